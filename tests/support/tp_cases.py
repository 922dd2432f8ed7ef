"""What each rank runs in the tensor-parallel tests: pipeline x (data x) tensor parallel on gloo ranks.

Global rank = (replica * pp + pipeline rank) * tp + tp index. Each case compares the loss and
every gradient this rank holds (gathered whole from its shards) with the eager model on the
global batch, and returns what the test asserts.
"""

from __future__ import annotations

import copy
import os
import time
import warnings

import torch
import torch.nn.functional as F
import tpmodels as tm
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import fxpipe
from fxpipe.testing import max_relative_error


def _full(t):
    """Return a tensor whole (a DTensor's shards gathered)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _mlp():
    return tm.ResidualMLP(), torch.randn(8, 16), torch.randn(8, 8), F.mse_loss


def _decoder():
    return tm.TiedDecoder(), torch.randint(0, 64, (4, 8)), torch.randint(0, 64, (4, 8)), tm.token_loss


def _qknorm():
    """The tied decoder with Qwen3's per-head q_norm and k_norm in every attention."""
    model = tm.TiedDecoder()
    for block in model.blocks:
        block.attn = tm.QKNormAttention()
    return model, torch.randint(0, 64, (4, 8)), torch.randint(0, 64, (4, 8)), tm.token_loss


def _llama():
    return tm.llama(), torch.randint(0, 64, (4, 8)), torch.randint(0, 64, (4, 8)), tm.token_loss


def _sp():
    return tm.TiedDecoder(positions=False), torch.randint(0, 64, (4, 8)), torch.randint(0, 64, (4, 8)), tm.token_loss


def _padded():
    """The tied decoder with a padding row (40) on the second rank's half of the vocabulary, and in the batch."""
    model = tm.TiedDecoder()
    model.embed.padding_idx = 40
    ids = torch.randint(0, 64, (4, 8))
    ids[:, 0] = 40
    return model, ids, torch.randint(0, 64, (4, 8)), tm.token_loss


class _ScaledEmbedding(nn.Embedding):
    """Gemma's embedding: its output scaled by a buffer of its own."""

    def __init__(self, *args):
        super().__init__(*args)
        self.register_buffer("embed_scale", torch.tensor(32 ** 0.5), persistent=False)

    def forward(self, ids):
        return super().forward(ids) * self.embed_scale


def _scaled():
    """The tied decoder with Gemma's scaled embedding, exported (the graph reads embed.embed_scale)."""
    model = tm.TiedDecoder()
    model.embed = _ScaledEmbedding(64, 32)
    model.head.weight = model.embed.weight
    return model, torch.randint(0, 64, (4, 8)), torch.randint(0, 64, (4, 8)), tm.token_loss


MODELS = {"mlp": (_mlp, tm.MLP_PLAN, {}), "decoder": (_decoder, tm.DECODER_PLAN, {}),
          "llama": (_llama, tm.LLAMA_PLAN, {"tracer": "export"}),
          "sp": (_sp, tm.SP_PLAN, {"split_points": ["blocks.1"]}),
          "padded": (_padded, tm.DECODER_PLAN, {}), "padded_export": (_padded, tm.DECODER_PLAN, {"tracer": "export"}),
          "scaled": (_scaled, tm.DECODER_PLAN, {"tracer": "export"}),
          "qknorm": (_qknorm, tm.DECODER_PLAN, {})}  # sequence parallel: its own plan


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
    plan = "written" if name == "sp" else plan
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
    """One step of each model (``mlp,decoder/1f1b``) equals eager: the loss, every gradient, the clipped norm."""
    names, _, schedule = schedule.partition("/")
    return {name: _equal(rank, world, name, schedule) for name in names.split(",")}


def _equal(rank, world, name, schedule):
    """One step of model ``name`` against eager, with the automatic plan."""
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


def accumulate(rank, world, schedule):
    """tp2 x dp2 (pp1): a step inside pipe.no_sync(), then a synced one, equal eager's two backwards (q_norm too)."""
    pipe, model, eager, x, y, loss_fn, step, held = _setup(rank, world, "qknorm", schedule, pp=1)
    x2, y2 = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(2)), torch.roll(y, 1, 0)
    replica, _, _, dp = _place(rank, world, 1, 2)
    rows = x.shape[0] // dp
    with pipe.no_sync():
        step()
    step(x2[replica * rows:(replica + 1) * rows], y2[replica * rows:(replica + 1) * rows])
    loss_fn(eager(x), y).backward()
    loss_fn(eager(x2), y2).backward()
    return {"grad_errors": _errors(held, eager)}


