"""fxpipe's distributed runtime against eager and torch.distributed.pipelining, side by side.

    python benchmarks/distributed.py            # 2 ranks x 1 thread, residual MLP, m = 8
    python benchmarks/distributed.py --dim 128 --hidden 512   # small micro-batches: 128 KiB messages

Two spawned ranks (gloo, one thread each) run, in alternation, one training step of:
fxpipe GPipe, torch.distributed.pipelining ScheduleGPipe, fxpipe 1F1B, its Schedule1F1B,
fxpipe's zero-bubble schedule ("zb", ZB-H1) and its ScheduleInterleavedZeroBubble (ZB1P) with
one stage per rank, all on the same model and the same 2-stage split; with two stages per
rank, over the same 4 pieces for both libraries, fxpipe's interleaved 1F1B and ZB-V against
its ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble and ScheduleZBVZeroBubble; and
eager PyTorch on rank 0 alone (one process, one thread) on the whole batch and over the
micro-batches one by one. A last run has both ranks compute their own half over the micro-batches at the same
time with no messages and no waiting: the busy time per rank, about the least any schedule
of this split can take on this machine (``benchmarks/zb_where.py`` adds to it the wait that
one stage per rank cannot avoid). The runs alternate in an order shuffled anew every
repetition (a step right after another kind of step pays for its memory layout); each time
is barrier to barrier on rank 0; each ratio is of medians measured in this one run. Then
fresh processes measure the peak memory growth of one step per rank, every fxpipe schedule
against GPipe, at m = 16.
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path[:0] = [os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."),
                os.path.dirname(os.path.abspath(__file__))]
import fxpipe  # noqa: E402
from ports import free_port  # noqa: E402
from rss import peak_growth  # noqa: E402


SCHEDULES = ("gpipe", "1f1b", "zb")  # one stage per rank
MULTI = ("interleaved", "zbv")  # two stages per rank
PP_MULTI = ("interleaved", "interleaved zb", "zbv")  # pipelining's schedules with two stages per rank


class Block(nn.Module):
    """A residual MLP block."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


class ResidualMLP(nn.Module):
    """A stack of residual MLP blocks."""

    def __init__(self, d: int, hidden: int, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[Block(d, hidden) for _ in range(blocks)])

    def forward(self, x):
        return self.blocks(x)




def _env(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank))
    torch.set_num_threads(1)


