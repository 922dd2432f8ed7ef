"""``fxpipe inspect MODEL --stages N``: compile a model and show what the compiler did.

Prints the plan's table; ``--json`` saves the plan, ``--dot`` writes the graph picture,
``--timeline`` runs a recorded training step and summarises it per stage, ``--code`` prints
what a step runs, ``--tp T`` the tensor-parallel plan ``tp_plan="auto"`` finds for ``T`` ranks per
stage (each module's style, what stays whole, the collectives per micro-batch).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Any

from fxpipe.tools.cliargs import (
    Failure,
    UsageError,
    add_export_dims,
    add_tracer,
    check_export_dims_args,
    count,
    device_names,
    does_not_run,
    leaf_modules,
    names,
    positive,
    shape,
    trace_hint,
)
from fxpipe.tools.factory import EXAMPLE, make_model

__all__ = ["register", "run"]


def register(commands: Any) -> None:
    """Add the ``inspect`` command to the ``fxpipe`` parser's subcommands."""
    from fxpipe.options import BALANCE_BY, SCHEDULES

    p = commands.add_parser(
        "inspect", help="show the stages, skip routes, graph picture and timeline of a model",
        description="Compile MODEL into pipeline stages and show what the compiler did.",
        epilog=f"example: {EXAMPLE} --dot unet.svg --timeline unet-trace.json")
    p.add_argument("model", metavar="MODEL", help="path/to/file.py:factory or package.module:factory; "
                   "factory() returns a model or (model, example_inputs)")
    p.add_argument("--stages", type=positive, metavar="N", help="number of pipeline stages (default: the --plan's)")
    p.add_argument("--chunks", type=positive, metavar="M", help="micro-batches (default: the --plan's, else 1)")
    p.add_argument("--balance-by", choices=BALANCE_BY, default="auto", help="the cost stages balance")
    p.add_argument("--split-points", type=names, metavar="A,B", help="modules or nodes where stages begin")
    p.add_argument("--checkpoint", type=_checkpoint, default="except_last", metavar="MODE|A,B,...",
                   help="recomputation policy: always, except_last (default), never, selective, offload (CUDA), "
                        "auto (with --max-memory), or one mode per stage separated by commas")
    p.add_argument("--max-memory", metavar="SIZE", help="memory budget per device for --checkpoint auto, e.g. 16GB")
    p.add_argument("--schedule", default="gpipe", metavar="NAME|FILE",
                   help=f"what a training step runs (the --timeline step, --code): one of {', '.join(SCHEDULES)}, "
                        "or a file of your own schedule (a line of actions per stage, e.g. '0F0 0B0')")
    p.add_argument("--stages-per-rank", type=positive, default=1, metavar="V",
                   help="stages on each rank (lane) of the schedule: 2 for interleaved or zbv (default 1)")
    p.add_argument("--devices", type=device_names, metavar="D,...", help="one device per stage, or one for all")
    p.add_argument("--leaf-modules", type=names, metavar="A,B",
                   help="submodules (qualified names) or module classes (class names) to keep as one call")
    add_tracer(p)
    add_export_dims(p)
    p.add_argument("--input-shape", type=shape, action="append", metavar="8,3,224,224",
                   help="a random float input of this shape (repeat for several inputs)")
    p.add_argument("--plan", metavar="FILE", help="reuse a stage assignment saved with --json")
    p.add_argument("--json", metavar="FILE", help="save the plan as JSON")
    p.add_argument("--dot", metavar="FILE", help="write the graph as Graphviz DOT (.svg/.png: render it)")
    p.add_argument("--timeline", metavar="FILE", help="run a training step and write its Chrome trace")
    p.add_argument("--warmup", type=count, default=1, metavar="N", help="untimed steps before the --timeline step (default 1)")
    p.add_argument("--torch-compile", nargs="?", const="inductor", metavar="BACKEND",
                   help="compile every stage with torch.compile (backend: inductor unless named, e.g. aot_eager); "
                        "the --timeline step then runs compiled, after the --warmup steps compiled it")
    p.add_argument("--code", action="store_true", help="print the generated executor")
    p.add_argument("--tp", type=positive, metavar="T", help="show the tensor-parallel plan tp_plan='auto' finds for "
                   "T ranks per stage: each module's style, what stays whole, the collectives per micro-batch")
    p.add_argument("--traceback", action="store_true", help="show Python tracebacks of unexpected errors")
    p.add_argument("-v", "--verbose", action="store_true", help="log what the compiler does")
    p.set_defaults(run=run)


