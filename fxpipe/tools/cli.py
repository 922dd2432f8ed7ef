"""The ``fxpipe`` command: ``fxpipe inspect MODEL --stages N`` shows what the compiler did;
``fxpipe plan MODEL --ranks N`` chooses a configuration (:mod:`fxpipe.tools.plancmd`).

    fxpipe inspect examples/unet.py:factory --stages 4 --chunks 4 --dot unet.svg --timeline t.json
    fxpipe plan examples/transformer.py:factory --ranks 4 --device h100 --memory 80GB

``MODEL`` is ``path/to/file.py:factory`` or ``package.module:factory``; ``factory()`` returns
a model or ``(model, example_inputs)``. Exit status: 0 on success, 1 when the model cannot be
pipelined as asked (it does not trace, its factory raises, a saved plan no longer matches),
2 for a command line that cannot be used (a bad MODEL, a malformed option).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from fxpipe.tools import plancmd
from fxpipe.tools.factory import EXAMPLE, FactoryError, ModelSpecError, make_model


class UsageError(Exception):
    """A command line that cannot be used; exit status 2."""


class Failure(Exception):
    """A model that cannot be inspected as asked; exit status 1."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``fxpipe`` command line; return the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="fxpipe: %(levelname)s: %(message)s")
    if not args.verbose:  # torch logs a traceback when a fake kernel rejects the shapes; we explain
        logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)
    try:
        return args.run(args)
    except (UsageError, ModelSpecError) as exc:
        print(f"fxpipe {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except (Failure, FactoryError) as exc:
        print(f"fxpipe {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if args.traceback:
            raise
        print(f"fxpipe {args.command}: error: {type(exc).__name__}: {exc}\n"
              "(run again with --traceback to see where)", file=sys.stderr)
        return 1


def _parser() -> argparse.ArgumentParser:
    """Build the argument parser."""
    from fxpipe.compiler import BALANCE_BY, CHECKPOINT_MODES, SCHEDULES

    parser = argparse.ArgumentParser(prog="fxpipe", description="Pipeline parallelism for any PyTorch model.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = commands.add_parser(
        "inspect", help="show the stages, skip routes, graph picture and timeline of a model",
        description="Compile MODEL into pipeline stages and show what the compiler did.",
        epilog=f"example: {EXAMPLE} --dot unet.svg --timeline unet-trace.json")
    p.add_argument("model", metavar="MODEL", help="path/to/file.py:factory or package.module:factory; "
                   "factory() returns a model or (model, example_inputs)")
    p.add_argument("--stages", type=_positive, metavar="N", help="number of pipeline stages (default: the --plan's)")
    p.add_argument("--chunks", type=_positive, metavar="M", help="micro-batches (default: the --plan's, else 1)")
    p.add_argument("--balance-by", choices=BALANCE_BY, default="auto", help="the cost stages balance")
    p.add_argument("--split-points", type=_names, metavar="A,B", help="modules or nodes where stages begin")
    p.add_argument("--checkpoint", choices=CHECKPOINT_MODES, default="except_last")
    p.add_argument("--schedule", default="gpipe", metavar="NAME|FILE",
                   help=f"what a training step runs (the --timeline step, --code): one of {', '.join(SCHEDULES)}, "
                        "or a file of your own schedule (a line of actions per stage, e.g. '0F0 0B0')")
    p.add_argument("--stages-per-rank", type=_positive, default=1, metavar="V",
                   help="stages on each rank (lane) of the schedule: 2 for interleaved or zbv (default 1)")
    p.add_argument("--devices", type=_names, metavar="D,...", help="one device per stage, or one for all")
    p.add_argument("--leaf-modules", type=_names, metavar="A,B", help="submodules to keep as one call")
    p.add_argument("--input-shape", type=_shape, action="append", metavar="8,3,224,224",
                   help="a random float input of this shape (repeat for several inputs)")
    p.add_argument("--plan", metavar="FILE", help="reuse a stage assignment saved with --json")
    p.add_argument("--json", metavar="FILE", help="save the plan as JSON")
    p.add_argument("--dot", metavar="FILE", help="write the graph as Graphviz DOT (.svg/.png: render it)")
    p.add_argument("--timeline", metavar="FILE", help="run a training step and write its Chrome trace")
    p.add_argument("--warmup", type=int, default=1, metavar="N", help="untimed steps before the --timeline step (default 1)")
    p.add_argument("--code", action="store_true", help="print the generated executor")
    p.add_argument("--traceback", action="store_true", help="show Python tracebacks of unexpected errors")
    p.add_argument("-v", "--verbose", action="store_true", help="log what the compiler does")
    p.set_defaults(run=_inspect)
    plancmd.register(commands, _positive, _names, _shape)
    return parser


def _positive(text: str) -> int:
    """Parse a positive integer option."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def _names(text: str) -> list[str]:
    """Parse a comma-separated list of names."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r} names nothing; separate names with commas")
    return names


def _shape(text: str) -> tuple[int, ...]:
    """Parse a shape such as 8,3,224,224."""
    try:
        shape = tuple(int(t) for t in text.replace("x", ",").split(","))
    except ValueError:
        shape = ()
    if not shape or any(d < 1 for d in shape):
        raise argparse.ArgumentTypeError(f"{text!r} is not a shape; write sizes with commas, e.g. 8,3,224,224")
    return shape


# -- inspect -------------------------------------------------------------------------------
def _inspect(args: argparse.Namespace) -> int:
    """Compile the model, print the plan, and write what the options ask for."""
    import fxpipe
    from fxpipe.plan.pipeline import human

    saved = None
    if args.plan:
        try:
            saved = fxpipe.PipelinePlan.load(args.plan)
        except (OSError, ValueError) as exc:
            raise UsageError(f"--plan {args.plan}: {exc}") from None
    n_stages = args.stages or (saved.n_stages if saved else None)
    if n_stages is None:
        raise UsageError(f"give the number of stages with --stages N; for example: {EXAMPLE}")
    if saved is not None and n_stages != saved.n_stages:
        raise UsageError(f"--plan {args.plan} has {saved.n_stages} stages but --stages {n_stages}; "
                         f"drop --stages (or give --stages {saved.n_stages}) to reuse the plan")
    chunks = args.chunks or (saved.chunks if saved else 1)
    model, inputs, kwargs = make_model(args.model, args.input_shape)
    if args.timeline and inputs is None:
        raise UsageError("--timeline runs a training step and needs example inputs: return "
                         "(model, example_inputs) from the factory or pass --input-shape")
    devices = args.devices * n_stages if args.devices and len(args.devices) == 1 else args.devices
    try:
        pipe = fxpipe.compile(model, n_stages, example_inputs=inputs, example_kwargs=kwargs or None,
                              devices=devices, chunks=chunks, checkpoint=args.checkpoint,
                              balance_by=args.balance_by, split_points=args.split_points,
                              leaf_modules=args.leaf_modules or (), plan=saved, schedule=args.schedule,
                              stages_per_rank=args.stages_per_rank)
    except fxpipe.TraceError as exc:
        hint = f"\nOn the command line: --leaf-modules {exc.module}" if exc.module else ""
        raise Failure(f"{exc}{hint}") from None
    except (fxpipe.PlanMismatchError, ValueError, TypeError) as exc:
        raise Failure(str(exc)) from None
    except RuntimeError as exc:  # the shape pass ran the model on (fake) example inputs
        lines = [l for l in str(exc).splitlines() if l.strip()
                 and not l.startswith(("Original traceback", "None", "Use tlparse"))]
        raise Failure("the model does not run on the example inputs: " + "\n".join(lines)) from None
    plan = pipe.plan
    params = sum(p.numel() for p in model.parameters())
    batch = "" if inputs is None or _batch(inputs) is None else f", example batch {_batch(inputs)}"
    print(f"{type(model).__name__} ({args.model}): {len(plan.graph_nodes)} graph nodes, "
          f"{human(params)} parameters, {plan.n_stages} stages, chunks={plan.chunks}{batch}, "
          f"balance_by={plan.balance_by}" + (f", plan from {args.plan}" if saved else ""))
    print(plan.table())
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
    return status


def _batch(inputs: tuple) -> int | None:
    """Return the dim-0 size of the first tensor input."""
    import torch

    for x in inputs:
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            return int(x.shape[0])
    return None


def _write_dot(args: argparse.Namespace, pipe: Any, model: Any, inputs: tuple | None) -> int:
    """Write the DOT graph, rendering it when the file asks for a picture; return a status."""
    from fxpipe.runtime.microbatch import micro_sizes
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

    import fxpipe

    assert inputs is not None
    pipe.train()
    tl = fxpipe.timeline(args.timeline)
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
