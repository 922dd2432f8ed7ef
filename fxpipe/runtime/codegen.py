"""Emit the GPipe clock-cycle schedule of a plan as Python source.

At clock ``k`` the pairs (micro-batch ``i``, stage ``j``) with ``i + j == k`` run. Each clock
first *fences* every pair (copies its inputs from other devices and joins a backward
dependency on micro-batch ``i - 1``), then *computes* them. Every value is a local variable
``<node>_m<i>``; a value is deleted as soon as its last consumer has run, so activations and
skip tensors live no longer than needed. Copies are emitted only between different devices.

The generated function takes the runtime ``rt`` (``compute``, ``copy``, ``depend``) and the
per-micro-batch inputs of stage 0, and returns the last stage's output per micro-batch.
"""

from __future__ import annotations

import linecache
from collections.abc import Callable

from fxpipe.options import checkpoint_stop
from fxpipe.plan.pipeline import PipelinePlan
from fxpipe.runtime.schedules.actions import clocks
from fxpipe.runtime.schedules.builtin import gpipe

__all__ = ["clock_cycles", "compile_source", "gpipe_source"]


def clock_cycles(m: int, n: int) -> list[list[tuple[int, int]]]:
    """Return, per clock, the (micro-batch, stage) pairs whose forward runs: i + j == k.

    Derived from GPipe's action lists (:mod:`fxpipe.runtime.schedules.builtin`), so the generated forward and
    the action-list runtimes follow one schedule.
    """
    at = clocks(gpipe(n, m))
    cycles: list[list[tuple[int, int]]] = [[] for _ in range(m + n - 1)]
    for action, k in sorted(at.items(), key=lambda item: (item[1], item[0].stage)):
        if action.kind == "F":
            cycles[k].append((action.mb, action.stage))
    return cycles


def _var(name: str, i: int) -> str:
    """Name the local variable holding value ``name`` of micro-batch ``i``."""
    return f"{name}_m{i}"


def _tuple(items: list[str]) -> str:
    """Render a Python tuple expression."""
    return "(" + "".join(f"{x}, " for x in items).rstrip() + ")" if len(items) != 1 else f"({items[0]},)"


def gpipe_source(plan: PipelinePlan, m: int, name: str = "gpipe", threaded: bool = False) -> str:
    """Return the source of a function running ``plan`` over ``m`` micro-batches, GPipe order.

    With ``threaded``, the stages of a clock compute together through ``rt.clock`` (one
    worker thread per device) instead of one after another.
    """
    n = plan.n_stages
    stop = [checkpoint_stop(p, m) for p in plan.policies()]  # per stage
    producer = plan.producer()
    last_use = {v: max(js) for v, js in plan.consumers().items()}
    devices = [s.device for s in plan.stages]
    lines = [
        f"def {name}(rt, mb):",
        f'    """GPipe: {n} stages x {m} micro-batches in {m + n - 1} clock cycles."""',
        "    compute, copy, depend = rt.compute, rt.copy, rt.depend",
    ]
    for k, pairs in enumerate(clock_cycles(m, n)):
        lines.append(f"    # clock {k}: " + " ".join(f"(micro-batch {i}, stage {j})" for i, j in pairs))
        copies: dict[int, list[str]] = {}
        for i, j in pairs:  # fence: inputs, copies, dependencies
            stage = plan.stages[j]
            args = [_var(v, i) for v in stage.inputs]
            if j == 0 and args:
                lines.append(f"    {_tuple(args)[1:-1]} = mb[{i}]")
            by_src: dict[int, list[int]] = {}
            for pos, v in enumerate(stage.inputs):
                if j > 0 and devices[producer[v]] != devices[j]:
                    by_src.setdefault(producer[v], []).append(pos)
            for src, positions in by_src.items():
                moved = [f"{args[p]}_to{j}" for p in positions]
                lines.append(f"    {_tuple(moved)[1:-1]} = copy({src}, {j}, {i}, "
                             f"{_tuple([args[p] for p in positions])})")
                for p, moved_name in zip(positions, moved):
                    args[p] = moved_name
                copies.setdefault(j, []).extend(moved)
            lines.append(f"    in{j} = {_tuple(args)}")
            if i > 0 and j > 0:
                before = _outputs(plan, j, i - 1)
                lines.append(f"    {_tuple(before)}, in{j} = depend({_tuple(before)}, in{j})")
        targets = []
        for i, j in pairs:
            if j == n - 1:
                targets.append(f"{_var('output', i)} = ")
            else:
                outs = _outputs(plan, j, i)
                targets.append(f"{_tuple(outs)[1:-1]} = " if outs else "")
        if threaded and len(pairs) > 1:  # compute the clock's stages together, one thread per device
            tasks = ", ".join(f"({j}, {i}, in{j}, {i < stop[j]})" for i, j in pairs)
            lines.append(f"    done = rt.clock(({tasks}))")
            lines += [f"    {t}done[{k}]" for k, t in enumerate(targets) if t]
            lines.append("    del done")
        for k, (i, j) in enumerate(pairs):  # compute (or, threaded, free what the clock used)
            stage = plan.stages[j]
            if not (threaded and len(pairs) > 1):
                lines.append(f"    {targets[k]}compute({j}, {i}, in{j}, {i < stop[j]})")
            dead = [f"in{j}"] + copies.get(j, []) + [_var(v, i) for v in stage.inputs
                                                    if last_use.get(v, 0) <= j]
            lines.append(f"    del {', '.join(dead)}")
    lines.append(f"    return [{', '.join(_var('output', i) for i in range(m))}]")
    return "\n".join(lines) + "\n"


def _outputs(plan: PipelinePlan, j: int, i: int) -> list[str]:
    """Return the variables that receive stage ``j``'s outputs for micro-batch ``i``."""
    if j == plan.n_stages - 1:
        return [_var("output", i)]
    return [_var(v, i) for v in plan.stages[j].outputs]


def compile_source(source: str, name: str, filename: str) -> Callable:
    """Compile generated source once; register it so tracebacks show its lines."""
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace: dict = {}
    exec(compile(source, filename, "exec"), namespace)  # noqa: S102 - our own generated code
    return namespace[name]
