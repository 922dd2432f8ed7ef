"""What each rank runs in the tests of parameters frozen after compile under data parallel (pp2 x dp2)."""

from __future__ import annotations

from dist_cases import _dp_setup, _grad_errors, _mlp_pair


def frozen_later(rank, world, schedule):
    """Freeze one linear per stage after a step, then a whole stage: each step's gradients equal eager's.

    DDP's reducer waited for the frozen parameters' gradients: the others were left unaveraged over
    the replicas, and the step after failed inside DDP. FSDP2 left a stage frozen whole unsharded.
    """
    pipe, model, eager, x, y, xs, ys, loss_fn, step, held = _dp_setup(rank, world, _mlp_pair, schedule,
                                                                      split_points=["2"])
    sharded = {n: type(p).__name__ for n, p in held}
    errors = []
    for k in range(4):
        if k == 1:  # one linear on each stage
            for m in (model, eager):
                m[0].weight.requires_grad_(False)
                m[4].bias.requires_grad_(False)
        if k == 3:  # the first stage whole
            for m in (model, eager):
                m[0].requires_grad_(False)
        for m in (model, eager):
            m.zero_grad(set_to_none=True)
        step(xs, ys)
        loss_fn(eager(x), y).backward()
        trained = [(n, p) for n, p in held if p.requires_grad]
        errors.append(max(_grad_errors(trained, eager).values(), default=0.0))  # stage 0 frozen whole: none
        assert all(p.grad is None for _, p in held if not p.requires_grad)
    return {"errors": errors, "still_sharded": {n: type(p).__name__ for n, p in held} == sharded,
            "replaced": [n for n, p in model.named_parameters() if not any(p is q for q in pipe.parameters())
                         and any(n == h for h, _ in held)]}


def unfrozen_later(rank, world, schedule):
    """The last stage frozen whole at compile, then unfrozen: DDP wraps it and reduces; FSDP2 refuses, naming the fix."""
    pipe, model, eager, x, y, xs, ys, loss_fn, step, held = _dp_setup(rank, world, _frozen_tail, schedule,
                                                                      split_points=["2"])
    for m in (model, eager):
        m[2].requires_grad_(True)
        m[4].requires_grad_(True)
    try:
        step(xs, ys)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {"refused": f"{type(exc).__name__}: {exc}"}
    loss_fn(eager(x), y).backward()
    return {"refused": None, "error": max(_grad_errors(held, eager).values())}


def _frozen_tail():
    model, x, y, loss_fn = _mlp_pair()
    model[2].requires_grad_(False)
    model[4].requires_grad_(False)
    return model, x, y, loss_fn


CASES = {"frozen_later": frozen_later, "unfrozen_later": unfrozen_later}
