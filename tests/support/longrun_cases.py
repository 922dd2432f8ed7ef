"""What each rank runs in the long-run tests: new sizes, failed steps, misuse, RoPE resumes."""

from __future__ import annotations

import copy
import os
import time
from datetime import timedelta

import torch
import torch.nn.functional as F
from models import token_loss
from rope import RopeLM, rope_init
from torch import nn

import fxpipe
from fxpipe.testing import max_relative_error


def tokens(step: int, t: int, batch: int = 8):
    """Return step ``step``'s tokens and targets of length ``t`` (the same in every process)."""
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 64, (batch, t), generator=g), torch.randint(0, 64, (batch, t), generator=g)


def _compile(model, world, schedule, **kw):
    """Compile ``model`` for ``world`` ranks (two stages per rank for interleaved and zbv)."""
    per = 2 if schedule in ("interleaved", "zbv") else 1
    kw = {"example_inputs": (tokens(0, 16)[0],), "chunks": 4, **kw}
    return fxpipe.compile(model, world * per, runtime="distributed", timeout=60, schedule=schedule,
                          stages_per_rank=per, **kw)


def _attempt(call):
    """Run ``call``; return what it raised (type, message, seconds taken), or ``["returned", "", seconds]``."""
    start = time.monotonic()
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return [type(exc).__name__, str(exc), time.monotonic() - start]
    return ["returned", "", time.monotonic() - start]


def _compare(pipe, model, eager, rank, ids, target, loss_fn=token_loss, inputs_everywhere=False):
    """Run one step on the pipe and on eager; return the loss error and this rank's worst gradient error."""
    expected = loss_fn(eager(ids), target)
    expected.backward()
    loss = pipe.step(ids if rank == 0 or inputs_everywhere else None, target=target, loss_fn=loss_fn)
    held = {id(p) for j in pipe.plan.stages_of(rank) for p in pipe.stages[j].parameters()}
    grads = dict(eager.named_parameters(remove_duplicate=False))
    worst = max(max_relative_error(p.grad, grads[n].grad)
                for n, p in model.named_parameters(remove_duplicate=False) if id(p) in held)
    for p in (*model.parameters(), *eager.parameters()):
        p.grad = None
    return [max_relative_error(loss, expected), worst]


def seqlens(rank, world, schedule):
    """Sequence lengths 16, 24, 8, 24 (the plan traced at 16) in one run, each step equal to eager."""
    torch.manual_seed(0)
    model = RopeLM()
    eager = copy.deepcopy(model)
    pipe = _compile(model, world, schedule)
    errors, seconds = [], []
    for step, t in enumerate([16, 24, 8, 24]):
        start = time.perf_counter()
        errors.append(_compare(pipe, model, eager, rank, *tokens(step, t)))
        seconds.append(time.perf_counter() - start)
    return {"errors": errors, "seconds": seconds}


def small_batches(rank, world, schedule):
    """Batches of 8, 1, 3 and 8 rows at chunks=4: a last batch with fewer rows than ranks, each step equal to eager."""
    torch.manual_seed(0)
    model = RopeLM()
    eager = copy.deepcopy(model)
    pipe = _compile(model, world, schedule)
    errors = []
    for step, rows in enumerate([8, 1, 3, 8]):
        ids, target = tokens(step, 16)
        errors.append(_compare(pipe, model, eager, rank, ids[:rows], target[:rows]))
    return {"errors": errors}


def seqlens_few_kept(rank, world, schedule):
    """Lengths coming back after their layouts were dropped, with another cache limit on each rank."""
    torch.manual_seed(0)
    model = RopeLM()
    eager = copy.deepcopy(model)
    pipe = _compile(model, world, schedule)
    pipe._runtime.layouts.limit = 2 - rank  # rank 1 drops what rank 0 keeps and does not send again
    errors = [_compare(pipe, model, eager, rank, *tokens(step, t)) for step, t in enumerate([16, 24, 8, 24, 16, 8])]
    return {"errors": errors, "kept": len(pipe._runtime.layouts)}


def recover(rank, world, schedule):
    """A loss that raises on the loss's rank, a batch the model cannot take; then steps equal to eager."""
    torch.manual_seed(0)
    model = RopeLM()
    eager = copy.deepcopy(model)
    pipe = _compile(model, world, schedule)
    out = {"before": _compare(pipe, model, eager, rank, *tokens(1, 16))}

    def broken(logits, target):
        raise RuntimeError("broken loss")

    out["failed"] = _attempt(lambda: pipe.step(tokens(2, 16)[0] if rank == 0 else None, target=tokens(2, 16)[1],
                                               loss_fn=broken))
    for p in model.parameters():  # the failed step's gradients are partial: drop them, as a loop would
        p.grad = None
    out["after"] = _compare(pipe, model, eager, rank, *tokens(3, 16))
    ids, target = tokens(4, 40)  # longer than the rotary tables: the model itself cannot run it
    out["refused"] = _attempt(lambda: pipe.step(ids if rank == 0 else None, target=target, loss_fn=token_loss))
    # loss_fn=None on the first rank alone (it computes no loss): the others, in their step, must not pair it
    # with the first rank's next call, its inputs against this step's target
    out["no_loss_fn"] = _attempt(lambda: pipe.step(ids[:, :16] if rank == 0 else None, target=target[:, :16],
                                                   loss_fn=None if rank == 0 else token_loss))
    out["again"] = _compare(pipe, model, eager, rank, *tokens(5, 24))
    return out


class _LateBomb(nn.Module):
    """Raise on the last micro-batch of a call while armed, half a second in (after the first rank sent it)."""

    armed = False

    def forward(self, x):
        from torch._subclasses.fake_tensor import FakeTensor

        if _LateBomb.armed and not isinstance(x, FakeTensor) and x.shape[0] < 2:
            time.sleep(0.5)
            raise RuntimeError("bomb in forward")
        return x