def _timed(fn) -> float:
    """Time ``fn`` barrier to barrier."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _speed_rank(rank: int, port: int, args, out: str) -> None:
    """One rank of the speed comparison."""
    _env(rank, port)
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    from torch.distributed.pipelining.schedules import (ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
                                                        ScheduleZBVZeroBubble)

    torch.manual_seed(0)
    base = ResidualMLP(args.dim, args.hidden, args.blocks)
    x = torch.randn(args.batch, args.dim)
    y = torch.randn(args.batch, args.dim)
    half = args.blocks // 2
    pipes = {s: fxpipe.compile(copy.deepcopy(base), 2, example_inputs=(x,), chunks=args.chunks,
                               schedule=s, checkpoint="never", runtime="distributed",
                               split_points=[f"blocks.{half}"]) for s in SCHEDULES}
    part = copy.deepcopy(base).blocks[:half] if rank == 0 else copy.deepcopy(base).blocks[half:]
    rows = args.batch // args.chunks  # shapes of a stage's input and output, both needing grads but x
    inp, outp = torch.empty(rows, args.dim).requires_grad_(rank > 0), torch.empty(rows, args.dim, requires_grad=True)
    stage = PipelineStage(part, rank, 2, torch.device("cpu"), input_args=(inp,), output_args=(outp,))
    zb_stage = PipelineStage(part, rank, 2, torch.device("cpu"), input_args=(inp,), output_args=(outp,))
    schedules = {"gpipe": ScheduleGPipe(stage, args.chunks, loss_fn=F.mse_loss),
                 "1f1b": Schedule1F1B(stage, args.chunks, loss_fn=F.mse_loss),
                 "zb": ScheduleInterleavedZeroBubble([zb_stage], args.chunks, loss_fn=F.mse_loss)}
    # two stages per rank, the same 4 pieces for both libraries
    quarter = args.blocks // 4
    points = [f"blocks.{k * quarter}" for k in (1, 2, 3)]
    for s in MULTI:
        pipes[s] = fxpipe.compile(copy.deepcopy(base), 4, example_inputs=(x,), chunks=args.chunks, schedule=s,
                                  checkpoint="never", runtime="distributed", split_points=points,
                                  stages_per_rank=2)
    placement = {"interleaved": [0, 1, 0, 1], "interleaved zb": [0, 1, 0, 1], "zbv": [0, 1, 1, 0]}
    make = {"interleaved": ScheduleInterleaved1F1B, "interleaved zb": ScheduleInterleavedZeroBubble,
            "zbv": ScheduleZBVZeroBubble}
    for s in PP_MULTI:
        pieces = [copy.deepcopy(base).blocks[k * quarter:(k + 1) * quarter] for k in range(4)]
        mine = [PipelineStage(pieces[k], k, 4, torch.device("cpu"),
                              input_args=(torch.empty(rows, args.dim).requires_grad_(k > 0),),
                              output_args=(torch.empty(rows, args.dim, requires_grad=True),))
                for k in range(4) if placement[s][k] == rank]
        schedules[s] = make[s](mine, args.chunks, loss_fn=F.mse_loss)
    last_rank = {s: 1 for s in SCHEDULES} | {"interleaved": 1, "interleaved zb": 1, "zbv": 0}
    eager = copy.deepcopy(base)

    def fx_step(s):
        last = pipes[s].plan.stages[-1].on_rank == rank
        pipes[s].step(x if rank == 0 else None, target=y if last else None, loss_fn=F.mse_loss)

    def pp_step(s):
        feed = (x,) if rank == 0 else ()
        if rank == last_rank[s]:
            schedules[s].step(*feed, target=y, losses=[])
        else:
            schedules[s].step(*feed)

    def eager_full():
        if rank == 0:
            F.mse_loss(eager(x), y).backward()

    def eager_micro():
        if rank == 0:
            for xs, ys in zip(x.chunk(args.chunks), y.chunk(args.chunks)):
                (F.mse_loss(eager(xs), ys) / args.chunks).backward()

    alone = copy.deepcopy(part)
    fixed = torch.randn(rows, args.dim)

    def halves_alone():  # each rank its own stage's F and B, concurrently, nothing to wait for
        half_alone(alone, x, y, args.chunks, rank, fixed)

    runs = {"eager": eager_full, "eager, micro-batches one by one": eager_micro,
            "fxpipe gpipe": lambda: fx_step("gpipe"), "pipelining gpipe": lambda: pp_step("gpipe"),
            "fxpipe 1f1b": lambda: fx_step("1f1b"), "pipelining 1f1b": lambda: pp_step("1f1b"),
            "fxpipe zb": lambda: fx_step("zb"), "pipelining zb": lambda: pp_step("zb"),
            "fxpipe interleaved": lambda: fx_step("interleaved"),
            "pipelining interleaved": lambda: pp_step("interleaved"),
            "pipelining interleaved zb": lambda: pp_step("interleaved zb"),
            "fxpipe zbv": lambda: fx_step("zbv"), "pipelining zbv": lambda: pp_step("zbv"),
            "halves alone, concurrently": halves_alone}
    time_shuffled(runs, args.reps, rank, out)


def half_alone(part: nn.Module, x: torch.Tensor, y: torch.Tensor, chunks: int, rank: int,
               fixed: torch.Tensor, after_first_forward=None) -> None:
    """Run one rank's half over the micro-batches with plain autograd, no messages (rank 1 has the loss)."""
    for k, (xs, ys) in enumerate(zip(x.chunk(chunks), y.chunk(chunks))):
        out = part(xs.detach().requires_grad_(rank > 0))
        if k == 0 and after_first_forward is not None:
            after_first_forward()
        if rank == 1:
            (F.mse_loss(out, ys) / chunks).backward()
        else:
            out.backward(fixed)


def time_shuffled(runs: dict, reps: int, rank: int, out: str) -> None:
    """Time each run ``reps`` times, barrier to barrier, in a new order each repetition; rank 0 reports them.

    The order is a shuffle seeded by the repetition, the same on every rank. A step pays for
    the memory layout the step before it left, so a fixed cycle (even one rotated every
    repetition) would have each run follow the same neighbour every time.
    """
    times: dict[str, list[float]] = {k: [] for k in runs}
    for fn in runs.values():  # warm up each
        _timed(fn)
    for r in range(reps):
        order = list(runs)
        random.Random(r).shuffle(order)
        for name in order:
            times[name].append(_timed(runs[name]))
    if rank == 0:
        report(out, rank, times)
    dist.destroy_process_group()


def _memory_rank(rank: int, port: int, args, schedule: str, out: str) -> None:
    """One rank of the memory comparison: peak RSS growth over one step."""
    _env(rank, port)
    torch.manual_seed(0)
    model = ResidualMLP(args.dim, args.hidden, args.blocks)
    x, y = torch.randn(args.mem_batch, args.dim), torch.randn(args.mem_batch, args.dim)
    if schedule in MULTI:
        quarter = args.blocks // 4
        layout = dict(split_points=[f"blocks.{k * quarter}" for k in (1, 2, 3)], stages_per_rank=2)
    else:
        layout = dict(split_points=[f"blocks.{args.blocks // 2}"])
    pipe = fxpipe.compile(model, 2 * layout.get("stages_per_rank", 1), example_inputs=(x,),
                          chunks=args.mem_chunks, schedule=schedule, checkpoint="never",
                          runtime="distributed", **layout)
    last = pipe.plan.stages[-1].on_rank == rank
    dist.barrier()
    with peak_growth() as growth:
        pipe.step(x if rank == 0 else None, target=y if last else None, loss_fn=F.mse_loss)
    report(out, rank, growth["bytes"])
    dist.destroy_process_group()


