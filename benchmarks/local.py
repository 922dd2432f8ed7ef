"""fxpipe's single-process executor against eager PyTorch and torchgpipe 0.0.7, side by side.

    pip install torchgpipe==0.0.7 --no-deps
    python benchmarks/local.py                 # speed (MLP and U-Net), then memory

Speed: one training step (forward + backward) of the same ``nn.Sequential`` with the same
4-stage split, chunks and checkpoint mode, run by eager PyTorch, fxpipe and torchgpipe in
alternation; then the torchgpipe paper's U-Net written with torchgpipe's ``@skippable``
stash/pop API against the same U-Net (the same modules) handed to fxpipe as a plain module.
Both also run through ``fxpipe.compat.torchgpipe.GPipe``, unchanged torchgpipe code on fxpipe.
Each ratio is of medians measured in this run. Memory: peak RSS growth over one step for each
checkpoint mode at m = 8, each mode in a fresh process.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples"), os.path.join(ROOT, "benchmarks")]
import fxpipe  # noqa: E402
from rss import peak_growth  # noqa: E402
from unet import UNet  # noqa: E402


def mlp(d: int, depth: int) -> nn.Sequential:
    """Return a stack of ``depth`` Linear + ReLU pairs."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(d, d), nn.ReLU()]
    return nn.Sequential(*layers)


def skippable_unet(model: UNet, api: str = "torchgpipe") -> nn.Sequential:
    """Rewrite a U-Net as torchgpipe wants it: a Sequential with @skippable stash and pop layers.

    ``api`` is ``"torchgpipe"`` or ``"fxpipe.compat.torchgpipe"``: whose ``skip`` module to use.
    """
    import importlib

    skip = importlib.import_module(api + ".skip")
    pop, skippable, stash = skip.pop, skip.skippable, skip.stash

    def stasher(name):
        @skippable(stash=[name])
        class Stash(nn.Module):
            def forward(self, x):
                yield stash(name, x)
                return x
        return Stash()

    def popper(name):
        @skippable(pop=[name])
        class PopCat(nn.Module):
            def forward(self, x):
                skip = yield pop(name)
                return torch.cat([x, skip], dim=1)
        return PopCat()

    class Pool(nn.Module):
        def forward(self, x):
            return F.max_pool2d(x, 2)

    depth = len(model.down)
    layers: list[nn.Module] = []
    for k, block in enumerate(model.down):
        layers += [block, stasher(f"skip{k}"), Pool()]
    layers.append(model.middle)
    for k, (up, dec) in enumerate(zip(model.up, model.dec)):
        layers += [up, popper(f"skip{depth - 1 - k}"), dec]
    layers.append(model.head)
    return nn.Sequential(*layers)


def split_points_for(seq: nn.Sequential, balance: list[int], names: list[str] | None = None) -> list[str]:
    """Return fxpipe split points that start stages where torchgpipe's balance does."""
    starts = [sum(balance[:k]) for k in range(1, len(balance))]
    names = names or [str(i) for i in range(len(seq))]
    return [names[s] for s in starts]


