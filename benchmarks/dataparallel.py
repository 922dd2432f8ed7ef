"""fxpipe's data parallel against DistributedDataParallel, side by side.

    python benchmarks/dataparallel.py            # 2 ranks x 1 thread, residual MLP

Two spawned ranks (gloo, one thread each) run, in alternation, one training step of the same
residual MLP on their own half of the batch: ``torch.nn.parallel.DistributedDataParallel``
(forward, MSE loss, backward), and fxpipe with one pipeline stage and two replicas
(``data_parallel=2``, ``chunks=1``; its gradients reduced by DDP's reducer), and the same with
FSDP2 sharding (``data_parallel_shard=True``). Each time is barrier to barrier on rank 0, the
runs in an order shuffled anew every repetition; each ratio is of medians from this one run.
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


def _rank(rank: int, port: int, args, out: str) -> None:
    """One rank: DDP, fxpipe replicate and fxpipe shard, each on this rank's half of the batch."""
    _env(rank, port)
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    base = ResidualMLP(args.dim, args.hidden, args.blocks)
    half = args.batch // 2
    x, y = torch.randn(args.batch, args.dim)[rank * half:(rank + 1) * half], torch.randn(half, args.dim)
    ddp = DistributedDataParallel(copy.deepcopy(base))
    pipes = {mode: fxpipe.compile(copy.deepcopy(base), 1, example_inputs=(x,), chunks=1, checkpoint="never",
                                  runtime="distributed", data_parallel=2, data_parallel_shard=mode == "shard")
             for mode in ("replicate", "shard")}

    def ddp_step():
        F.mse_loss(ddp(x), y).backward()
        ddp.zero_grad()

    def fx_step(mode):
        pipes[mode].step(x, target=y, loss_fn=F.mse_loss)
        pipes[mode].zero_grad()

    runs = {"DistributedDataParallel": ddp_step, "fxpipe data_parallel=2": lambda: fx_step("replicate"),
            "fxpipe data_parallel=2, FSDP2": lambda: fx_step("shard")}
    time_shuffled(runs, args.reps, rank, out)


def main() -> None:
    """Parse arguments, run the comparison, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    model_arguments(parser, reps=15)
    args = parser.parse_args()
    med = {k: statistics.median(v) for k, v in _spawn(_rank, args)[0].items()}
    print(f"residual MLP d={args.dim} hidden={args.hidden} blocks={args.blocks} batch={args.batch} (half per rank), "
          f"2 ranks x 1 thread, {args.reps} alternating runs, median step time")
    base = med["DistributedDataParallel"]
    for k, v in med.items():
        print(f"{k:32} {v:8.3f} s   / DDP {v / base:.3f}")


if __name__ == "__main__":
    main()