def late_inference_failure(rank, world, schedule, evaluate=False):
    """A pipe(x) failing on the last rank after the first rank finished its part and began a step; then steps.

    ``evaluate``: a good pipe(x) between the failing one and the steps (what an evaluation loop catching
    the error does), which a middle rank of four finishes before the failure reaches it.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), _LateBomb(), nn.Linear(8, 4))
    eager = copy.deepcopy(model)
    splits = {2: ["4"], 4: ["2", "3", "4"]}[world]
    pipe = fxpipe.compile(model, world, example_inputs=(torch.randn(8, 8),), chunks=4, runtime="distributed",
                          timeout=20, schedule=schedule, leaf_modules=[_LateBomb], split_points=splits)
    batches = [(torch.randn(8, 8, generator=torch.Generator().manual_seed(k)),
                torch.randn(8, 4, generator=torch.Generator().manual_seed(100 + k))) for k in range(3)]
    _LateBomb.armed = rank == world - 1
    out = {"failed": _attempt(lambda: pipe(torch.randn(7, 8) if rank == 0 else None))}
    _LateBomb.armed = False
    if evaluate:
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(50))
        with torch.no_grad():
            got = pipe(x if rank == 0 else None)
            out["evaluated"] = None if got is None else max_relative_error(got, eager(x))
    errors = []
    for x, y in batches:  # the first rank's first step was paired with the last rank's next: off by one
        expected = F.mse_loss(eager(x), y)
        expected.backward()
        loss = pipe.step(x if rank == 0 else None, target=y, loss_fn=F.mse_loss)
        held = [p for j in pipe.plan.stages_of(rank) for p in pipe.stages[j].parameters()]
        grads = {id(p): q.grad for p, q in zip(model.parameters(), eager.parameters())}
        errors.append(max([max_relative_error(loss, expected)] + [max_relative_error(p.grad, grads[id(p)])
                                                                  for p in held]))
        for p in (*model.parameters(), *eager.parameters()):
            p.grad = None
    out["errors"] = errors
    return out


def late_failure_then_evaluation(rank, world, schedule):
    """:func:`late_inference_failure` with a good pipe(x) after the failing one."""
    return late_inference_failure(rank, world, schedule, evaluate=True)


def _rope_pipes(world, schedule):
    """Return a RopeLM, an eager copy, its pipe (one pipeline of 2 ranks; 2 replicas of 2 on 4) and the replicas."""
    torch.manual_seed(0)
    model = RopeLM()
    eager = copy.deepcopy(model)
    dp = 2 if world == 4 else 1
    pipe = fxpipe.compile(model, world // dp, example_inputs=(tokens(0, 16)[0],), chunks=2,
                          runtime="distributed", timeout=20, schedule=schedule, data_parallel=dp)
    return model, eager, pipe, dp


def misuse(rank, world, schedule):
    """The target on the first rank only; the inputs on the last rank only (positional, then as keywords); a correct step."""
    model, eager, pipe, dp = _rope_pipes(world, schedule)
    last = pipe.plan.stages[-1].on_rank
    me = rank % (world // dp)  # pipeline rank
    ids, target = tokens(1, 16)
    out = {}
    for label, x, y in [("target_on_first", ids if me == 0 else None, target if me == 0 else None),
                        ("inputs_on_last", ids if me == last else None, target if me == last else None)]:
        out[label] = _attempt(lambda: pipe.step(x, target=y, loss_fn=token_loss))  # noqa: B023 - called at once
    # keywords only, on the last rank: the first rank has nothing to bind
    out["keywords_on_last"] = _attempt(lambda: pipe.step(**({"ids": ids} if me == last else {}), target=target,
                                                         loss_fn=token_loss))
    if dp == 1:
        out["after"] = _compare(pipe, model, eager, rank, ids, target)
    else:
        ids, target = ids[rank // 2 * 4:][:4], target[rank // 2 * 4:][:4]  # each replica its half
        out["after"] = float(pipe.step(ids, target=target, loss_fn=token_loss))
    # the target on the first rank only again, on a later step: the loss's rank refused it alone, the others
    # failed in their sends, and under data parallel the pipe was dead for every later step
    out["target_on_first_later"] = _attempt(lambda: pipe.step(ids if me == 0 else None, loss_fn=token_loss,
                                                              target=target if me == 0 else None))
    for p in pipe.parameters():
        p.grad = None
    out["recovered"] = float(pipe.step(ids, target=target, loss_fn=token_loss))
    return out


def target_on_loss_rank_only(rank, world, schedule):
    """The target only where the loss is computed, as the docs show: first of another batch size, then (2
    replicas) missing on replica 1's loss rank alone; then a correct step."""
    _, _, pipe, dp = _rope_pipes(world, schedule)
    me, replica = rank % (world // dp), rank // (world // dp)
    last = pipe.plan.stages[-1].on_rank
    ids, target = tokens(1, 16)
    cases = [("short_target", target[:3])]
    if dp == 2:
        cases.append(("missing_on_one_replica", target if replica == 0 else None))
    out = {}
    for label, y in cases:
        out[label] = _attempt(lambda: pipe.step(ids if me == 0 else None, loss_fn=token_loss,
                                                target=y if me == last else None))  # noqa: B023 - called at once
    given = {"target": target} if me == last else {}  # target= left out where no loss is computed, as docs say
    out["after"] = float(pipe.step(ids if me == 0 else None, loss_fn=token_loss, **given) or 0.0)
    return out


def replica_peer_stuck(rank, world, schedule):
    """pp2 x dp2; on the second step rank 3's loss_fn raises and its process lingers: rank 1, waiting in the
    replicas' gradient reduction, must give up after timeout= (5 s), not torch's default 30 minutes."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=2, runtime="distributed", timeout=5,
                          schedule=schedule, data_parallel=2)
    pipe.step(x, target=y, loss_fn=F.mse_loss)

    def failing(out, tgt):
        if rank == 3:
            raise RuntimeError("rank 3's loss fails")
        return F.mse_loss(out, tgt)

    out = {"failed": _attempt(lambda: pipe.step(x, target=y, loss_fn=failing))}
    if rank == 3:
        time.sleep(12)  # a script that logs the error and lingers before it exits
    return out


def argument_refusals(rank, world, schedule):
    """pipe.step's own arguments refused: target= left out on the loss rank (the first step, a later one, one
    replica's alone), loss_fn= left out everywhere, a step under no_grad; each refused on every rank, then a
    step equal to eager.

    4 ranks: two replicas of 2 ranks, whose run a refusal once ended (the replicas' reductions cannot be realigned).
    """
    torch.manual_seed(0)
    model = RopeLM()
    eager = copy.deepcopy(model)
    dp = 2 if world == 4 else 1
    per = 2 if schedule in ("interleaved", "zbv") else 1
    pipe = fxpipe.compile(model, world // dp * per, example_inputs=(tokens(0, 16)[0],), chunks=2, timeout=20,
                          runtime="distributed", schedule=schedule, stages_per_rank=per, data_parallel=dp)
    me, replica = rank % (world // dp), rank // (world // dp)
    last = pipe.plan.stages[-1].on_rank
    ids, target = tokens(1, 16)

    def step(with_target=True, with_loss_fn=True):
        given = {"target": target} if with_target else {}
        if with_loss_fn:
            given["loss_fn"] = token_loss
        return pipe.step(ids if me == 0 else None, **given)

    out = {"first": _attempt(lambda: step(with_target=me != last)),
           "good": float(step())}
    out["later"] = _attempt(lambda: step(with_target=me != last))
    if dp == 2:
        out["one_replica"] = _attempt(lambda: step(with_target=not (me == last and replica == 1)))
    out["no_loss_fn"] = _attempt(lambda: step(with_loss_fn=False))
    if dp == 2:  # a str where replica 1 takes its tensor: it was "a batch of None rows ... drop_last=True"
        out["string"] = _attempt(lambda: pipe.step(("a str" if replica == 1 else ids) if me == 0 else None,
                                                   target=target, loss_fn=token_loss))
    with torch.no_grad():  # a validation loss by pipe.step: refused on every rank itself
        out["no_grad"] = _attempt(step)
    for p in (*model.parameters(), *eager.parameters()):
        p.grad = None
    expected = token_loss(eager(ids), target)
    expected.backward()
    out["after"] = float(step())
    out["loss_error"] = max_relative_error(torch.tensor(out["after"]), expected.detach())
    held = {id(p) for j in pipe.plan.stages_of(me) for p in pipe.stages[j].parameters()}
    grads = dict(eager.named_parameters(remove_duplicate=False))
    out["grad_error"] = max(max_relative_error(p.grad, grads[n].grad)
                            for n, p in model.named_parameters(remove_duplicate=False) if id(p) in held)
    return out


def state_mismatch(rank, world, schedule):
    """pp2 x dp2: replica 0's loss rank in eval mode at the pipe's first step; a good step; replica 1's loss rank
    under autocast, then with loss_reduction='sum' alone; each refused on every rank (it was a failed step,
    which under data parallel ended the pipe), then a step equal to eager."""
    torch.manual_seed(0)
    model = RopeLM()
    eager = copy.deepcopy(model)
    pipe = fxpipe.compile(model, 2, example_inputs=(tokens(0, 16)[0],), chunks=2, timeout=20,
                          runtime="distributed", schedule=schedule, data_parallel=2)
    me = rank % 2
    ids, target = tokens(1, 16)

    def step(**kw):
        return pipe.step(ids if me == 0 else None, target=target, loss_fn=token_loss, **kw)

    if rank == 1:
        pipe.eval()
    out = {"eval": _attempt(step)}
    pipe.train()
    step()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=rank == 3):
        out["autocast"] = _attempt(step)
    out["reduction"] = _attempt(lambda: step(loss_reduction="sum" if rank == 3 else "mean"))
    for p in (*model.parameters(), *eager.parameters()):
        p.grad = None
    out["after"] = _compare(pipe, model, eager, me, ids, target)
    return out


def middle_refusal_first(rank, world, schedule):
    """3 ranks: the middle rank leaves out loss_fn= at the pipe's first step (a failed step); then steps equal to
    eager (the first rank had read the loss rank's check of the target, the loss rank had not sent it all: the
    next steps waited for timeout=)."""
    torch.manual_seed(0)
    model = RopeLM()
    eager = copy.deepcopy(model)
    pipe = _compile(model, world, schedule)
    ids, target = tokens(1, 16)
    out = {"failed": _attempt(lambda: pipe.step(ids if rank == 0 else None, target=target,
                                                **({} if rank == 1 else {"loss_fn": token_loss})))}
    for p in model.parameters():
        p.grad = None
    out["after"] = [_compare(pipe, model, eager, rank, *tokens(step, 16)) for step in (2, 3)]
    return out


def unfrozen_under_dp(rank, world, schedule):
    """pp2 x dp2 with the first stage frozen at compile: a parameter unfrozen, the step is refused on every rank;
    frozen again, the next step equals eager's (the refusal once ended the pipe: 'restart the job')."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])
    model[:3].requires_grad_(False)  # stage 0 (the frozen blocks cost less: it holds three)
    eager = copy.deepcopy(model)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=2, runtime="distributed", timeout=20,
                          schedule=schedule, data_parallel=2)
    me = rank % 2
    out = {"first": float(pipe.step(x if me == 0 else None, target=y, loss_fn=F.mse_loss))}
    model[0][0].weight.requires_grad_(True)
    out["unfrozen"] = _attempt(lambda: pipe.step(x if me == 0 else None, target=y, loss_fn=F.mse_loss))
    model[0][0].weight.requires_grad_(False)
    for p in (*model.parameters(), *eager.parameters()):
        p.grad = None
    expected = F.mse_loss(eager(x), y)
    expected.backward()
    out["after"] = max_relative_error(pipe.step(x if me == 0 else None, target=y, loss_fn=F.mse_loss),
                                      expected.detach())
    held = {id(p) for j in pipe.plan.stages_of(me) for p in pipe.stages[j].parameters() if p.requires_grad}
    grads = dict(eager.named_parameters())
    out["grads"] = max([max_relative_error(p.grad, grads[n].grad) for n, p in model.named_parameters()
                        if id(p) in held], default=0.0)  # rank 0's stage is frozen whole
    return out


def misuse_zbv(rank, world, schedule):
    """ZB-V, whose loss is on rank 0: the target on the highest rank only; inputs missing for pipe(x); then a step."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2 * world)])
    eager = copy.deepcopy(model)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    pipe = fxpipe.compile(model, 2 * world, example_inputs=(x,), chunks=world, runtime="distributed", timeout=20,
                          schedule="zbv", stages_per_rank=2)
    out = {}
    for label, call in [("target_on_highest", lambda: pipe.step(x if rank == 0 else None, loss_fn=F.mse_loss,
                                                                target=y if rank == world - 1 else None)),
                        ("forward_without_inputs", lambda: pipe(x if rank == world - 1 else None))]:
        out[label] = _attempt(call)
    out["after"] = _compare(pipe, model, eager, rank, x, y, loss_fn=F.mse_loss)
    return out


class _WithLoss(nn.Module):
    """Return per-row outputs and a loss over the batch, as a Hugging Face model given labels= does."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())

    def forward(self, x, labels):
        out = self.layers(x)
        return {"logits": out, "loss": F.mse_loss(out, labels)}


def unjoinable_forward(rank, world, schedule):
    """pipe(x) of a model returning a 0-dim loss is refused on every rank in the same call; the ranks stay in step."""
    torch.manual_seed(0)
    model = _WithLoss()
    eager = copy.deepcopy(model)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    pipe = fxpipe.compile(model, world, example_inputs=(x, y), chunks=2, runtime="distributed", timeout=20,
                          schedule=schedule)
    out = {}
    for label in ("first", "again"):  # a refused call, then the same call: each refused on every rank
        out[label] = _attempt(lambda: pipe(x, y))
    start = time.monotonic()
    loss = pipe.step(x, y, target=None, loss_fn=lambda o, _: o["loss"])
    expected = eager(x, y)["loss"]
    out["step"] = [max_relative_error(loss, expected), time.monotonic() - start]
    return out


class _Labelled(nn.Module):
    """Return logits and a token loss skipping -100 over labels= given as an input, as a Hugging Face LM does."""

    def __init__(self):
        super().__init__()
        self.emb, self.body, self.head = nn.Embedding(16, 8), nn.Linear(8, 8), nn.Linear(8, 16)

    def forward(self, tokens, labels=None):
        logits = self.head(torch.tanh(self.body(self.emb(tokens))))
        return {"logits": logits, "loss": F.cross_entropy(logits.reshape(-1, 16), labels.reshape(-1))}


def labels_on_the_first_rank(rank, world, schedule):
    """labels= padded with -100 in unequal shares, given to the first rank only: warned of on that rank."""
    import warnings

    torch.manual_seed(0)
    tokens, labels = torch.randint(0, 16, (4, 6)), torch.randint(0, 16, (4, 6))
    labels[2:, 1:] = -100  # the second micro-batch counts 2 of its 12 entries, the first all 12
    pipe = fxpipe.compile(_Labelled(), world, example_inputs=(tokens,), example_kwargs={"labels": labels}, chunks=2,
                          runtime="distributed", timeout=30, schedule=schedule)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe.step(tokens if rank == 0 else None, labels=labels if rank == 0 else None, target=None,
                  loss_fn=lambda out, _: out["loss"])
    return {"warned": [str(w.message)[:80] for w in caught if "ignore_index" in str(w.message)]}


def loss_dtype(rank, world, schedule):
    """A float64 model's loss: the same value and dtype on every rank."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)).double()
    eager = copy.deepcopy(model)
    x, y = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)
    pipe = fxpipe.compile(model, world, example_inputs=(x,), chunks=2, runtime="distributed", timeout=20,
                          schedule=schedule)
    loss = pipe.step(x, target=y, loss_fn=F.mse_loss)
    return {"dtype": str(loss.dtype), "value": loss.item(), "expected": F.mse_loss(eager(x), y).item()}


def model_cast(rank, world, schedule):
    """A token model cast after compile: float64 steps, a step the cast fails, then float32 again, each equal eager."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(64, 16), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 64))
    eager = copy.deepcopy(model)
    pipe = fxpipe.compile(model, world, example_inputs=(tokens(0, 6)[0],), chunks=2, runtime="distributed",
                          timeout=20, schedule=schedule)
    errors, ids, target = [], *tokens(1, 6)
    for dtype in (torch.float64, torch.float32):
        model.to(dtype), eager.to(dtype)
        errors.append(_compare(pipe, model, eager, rank, ids, target))
    model.double()
    model[3].float()  # a float64 activation into a float32 linear: the step fails on the rank holding it
    failed = _attempt(lambda: pipe.step(ids if rank == 0 else None, target=target, loss_fn=token_loss))
    model.float()
    errors.append(_compare(pipe, model, eager, rank, ids, target))
    return {"errors": errors, "failed": failed[:2]}


def rope_resume(rank, world, schedule):
    """A RoPE decoder on meta with weights= and init=: train, save, load into a fresh pipe, go on."""
    out_dir = os.environ["FXPIPE_TEST_DIR"]
    torch.manual_seed(0)
    weights = RopeLM().state_dict()  # persistent tensors only: the rotary tables are not saved

    def build():
        with torch.device("meta"):
            model = RopeLM()
        pipe = _compile(model, world, schedule, weights=weights, init=rope_init)
        return pipe, torch.optim.AdamW(pipe.parameters(), lr=1e-2)

    def train(pipe, opt, steps):
        losses = []
        for step in steps:
            opt.zero_grad()
            ids, target = tokens(step, 16)
            losses.append(float(pipe.step(ids, target=target, loss_fn=token_loss)))
            opt.step()
        return losses

    pipe, opt = build()
    before = train(pipe, opt, range(3))
    path = os.path.join(out_dir, "ckpt")
    fxpipe.save(pipe, path, optimizer=opt, extra={"step": 3})
    try:
        fxpipe.save(pipe, os.path.join(out_dir, "differs"), extra={"rank": rank})
    except Exception as exc:  # noqa: BLE001 - reported to the test
        differs = [type(exc).__name__, str(exc), os.path.exists(os.path.join(out_dir, "differs"))]
    fresh, fresh_opt = build()
    extra = fxpipe.load(fresh, path, optimizer=fresh_opt)
    after = train(fresh, fresh_opt, range(extra["step"], 5))
    straight, straight_opt = build()
    unbroken = train(straight, straight_opt, range(5))
    return {"before": before, "after": after, "unbroken": unbroken, "differs": differs,
            "latest": fxpipe.latest_checkpoint(out_dir)}


def chunks_warning(rank, world, schedule):
    """A batch smaller than chunks runs fewer micro-batches and says so once."""
    import warnings

    torch.manual_seed(0)
    pipe = _compile(RopeLM(), world, schedule)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            ids, target = tokens(step, 16, batch=2)
            pipe.step(ids, target=target, loss_fn=token_loss)
    return {"warnings": [str(w.message) for w in caught if "micro-batch" in str(w.message)]}


def dies_then(rank, world, schedule):
    """Rank 1 dies in the second step; the others raise, then raise again at once on the next call."""
    torch.manual_seed(0)
    pipe = _compile(RopeLM(), world, schedule)
    ids, target = tokens(1, 16)
    pipe.step(ids, target=target, loss_fn=token_loss)
    if rank == 1:
        os._exit(3)
    out = {}
    for label in ("first", "again"):
        out[label] = _attempt(lambda: pipe.step(ids, target=target, loss_fn=token_loss))
    # rank 0 hosts the store here; keep it up until rank 2 is done, as torchrun's agent would
    store = torch.distributed.distributed_c10d._get_default_store()
    store.set(f"dies_then/done/{rank}", "1")
    if rank == 0:
        store.wait(["dies_then/done/2"], timedelta(seconds=30))
    return out


def hf_llama(rank, world, schedule):
    """Hugging Face Llama from a config: built with deferred_init, exported, new lengths, a failure, a resume."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)

    def build():
        with fxpipe.deferred_init():
            model = LlamaForCausalLM(cfg)
        return model

    def loss_fn(out, target):
        return token_loss(out.logits, target)

    eager = fxpipe.materialize(build())  # the same recipes and seeds as the stages replay
    model = build()
    pipe = _compile(model, world, schedule, tracer="export")
    out = {"meta_after_compile": sorted(n for n, t in model.state_dict(keep_vars=True).items()
                                        if not t.is_meta and n not in pipe.state_dict())}
    out["errors"] = [_compare(pipe, model, eager, rank, *tokens(step, t), loss_fn=loss_fn)
                     for step, t in enumerate([16, 24, 8])]

    def broken(o, target):
        raise RuntimeError("broken loss")

    try:
        pipe.step(*tokens(9, 16)[:1], target=tokens(9, 16)[1], loss_fn=broken)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["failed"] = type(exc).__name__
    for p in model.parameters():
        p.grad = None
    out["errors"].append(_compare(pipe, model, eager, rank, *tokens(10, 24), loss_fn=loss_fn))
    path = os.path.join(os.environ["FXPIPE_TEST_DIR"], "llama")
    fxpipe.save(pipe, path)
    fresh_model = build()
    fresh = _compile(fresh_model, world, schedule, tracer="export")
    fxpipe.load(fresh, path)  # the rotary tables are in no checkpoint: they stay as replayed
    out["errors"].append(_compare(fresh, fresh_model, eager, rank, *tokens(11, 16), loss_fn=loss_fn))
    return out


class _Regularized(nn.Module):
    """A block whose forward differs by mode in its own code and in its batch norm, deterministically."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.norm, self.aux = nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.norm(self.lin(x))
        if self.training:  # nodes of training mode only (a module call too), joined with the input below
            h = h + 0.1 * self.aux(h).tanh()
        return x + F.dropout(h, 0.0, training=self.training)


def modes(rank, world, schedule):
    """Train, evaluate, train again on one pipe per tracer, each forward and step equal to eager."""
    out = {}
    for tracer, split in (("fx", ["mul_1"]), ("export", None)):
        torch.manual_seed(0)
        # fx compiles in eval mode: the training-only modules come from the other mode's graph
        model = nn.Sequential(*[_Regularized() for _ in range(4)], nn.Linear(8, 4)).train(tracer == "export")
        eager = copy.deepcopy(model)
        x, target = torch.randn(8, 8), torch.randn(8, 4)
        # fx: cut inside the training-only nodes, so a value of training mode only crosses ranks
        pipe = _compile(model, world, schedule, example_inputs=(x,), chunks=1, tracer=tracer, split_points=split)
        errors = []
        for mode in (True, False, True, False):
            pipe.train(mode)
            eager.train(mode)
            if mode:
                errors.append(_compare(pipe, model, eager, rank, x, target, loss_fn=F.mse_loss))
            else:
                with torch.no_grad():
                    got, expected = pipe(x if rank == 0 else None), eager(x)
                errors.append([max_relative_error(got, expected) if got is not None else 0.0])
        buffers = dict(eager.named_buffers())
        held = {n for j in pipe.plan.stages_of(rank) for n, _ in pipe.stages[j].named_buffers()}
        errors.append([max_relative_error(b, buffers[n]) for n, b in model.named_buffers()
                       if n in held and b.is_floating_point()])
        out[tracer] = errors
    pipe.train(rank == 0)  # a pipe.eval() on one rank only
    try:
        pipe.step(x if rank == 0 else None, target=target, loss_fn=F.mse_loss)
        refused = None
    except Exception as exc:  # noqa: BLE001 - the test reads what each rank raised
        refused = [type(exc).__name__, str(exc)]
    return {"errors": out, "refused": refused}


def spectral(rank, world, schedule):
    """Spectral norms recomputed in backward (their u and v written by forward): two steps equal to eager."""
    torch.manual_seed(0)
    norm = nn.utils.parametrizations.spectral_norm
    model = nn.Sequential(*[m for _ in range(4) for m in (norm(nn.Linear(8, 8)), nn.Tanh())])
    eager = copy.deepcopy(model)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    pipe = _compile(model, world, schedule, example_inputs=(x,), chunks=2, checkpoint="always")
    held = {n for j in pipe.plan.stages_of(rank) for n, _ in pipe.stages[j].named_parameters()}
    errors = []
    for _ in range(2):
        expected = sum(F.mse_loss(eager(a), b) / 2 for a, b in zip(x.chunk(2), y.chunk(2)))  # eager per micro-batch
        expected.backward()
        loss = pipe.step(x if rank == 0 else None, target=y, loss_fn=F.mse_loss)
        grads = dict(eager.named_parameters())
        errors.append([max_relative_error(loss, expected)] + [max_relative_error(p.grad, grads[n].grad)
                                                             for n, p in model.named_parameters() if n in held])
        for p in (*model.parameters(), *eager.parameters()):
            p.grad = None
    return {"errors": errors}


def input_grads(rank, world, schedule):
    """Embeddings a trainable module makes before the pipe, on the first rank: its gradients equal eager's."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(8, 8), nn.Tanh())])
    encoder, raw, y = nn.Linear(6, 8), torch.randn(8, 6), torch.randn(8, 8)
    eager, eager_encoder = copy.deepcopy(model), copy.deepcopy(encoder)
    pipe = _compile(model, world, schedule, example_inputs=(torch.randn(8, 8),), chunks=2)
    errors = []
    for _ in range(2):  # the user's graph is made anew each step
        F.mse_loss(eager(eager_encoder(raw)), y).backward()
        pipe.step(encoder(raw) if rank == 0 else None, target=y, loss_fn=F.mse_loss)
        if rank == 0:
            errors.append([max_relative_error(p.grad, q.grad) for p, q in zip(encoder.parameters(),
                                                                             eager_encoder.parameters())])
        for p in (*model.parameters(), *eager.parameters(), *encoder.parameters(), *eager_encoder.parameters()):
            p.grad = None
    return {"errors": errors}


def calls_differ(rank, world, schedule):
    """Ranks given another schedule at compile; then rank 0 calling pipe(x) while the others call pipe.step."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])
    eager = copy.deepcopy(model)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    dp = 2 if world == 4 else 1
    out = {}
    out["options"] = _attempt(lambda: fxpipe.compile(model, world // dp, example_inputs=(x,), chunks=2, timeout=20,
                                                     runtime="distributed", data_parallel=dp,
                                                     schedule=schedule if rank == 0 else "gpipe"))
    # an option no rank could use, on the last rank only (read per rank): refused there before joining
    out["invalid"] = _attempt(lambda: fxpipe.compile(model, world // dp, example_inputs=(x,), timeout=20,
                                                     runtime="distributed", data_parallel=dp, schedule=schedule,
                                                     chunks=0 if rank == world - 1 else 2))
    out["weights"] = _attempt(lambda: fxpipe.compile(model, world // dp, example_inputs=(x,), timeout=20, chunks=2,
                                                     runtime="distributed", data_parallel=dp, schedule=schedule,
                                                     weights=None if rank == 0 else 7))
    pipe = fxpipe.compile(model, world // dp, example_inputs=(x,), chunks=2, runtime="distributed", timeout=20,
                          schedule=schedule, data_parallel=dp)
    # the mistake: pipe(x) on one rank (a whole replica under data parallel), pipe.step on the others
    out["calls"] = _attempt(lambda: pipe(x) if rank == 0 else pipe.step(x, target=y, loss_fn=F.mse_loss))
    start = time.monotonic()  # every rank steps again, together
    loss = pipe.step(x, target=y, loss_fn=F.mse_loss)
    out["again"] = [max_relative_error(loss, F.mse_loss(eager(x), y)), time.monotonic() - start]
    # the same mistake after a step (the loss's rank then tells the first rank of its target at each step),
    # by the first or the last rank of the first replica
    for label, infers in [("calls_later", 0), ("last_calls_later", world // dp - 1)]:
        out[label] = _attempt(lambda: pipe(x) if rank == infers else  # noqa: B023 - called at once
                              pipe.step(x, target=y, loss_fn=F.mse_loss))
        pipe.zero_grad()
        start = time.monotonic()
        loss = pipe.step(x, target=y, loss_fn=F.mse_loss)
        out[f"{label}_again"] = [max_relative_error(loss, F.mse_loss(eager(x), y)), time.monotonic() - start]
    return out


def save_on_one_rank(rank, world, schedule):
    """fxpipe.save on rank 0 alone while rank 1 steps; both catch the failure and train on, batch by batch."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])
    eager = copy.deepcopy(model)
    pipe = fxpipe.compile(model, 2, example_inputs=(torch.randn(8, 8),), chunks=2, runtime="distributed", timeout=4,
                          schedule=schedule)
    out = {"steps": []}
    for k in range(4):
        g = torch.Generator().manual_seed(k)
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
        try:
            if k == 1 and rank == 0:  # the mistake: a save under `if rank == 0:`
                fxpipe.save(pipe, os.path.join(os.environ["FXPIPE_TEST_DIR"], "alone"))
            loss = pipe.step(x, target=y, loss_fn=F.mse_loss)
            out["steps"].append([k, max_relative_error(loss, F.mse_loss(eager(x), y))])
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out["steps"].append([k, type(exc).__name__])
    return out


def compile_twice(rank, world, schedule):
    """A model compiled across ranks, then compiled again (another cut): refused, not initialised anew."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])
    x = torch.randn(8, 8)
    fxpipe.compile(model, 2, example_inputs=(x,), chunks=2, runtime="distributed", timeout=20, schedule=schedule)
    out = {}
    # the model again; a submodule of it; a module holding it (each took tensors the first pipe runs, silently)
    for name, again in (("again", model), ("part", model[1:]), ("whole", nn.Sequential(model, nn.Linear(8, 8)))):
        try:
            fxpipe.compile(again, 2, example_inputs=(x,), chunks=2, runtime="distributed", timeout=20,
                           schedule=schedule)
            out[name] = "compiled"
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


def autocast_on_one_rank(rank, world, schedule):
    """torch.autocast around pipe.step on rank 0 only; then a step on every rank without it."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])
    eager = copy.deepcopy(model)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=2, runtime="distributed", timeout=20,
                          schedule=schedule)
    out = {}
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=rank == 0):
            pipe.step(x, target=y, loss_fn=F.mse_loss)
        out["mixed"] = "returned"
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["mixed"] = f"{type(exc).__name__}: {exc}"
    pipe.zero_grad()
    loss = pipe.step(x, target=y, loss_fn=F.mse_loss)
    out["after"] = max_relative_error(loss, F.mse_loss(eager(x), y))
    return out


def built_otherwise(rank, world, schedule):
    """Rank 1 builds the head with 10 classes where rank 0 builds 4 (a config read per rank)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4 if rank == 0 else 10))
    return {"built": _attempt(lambda: fxpipe.compile(model, 2, example_inputs=(torch.randn(8, 8),), chunks=2,
                                                     runtime="distributed", timeout=20, schedule=schedule))}


def wrapped_state_dict(rank, world, schedule):
    """A module holding the pipe: its state dict (this rank's keys) loads back strictly, and assign=True reaches the stages."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])
    pipe = fxpipe.compile(model, 2, example_inputs=(torch.randn(8, 8),), chunks=2, runtime="distributed", timeout=20,
                          schedule=schedule)
    wrapper = nn.Module()
    wrapper.pipe = pipe
    state = {k: v.clone() + 1 for k, v in wrapper.state_dict().items()}
    out = {"keys": sorted(state)}
    try:
        wrapper.load_state_dict(state, assign=True)
        out["loaded"] = all(torch.equal(wrapper.state_dict()[k], v) for k, v in state.items())
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["loaded"] = f"{type(exc).__name__}: {exc}"
    return out


def target_on_one_replica(rank, world, schedule):
    """Two replicas; the target passed on replica 0 only (``target=y if replica == 0 else None``)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=2, runtime="distributed", timeout=20,
                          schedule=schedule, data_parallel=2)
    replica = rank // 2
    return {"failed": _attempt(lambda: pipe.step(x[4 * replica:][:4], target=y[:4] if replica == 0 else None,
                                                 loss_fn=F.mse_loss))}


