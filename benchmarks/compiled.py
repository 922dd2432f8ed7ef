"""Compiled stages (``torch_compile=``): against torch.compile alone, the same pipe eager, and pipelining compiled.

    python benchmarks/compiled.py            # inductor on CPU; 1 process, then 2 ranks x 1 thread
    python benchmarks/compiled.py --quick    # toy sizes and 2 repetitions: checks the script, numbers mean nothing

The model is a transformer-like stack without attention (``Stack`` of tests/support/models.py:
pre-norm LayerNorm, GELU MLP, residual add: the memory-bound kernels inductor fuses), one
training step (forward, MSE loss, backward; no optimizer), ``checkpoint="never"`` everywhere.

(a) One process, one thread: ``fxpipe.compile(model, 1, chunks=1, torch_compile=True)``'s step
    against ``torch.compile(model)``'s forward and backward alone (target: <= 1.05x).
(b) Two spawned ranks (gloo, one thread each), one stage per rank: fxpipe's zero-bubble
    schedule with compiled stages against the same pipe uncompiled (target: <= 0.85x).
(c) The same ranks: fxpipe zb compiled against torch.distributed.pipelining with each stage
    module compiled (``torch.compile`` of the stage's piece) under every schedule of its that
    accepts compiled stages (GPipe, 1F1B, interleaved 1F1B over 4 pieces; its zero-bubble
    schedules are tried too, and reported if they refuse), against its fastest (target: <= 0.90x).

Every run is warmed up (compiled) first; then the runs alternate in a new shuffled order each
repetition, each timed barrier to barrier (in one process: alone); each ratio is of medians
from this one run.
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path[:0] = [ROOT, BENCH, os.path.join(ROOT, "tests", "support"), os.path.join(ROOT, "examples")]
import fxpipe  # noqa: E402
from distributed import _env, _spawn, _timed, report  # noqa: E402
from models import Stack  # noqa: E402

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb", "zbv")  # pipelining's, in the order tried


def _model(args) -> tuple[Stack, torch.Tensor, torch.Tensor]:
    """Return the stack and one batch of inputs and targets, the same on every rank."""
    torch.manual_seed(0)
    model = Stack(d=args.dim, hidden=args.hidden, layers=args.layers, out=args.dim)
    return model, torch.randn(args.batch, args.dim), torch.randn(args.batch, args.dim)


def _race(runs: dict, reps: int, timed) -> dict[str, float]:
    """Warm each run up (compiling it), then time them ``reps`` times, shuffled; return median seconds."""
    for fn in runs.values():
        fn()
        fn()
    times: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(reps):
        order = list(runs)
        random.Random(r).shuffle(order)
        for name in order:
            times[name].append(timed(runs[name]))
    return {k: statistics.median(v) for k, v in times.items()}


def one_process(args) -> dict[str, float]:
    """(a): fxpipe, one stage and one chunk, compiled, against torch.compile(model) alone."""
    torch.set_num_threads(1)
    base, x, y = _model(args)
    alone = torch.compile(copy.deepcopy(base))
    pipe = fxpipe.compile(copy.deepcopy(base), 1, example_inputs=(x,), chunks=1, checkpoint="never",
                          devices=["cpu"], torch_compile=True)
    eager = copy.deepcopy(base)

    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    runs = {"torch.compile(model)": lambda: F.mse_loss(alone(x), y).backward(),
            "fxpipe 1 stage, torch_compile=True": lambda: pipe.step(x, target=y, loss_fn=F.mse_loss),
            "eager": lambda: F.mse_loss(eager(x), y).backward()}
    return _race(runs, args.reps, timed)


def _pipelining(args, base, x, rank: int) -> tuple[dict, dict]:
    """Build pipelining's schedules over compiled stage modules; return them and why any refused."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    from torch.distributed.pipelining.schedules import (ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
                                                        ScheduleZBVZeroBubble)

    rows = args.batch // args.chunks
    blocks = base.blocks

    def stage(piece, k: int, n: int):
        inp = torch.empty(rows, args.dim).requires_grad_(k > 0)
        out = torch.empty(rows, args.dim, requires_grad=True)
        return PipelineStage(torch.compile(piece), k, n, torch.device("cpu"), input_args=(inp,), output_args=(out,))

    half, quarter = args.layers // 2, args.layers // 4
    halves = [torch.nn.Sequential(copy.deepcopy(base.inp), *copy.deepcopy(blocks[:half])),
              torch.nn.Sequential(*copy.deepcopy(blocks[half:]), copy.deepcopy(base.norm), copy.deepcopy(base.head))]
    quarters = [torch.nn.Sequential(copy.deepcopy(base.inp), *copy.deepcopy(blocks[:quarter])),
                torch.nn.Sequential(*copy.deepcopy(blocks[quarter:half])),
                torch.nn.Sequential(*copy.deepcopy(blocks[half:3 * quarter])),
                torch.nn.Sequential(*copy.deepcopy(blocks[3 * quarter:]), copy.deepcopy(base.norm),
                                    copy.deepcopy(base.head))]
    loop, vee = [0, 1, 0, 1], [0, 1, 1, 0]
    makers = {
        "gpipe": lambda: ScheduleGPipe(stage(copy.deepcopy(halves[rank]), rank, 2), args.chunks, loss_fn=F.mse_loss),
        "1f1b": lambda: Schedule1F1B(stage(copy.deepcopy(halves[rank]), rank, 2), args.chunks, loss_fn=F.mse_loss),
        "interleaved": lambda: ScheduleInterleaved1F1B(
            [stage(copy.deepcopy(quarters[k]), k, 4) for k in range(4) if loop[k] == rank], args.chunks,
            loss_fn=F.mse_loss),
        "zb": lambda: ScheduleInterleavedZeroBubble(
            [stage(copy.deepcopy(halves[rank]), rank, 2)], args.chunks, loss_fn=F.mse_loss),
        "zbv": lambda: ScheduleZBVZeroBubble(
            [stage(copy.deepcopy(quarters[k]), k, 4) for k in range(4) if vee[k] == rank], args.chunks,
            loss_fn=F.mse_loss),
    }
    last = {"gpipe": 1, "1f1b": 1, "interleaved": 1, "zb": 1, "zbv": 0}
    schedules, refused = {}, {}
    for name in PP_SCHEDULES:
        try:
            sched = makers[name]()
            _pp_step(sched, x, None, rank, last[name], trial=True)
            schedules[name] = (sched, last[name])
        except Exception as exc:  # noqa: BLE001 - a schedule that refuses compiled stages is reported
            refused[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
            if os.environ.get("FXPIPE_BENCH_TRACEBACK"):
                traceback.print_exc()
    return schedules, refused


def _pp_step(sched, x, y, rank: int, last_rank: int, trial: bool = False) -> None:
    """One step of a pipelining schedule (a trial step runs with a stand-in target)."""
    feed = (x,) if rank == 0 else ()
    if rank == last_rank:
        target = torch.zeros(x.shape[0], x.shape[1]) if y is None else y
        sched.step(*feed, target=target, losses=[])
    else:
        sched.step(*feed)


def _ranks(rank: int, port: int, args, out: str) -> None:
    """One rank of (b) and (c)."""
    _env(rank, port)
    base, x, y = _model(args)
    point = [f"blocks.{args.layers // 2}"]
    pipes = {c: fxpipe.compile(copy.deepcopy(base), 2, example_inputs=(x,), chunks=args.chunks, schedule="zb",
                               checkpoint="never", runtime="distributed", split_points=point,
                               torch_compile=c == "compiled") for c in ("compiled", "eager")}
    schedules, refused = _pipelining(args, base, x, rank)

    def fx_step(kind: str) -> None:
        pipe = pipes[kind]
        last = pipe.plan.stages[-1].on_rank == rank
        pipe.step(x if rank == 0 else None, target=y if last else None, loss_fn=F.mse_loss)

    runs = {"fxpipe zb, compiled stages": lambda: fx_step("compiled"), "fxpipe zb, eager": lambda: fx_step("eager")}
    for name, (sched, last) in schedules.items():
        runs[f"pipelining {name}, compiled stages"] = (lambda s=sched, r=last: _pp_step(s, x, y, rank, r))
    med = _race(runs, args.reps, _timed)
    stats = pipes["compiled"].compile_stats
    if rank == 0:
        report(out, rank, {"times": med, "refused": refused,
                           "compile": {str(j): s["seconds"] for j, s in stats.items()}})
    dist.destroy_process_group()


def main() -> None:
    """Parse arguments, run (a), then (b) and (c) on two ranks; print the ratios."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--quick", action="store_true", help="toy sizes, 2 repetitions (checks the script)")
    args = parser.parse_args()
    if args.quick:
        args.dim, args.hidden, args.layers, args.batch, args.chunks, args.reps = 32, 64, 4, 64, 4, 2

    print(f"Stack d={args.dim} hidden={args.hidden} layers={args.layers} batch={args.batch}, inductor on CPU, "
          f"{args.reps} alternating runs, median step time")
    a = one_process(args)
    print("\n(a) one process, 1 thread, one stage and one chunk")
    for k, v in a.items():
        print(f"  {k:40} {v:8.4f} s")
    print(f"  fxpipe / torch.compile(model) alone: {a['fxpipe 1 stage, torch_compile=True'] / a['torch.compile(model)']:.3f}"
          f"   (target <= 1.05)   torch.compile / eager: {a['torch.compile(model)'] / a['eager']:.3f}")

    got = _spawn(_ranks, args)[0]
    med, refused = got["times"], got["refused"]
    print(f"\n(b, c) 2 ranks x 1 thread (gloo), m={args.chunks}, one stage per rank (interleaved: two)")
    for k, v in med.items():
        print(f"  {k:40} {v:8.4f} s")
    for name, why in refused.items():
        print(f"  pipelining {name} refuses compiled stages: {why}")
    fx, eager = med["fxpipe zb, compiled stages"], med["fxpipe zb, eager"]
    print(f"  (b) fxpipe zb compiled / the same pipe eager: {fx / eager:.3f}   (target <= 0.85)")
    theirs = [k for k in med if k.startswith("pipelining")]
    if theirs:
        best = min(theirs, key=med.__getitem__)
        print(f"  (c) fxpipe zb compiled / pipelining's fastest with compiled stages ({best}): "
              f"{fx / med[best]:.3f}   (target <= 0.90)")
    print("  fxpipe's compile time on rank 0 (first step): " + ", ".join(
        f"stage {j} {s:.1f} s" for j, s in got["compile"].items()))


if __name__ == "__main__":
    main()