def timed(fn, reps: int) -> float:
    """Return the time of one call of ``fn``."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def race(runs: dict, reps: int) -> dict[str, float]:
    """Run every entry once to warm up, then ``reps`` times in alternation; return medians."""
    for fn in runs.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(reps):
        for name, fn in runs.items():
            times[name].append(timed(fn, reps))
    return {k: statistics.median(v) for k, v in times.items()}


def report(title: str, med: dict[str, float], base: str) -> None:
    """Print medians and ratios against ``base``."""
    print(f"\n{title}")
    print(f"{'run':44} {'median s':>9} {'/ ' + base:>14}")
    for k, v in med.items():
        print(f"{k:44} {v:9.4f} {v / med[base]:13.3f}x")


def train_step(module, x, y):
    """Return a closure running forward, MSE loss and backward."""
    def step():
        F.mse_loss(module(x), y).backward()
    return step


def speed_mlp(args) -> None:
    """Eager, fxpipe and torchgpipe on one Sequential, same split, chunks and checkpoint mode."""
    from torchgpipe import GPipe

    from fxpipe.compat.torchgpipe import GPipe as CompatGPipe

    torch.manual_seed(0)
    seq = mlp(args.dim, args.depth)
    x, y = torch.randn(args.batch, args.dim), torch.randn(args.batch, args.dim)
    balance = [len(seq) // 4] * 4
    eager = copy.deepcopy(seq)
    one = fxpipe.compile(copy.deepcopy(seq), 1, example_inputs=(x,), chunks=1, checkpoint="never",
                         devices=["cpu"])
    fx = fxpipe.compile(copy.deepcopy(seq), 4, example_inputs=(x,), chunks=args.chunks,
                        checkpoint="except_last", devices=["cpu"] * 4,
                        split_points=split_points_for(seq, balance, [n for n in _node_names(seq)]))
    tg = GPipe(copy.deepcopy(seq), balance=balance, devices=["cpu"] * 4, chunks=args.chunks,
               checkpoint="except_last")
    compat = CompatGPipe(copy.deepcopy(seq), balance=balance, devices=["cpu"] * 4, chunks=args.chunks,
                         checkpoint="except_last")
    mbs = list(zip(x.chunk(args.chunks), y.chunk(args.chunks)))

    def eager_micro():
        for xs, ys in mbs:
            (F.mse_loss(eager(xs), ys) / len(mbs)).backward()

    med = race({"eager": train_step(eager, x, y), "eager, micro-batches one by one": eager_micro,
                "fxpipe 1 stage, 1 chunk, never": train_step(one, x, y),
                f"fxpipe 4 stages, chunks {args.chunks}, except_last": train_step(fx, x, y),
                f"torchgpipe 4 stages, chunks {args.chunks}, except_last": train_step(tg, x, y),
                "fxpipe.compat.torchgpipe.GPipe, same": train_step(compat, x, y)}, args.reps)
    report(f"MLP: nn.Sequential of {args.depth} x (Linear({args.dim}, {args.dim}) + ReLU), batch "
           f"{args.batch}, balance {balance}; {args.reps} alternating runs", med, "eager")
    tgk = f"torchgpipe 4 stages, chunks {args.chunks}, except_last"
    fxk = f"fxpipe 4 stages, chunks {args.chunks}, except_last"
    print(f"fxpipe / torchgpipe: {med[fxk] / med[tgk]:.3f}")
    # the least this step can take on one core: eager over the micro-batches plus the recomputed
    # forwards (all but the last micro-batch, about a third of forward + backward each)
    limit = med["eager, micro-batches one by one"] * (1 + (args.chunks - 1) / args.chunks / 3)
    print(f"limit = eager over the micro-batches x (1 + (m - 1)/m x 1/3): fxpipe / limit = {med[fxk] / limit:.3f}, "
          f"torchgpipe / limit = {med[tgk] / limit:.3f}")
    print(f"fxpipe.compat.torchgpipe.GPipe / torchgpipe: {med['fxpipe.compat.torchgpipe.GPipe, same'] / med[tgk]:.3f}")


def _node_names(seq: nn.Sequential) -> list[str]:
    """Return the module names of a Sequential's layers, which fxpipe accepts as split points."""
    return [name for name, _ in seq.named_children()]