def plans(rank, world, schedule):
    """The automatic plan equals the written one for each model (compiled on 4 ranks, no step)."""
    out = {}
    for name in MODELS:
        auto = _setup(rank, world, name, "1f1b")[0].plan.tensor_parallel["modules"]
        written = _setup(rank, world, name, "1f1b", plan="written")[0].plan.tensor_parallel["modules"]
        out[name] = [auto, written]
    return out




def _adam_step(pipe, step, x, y):
    """One Adam step of ``pipe`` on a batch; return the optimizer and the loss."""
    opt = getattr(pipe, "_test_opt", None) or torch.optim.Adam(pipe.parameters(), lr=1e-2)
    pipe._test_opt = opt
    opt.zero_grad()
    loss = step(x, y)
    opt.step()
    return opt, float(loss)


def save_tp(rank, world, schedule):
    """pp=2 x tp=2: a step, save (model and Adam state) and the next step's loss, for load_tp to match."""
    pipe, model, eager, x, y, loss_fn, step, held = _setup(rank, world, "decoder", schedule)
    opt, _ = _adam_step(pipe, step, x, y)
    path = os.path.join(os.environ["FXPIPE_TEST_DIR"], "ckpt")
    fxpipe.save(pipe, path, optimizer=opt)
    x2, y2 = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1)), \
        torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(2))
    _, loss = _adam_step(pipe, step, x2, y2)
    return {"next_loss": loss, "sharded": sorted(n for n, q in held if hasattr(q, "to_local"))}


def load_tp(rank, world, schedule):
    """Another tp (``tp1``: one rank per stage; ``tp4``: one stage of 4 ranks): load save_tp's checkpoint, step.

    The plain module loads it too: its loss on the next batch is the pipe's next step's.
    """
    path = os.path.join(os.environ["FXPIPE_TEST_DIR"], "ckpt")
    tp = int(schedule.removeprefix("tp"))
    pipe, model, eager, x, y, loss_fn, step, held = _setup(rank, world, "decoder", "1f1b", pp=world // tp, tp=tp)
    opt = torch.optim.Adam(pipe.parameters(), lr=1e-2)
    fxpipe.load(pipe, path, optimizer=opt)
    pipe._test_opt = opt
    x2, y2 = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1)), \
        torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(2))
    _, loss = _adam_step(pipe, step, x2, y2)
    plain = tm.TiedDecoder()
    fxpipe.load(plain, path)
    return {"next_loss": loss, "plain_loss": float(loss_fn(plain(x2), y2))}