def target_lost_on_one_replica_later(rank, world, schedule):
    """Two replicas; a good step, one with the target on replica 1 only, then a good step (loss against eager)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    expected = float(F.mse_loss(model(x), y))
    per = 2 if schedule == "zbv" else 1
    pipe = fxpipe.compile(model, 2 * per, example_inputs=(x,), chunks=2, runtime="distributed", timeout=20,
                          schedule=schedule, data_parallel=2, stages_per_rank=per)
    replica = rank // 2
    out = {}
    for name, given in (("first", True), ("lost", replica == 1), ("after", True)):
        target = y[4 * replica:][:4] if given else None
        out[name] = _attempt(lambda t=target: out.update(loss=float(pipe.step(x[4 * replica:][:4], target=t,
                                                                              loss_fn=F.mse_loss))))
    return {**out, "expected": expected}


class _Gate(nn.Module):
    """A leaf module branching on a value (the documented fix for fx's refusal): fake tensors cannot follow it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        if bool((h > -1e9).all()):
            h = torch.relu(h)
        return self.b(h) + x


def data_dependent_leaf(rank, world, schedule):
    """A model with a data-dependent leaf: steps of 8 and 6 rows against eager on the same micro-batches."""
    torch.manual_seed(0)
    model = nn.Sequential(_Gate(), _Gate(), _Gate(), nn.Linear(8, 4))
    eager = copy.deepcopy(model)
    pipe = fxpipe.compile(model, world, example_inputs=(torch.randn(8, 8),), chunks=2, runtime="distributed",
                          timeout=20, schedule=schedule, leaf_modules=[_Gate])
    errors = []
    for rows in (8, 6):
        x, y = torch.randn(rows, 8), torch.randn(rows, 4)
        loss = pipe.step(x, target=y, loss_fn=F.mse_loss)
        expected = sum(F.mse_loss(eager(xi), yi) * len(xi) / rows for xi, yi in zip(x.chunk(2), y.chunk(2)))
        errors.append(max_relative_error(loss, expected))
    return {"errors": errors}


def sharded_per_rank(rank, world, schedule):
    """A DistributedSampler left to its defaults gives each rank of a pipeline its own rows: refused on the first
    step (inputs, then a target alone) and the first pipe(x); then a loader sharded by fxpipe.data_shard steps."""
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    _, eager, pipe, dp = _rope_pipes(world, schedule)
    me = rank % (world // dp)
    data = TensorDataset(*tokens(1, 16, batch=32))
    out = {"shard": list(fxpipe.data_shard(pipe))}
    own = next(iter(DataLoader(data, batch_size=8, sampler=DistributedSampler(data, shuffle=False))))  # per rank
    ids, target = tokens(2, 16)
    calls = [("every_rank_own_rows", lambda: pipe.step(own[0], target=own[1], loss_fn=token_loss)),
             ("target_alone_differs", lambda: pipe.step(ids if me == 0 else None,
                                                        target=target if me == 0 else tokens(3, 16)[1],
                                                        loss_fn=token_loss)),
             ("forward_own_rows", lambda: pipe(own[0])),
             ("fewer_rows", lambda: pipe.step(ids if me == 0 else ids[:6], target=target if me == 0 else target[:6],
                                              loss_fn=token_loss))]
    for label, call in calls:
        out[label] = _attempt(call)
    sampler = DistributedSampler(data, *fxpipe.data_shard(pipe), shuffle=False)
    x, y = next(iter(DataLoader(data, batch_size=8, sampler=sampler)))
    loss = float(pipe.step(x, target=y, loss_fn=token_loss))  # every rank passes its loader's batch
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, (x, y))
    firsts = [gathered[r * (world // dp)] for r in range(dp)]  # each replica's first rank's rows
    with torch.no_grad():
        expected = sum(float(token_loss(eager(a), b)) for a, b in firsts) / dp
    out["loss_error"] = abs(loss - expected) / abs(expected)
    return out


def dies_saving(rank, world, schedule):
    """Rank 1 dies in fxpipe.save after writing its share; rank 0 raises, and the half-written save is skipped."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    pipe = _compile(RopeLM(), world, schedule)
    ids, target = tokens(1, 16)
    pipe.step(ids, target=target, loss_fn=token_loss)
    folder = os.path.join(os.environ["FXPIPE_TEST_DIR"], "ckpt")
    fxpipe.save(pipe, os.path.join(folder, "step-1"))
    if rank == 1:
        write = dcp.FileSystemWriter.write_data

        def dying(self, plan, planner):
            write(self, plan, planner).wait()
            os._exit(3)
        dcp.FileSystemWriter.write_data = dying
    out = {"saving": _attempt(lambda: fxpipe.save(pipe, os.path.join(folder, "step-2")))}
    out["latest"] = os.path.basename(fxpipe.latest_checkpoint(folder))
    return out


class _PositionsLast(nn.Module):
    """Slice a position table in the last stage: a longer sequence than the table fails there only."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(16, 16) for _ in range(4)])
        self.pos = nn.Parameter(torch.randn(1, 12, 16))
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.out(x + self.pos[:, :x.shape[1]])


def too_long_for_the_last_stage(rank, world, schedule):
    """A sequence the last stage cannot take is refused on every rank before the call, pipe(x) and step alike."""
    torch.manual_seed(0)
    model = _PositionsLast()
    pipe = fxpipe.compile(model, world, example_inputs=(torch.randn(4, 8, 16),), chunks=2, runtime="distributed",
                          timeout=60, schedule=schedule, split_points=["layers.2"])
    out = {}
    x, y = torch.randn(4, 20, 16), torch.randn(4, 20, 4)
    with torch.no_grad():
        out["call"] = _attempt(lambda: pipe(x if rank == 0 else None))
    out["step"] = _attempt(lambda: pipe.step(x if rank == 0 else None, target=y, loss_fn=F.mse_loss))
    x, y = torch.randn(4, 8, 16), torch.randn(4, 8, 4)
    out["after"] = _attempt(lambda: pipe.step(x if rank == 0 else None, target=y, loss_fn=F.mse_loss))
    return out


def skipped_call(rank, world, schedule):
    """The loss's rank skips the first of three steps, and its script ends: the first rank's third call names it."""
    from fxpipe.runtime.transport.release import release_all

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=2, runtime="distributed", timeout=30,
                          schedule=schedule)
    out = {"calls": []}
    for k in range(3):
        if k == 0 and rank == world - 1:
            continue  # the mistake: a `continue` on one rank
        out["calls"].append(_attempt(lambda: pipe.step(x if rank == 0 else None, target=y, loss_fn=F.mse_loss)))
    if rank == world - 1:
        release_all()  # what the interpreter's exit runs (a spawned test rank exits without it)
    return out


class _Masked(nn.Module):
    """An optional mask (None in the example: traced fixed to None) and a scale whose default is not None."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x, mask=None, scale=2.0):
        h = torch.relu(self.a(x))
        if mask is not None:
            h = h * mask
        if scale is not None:
            h = h * scale
        return self.b(h)


def fixed_input_on_one_rank(rank, world, schedule):
    """A value for an input the trace fixed, given on rank 1 only: refused on every rank at the first step, on
    rank 1 (its peer failing the step) at a later one; then a step with None everywhere equals eager."""
    torch.manual_seed(0)
    model = _Masked()
    eager = copy.deepcopy(model)
    x, y, mask = torch.randn(8, 16), torch.randn(8, 16), torch.rand(8, 16)
    pipe = fxpipe.compile(model, world, example_inputs=(x,), example_kwargs={"scale": None}, chunks=2,
                          schedule=schedule, runtime="distributed", timeout=60)
    out = {"first": _attempt(lambda: pipe.step(x, mask if rank == 1 else None, scale=None, target=y,
                                               loss_fn=F.mse_loss)),
           "scale_first": _attempt(lambda: pipe.step(x, scale=None if rank == 0 else 2.0, target=y,
                                                     loss_fn=F.mse_loss))}
    pipe.step(x, scale=None, target=y, loss_fn=F.mse_loss)
    out["later"] = _attempt(lambda: pipe.step(x, mask if rank == 1 else None, scale=None, target=y,
                                              loss_fn=F.mse_loss))
    pipe.zero_grad()
    loss = pipe.step(x, scale=None, target=y, loss_fn=F.mse_loss)
    expected = F.mse_loss(eager(x, scale=None), y)
    out["loss_error"] = max_relative_error(loss, expected)
    return out