def speed_unet(args) -> None:
    """The paper's U-Net: torchgpipe with @skippable against fxpipe with a plain module."""
    from torchgpipe import GPipe
    from torchgpipe.balance import balance_by_time

    torch.manual_seed(0)
    model = UNet(depth=args.unet_depth, base=args.unet_base).train()
    x = torch.randn(args.unet_batch, 3, args.unet_size, args.unet_size)
    y = torch.randn(args.unet_batch, 2, args.unet_size, args.unet_size)
    seq = skippable_unet(copy.deepcopy(model))
    balance = balance_by_time(4, seq, x[: max(1, args.unet_batch // args.chunks)], device="cpu")
    tg = GPipe(seq, balance=balance, devices=["cpu"] * 4, chunks=args.chunks, checkpoint="except_last")
    from fxpipe.compat.torchgpipe import GPipe as CompatGPipe

    compat = CompatGPipe(skippable_unet(copy.deepcopy(model), "fxpipe.compat.torchgpipe"), balance=balance,
                         devices=["cpu"] * 4, chunks=args.chunks, checkpoint="except_last")
    # the same split for fxpipe: the first module of each of torchgpipe's partitions
    names = _unet_layer_names(model)
    same = fxpipe.compile(copy.deepcopy(model), 4, example_inputs=(x,), chunks=args.chunks,
                          checkpoint="except_last", devices=["cpu"] * 4,
                          split_points=_first_real(names, balance))
    auto = fxpipe.compile(copy.deepcopy(model), 4, example_inputs=(x,), chunks=args.chunks,
                          checkpoint="except_last", devices=["cpu"] * 4)
    eager = copy.deepcopy(model)
    med = race({"eager": train_step(eager, x, y),
                "torchgpipe (@skippable Sequential)": train_step(tg, x, y),
                "fxpipe.compat.torchgpipe.GPipe (same)": train_step(compat, x, y),
                "fxpipe (plain module, torchgpipe's split)": train_step(same, x, y),
                "fxpipe (plain module, its own split)": train_step(auto, x, y)}, args.reps)
    report(f"U-Net depth {args.unet_depth}, base {args.unet_base}, batch {args.unet_batch} x 3 x "
           f"{args.unet_size}^2, 4 stages, chunks {args.chunks}, except_last; balance {balance}",
           med, "torchgpipe (@skippable Sequential)")


def _unet_layer_names(model: UNet) -> list[str | None]:
    """Name each layer of :func:`skippable_unet` by the plain U-Net's module (None: no module)."""
    names: list[str | None] = []
    for k in range(len(model.down)):
        names += [f"down.{k}", None, None]
    names.append("middle")
    for k in range(len(model.up)):
        names += [f"up.{k}", None, f"dec.{k}"]
    names.append("head")
    return names


def _first_real(names: list[str | None], balance: list[int]) -> list[str]:
    """Return, per partition after the first, the first layer there that is a real module."""
    points = []
    for k in range(1, len(balance)):
        start = sum(balance[:k])
        points.append(next(n for n in names[start:] if n is not None))
    return points


def cpu_threads(args) -> None:
    """Measure whether computing a clock's stages on concurrent CPU threads pays."""
    torch.manual_seed(0)
    seq = mlp(args.dim, args.depth)
    x, y = torch.randn(args.batch, args.dim), torch.randn(args.batch, args.dim)
    points = split_points_for(seq, [len(seq) // 4] * 4)
    runs = {}
    # "cpu" and "cpu:0" are two devices to fxpipe, so each gets a worker thread
    for name, devices, threads, torch_threads in [
            ("sequential, torch 1 thread", ["cpu"] * 4, False, 1),
            ("sequential, torch 2 threads", ["cpu"] * 4, False, 2),
            ("2 worker threads x torch 1 thread", ["cpu", "cpu:0"] * 2, True, 1)]:
        pipe = fxpipe.compile(copy.deepcopy(seq), 4, example_inputs=(x,), chunks=args.chunks,
                              checkpoint="except_last", devices=devices, split_points=points)
        pipe._runtime.use_threads(threads)

        def step(pipe=pipe, n=torch_threads):
            torch.set_num_threads(n)
            F.mse_loss(pipe(x), y).backward()
        runs[name] = step
    med = race(runs, args.reps)
    torch.set_num_threads(args.threads)
    report("Worker threads on CPU: the same 4-stage MLP step", med, "sequential, torch 2 threads")


def memory_mode(args) -> None:
    """In this fresh process, print the peak RSS growth of one step under ``--memory-mode``."""
    torch.manual_seed(0)
    seq = mlp(args.dim, args.depth)
    x, y = torch.randn(args.mem_batch, args.dim), torch.randn(args.mem_batch, args.dim)
    pipe = fxpipe.compile(seq, 4, example_inputs=(x,), chunks=8, checkpoint=args.memory_mode,
                          devices=["cpu"] * 4, split_points=split_points_for(seq, [len(seq) // 4] * 4))
    with peak_growth() as growth:
        pipe.step(x, target=y, loss_fn=F.mse_loss)
    print(json.dumps(growth["bytes"]))


def memory(args) -> None:
    """Measure each checkpoint mode in a fresh process; print the growth and the ratios."""
    growth = {}
    # glibc keeps freed heap blocks, so RSS would show the most memory ever touched; mapping
    # every block over 64 KiB on its own returns freed tensors to the OS, and the RSS peak
    # then follows the live tensors
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    for mode in ("never", "except_last", "always"):
        out = subprocess.run([sys.executable, __file__, "--memory-mode", mode, "--dim", str(args.dim),
                              "--depth", str(args.depth), "--mem-batch", str(args.mem_batch),
                              "--threads", str(args.threads)],
                             check=True, capture_output=True, text=True, env=env).stdout
        growth[mode] = json.loads(out.strip().splitlines()[-1])
    print(f"\nPeak RSS growth over one step, MLP {args.depth} x Linear({args.dim}), batch {args.mem_batch}, "
          "4 stages, chunks 8, each mode in a fresh process")
    for mode, g in growth.items():
        ratio = f"{growth['never'] / g:.2f}" if g else "n/a (no growth measured)"
        print(f"{mode:12} {g / 2**20:9.1f} MiB   never / {mode} = {ratio}")


def main() -> None:
    """Parse arguments and run the comparisons."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--unet-depth", type=int, default=3)
    parser.add_argument("--unet-base", type=int, default=16)
    parser.add_argument("--unet-batch", type=int, default=32)
    parser.add_argument("--unet-size", type=int, default=64)
    parser.add_argument("--mem-batch", type=int, default=8192)
    parser.add_argument("--memory-mode", choices=["never", "except_last", "always"])
    parser.add_argument("--only", choices=["mlp", "unet", "memory", "cpu-threads"])
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on a shared 2-core machine more threads make "
                             "OpenMP contention, not the pipeline, dominate the times)")
    parser.add_argument("--quick", action="store_true", help="a tiny smoke run")
    args = parser.parse_args()
    if args.quick:
        args.reps, args.dim, args.batch, args.mem_batch, args.unet_batch, args.unet_size = 2, 256, 128, 512, 8, 32
    torch.set_num_threads(args.threads)
    if args.memory_mode:
        memory_mode(args)
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if args.only in (None, "mlp"):
        speed_mlp(args)
    if args.only in (None, "unet"):
        speed_unet(args)
    if args.only in (None, "memory"):
        memory(args)
    if args.only == "cpu-threads":
        cpu_threads(args)


if __name__ == "__main__":
    main()
