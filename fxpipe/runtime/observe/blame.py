"""Name the stage and node where a stage's forward raised, on the exception itself.

A stage GraphModule runs generated code; when one of its nodes raises, the traceback shows a
line of that code. :func:`note_failure`, called by the stage call on any exception, leaves
the exception of its original type and with its original traceback, and adds a note
naming the stage, its device,
the node (its op, target and the module it came from) and the pass (forward, checkpointed
forward, or recomputation in backward)::

    ValueError: negative input
    fxpipe: raised in stage 1 (cpu), node 'gate' (call_module gate: Gate, module 'gate'), in forward

The node is found from the traceback (the stage's generated line maps to a node), so nothing
is re-run.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.fx

__all__ = ["describe_node", "failing_node", "keep_tracebacks", "note_failure"]

_NOTE = "fxpipe: raised in stage"


class _Unwrapped:
    """A GraphModule class's call that lets exceptions through with their tracebacks."""

    def __init__(self, cls: type[torch.fx.GraphModule]) -> None:
        self.cls = cls

    def __call__(self, obj: torch.fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
        return super(self.cls, obj).__call__(*args, **kwargs)


def keep_tracebacks(gm: torch.fx.GraphModule) -> None:
    """Make calls of ``gm`` keep the traceback of an op raising in its generated code.

    torch.fx wraps a GraphModule's call so that an exception raised right in the generated
    forward (``torch.cat``, ``+``: no deeper Python frame) loses its traceback and a copy of
    the code goes to stderr; without the traceback no node can be named. Only ``gm``'s own
    class changes (each GraphModule has one).
    """
    cls = type(gm)
    if "_wrapped_call" in vars(cls):
        cls._wrapped_call = _Unwrapped(cls)  # type: ignore[attr-defined]


def failing_node(gm: torch.fx.GraphModule, exc: BaseException) -> torch.fx.Node | None:
    """Return the node of ``gm`` whose generated line is in ``exc``'s traceback, innermost first."""
    forward = getattr(type(gm), "forward", None)
    code = getattr(forward, "__code__", None)
    lineno_map = getattr(gm, "_lineno_map", None)
    if code is None or not lineno_map:
        return None
    start = getattr(gm, "_prologue_start", 0) or 0
    nodes = list(gm.graph.nodes)
    found = None
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == code.co_filename:
            index = lineno_map.get(tb.tb_lineno - start)
            if index is not None and index < len(nodes):
                found = nodes[index]
        tb = tb.tb_next
    return found


def describe_node(gm: torch.fx.GraphModule, node: torch.fx.Node) -> str:
    """Describe a node by name, op, target and the module it was traced from."""
    target = node.target if isinstance(node.target, str) else getattr(
        node.target, "__name__", str(node.target))
    what = f"{node.op} {target}"
    if node.op == "call_module":
        what += f": {type(gm.get_submodule(cast(str, node.target))).__name__}"
    stack = node.meta.get("nn_module_stack") or {}
    paths = [path for path, _ in stack.values() if path]
    where = f", module '{paths[-1]}'" if paths else ""
    return f"'{node.name}' ({what}{where})"


def note_failure(exc: BaseException, gm: torch.fx.GraphModule, index: int, device: torch.device,
                 in_pass: str = "forward") -> None:
    """Add a note to ``exc`` naming stage ``index``, its device, the failing node and the pass it was in (once)."""
    notes = getattr(exc, "__notes__", [])
    if not any(str(n).startswith(_NOTE) for n in notes):
        node = failing_node(gm, exc)
        at = f", node {describe_node(gm, node)}" if node is not None else ""
        _add_note(exc, f"{_NOTE} {index} ({device}){at}, in {in_pass}")


def _add_note(exc: BaseException, note: str) -> None:
    """Attach ``note`` to ``exc`` (PEP 678; a plain attribute before Python 3.11)."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # pragma: no cover - Python 3.10
        vars(exc)["__notes__"] = [*getattr(exc, "__notes__", []), note]  # 3.10's BaseException declares none
