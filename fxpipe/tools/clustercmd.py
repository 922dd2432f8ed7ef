"""``fxpipe plan MODEL --gpus N --gpus-per-node G``: lay a model out on a whole cluster and print how.

    fxpipe plan benchmarks/llama.py:llama3_8b --gpus 64 --gpus-per-node 8 --device h100 --memory 80GB \\
        --global-batch 512 --seq 8192 --dtype bf16 --json plan.json

Prints the fastest layouts that fit (dp x pp x tp, FSDP2 or DDP, stages per rank, schedule,
chunks, recomputation; step time, tokens per second per GPU, bubble, peak memory per rank), how
many were rejected and why the closest ones overflow, then the first choice's
``fxpipe.compile(...)`` call and ``torchrun`` line; ``--json FILE`` saves its plan, which
``fxpipe.compile(model, ..., plan=FILE)`` reproduces (see :mod:`fxpipe.simulate.cluster`).
"""

from __future__ import annotations

import argparse
from typing import Any

from tabulate import tabulate

from fxpipe.plan.pipeline import human
from fxpipe.tools.cliargs import Failure, UsageError, counts, leaf_modules, positive, rows_text

__all__ = ["add_arguments", "bandwidth", "run_cluster"]

_BITS = {"gb/s": 1e9 / 8, "gbit/s": 1e9 / 8, "gbps": 1e9 / 8, "tb/s": 1e12 / 8, "gbyte/s": 1e9, "GB/s": 1e9}


def bandwidth(text: str) -> float:
    """Parse a link speed per GPU: ``400Gb/s`` (bits), ``50GB/s`` (bytes), or a number of Gb/s; return bytes/s."""
    s = text.strip().replace(" ", "")
    digits = s.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ/")
    unit = s[len(digits):]
    try:
        value = float(digits)
    except ValueError:
        value = -1.0
    scale = 1e9 / 8 if not unit else 1e9 if unit in ("GB/s", "GBps") else 1e12 if unit in ("TB/s",) \
        else _BITS.get(unit.lower())
    if scale is None or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a link speed; write e.g. 400Gb/s, 50GB/s or 400 (Gb/s)")
    return value * scale


def add_arguments(p: Any) -> None:
    """Add the cluster search's options to the ``plan`` parser."""
    p.add_argument("--gpus", type=int, metavar="N", help="search the whole cluster's layout over N devices: "
                   "dp x pp x tp, FSDP or DDP, stages per rank, every schedule, chunks, recomputation")
    p.add_argument("--gpus-per-node", type=int, default=8, metavar="G",
                   help="devices per node (tp stays inside a node; default 8)")
    p.add_argument("--inter-node-bandwidth", type=bandwidth, metavar="SPEED",
                   help="bandwidth per GPU between nodes, e.g. 400Gb/s (default) or 50GB/s")
    p.add_argument("--seq", type=positive, metavar="S", help="sequence length: passed to the factory as seq=S, "
                   "and the tokens per row of the throughput")
    p.add_argument("--tp", type=counts, metavar="T,...", help="tensor-parallel sizes to try (default: powers of "
                   "two up to --gpus-per-node that the automatic TP plan takes)")