def _checkpoint(text: str) -> str | list[str]:
    """Parse ``--checkpoint``: one mode, or one per stage separated by commas."""
    modes = names(text)
    return modes[0] if len(modes) == 1 else modes


def run(args: argparse.Namespace) -> int:
    """Compile the model, print the plan, and write what the options ask for."""
    from fxpipe import compiler
    from fxpipe.errors import PlanMismatchError, ScheduleError, TraceError
    from fxpipe.options import CompileOptions
    from fxpipe.plan import PipelinePlan
    from fxpipe.plan.pipeline import human

    saved = None
    if args.plan:
        try:
            saved = PipelinePlan.load(args.plan)
        except (OSError, ValueError) as exc:
            raise UsageError(f"--plan {args.plan}: {exc}") from None
    n_stages = args.stages or (saved.n_stages if saved else None)
    if n_stages is None:
        raise UsageError(f"give the number of stages with --stages N; for example: {EXAMPLE}")
    if saved is not None and n_stages != saved.n_stages:
        raise UsageError(f"--plan {args.plan} has {saved.n_stages} stages but --stages {n_stages}; "
                         f"drop --stages (or give --stages {saved.n_stages}) to reuse the plan")
    if args.devices and len(args.devices) not in (1, n_stages):
        raise UsageError(f"--devices has {len(args.devices)} names but --stages {n_stages}: give one device per "
                         "stage, or one for all")
    chunks = args.chunks or (saved.chunks if saved else 1)
    for option, path in (("--dot", args.dot), ("--timeline", args.timeline), ("--json", args.json)):
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder is not None and not os.path.isdir(folder):  # found before tracing and running, not after
            raise UsageError(f"{option} {path}: the folder {folder} does not exist; create it or write elsewhere")
    check_export_dims_args(args)  # before the model's module is imported and built
    model, inputs, kwargs = make_model(args.model, args.input_shape)
    if args.timeline and inputs is None:
        raise UsageError("--timeline runs a training step and needs example inputs: return "
                         "(model, example_inputs) from the factory or pass --input-shape")
    devices = args.devices * n_stages if args.devices and len(args.devices) == 1 else args.devices
    try:
        from fxpipe.simulate.devices import parse_bytes

        max_memory = parse_bytes(args.max_memory) if args.max_memory else None
    except ValueError as exc:
        raise UsageError(f"--max-memory: {exc}") from None
    compiled = {"backend": args.torch_compile} if args.torch_compile else False
    try:  # an option value no model could use is the command line's mistake: exit 2, before tracing
        CompileOptions(n_stages, chunks=chunks, checkpoint=args.checkpoint, balance_by=args.balance_by,
                       max_memory=max_memory, schedule=args.schedule, stages_per_rank=args.stages_per_rank,
                       torch_compile=compiled, tracer=args.tracer, export_dims=args.export_dims).check()
    except (ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from None
    try:
        pipe = compiler.compile(model, n_stages, example_inputs=inputs, example_kwargs=kwargs or None,
                              devices=devices, chunks=chunks, checkpoint=args.checkpoint,
                              balance_by=args.balance_by, split_points=args.split_points,
                              leaf_modules=leaf_modules(model, args.leaf_modules), tracer=args.tracer, plan=saved,
                              export_dims=args.export_dims,
                              schedule=args.schedule,
                              stages_per_rank=args.stages_per_rank, max_memory=max_memory,
                              torch_compile=compiled)
    except ScheduleError as exc:  # the schedule's name or file, against the stages
        raise UsageError(str(exc)) from None
    except TraceError as exc:
        raise Failure(f"{exc}{trace_hint(exc)}") from None
    except (PlanMismatchError, ValueError, TypeError) as exc:
        raise Failure(str(exc)) from None
    except RuntimeError as exc:  # the shape pass ran the model on (fake) example inputs
        raise does_not_run(exc) from None
    plan = pipe.plan
    if inputs is not None and not any(s.peak for s in plan.stages):
        _predict_peaks(pipe)
    params = sum(p.numel() for p in model.parameters())
    batch = "" if inputs is None or _batch(inputs) is None else f", example batch {_batch(inputs)}"
    print(f"{type(model).__name__} ({args.model}): {len(plan.graph_nodes)} graph nodes, "
          f"{human(params)} parameters, {plan.n_stages} stages, chunks={plan.chunks}{batch}, "
          f"balance_by={plan.balance_by}" + (f", plan from {args.plan}" if saved else ""))
    rows = _batch(inputs) if inputs is not None else None
    if rows is not None and rows < plan.chunks:  # a step splits into at most one micro-batch per row
        print(f"note: the example batch of {rows} rows runs as {rows} micro-batches of one row, fewer than "
              f"chunks={plan.chunks}; the efficiency below is for batches of at least {plan.chunks} rows")
    print(plan.table())
    if args.tp and args.tp > 1:
        _print_tp(pipe, args.tp)
    status = 0
    if args.json:
        plan.save(args.json)
        print(f"plan saved to {args.json}")
    if args.dot:
        status = max(status, _write_dot(args, pipe, model, inputs))
    if args.timeline:
        _write_timeline(args, pipe, inputs, kwargs)
    if args.code:
        print(pipe.code, end="")
    if pipe.compile_stats:
        _print_compiled(pipe.compile_stats)
    return status


def _print_compiled(stats: dict[int, dict[str, Any]]) -> None:
    """Print what torch.compile did per stage: graphs, compiles, time, graph breaks, the I/W split."""
    if not any(s["compiles"] for s in stats.values()):  # torch.compile compiles at a stage's first run
        print("torch.compile: no stage ran, so none compiled yet (each compiles at its first call); add --timeline "
              "to run a step and see what it compiled")
        return
    for j, s in stats.items():
        split = ", backward split " + " + ".join(f"I {i} / W {w} nodes" for i, w in s["split"]) if s["split"] else ""
        print(f"torch.compile ({s['backend']}) stage {j}: {s['graphs']} graph(s), {s['compiles']} compile(s), "
              f"{s['seconds']:.1f} s{split}")
        for note in s["breaks"]:
            print(f"  graph break at {note}")


def _predict_peaks(pipe: Any) -> None:
    """Write each stage's predicted peak memory under its policy into the plan (for the table)."""
    from fxpipe.simulate.simulation import simulate

    runtime = "distributed" if pipe.plan.stages[0].device.startswith("rank") else "local"
    try:
        sim = simulate(pipe, device="h100", runtime=runtime)  # a nominal model: the memory walk needs no speeds
    except Exception as exc:  # noqa: BLE001 - fake tensors cannot follow every model: no peak column then
        print(f"(no predicted peaks: {type(exc).__name__} while following the model on fake tensors)")
        return
    for s, result in zip(pipe.plan.stages, sim.stages):
        s.peak = int(result.memory.peak)


def _print_tp(pipe: Any, t: int) -> None:
    """Print the automatic tensor-parallel plan for ``t`` ranks per stage (nothing is sharded here)."""
    from fxpipe.errors import TensorParallelError
    from fxpipe.plan.pipeline import tp_lines
    from fxpipe.plan.tensorparallel import plan_tensor_parallel
    from fxpipe.plan.tpcoverage import little_split

    try:
        tp = plan_tensor_parallel(pipe._gm, t, "auto", record=False)
    except TensorParallelError as exc:
        raise Failure(str(exc)) from None
    print("\n".join(tp_lines(tp.record(pipe.plan.chunks)) + _per_rank_lines(pipe, tp)))
    note = little_split(pipe._gm, tp)
    if note is not None:
        print(f"  note: {note}")


def _per_rank_lines(pipe: Any, tp: Any) -> list[str]:
    """Return each stage's parameters and FLOPs per rank under ``tp`` beside the whole stage's (the table's)."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    from fxpipe.plan.pipeline import human
    from fxpipe.plan.stages import named_tensors
    from fxpipe.plan.tpstyles import weight_placement

    t, cut = tp.size, 1 - 1 / tp.size
    split: set[int] = set()  # the tensors each rank holds 1/t of (a row-wise layer's bias stays whole)
    split_nodes: set[str] = set()
    for fqn, style in tp.styles.items():
        site = tp.sites[fqn]
        if weight_placement(style, site) in ("S0", "S1"):
            split.add(id(site.weight))
            split_nodes.update(site.nodes)
            if site.bias is not None and isinstance(style, ColwiseParallel):
                split.add(id(site.bias))
    flops = {n.name: n.meta.get("fxpipe.flops", 0) + n.meta.get("fxpipe.flops_bwd", 0) for n in pipe._gm.graph.nodes}
    lines = [f"  per rank (each of the {t} holds 1/{t} of every split layer; the stage table above is whole):"]
    for s, module in zip(pipe.plan.stages, pipe.stages):
        tensors = {id(x): x for _, x in named_tensors(module)}
        params = s.params - cut * sum(x.numel() * x.element_size() for i, x in tensors.items() if i in split)
        computed = s.flops - cut * sum(flops.get(v, 0) for v in s.nodes if v in split_nodes)
        lines.append(f"    stage {s.index}: params {human(int(params), 'B')} of {human(s.params, 'B')}"
                     + (f", FLOPs f+b {human(int(computed))} of {human(s.flops)}" if s.flops else ""))
    return lines


def _batch(inputs: tuple) -> int | None:
    """Return the dim-0 size of the first tensor input."""
    import torch

    for x in inputs:
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            return int(x.shape[0])
    return None


def _write_dot(args: argparse.Namespace, pipe: Any, model: Any, inputs: tuple | None) -> int:
    """Write the DOT graph, rendering it when the file asks for a picture; return a status."""
    from fxpipe.plan.batches import micro_sizes
    from fxpipe.tools import dot

    batch = _batch(inputs) if inputs is not None else None
    micro = len(micro_sizes(batch, pipe.plan.chunks)) if batch else pipe.plan.chunks  # as the table
    source = dot.to_dot(pipe._gm, pipe.plan, micro_batches=micro, title=type(model).__name__)
    target = args.dot
    if not target.lower().endswith((".svg", ".png", ".pdf")):
        with open(target, "w") as f:
            f.write(source)
        print(f"graph written to {target}")
        return 0
    dot_path = os.path.splitext(target)[0] + ".dot"
    if not dot.graphviz_available():
        with open(dot_path, "w") as f:
            f.write(source)
        print(f"fxpipe inspect: error: cannot render {target}: Graphviz's `dot` is not installed "
              f"(Debian/Ubuntu: apt install graphviz); wrote the DOT source to {dot_path}", file=sys.stderr)
        return 1
    try:
        dot.render(source, target)
    except RuntimeError as exc:
        raise Failure(str(exc)) from None
    print(f"graph rendered to {target}")
    return 0


def _write_timeline(args: argparse.Namespace, pipe: Any, inputs: tuple | None, kwargs: dict) -> None:
    """Run warm-up steps, then one recorded training step; write and summarise its trace."""
    from tabulate import tabulate

    from fxpipe.runtime.observe.timeline import timeline

    assert inputs is not None
    pipe.train()
    tl = timeline(args.timeline)
    for k in range(max(args.warmup, 0) + 1):
        with tl if k == max(args.warmup, 0) else contextlib.nullcontext():
            if pipe.plan.schedule == "gpipe":
                _stand_in_loss(pipe(*inputs, **kwargs), None).backward()
            else:  # the schedule's own forward and backward actions
                pipe.step(*inputs, target=None, loss_fn=_stand_in_loss, **kwargs)
        pipe.zero_grad(set_to_none=True)
    weights = any(e["cat"] == "weight" for e in tl.events)  # a schedule with W steps
    kinds = ["forward", "recompute", "backward"] + (["weight"] if weights else []) + ["copy"]
    counts = {kind: sum(e["cat"] == kind for e in tl.events) for kind in kinds}
    span = max(e["ts"] + e["dur"] for e in tl.events) - min(e["ts"] for e in tl.events)
    print(f"timeline saved to {args.timeline}: one training step ({pipe.plan.schedule}), {span / 1e3:.1f} ms, "
          + ", ".join(f"{n} {kind}" for kind, n in counts.items())
          + " events (open it in https://ui.perfetto.dev)")
    rows = []
    for s in pipe.plan.stages:
        ms = {kind: sum(e["dur"] for e in tl.events if e["cat"] == kind and e["args"]["stage"] == s.index) / 1e3
              for kind in counts}
        busy = sum(v for k, v in ms.items() if k != "copy") / (span / 1e3) if span else 0.0
        rows.append([s.index, s.device] + [f"{ms[k]:.1f}" for k in counts] + [f"{busy:.0%}"])
    headers = ["stage", "device"] + [f"{k}-in ms" if k == "copy" else f"{k} ms" for k in kinds] + ["busy"]
    print(tabulate(rows, headers=headers, tablefmt="simple"))


def _stand_in_loss(out: Any, _target: Any) -> Any:
    """Return the sum of the means of the outputs that require grad: a loss to time backward with."""
    import torch
    from torch.utils._pytree import tree_leaves

    grad = torch.is_grad_enabled()  # a checkpointed micro-batch's loss is first computed without
    leaves = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()
              and (t.requires_grad or not grad)]
    if not leaves:
        raise Failure("the model's output does not require grad, so there is no backward to time")
    return sum(t.float().mean() for t in leaves)