def report(out: str, rank: int, value) -> None:
    """Hand ``value`` (JSON) from rank ``rank`` back to :func:`_spawn`."""
    with open(f"{out}.{rank}", "w") as f:
        json.dump(value, f)


def _spawn(target, *extra) -> list:
    """Run ``target(rank, port, *extra, out)`` on two spawned ranks; return what each reported (or None)."""
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "report")
        procs = [ctx.Process(target=target, args=(r, port, *extra, out)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
            if p.exitcode:
                raise SystemExit(f"a rank failed with exit code {p.exitcode}")
        reports = []
        for r in range(2):
            if os.path.exists(f"{out}.{r}"):
                with open(f"{out}.{r}") as f:
                    reports.append(json.load(f))
            else:
                reports.append(None)
        return reports


def model_arguments(parser: argparse.ArgumentParser, reps: int) -> None:
    """Add the residual MLP's size, the micro-batch count and the repetitions to ``parser``."""
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--reps", type=int, default=reps)


def main() -> None:
    """Parse arguments, run both comparisons, print the tables."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    model_arguments(parser, reps=7)
    parser.add_argument("--mem-batch", type=int, default=4096)
    parser.add_argument("--mem-chunks", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="a tiny smoke run")
    args = parser.parse_args()
    if args.quick:
        args.reps, args.batch, args.mem_batch = 2, 256, 512

    med = {k: statistics.median(v) for k, v in _spawn(_speed_rank, args)[0].items()}
    print(f"residual MLP d={args.dim} hidden={args.hidden} blocks={args.blocks} batch={args.batch} "
          f"m={args.chunks}, 2 ranks x 1 thread, {args.reps} alternating runs, median step time")
    print(f"{'run':40} {'median s':>9} {'vs eager':>9}")
    for k, v in med.items():
        print(f"{k:40} {v:9.3f} {med['eager'] / v:8.2f}x")
    bound = 2 * args.chunks / (args.chunks + 1)
    micro = med["eager, micro-batches one by one"]
    print(f"speedup bound of GPipe and 1F1B 2m/(m+1) = {bound:.2f}x; eager micro-batched / eager = "
          f"{micro / med['eager']:.3f}")
    for s in SCHEDULES + ("interleaved", "zbv"):
        print(f"fxpipe {s} / torch.distributed.pipelining {s}: "
              f"{med[f'fxpipe {s}'] / med[f'pipelining {s}']:.3f}")
    best = min((f"fxpipe {s}" for s in SCHEDULES + MULTI), key=med.__getitem__)
    theirs = min((f"pipelining {s}" for s in SCHEDULES + PP_MULTI), key=med.__getitem__)
    print(f"fxpipe's best ({best}) / pipelining 1f1b: {med[best] / med['pipelining 1f1b']:.3f}   "
          f"/ pipelining's best ({theirs}): {med[best] / med[theirs]:.3f}")
    print("speedup over one process over the same micro-batches: " + ", ".join(
        f"{s} {micro / med[f'fxpipe {s}']:.2f}x" for s in SCHEDULES + MULTI))
    p, m = 2, args.chunks  # 1F1B's bound: (m + p - 1)/m x the busy time of one of p equal ranks
    bound = (m + p - 1) / m * micro / p
    print(f"1F1B's bound (m + p - 1)/m x eager over the micro-batches / p: fxpipe 1f1b / bound = "
          f"{med['fxpipe 1f1b'] / bound:.3f}, pipelining 1f1b / bound = {med['pipelining 1f1b'] / bound:.3f}; "
          f"fxpipe zb / fxpipe 1f1b = {med['fxpipe zb'] / med['fxpipe 1f1b']:.3f}")
    floor = med["halves alone, concurrently"]
    print(f"busy time per rank (halves alone) / torch.distributed.pipelining 1f1b: "
          f"{floor / med['pipelining 1f1b']:.3f}  (about the least any schedule of this split takes)")

    peaks = {}
    # freed tensors go back to the OS (see benchmarks/local.py), so the peak follows live memory
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    for s in SCHEDULES + MULTI:
        peaks[s] = _spawn(_memory_rank, args, s)
    print(f"\npeak memory growth over one step, m={args.mem_chunks}, batch={args.mem_batch}, "
          "checkpoint='never' (MiB, per rank)")
    for r in range(2):
        mib = {s: peaks[s][r] / 2**20 for s in SCHEDULES + MULTI}
        print(f"rank {r}: " + "   ".join(f"{s} {v:7.1f}" for s, v in mib.items()) + "   " + "   ".join(
            f"{s}/1f1b {mib[s] / mib['1f1b']:.2f}" for s in ("gpipe", "zb") + MULTI))


if __name__ == "__main__":
    main()
