"""What each rank runs in the tensor-parallel tests: pipeline x (data x) tensor parallel on gloo ranks.

Global rank = (replica * pp + pipeline rank) * tp + tp index. Each case compares the loss and
every gradient this rank holds (gathered whole from its shards) with the eager model on the
global batch, and returns what the test asserts.
"""

from __future__ import annotations

import copy
import os

import torch
import torch.nn.functional as F
import tpmodels as tm

import fxpipe
from fxpipe.testing import max_relative_error


def _full(t):
    """Return a tensor whole (a DTensor's shards gathered)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _mlp():
    return tm.ResidualMLP(), torch.randn(8, 16), torch.randn(8, 8), F.mse_loss


def _decoder():
    return tm.TiedDecoder(), torch.randint(0, 64, (4, 8)), torch.randint(0, 64, (4, 8)), tm.token_loss


def _llama():
    return tm.llama(), torch.randint(0, 64, (4, 8)), torch.randint(0, 64, (4, 8)), tm.token_loss


MODELS = {"mlp": (_mlp, tm.MLP_PLAN, {}), "decoder": (_decoder, tm.DECODER_PLAN, {}),
          "llama": (_llama, tm.LLAMA_PLAN, {"tracer": "export"})}


def _place(rank, world, pp, tp):
    """Return (replica, pipeline rank, tp index, replicas) of a global rank."""
    dp = world // (pp * tp)
    replica, rest = divmod(rank, pp * tp)
    return replica, rest // tp, rest % tp, dp


def _setup(rank, world, name, schedule, pp=2, tp=2, plan="auto", chunks=2, **kw):
    """Compile model ``name`` for this rank; return the pipe, the models, this replica's batch and a step."""
    schedule, _, mode = schedule.partition(":")
    make, written, extra = MODELS[name]
    torch.manual_seed(0)
    model, x, y, loss_fn = make()
    eager = copy.deepcopy(model)
    replica, p, k, dp = _place(rank, world, pp, tp)
    rows = x.shape[0] // dp
    xs, ys = x[replica * rows:(replica + 1) * rows], y[replica * rows:(replica + 1) * rows]
    v = 2 if schedule in ("interleaved", "zbv") else 1
    pipe = fxpipe.compile(model, pp * v, example_inputs=(xs,), runtime="distributed", timeout=60, schedule=schedule,
                          chunks=chunks, data_parallel=dp, data_parallel_shard=mode == "shard", stages_per_rank=v,
                          tensor_parallel=tp, tp_plan=written if plan == "written" else plan, **extra, **kw)
    last = pipe.plan.stages[-1].on_rank == p

    def step(a=xs, b=ys):
        # the inputs and the target on the group's first rank only: the others take them from it
        return pipe.step(a if p == 0 and k == 0 else None, target=b if last and k == 0 else None, loss_fn=loss_fn)

    held = [(n, q) for n, q in model.named_parameters(remove_duplicate=False)
            if any(q is s for j in pipe.plan.stages_of(p) for s in pipe.stages[j].parameters())]
    return pipe, model, eager, x, y, loss_fn, step, held


def _errors(held, eager):
    """Return the relative error of every held gradient against eager's (whole, gathered from shards)."""
    grads = dict(eager.named_parameters(remove_duplicate=False))
    return {n: max_relative_error(_full(q.grad), grads[n].grad) if q.grad is not None else float("inf")
            for n, q in held}


def equal(rank, world, schedule):
    """One step of each model equals eager: loss and every gradient; the plan is the written one."""
    name, _, schedule = schedule.partition("/")
    pipe, model, eager, x, y, loss_fn, step, held = _setup(rank, world, name, schedule)
    loss = step()
    expected = loss_fn(eager(x), y)
    expected.backward()
    out = {"loss_error": max_relative_error(loss, expected), "grad_errors": _errors(held, eager),
           "sharded": sorted(n for n, q in held if hasattr(q, "to_local")),
           "plan": pipe.plan.tensor_parallel["modules"]}
    norm = fxpipe.clip_grad_norm_(pipe, 0.05)
    out["norm_error"] = max_relative_error(norm, torch.nn.utils.clip_grad_norm_(eager.parameters(), 0.05))
    out["clipped_errors"] = _errors(held, eager)
    return out


def plans(rank, world, schedule):
    """The automatic plan equals the written one for each model (compiled on 4 ranks, no step)."""
    out = {}
    for name in MODELS:
        auto = _setup(rank, world, name, "1f1b")[0].plan.tensor_parallel["modules"]
        written = _setup(rank, world, name, "1f1b", plan="written")[0].plan.tensor_parallel["modules"]
        out[name] = [auto, written]
    return out



def debug_ties(rank, world, schedule):
    pipe, model, eager, x, y, loss_fn, step, held = _setup(rank, world, "decoder", schedule)
    rt = pipe._runtime
    return {"ties": [[m, [(tuple(q.shape), type(q).__name__, tuple(q.to_local().shape) if hasattr(q, "to_local") else None) for q in ps], f] for (g, ps, f), m in zip(rt.ties.mine, [rt.ties.members[i] for i in rt.ties.index])]}


def debug_cross(rank, world, schedule):
    pipe, model, eager, x, y, loss_fn, step, held = _setup(rank, world, "decoder", schedule)
    rt = pipe._runtime
    return {"shards": {k: str(v) for k, v in rt.shards.items()}, "crossing": rt.crossing,
            "stages": [(s.inputs, s.outputs) for s in pipe.plan.stages]}


def debug_msgs(rank, world, schedule):
    pipe, model, eager, x, y, loss_fn, step, held = _setup(rank, world, "decoder", schedule)
    rt = pipe._runtime
    log = []
    orig = rt.comm._batch
    def batch(sends, recvs, what):
        log.append((what, [tuple(t.shape) for t, _, _ in sends], [tuple(t.shape) for t, _, _ in recvs]))
        print(rank, log[-1], flush=True)
        return orig(sends, recvs, what)
    rt.comm._batch = batch
    step()
    return {"log": log}


def debug_grads(rank, world, schedule):
    pipe, model, eager, x, y, loss_fn, step, held = _setup(rank, world, "decoder", schedule)
    rt = pipe._runtime
    rt._sum_tied = lambda: None
    step()
    return {n: [str(getattr(q.grad, "placements", None)), tuple(_loc(q.grad).shape)] for n, q in held if q.grad is not None and n in ("embed.weight", "head.weight", "blocks.0.attn.q.weight")}


def _loc(t):
    return t.to_local() if hasattr(t, "to_local") else t