class _Collectives(TorchDispatchMode):
    """Count the functional collectives DTensor runs, in forward and in backward (autograd's graph task)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"):
            self.seen.append((name, "backward" if torch._C._current_graph_task_id() != -1 else "forward"))
        return func(*args, **(kwargs or {}))


def count(rank, world, schedule):
    """pp=1 x tp=2, the automatic plan on ``schedule``'s model: the collectives of a step, forward and backward.

    ``mlp``: residual MLP blocks (Megatron's count); ``decoder``: query, key and value share one backward
    all-reduce, so an attention block counts as an MLP block does.
    """
    pipe, model, eager, x, y, loss_fn, step, held = _setup(rank, world, schedule, "1f1b", pp=1, chunks=2,
                                                           checkpoint="never")  # recomputation repeats the forward
    step()  # a first step: layouts propagated, buffers made
    model.zero_grad(set_to_none=True)
    with _Collectives() as comm:
        loss = step()
    expected = loss_fn(eager(x), y)
    expected.backward()
    return {"seen": comm.seen, "blocks": len(model.blocks), "chunks": pipe.plan.chunks,
            "recorded": pipe.plan.tensor_parallel["calls"], "loss_error": max_relative_error(loss, expected),
            "grad_errors": _errors(held, eager)}


def memory(rank, world, schedule):
    """A model built on meta, tp=2 from a 3-D mesh=: each rank's parameter bytes of its stage against the whole stage's."""
    from torch.distributed.device_mesh import init_device_mesh

    with torch.device("meta"):
        model = tm.ResidualMLP(d=32, hidden=128, blocks=4)
    x = torch.randn(8, 32)
    fxpipe.init_distributed()
    mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp", "pp", "tp"))
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), runtime="distributed", timeout=60, chunks=2,
                          mesh=mesh, schedule="1f1b")
    _, p, _, _ = _place(rank, world, 2, 2)
    held = {id(q): q for j in pipe.plan.stages_of(p) for q in pipe.stages[j].parameters()}
    local = sum((q.to_local() if hasattr(q, "to_local") else q).nbytes for q in held.values())
    whole = sum(pipe.plan.stages[j].params for j in pipe.plan.stages_of(p))
    loss = pipe.step(x, target=torch.zeros(8, 8), loss_fn=F.mse_loss)
    return {"local": local, "whole": whole, "meta_left": any(q.is_meta for q in held.values()), "loss": float(loss),
            "size": pipe.plan.tensor_parallel["size"]}



def mixed(rank, world, schedule):
    """pp=2 x tp=2: autocast bf16 runs every stage's shards in bf16; fp16 loss scaling skips the same step everywhere."""
    pipe, model, eager, x, y, loss_fn, step, held = _setup(rank, world, "decoder", schedule)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = step()
        want = loss_fn(eager(x), y)
    out = {"bf16_loss_error": max_relative_error(got, want.float()),
           "bf16_vs_fp32": max_relative_error(got, loss_fn(eager(x), y).detach())}
    model.zero_grad(set_to_none=True)
    sc = fxpipe.grad_scaler(pipe, init_scale=1024.0)
    # whole parameters first (an optimizer over pipe.parameters() meets an untied norm or head first): one foreach
    # call unscaling both kinds read the first gradient's DTensor placements ("'Tensor' object has no attribute")
    opt = torch.optim.SGD(sorted((q for _, q in held), key=lambda q: hasattr(q, "placements")), lr=0.1)
    _, p, k, _ = _place(rank, world, 2, 2)
    last = pipe.plan.stages[-1].on_rank == p
    with torch.autocast("cpu", dtype=torch.float16):
        loss = pipe.step(x if p == 0 else None, target=y if last else None, loss_fn=loss_fn, scaler=sc)
    if rank == world - 1:  # one shard of one rank overflows
        q = held[-1][1]
        (q.grad.to_local() if hasattr(q.grad, "to_local") else q.grad).view(-1)[0] = float("inf")
    before = [q.detach().clone() for _, q in held]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        sc.step(opt)
    out["warned"] = [str(w.message) for w in seen if "numel=1" in str(w.message)]  # the scale, replicated by design
    sc.update()
    out.update(skipped=all(torch.equal(_full(a), _full(q.detach())) for a, (_, q) in zip(before, held)),
               scale=sc.get_scale(), fp16_loss=float(loss))
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):  # no overflow: the step is taken
        pipe.step(x if p == 0 else None, target=y if last else None, loss_fn=loss_fn, scaler=sc)
    before = [q.detach().clone() for _, q in held]
    sc.step(opt)
    sc.update()
    out["then_stepped"] = not any(torch.equal(_full(a), _full(q.detach())) for a, (_, q) in zip(before, held))
    return out


def policies(rank, world, schedule):
    """pp=2 x tp=2, the decoder: checkpoint='selective', a policy per stage and 'auto' (TP-sharded costs) equal eager."""
    out = {}
    for name, checkpoint in (("selective", "selective"), ("per_stage", ["selective", "always"]), ("auto", "auto")):
        budget = {"max_memory": 120e3} if checkpoint == "auto" else {}  # the predicted peaks are 86-111 kB at least
        pipe, model, eager, x, y, loss_fn, step, held = _setup(rank, world, "decoder", schedule,
                                                               checkpoint=checkpoint, **budget)
        loss = step()
        expected = loss_fn(eager(x), y)
        expected.backward()
        out[name] = {"loss_error": max_relative_error(loss, expected), "grad_errors": _errors(held, eager),
                     "policies": pipe.plan.policies()}
    return out


def misuse(rank, world, schedule):
    """pp2 x tp2: the target on the first stage's ranks only, every rank's own rows, a group's two targets (all
    refused on every rank); then inputs and target on each group's second rank (the group takes them from it); then
    the target on the first stage's ranks only again, on a later step (refused on every rank, and the pipe steps on)."""
    pipe, model, eager, x, y, loss_fn, step, held = _setup(rank, world, "mlp", schedule)
    _, p, k, _ = _place(rank, world, 2, 2)
    last = pipe.plan.stages[-1].on_rank == p
    out = {}
    for label, a, b in [("target_on_first", x if p == 0 else None, y if p == 0 else None),
                        ("own_rows", x + rank, y + rank),  # DistributedSampler(ds) over every rank
                        ("no_inputs", None, y if last else None),
                        ("group_targets_differ", x if p == 0 and k == 0 else None, y + k if last else None),
                        ("on_second", x if p == 0 and k == 1 else None, y if last and k == 1 else None),
                        ("target_on_first_later", x if p == 0 else None, y if p == 0 else None)]:
        try:
            out[label] = ["returned", pipe.step(a, target=b, loss_fn=loss_fn).item()]
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out[label] = [type(exc).__name__, str(exc)]
    pipe.zero_grad()
    loss = step()
    expected = loss_fn(eager(x), y)
    expected.backward()
    out["expected"] = expected.item()
    out["after"] = [max_relative_error(loss, expected), max(_errors(held, eager).values())]
    out["devices"] = [s.device for s in pipe.plan.stages]
    return out


