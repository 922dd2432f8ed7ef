"""What a new sequence length costs across ranks: its first step against a repeat of it.

    python benchmarks/new_shape.py            # 2 ranks x 1 thread, GPT-style decoder, 1F1B, m = 4

Two spawned ranks (gloo, one thread each) train a GPT-style decoder (examples/transformer.py)
compiled for sequences of 64 tokens. Each new length's first step propagates the values that
cross the stage boundary for its micro-batch layout on fake tensors (on the first rank, which
sends them ahead in the step's header) before running; its later steps reuse them. Each
length runs ``--reps`` times; the ratio is its first step's time over the median of the
others, barrier to barrier on rank 0, measured in this one run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path[:0] = [os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."),
                os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples")]
import fxpipe  # noqa: E402
from fxpipe.runtime.transport.procgroup import init_distributed  # noqa: E402
from transformer import GPT  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ports import free_port  # noqa: E402

LENGTHS = (64, 96, 32, 128, 48)


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Return the mean cross-entropy over every token."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _rank(rank: int, port: int, reps: int, out: str) -> None:
    """Train on every length ``reps`` times on this rank; rank 0 writes the times."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    init_distributed(120)
    torch.manual_seed(0)
    model = GPT(vocab=512, d=128, layers=8, heads=4, seq=max(LENGTHS))
    ids = torch.randint(0, 512, (8, 64))
    pipe = fxpipe.compile(model, 2, example_inputs=(ids,), chunks=4, schedule="1f1b", runtime="distributed")
    times: dict[int, list[float]] = {}
    for t in LENGTHS:
        x, y = torch.randint(0, 512, (8, t)), torch.randint(0, 512, (8, t))
        for _ in range(reps):
            dist.barrier()
            start = time.perf_counter()
            pipe.step(x, target=y, loss_fn=_loss)
            dist.barrier()
            times.setdefault(t, []).append(time.perf_counter() - start)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(times, f)
    dist.destroy_process_group()


def main() -> None:
    """Spawn two ranks, time every length, print the ratios."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=6)
    args = parser.parse_args()
    out = os.path.join(tempfile.mkdtemp(), "times.json")
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, args.reps, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    with open(out) as f:
        times = {int(k): v for k, v in json.load(f).items()}
    print(f"{'length':>6}  {'first step ms':>13}  {'repeat ms (median)':>18}  {'first / repeat':>14}")
    ratios = []
    for t, ts in times.items():
        first, repeat = ts[0], statistics.median(ts[1:])
        ratios.append(first / repeat)
        note = "  (the compiled length: also the step's first ever)" if t == 64 else ""
        print(f"{t:>6}  {first * 1e3:>13.1f}  {repeat * 1e3:>18.1f}  {first / repeat:>14.2f}{note}")
    print(f"worst new length (not the first ever step): {max(ratios[1:]):.2f}x a repeat")


if __name__ == "__main__":
    main()
