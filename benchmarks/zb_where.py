"""Where a distributed zero-bubble step spends its time, per rank, from fxpipe's own timeline.

    python benchmarks/zb_where.py --reps 14     # 2 ranks x 1 thread, residual MLP, m = 8
    python benchmarks/zb_where.py --reps 8 --schedule zbv   # ZB-V over 4 pieces, two per rank

On the model and split of ``benchmarks/distributed.py``, each rank records its zero-bubble
steps with ``fxpipe.timeline()`` and sums its forward, backward and weight-gradient events
(its busy time); the rest of the step it waits. Alternating with those steps, both ranks
compute their own half with plain autograd and no messages, rank 1 starting only once rank
0's first forward is done: what any schedule with one stage per rank must at least do (the
last rank can do nothing before its first input, then has all its own work to do). The
comparison says how much of the step is waiting that a schedule could remove and how much
is the runtime's own cost. Medians of ``--reps`` of each, measured in this one run.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path[:0] = [os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."),
                os.path.dirname(os.path.abspath(__file__))]
import fxpipe  # noqa: E402
from distributed import ResidualMLP, _env, _spawn, half_alone, model_arguments, report  # noqa: E402


def _rank(rank: int, port: int, args, out: str) -> None:
    """One rank: record zero-bubble steps and time the bound, alternating."""
    _env(rank, port)
    torch.manual_seed(0)
    base = ResidualMLP(args.dim, args.hidden, args.blocks)
    x, y = torch.randn(args.batch, args.dim), torch.randn(args.batch, args.dim)
    half = args.blocks // 2
    if args.schedule == "zbv":  # 4 pieces of the same model, rank 0 holding the first and the last
        q = args.blocks // 4
        pipe = fxpipe.compile(copy.deepcopy(base), 4, example_inputs=(x,), chunks=args.chunks, schedule="zbv",
                              checkpoint="never", runtime="distributed", stages_per_rank=2,
                              split_points=[f"blocks.{k * q}" for k in (1, 2, 3)])
    else:
        pipe = fxpipe.compile(copy.deepcopy(base), 2, example_inputs=(x,), chunks=args.chunks, schedule="zb",
                              checkpoint="never", runtime="distributed", split_points=[f"blocks.{half}"])
    last = pipe.plan.stages[-1].on_rank == rank
    part = copy.deepcopy(base).blocks[:half] if rank == 0 else copy.deepcopy(base).blocks[half:]
    fixed = torch.randn(args.batch // args.chunks, args.dim)
    rows: dict[str, list[float]] = {"step": [], "busy": [], "first": [], "bound step": [], "bound busy": [],
                                    "bound first": []}

    def zb() -> None:
        dist.barrier()
        start = time.perf_counter()
        with fxpipe.timeline() as tl:
            pipe.step(x if rank == 0 else None, target=y if last else None, loss_fn=F.mse_loss)
        dist.barrier()
        rows["step"].append(time.perf_counter() - start)  # barrier to barrier, like the bound
        rows["busy"].append(sum(e["dur"] for e in tl.events) / 1e6)
        rows["first"].append(min(e["ts"] for e in tl.events) / 1e6)  # on rank 1: its first input came

    def bound() -> None:  # rank 1 starts once rank 0's first forward is done
        flag, waited = torch.zeros(1), 0.0
        dist.barrier()
        start = time.perf_counter()
        if rank == 1:
            dist.recv(flag, 0)
            waited = time.perf_counter() - start
        half_alone(part, x, y, args.chunks, rank, fixed, (lambda: dist.send(flag, 1)) if rank == 0 else None)
        busy = time.perf_counter() - start - waited
        dist.barrier()
        rows["bound step"].append(time.perf_counter() - start)
        rows["bound busy"].append(busy)
        rows["bound first"].append(waited)

    zb()  # warm up both
    bound()
    for values in rows.values():
        values.clear()
    for r in range(args.reps):
        for fn in ((zb, bound) if r % 2 == 0 else (bound, zb)):
            fn()
    report(out, rank, rows)
    dist.destroy_process_group()


def main() -> None:
    """Run both ranks; print each rank's step, busy and waiting time, zb against the bound."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    model_arguments(parser, reps=14)
    parser.add_argument("--schedule", choices=("zb", "zbv"), default="zb",
                        help="zb: a stage per rank; zbv: the MLP in 4 pieces, two per rank (the bound stays "
                             "the one-stage-per-rank one)")
    args = parser.parse_args()
    med = [{k: statistics.median(v) for k, v in rows.items()} for rows in _spawn(_rank, args)]
    print(f"residual MLP d={args.dim} hidden={args.hidden} blocks={args.blocks} batch={args.batch} "
          f"m={args.chunks}, 2 ranks x 1 thread, medians of {args.reps} of each (s)")
    print(f"{'':28} {'rank':>4} {'step':>7} {'busy':>7} {'waiting':>8} {'first input':>12}")
    for label, key in ((f"fxpipe {args.schedule}", ""), ("bound (plain autograd)", "bound ")):
        for r, m in enumerate(med):
            print(f"{label if r == 0 else '':28} {r:>4} {m[key + 'step']:7.3f} {m[key + 'busy']:7.3f} "
                  f"{m[key + 'step'] - m[key + 'busy']:8.3f} {m[key + 'first']:12.3f}")
    last = med[-1]
    s = args.schedule
    print(f"last rank's busy time, {s} / bound: {last['busy'] / last['bound busy']:.3f}; "
          f"its wait for its first input, {s} / bound: {last['first'] / last['bound first']:.3f}")
    print(f"step, {s} / bound: {last['step'] / last['bound step']:.3f}")


if __name__ == "__main__":
    main()
