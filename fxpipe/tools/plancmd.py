"""``fxpipe plan MODEL --ranks N --device D --memory M``: simulate the configurations, print the best, save one.

    fxpipe plan examples/transformer.py:factory --ranks 4 --device h100 --memory 80GB --global-batch 512

With ``--gpus N --gpus-per-node G`` instead of ``--ranks``, the whole cluster's layout is searched
(:mod:`fxpipe.tools.clustercmd`).

Prints the fastest configurations that fit the memory budget (predicted step time,
throughput, bubble and each rank's peak memory), how many were rejected over the budget, and
the first choice's per-stage breakdown; ``--json FILE`` saves its plan for
``fxpipe.compile(plan=FILE)`` or ``fxpipe inspect --plan FILE``; ``--trace FILE`` writes its
simulated timeline as a Chrome trace.
"""

from __future__ import annotations

import argparse
from typing import Any

from tabulate import tabulate

from fxpipe.plan.pipeline import human
from fxpipe.tools.cliargs import (
    Failure,
    UsageError,
    add_export_dims,
    add_tracer,
    check_export_dims_args,
    counts,
    does_not_run,
    leaf_modules,
    names,
    positive,
    rows_text,
    shape,
)
from fxpipe.tools.clustercmd import add_arguments, run_cluster

__all__ = ["register"]

_DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
           "fp16": "float16", "float16": "float16", "tf32": "tfloat32"}