def calls_differ(rank, world, schedule):
    """pp2 x tp2, after a first step: each rank in turn calling pipe(x) while the others step, one rank in eval
    mode, under autocast, with another loss_reduction, or refusing its own arguments (a step under no_grad), each
    followed by a step of every rank; every call times how long its refusal took."""
    pipe, model, eager, x, y, loss_fn, step, held = _setup(rank, world, "mlp", schedule)
    out = {"first": step().item()}

    def mistake(odd):
        if rank != odd:
            return step()
        if odd == 0:
            return pipe(x)
        if odd == 1:
            with torch.no_grad():
                return step()
        if odd == 2:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return step()
        pipe.eval()
        try:
            return step()
        finally:
            pipe.train()

    for label, call in [*((f"infers_{odd}", lambda odd=odd: pipe(x) if rank == odd else step()) for odd in range(4)),
                        *((f"mistake_{odd}", lambda odd=odd: mistake(odd)) for odd in range(4)),
                        ("summed_3", lambda: pipe.step(x if rank == 0 else None, target=y if rank == 2 else None,
                                                       loss_fn=loss_fn, loss_reduction="sum" if rank == 3 else "mean"))]:
        start = time.monotonic()
        try:
            call()
            out[label] = ["returned", "", time.monotonic() - start]
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out[label] = [type(exc).__name__, str(exc), time.monotonic() - start]
    for _ in range(2):  # the pipe steps on: two more steps, against eager's three
        pipe.zero_grad()
        loss = step()
    for _ in range(3):
        eager.zero_grad()
        expected = loss_fn(eager(x), y)
        expected.backward()
    out["after"] = [max_relative_error(loss, expected), max(_errors(held, eager).values())]
    return out


def ended_early(rank, world, schedule):
    """pp2 x tp2: rank 2's script ends after two of three steps, on an error outside the pipe's calls; the others'
    third step names it."""
    import sys

    from fxpipe.runtime.transport.release import release_all

    pipe, model, eager, x, y, loss_fn, step, held = _setup(rank, world, "mlp", schedule)
    out = {"calls": []}
    for k in range(3):
        if k == 2 and rank == 2:
            sys.last_value = RuntimeError("crash on rank 2")  # what the interpreter sets as it prints the traceback
            release_all()  # what its exit runs (a spawned test rank exits without it)
            break
        start = time.monotonic()
        try:
            step()
            out["calls"].append(["returned", "", time.monotonic() - start])
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out["calls"].append([type(exc).__name__, str(exc), time.monotonic() - start])
    return out


class _MaskedMLP(nn.Module):
    """Two linear pairs tensor parallel splits, and an optional mask (None in the example: fixed to None)."""

    def __init__(self):
        super().__init__()
        self.up1, self.down1 = nn.Linear(16, 32), nn.Linear(32, 16)
        self.up2, self.down2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x, mask=None):
        h = self.down1(torch.relu(self.up1(x)))
        if mask is not None:
            h = h * mask
        return self.down2(torch.relu(self.up2(h)))


def fixed_later(rank, world, schedule):
    """pp2 x tp2: a value for the input the trace fixed, given on rank 3 only at a later call (no glance there):
    refused on every rank (its peers failing the step), where it was ignored, silently."""
    torch.manual_seed(0)
    model = _MaskedMLP()
    x, y, mask = torch.randn(8, 16), torch.randn(8, 16), torch.rand(8, 16)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=2, schedule=schedule, runtime="distributed",
                          tensor_parallel=2, split_points=["up2"], timeout=60)
    pipe.step(x, target=y, loss_fn=F.mse_loss)
    try:
        loss = pipe.step(x, mask if rank == 3 else None, target=y, loss_fn=F.mse_loss)
        return {"later": ["returned", str(float(loss))]}
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {"later": [type(exc).__name__, str(exc)]}
