"""Zero bubble (ZB-H1) against one with an extra warm-up forward, side by side on 2 ranks.

    python benchmarks/zb_warmup.py --reps 15    # 2 ranks x 1 thread, residual MLP, m = 8

fxpipe's ``schedule="zb"`` is the paper's ZB-H1, with 1F1B's warm-up (``zero_bubble(n, m)``).
One more warm-up forward on every stage but the last (``extra_warmup=1``) would have the
next stage's input ready before it asks, for one more micro-batch held; this measures it.
Both run (the second as your own schedule: ``schedule=`` the action lists) in the same two processes, alternating with
fxpipe's 1F1B in an order shuffled anew every repetition (the run after another kind of step
pays for its memory layout), on the model and split of ``benchmarks/distributed.py``. Each time is barrier
to barrier on rank 0; each ratio is of medians measured in this one run.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path[:0] = [os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."),
                os.path.dirname(os.path.abspath(__file__))]
import fxpipe  # noqa: E402
from distributed import ResidualMLP, _env, _spawn, model_arguments, time_shuffled  # noqa: E402
from fxpipe.runtime.schedules.builtin import zero_bubble  # noqa: E402


def _rank(rank: int, port: int, args, out: str) -> None:
    """One rank: time 1F1B and both zero-bubble programs, alternating."""
    _env(rank, port)
    torch.manual_seed(0)
    base = ResidualMLP(args.dim, args.hidden, args.blocks)
    x, y = torch.randn(args.batch, args.dim), torch.randn(args.batch, args.dim)
    schedules = {"1f1b": "1f1b", "zb": "zb",
                 "zb_extra": zero_bubble(2, args.chunks, extra_warmup=1)}  # your own schedule, as action lists
    pipes = {k: fxpipe.compile(copy.deepcopy(base), 2, example_inputs=(x,), chunks=args.chunks, schedule=s,
                               checkpoint="never", runtime="distributed",
                               split_points=[f"blocks.{args.blocks // 2}"]) for k, s in schedules.items()}

    def step(schedule: str) -> None:
        pipes[schedule].step(x if rank == 0 else None, target=y if rank == 1 else None, loss_fn=F.mse_loss)

    runs = {"fxpipe 1f1b": lambda: step("1f1b"),
            "fxpipe zb (ZB-H1, 1F1B warm-up)": lambda: step("zb"),
            "fxpipe zb, one more warm-up forward": lambda: step("zb_extra")}
    time_shuffled(runs, args.reps, rank, out)


def main() -> None:
    """Parse arguments, run, print the medians and ratios."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    model_arguments(parser, reps=9)
    args = parser.parse_args()
    med = {k: statistics.median(v) for k, v in _spawn(_rank, args)[0].items()}
    print(f"residual MLP d={args.dim} hidden={args.hidden} blocks={args.blocks} batch={args.batch} "
          f"m={args.chunks}, 2 ranks x 1 thread, {args.reps} alternating runs, median step time")
    for k, v in med.items():
        print(f"{k:36} {v:7.3f} s   {v / med['fxpipe 1f1b']:.3f}x 1f1b")
    ratio = med["fxpipe zb, one more warm-up forward"] / med["fxpipe zb (ZB-H1, 1F1B warm-up)"]
    print(f"one more warm-up forward / ZB-H1: {ratio:.3f}")


if __name__ == "__main__":
    main()
