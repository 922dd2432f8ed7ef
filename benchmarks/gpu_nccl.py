"""Part 4 of ``gpu_check.py``: fxpipe against torch.distributed.pipelining, 2 ranks under NCCL.

Two spawned ranks, one GPU each, run in turn one training step of fxpipe's GPipe, 1F1B and
zero bubble and of pipelining's ScheduleGPipe and Schedule1F1B, on the same residual MLP
split at its middle block (as ``benchmarks/distributed.py`` does on CPU with gloo). Each
time is barrier to barrier with the GPU synchronized, on rank 0; the order of the runs is
shuffled anew each round, the same on both ranks; rank 0 fixes the number of rounds from the
budget and the first round.
"""

from __future__ import annotations

import copy
import json
import os
import random
import statistics
import sys
import time

import torch

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(BENCH), BENCH]
from ports import run_two_ranks  # noqa: E402

SIZES = {"gpu": {"d": 1024, "hidden": 4096, "blocks": 8, "batch": 4096, "m": 8},
         "standin": {"d": 32, "hidden": 64, "blocks": 4, "batch": 32, "m": 4}}


def _rank(rank: int, port: int, standin: bool, deadline: float, out: str) -> None:
    """One rank: build both libraries' pipelines, time their steps, rank 0 writes the medians."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from distributed import ResidualMLP
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    import fxpipe

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    if standin:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    size = SIZES["standin" if standin else "gpu"]
    d, m, half = size["d"], size["m"], size["blocks"] // 2
    torch.manual_seed(0)
    base = ResidualMLP(d, size["hidden"], size["blocks"])
    x_cpu = torch.randn(size["batch"], d)
    x, y = x_cpu.to(device), torch.randn(size["batch"], d).to(device)
    pipes = {s: fxpipe.compile(copy.deepcopy(base), 2, example_inputs=(x_cpu,), chunks=m, schedule=s,
                               checkpoint="never", runtime="distributed", split_points=[f"blocks.{half}"])
             for s in ("gpipe", "1f1b", "zb")}
    part = (copy.deepcopy(base).blocks[:half] if rank == 0 else copy.deepcopy(base).blocks[half:]).to(device)
    rows = size["batch"] // m
    inp = torch.empty(rows, d, device=device).requires_grad_(rank > 0)
    outp = torch.empty(rows, d, device=device, requires_grad=True)
    stage = PipelineStage(part, rank, 2, device, input_args=(inp,), output_args=(outp,))
    schedules = {"gpipe": ScheduleGPipe(stage, m, loss_fn=F.mse_loss),
                 "1f1b": Schedule1F1B(stage, m, loss_fn=F.mse_loss)}

    def fx(s):
        pipes[s].step(x if rank == 0 else None, target=y if rank == 1 else None, loss_fn=F.mse_loss)

    def pp(s):
        if rank == 0:
            schedules[s].step(x)
        else:
            schedules[s].step(target=y, losses=[])

    runs = {f"fxpipe {s}": (lambda s=s: fx(s)) for s in ("gpipe", "1f1b", "zb")}
    runs.update({f"pipelining {s}": (lambda s=s: pp(s)) for s in ("gpipe", "1f1b")})

    def timed(fn) -> float:
        dist.barrier(device_ids=None if standin else [rank])
        if not standin:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if not standin:
            torch.cuda.synchronize(device)
        dist.barrier(device_ids=None if standin else [rank])
        return time.perf_counter() - start

    for fn in runs.values():  # warm up
        timed(fn)
    first = {k: timed(fn) for k, fn in runs.items()}
    left = deadline - time.time()
    rounds = torch.tensor([max(2, min(15, int(left / (1.2 * sum(first.values())))))], device=device)
    dist.broadcast(rounds, 0)  # rank 0's count, on both
    times = {k: [v] for k, v in first.items()}
    for r in range(int(rounds.item())):
        order = list(runs)
        random.Random(r).shuffle(order)
        for name in order:
            times[name].append(timed(runs[name]))
    if rank == 0:
        with open(out, "w") as f:
            json.dump({k: statistics.median(v) for k, v in times.items()}, f)
    dist.destroy_process_group()


def measure_nccl(seconds: float, rows: list, standin: bool) -> None:
    """Spawn the two ranks, wait at most ``seconds``, and add their medians and ratios to ``rows``."""
    med = run_two_ranks(_rank, seconds, 0.8, standin, "medians.json", "the NCCL comparison")
    size = SIZES["standin" if standin else "gpu"]
    what = (f"residual MLP d={size['d']} hidden={size['hidden']} blocks={size['blocks']}, "
            f"batch {size['batch']}, m={size['m']}, {'gloo' if standin else 'NCCL'}")
    for name, t in med.items():
        rows.append(["nccl", f"2 ranks, {name} step", f"{t * 1e3:.1f} ms", what if name == "fxpipe gpipe" else ""])
    for s in ("gpipe", "1f1b"):
        rows.append(["nccl", f"fxpipe {s} / pipelining {s}", f"{med[f'fxpipe {s}'] / med[f'pipelining {s}']:.3f}",
                     "below 1: fxpipe faster"])
    rows.append(["nccl", "fxpipe zb / pipelining 1f1b", f"{med['fxpipe zb'] / med['pipelining 1f1b']:.3f}", ""])