def run_cluster(args: argparse.Namespace, device: Any, memory: float | None, dtype: Any) -> int:
    """Search the cluster's layouts, print the best and how to run it; return the exit status."""
    from fxpipe.simulate.cluster import cluster_search
    from fxpipe.tools.factory import make_model

    if args.gpus < 1 or args.gpus_per_node < 1:
        raise UsageError(f"--gpus {args.gpus} --gpus-per-node {args.gpus_per_node}: use positive counts")
    if args.gpus % min(args.gpus_per_node, args.gpus):
        raise UsageError(f"--gpus {args.gpus} is not a whole number of {args.gpus_per_node}-GPU nodes; "
                         "give a multiple of --gpus-per-node")
    if args.measure:
        raise UsageError("--measure times nodes on this machine; the cluster search (--gpus) uses a device "
                         "model: leave --measure out, or plan with --ranks")
    if args.inter_node_bandwidth:
        device = device.replace(inter_bandwidth=args.inter_node_bandwidth)
    model, inputs, kwargs = make_model(args.model, args.input_shape, {"seq": args.seq} if args.seq else None)
    if inputs is None:
        raise UsageError("planning needs example inputs: return (model, example_inputs) from the factory "
                         "or pass --input-shape")
    first = inputs[0]
    tokens = args.seq or (int(first.shape[1]) if not first.is_floating_point() and first.dim() >= 2 else 1)
    schedules = args.schedules if args.schedules_given else None
    found = cluster_search(model, inputs, gpus=args.gpus, gpus_per_node=args.gpus_per_node, device=device,
                           memory=memory, batch=args.global_batch, kwargs=kwargs or None, dtype=dtype,
                           optimizer=args.optimizer, schedules=schedules, checkpoints=args.checkpoint,
                           tensor_parallel=args.tp, keep=max(args.top, 10), tokens=tokens,
                           leaf_modules=leaf_modules(model, args.leaf_modules), tracer=args.tracer, stages=args.stages,
                           export_dims=args.export_dims,
                           chunks=args.chunks)
    unit = "tokens/s/GPU" if tokens > 1 else "samples/s/GPU"
    nodes = -(-args.gpus // args.gpus_per_node)
    print(f"{type(model).__name__} ({args.model}) on {args.gpus} x {device.name}{' (nominal)' if device.nominal else ''}"
          f" in {nodes} node(s) of {min(args.gpus_per_node, args.gpus)}, {human(found.memory, 'B')} per device, "
          f"global batch {found.batch}{f' x {tokens} tokens' if tokens > 1 else ''}, optimizer {args.optimizer}, "
          f"inter-node {human(device.inter_bandwidth * 8, 'b')}/s per GPU: {found.layouts} layouts, "
          f"{found.simulated} simulated, {found.bounded} pruned by the compute bound, {len(found.rejected)} over "
          f"the memory budget{_refused(found)} ({found.seconds:.1f} s)")
    if not found.ranked and not found.rejected and found.refused:
        raise Failure(f"no layout runs: each is one fxpipe.compile refuses ({found.refused[0].overflow}); search "
                      "other --schedules or --stages, whose placement keeps those stages on ranks of their own, or "
                      "--tp sizes that leave no replicas")
    if not found.ranked:
        closest = [c for c in found.rejected if c.sim is not None][:3] or found.rejected[:3]
        lines = "\n  ".join(f"{c.shape.name()}, {c.shape.schedule}, chunks={c.shape.chunks}: {c.overflow}"
                            for c in closest)
        raise Failure(f"no layout fits in {human(found.memory, 'B')} per device; the closest:\n  {lines}\n"
                      "raise --memory, add --gpus, or lower --global-batch")
    rows = []
    for k, c in enumerate(found.ranked[:args.top]):
        s, sim = c.shape, c.sim
        assert sim is not None
        rows.append([k + 1, s.dp, s.pp, s.tp, s.v, "fsdp" if s.shard else "ddp" if s.dp > 1 else "-", s.schedule,
                     s.chunks, rows_text(found.batch / s.dp, s.chunks), _policy(c), f"{sim.step_time * 1e3:.1f}",
                     f"{found.per_gpu(c):,.0f}", f"{sim.bubble:.0%}", human(c.peak, "B")])
    print(tabulate(rows, headers=["#", "dp", "pp", "tp", "v", "replicas", "schedule", "chunks", "rows", "checkpoint",
                                  "step ms", unit, "bubble", "peak/rank"], tablefmt="simple"))
    over = [c for c in found.rejected if c.sim is not None][:3] + [c for c in found.rejected if c.sim is None][:2]
    for c in over:
        print(f"rejected: {c.shape.name()}, {c.shape.schedule}, chunks={c.shape.chunks}: {c.overflow}")
    best = found.ranked[0]
    assert best.sim is not None
    print(f"first choice: {best.shape.name()}, {best.shape.schedule}, chunks={best.shape.chunks}, "
          f"checkpoint={best.setting!r}: {best.sim.step_time * 1e3:.1f} ms per step, {found.per_gpu(best):,.0f} {unit}")
    path = args.json or "plan.json"
    print("  " + found.compile_call(best, path) + ("" if args.json else f"   # after --json {path} saves it"))
    print("  " + found.launch_line())
    if args.json:
        found.plan(best).save(args.json)
        print(f"plan saved to {args.json}")
    if args.trace:
        best.sim.timeline().save(args.trace)
        print(f"simulated timeline saved to {args.trace} (open it in https://ui.perfetto.dev)")
    return 0


def _policy(c: Any) -> str:
    """Name a layout's recomputation: a mode, or the policies per stage."""
    return c.checkpoint if c.checkpoint != "auto" else "auto: " + ",".join(c.policies)


def _refused(found: Any) -> str:
    """Say how many layouts were left out because fxpipe.compile refuses them, and why (the first's reason)."""
    if not found.refused:
        return ""
    return f", {len(found.refused)} refused by fxpipe.compile ({found.refused[0].overflow})"
