"""How 4 gloo ranks share this machine's cores in a synchronized step, against what the simulator measured.

    python benchmarks/sharing_check.py            # 4 spawned ranks, dp4 of validate_layouts' MLP, 9 repetitions

Every rank holds the MLP of ``benchmarks/validate_layouts.py`` (8 x Linear(512) + Tanh) and a
quarter of its batch in 4 micro-batches, and times, alternating and barrier to barrier:

    plain, alone           rank 0's forward and backward while the others wait
    plain, every rank      the same on every rank at once
    all-reduce             a flat all-reduce of the gradients' size over the 4 ranks
    plain, then all-reduce the two in turn
    plain DDP              ``DistributedDataParallel``, ``no_sync`` on all but the last micro-batch
    fxpipe dp4             ``fxpipe.compile(..., data_parallel=4)``'s step
    batch check, gathered  the replicas' batch sizes by ``all_gather_object`` (what fxpipe's step ran)
    batch check, reduced   one all-reduce (MAX) of the largest and the negated smallest (what it runs now)

then ``fxpipe.simulate(pipe, device="cpu", measured=True)``. It prints the medians, the sharing
a synchronized step sees (4 x alone / every rank at once) beside the ``slots`` the simulator
measured (4 x alone / the ranks' mean time), and the prediction against fxpipe's step.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), HERE]
from ports import run_ranks
from validate_layouts import _mlp

import fxpipe

WORLD, CHUNKS = 4, 4


def _rank(rank: int, port: int, reps: int, out: str) -> None:
    """One rank: time every run in turn, then predict fxpipe's step; rank 0 writes the medians."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, x, y, loss_fn = _mlp()
    rows = x.shape[0] // WORLD
    xs, ys = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
    plain = copy.deepcopy(model)
    pipe = fxpipe.compile(model, 1, example_inputs=(xs,), runtime="distributed", chunks=CHUNKS,
                          checkpoint="never", data_parallel=WORLD)
    ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(plain))
    opts = {k: torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=1e-3)
            for k, m in (("plain", plain), ("ddp", ddp), ("fxpipe", pipe))}
    flat = torch.zeros(sum(p.numel() for p in plain.parameters()))

    def micro(module, key: str, sync_last: bool = False) -> None:
        pairs = list(zip(xs.chunk(CHUNKS), ys.chunk(CHUNKS)))
        for i, (a, b) in enumerate(pairs):
            quiet = ddp.no_sync() if sync_last and i < len(pairs) - 1 else contextlib.nullcontext()
            with quiet:
                (loss_fn(module(a), b) / CHUNKS).backward()
        opts[key].step()
        opts[key].zero_grad(set_to_none=True)

    def fx() -> None:
        pipe.step(xs, target=ys, loss_fn=loss_fn)
        opts["fxpipe"].step()
        opts["fxpipe"].zero_grad(set_to_none=True)

    runs = {"plain, every rank": lambda: micro(plain, "plain"), "all-reduce": lambda: dist.all_reduce(flat),
            "plain, then all-reduce": lambda: (micro(plain, "plain"), dist.all_reduce(flat)),
            "plain DDP": lambda: micro(ddp, "ddp", sync_last=True), "fxpipe dp4": fx,
            "batch check, gathered": lambda: dist.all_gather_object([None] * WORLD, rows),
            "batch check, reduced": lambda: dist.all_reduce(torch.tensor([rows, -rows]), op=dist.ReduceOp.MAX)}
    for fn in runs.values():
        fn()
        fn()
    times: dict[str, list[float]] = {k: [] for k in ["plain, alone", *runs]}
    for _ in range(reps):
        dist.barrier()
        if rank == 0:
            start = time.perf_counter()
            micro(plain, "plain")
            times["plain, alone"].append(time.perf_counter() - start)
        for name, fn in runs.items():
            dist.barrier()
            start = time.perf_counter()
            fn()
            dist.barrier()
            times[name].append(time.perf_counter() - start)
    sim = fxpipe.simulate(pipe, device="cpu", measured=True, optimizer="sgd")
    if rank == 0:
        result = {k: statistics.median(v) for k, v in times.items()}
        result.update(predicted=sim.step_time, slots=sim.device.slots)
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def main() -> None:
    """Spawn the ranks, then print the medians and the two sharing figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=9)
    args = parser.parse_args()
    res = run_ranks(_rank, WORLD, args.reps)
    if res is None:
        raise SystemExit("a rank failed (see its output above)")
    print(f"dp{WORLD} of validate_layouts' MLP, {CHUNKS} micro-batches, {args.reps} alternating repetitions, "
          f"medians barrier to barrier")
    for k in ("plain, alone", "plain, every rank", "all-reduce", "plain, then all-reduce", "plain DDP", "fxpipe dp4",
              "batch check, gathered", "batch check, reduced"):
        print(f"  {k:24s} {res[k] * 1e3:8.2f} ms")
    print(f"sharing in a synchronized step, {WORLD} x alone / every rank: {WORLD * res['plain, alone'] / res['plain, every rank']:.2f}"
          f"; measured for the prediction (slots, by the ranks' mean): {res['slots']:.2f}")
    print(f"fxpipe dp4 / plain DDP: {res['fxpipe dp4'] / res['plain DDP']:.3f}; plain DDP / plain, then all-reduce: "
          f"{res['plain DDP'] / res['plain, then all-reduce']:.3f}")
    print(f"predicted {res['predicted'] * 1e3:.1f} ms: {res['predicted'] / res['fxpipe dp4']:.3f}x fxpipe's step")
    print(f"batch check, gathered / reduced: {res['batch check, gathered'] / res['batch check, reduced']:.1f}x")


if __name__ == "__main__":
    main()