def register(commands: Any) -> None:
    """Add the ``plan`` subcommand to ``commands`` (the ``fxpipe`` parser's subparsers)."""
    p = commands.add_parser(
        "plan", help="predict step time and memory of every configuration and choose one",
        description="Simulate MODEL's pipeline configurations (stages, chunks, schedule, checkpointing) on "
                    "a device model and print the fastest that fit the memory budget.",
        epilog="example: fxpipe plan examples/transformer.py:factory --ranks 4 --device h100 --memory 80GB "
               "--global-batch 512 --json best.json")
    p.add_argument("model", metavar="MODEL", help="path/to/file.py:factory or package.module:factory; "
                   "factory() returns a model and example inputs")
    p.add_argument("--ranks", type=positive, metavar="N", help="devices to spread one pipeline over (one stage "
                   "per rank; or --gpus for a whole cluster's layout)")
    p.add_argument("--device", default="cpu", metavar="NAME",
                   help="device model: a100, h100, h200 (nominal spec-sheet numbers) or cpu (this machine, "
                        "calibrated now); default cpu")
    p.add_argument("--memory", metavar="SIZE", help="memory budget per device, e.g. 80GB (default: the device's)")
    p.add_argument("--global-batch", type=positive, metavar="B", help="rows per step (default: the example batch)")
    p.add_argument("--stages", type=counts, metavar="N,...", help="stage counts to try (default: divisors of --ranks)")
    p.add_argument("--chunks", type=counts, metavar="M,...", help="micro-batch counts to try (default: 1, 2, 4, ... 64)")
    p.add_argument("--schedules", type=names, default=None, metavar="A,B",
                   help="schedules to try (default: gpipe,1f1b,zb; with --gpus also interleaved,zbv)")
    p.add_argument("--checkpoint", type=names, default=["never", "selective", "except_last", "always", "auto"],
                   metavar="A,B", help="checkpoint modes to try, each for every stage, and 'auto': the least "
                   "recomputation per stage that fits (default: never,selective,except_last,always,auto)")
    p.add_argument("--optimizer", default="adam", choices=["none", "sgd", "momentum", "adam", "adamw"],
                   help="optimizer whose state counts against memory (default adam)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), help="training dtype for the FLOP rate (default: the model's)")
    p.add_argument("--measure", action="store_true",
                   help="time every node on this machine per micro-batch size instead of FLOP rates (--device cpu)")
    p.add_argument("--top", type=positive, default=10, metavar="K", help="configurations to print (default 10)")
    p.add_argument("--json", metavar="FILE", help="save the first choice's plan as JSON")
    p.add_argument("--trace", metavar="FILE", help="write the first choice's simulated step as a Chrome trace")
    p.add_argument("--leaf-modules", type=names, metavar="A,B",
                   help="submodules (qualified names) or module classes (class names) to keep as one call")
    p.add_argument("--input-shape", type=shape, action="append", metavar="8,3,224,224",
                   help="a random float input of this shape (repeat for several inputs)")
    add_tracer(p)
    add_export_dims(p)
    p.add_argument("--traceback", action="store_true", help="show Python tracebacks of unexpected errors")
    p.add_argument("-v", "--verbose", action="store_true", help="log what the planner does")
    add_arguments(p)
    p.set_defaults(run=run)



def run(args: argparse.Namespace) -> int:
    """Search the configurations, print the best, save what was asked; return the exit status."""
    import torch

    from fxpipe.errors import PropagationError
    from fxpipe.options import SINGLE_STAGE_SCHEDULES as SCHEDULE_NAMES
    from fxpipe.simulate.devices import device_model, parse_bytes
    from fxpipe.simulate.planner import CHECKPOINTS, search
    from fxpipe.tools.factory import make_model

    if (args.ranks is None) == (args.gpus is None):
        raise UsageError("give --ranks N (one pipeline, a stage per rank) or --gpus N (a whole cluster's layout)"
                         + (", not both" if args.ranks is not None else ""))
    args.schedules_given = args.schedules is not None
    if args.gpus is not None:
        from fxpipe.options import SCHEDULES
        for s in args.schedules or ():
            if s not in SCHEDULES:
                raise UsageError(f"--schedules: {s!r} is not a schedule; use some of {','.join(SCHEDULES)}")
    elif args.schedules is None:
        args.schedules = list(SCHEDULE_NAMES)
    for s in args.schedules if args.gpus is None else ():
        if s not in SCHEDULE_NAMES:
            if s in ("interleaved", "zbv"):
                raise UsageError(f"--schedules: {s!r} places several stages on a rank, which fxpipe plan --ranks does "
                                 f"not search (each stage gets its own rank); use some of {','.join(SCHEDULE_NAMES)}, "
                                 f"or --gpus N to search the cluster's layout, stages per rank included")
            raise UsageError(f"--schedules: {s!r} is not a schedule; use some of {','.join(SCHEDULE_NAMES)}")
    check_export_dims_args(args)
    for c in args.checkpoint:
        if c not in CHECKPOINTS:
            raise UsageError(f"--checkpoint: {c!r} is not a mode; use some of {','.join(CHECKPOINTS)}")
    try:
        memory = parse_bytes(args.memory) if args.memory else None
        device = device_model(args.device)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.measure and device.name != "cpu":
        raise UsageError("--measure times nodes on this machine; use it with --device cpu")
    dtype = getattr(torch, _DTYPES[args.dtype]) if args.dtype and args.dtype != "tf32" else None
    if args.dtype == "tf32":
        device = device.replace(peak_flops=device.peak_flops | {"float32": device.peak_flops.get("tfloat32", 0.0)})
    if args.gpus is not None:
        return run_cluster(args, device, memory, dtype)
    if args.seq or args.tp or args.inter_node_bandwidth:
        raise UsageError("--seq, --tp and --inter-node-bandwidth go with --gpus (the cluster search)")
    model, inputs, kwargs = make_model(args.model, args.input_shape)
    if inputs is None:
        raise UsageError("planning needs example inputs: return (model, example_inputs) from the factory "
                         "or pass --input-shape")
    try:
        found = search(model, inputs, ranks=args.ranks, device=device, memory=memory, batch=args.global_batch,
                       kwargs=kwargs or None, stages=args.stages, chunks=args.chunks, schedules=args.schedules,
                       checkpoints=args.checkpoint, optimizer=args.optimizer, dtype=dtype, measure=args.measure,
                       leaf_modules=leaf_modules(model, args.leaf_modules), tracer=args.tracer,
                       export_dims=args.export_dims)
    except PropagationError as exc:  # the shape pass ran the model on (fake) example inputs
        raise does_not_run(exc) from None
    total = len(found.ranked) + len(found.rejected)
    print(f"{type(model).__name__} ({args.model}) on {args.ranks} x {device.name}"
          f"{' (nominal)' if device.nominal else ' (calibrated here)'}, {human(found.memory, 'B')} per device, "
          f"global batch {found.batch}, optimizer {args.optimizer}: {total} configurations, "
          f"{len(found.rejected)} over the memory budget")
    if not found.ranked:
        smallest = min(found.rejected, key=lambda c: max(c.peaks))
        raise Failure(f"no configuration fits in {human(found.memory, 'B')} per device; the smallest needs "
                      f"{human(max(smallest.peaks), 'B')} ({_describe(smallest)}); raise --memory or add --ranks")
    rows = [[k + 1, c.stages, c.chunks, rows_text(found.batch, c.chunks), c.schedule, _policy(c),
             f"{c.sim.step_time * 1e3:.2f}", f"{c.sim.throughput:.1f}", f"{c.sim.bubble:.0%}",
             " ".join(human(p, "B") for p in c.peaks)] for k, c in enumerate(found.ranked[:args.top])]
    print(tabulate(rows, headers=["#", "stages", "chunks", "rows", "schedule", "checkpoint", "step ms",
                                  "samples/s", "bubble", "peak memory per rank"], tablefmt="simple"))
    best = found.ranked[0]
    print(f"first choice: {_describe(best)}")
    print(best.sim.table())
    if args.json:
        found.plan(best).save(args.json)
        print(f"plan saved to {args.json}: fxpipe.compile(model, {best.stages}, {_examples(inputs, kwargs)}, "
              f"plan={args.json!r}, "
              f"chunks={best.chunks}, schedule={best.schedule!r}, checkpoint={best.setting!r}, "
              f"runtime='distributed') under torchrun --nproc-per-node {best.stages} (as predicted; in one process "
              f"give devices=[...] instead of runtime=)")
    if args.trace:
        best.sim.timeline().save(args.trace)
        print(f"simulated timeline saved to {args.trace} (open it in https://ui.perfetto.dev)")
    return 0


def _examples(inputs: Any, kwargs: dict | None) -> str:
    """Write the example arguments of the compile call that reproduces the plan (a trace fixes the constants)."""
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    written = "(x,)" if len(args) == 1 else f"({', '.join(f'x{i}' for i in range(len(args)))})"
    named = ", ".join(f"{k!r}: {v!r}" if v is None or type(v) in (bool, int, float, str) else f"{k!r}: ..."
                      for k, v in (kwargs or {}).items())
    return f"example_inputs={written}" + (f", example_kwargs={{{named}}}" if named else "")


def _policy(c: Any) -> str:
    """Name a configuration's checkpointing: a mode, or auto's policy per stage."""
    return c.checkpoint if c.checkpoint != "auto" else "auto: " + ",".join(c.policies)


def _describe(c: Any) -> str:
    """Name a configuration in one phrase."""
    return (f"{c.stages} stage{'s' if c.stages != 1 else ''}, chunks={c.chunks}, schedule={c.schedule!r}, "
            f"checkpoint={c.setting!r}")
