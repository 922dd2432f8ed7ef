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

__all__ = ["add_note", "call_wrapper_code", "describe_node", "failing_node", "keep_tracebacks", "node_in_stack", "note_failure"]

_NOTE = "fxpipe: raised in stage"


class _Unwrapped:
    """A GraphModule class's call that lets exceptions through with their tracebacks."""

    def __init__(self, cls: type[torch.fx.GraphModule]) -> None:
        self.cls = cls

    def __call__(self, obj: torch.fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
        return super(self.cls, obj).__call__(*args, **kwargs)


def call_wrapper_code() -> Any:
    """Return the code object of the call :func:`keep_tracebacks` puts around a GraphModule's forward.

    One code object serves every stage, so torch.compile must step over its frame (and
    compile each stage's own generated forward) rather than cache every stage's graphs on it.
    """
    return _Unwrapped.__call__.__code__


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
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append((tb.tb_frame.f_code.co_filename, tb.tb_lineno))
        tb = tb.tb_next
    return node_in_stack(gm, frames)


def node_in_stack(gm: torch.fx.GraphModule, frames: Any) -> torch.fx.Node | None:
    """Return the node of ``gm`` at the innermost of ``frames`` in its generated code.

    ``frames`` are ``(filename, lineno)`` pairs or ``traceback.FrameSummary`` objects (a
    stack torch.compile reports), outermost first. A stack that starts inside a module the
    stage calls (torch.compile reports a graph break in its own frame) names the first
    ``call_module`` node whose module's ``forward`` holds the outermost such frame.
    """
    pairs = [(f.filename, f.lineno) if hasattr(f, "filename") else tuple(f) for f in frames]
    forward = getattr(type(gm), "forward", None)
    code = getattr(forward, "__code__", None)
    lineno_map = getattr(gm, "_lineno_map", None)
    if code is None or not lineno_map:
        return None
    start = getattr(gm, "_prologue_start", 0) or 0
    nodes = list(gm.graph.nodes)
    found = None
    for filename, lineno in pairs:
        if filename == code.co_filename and lineno is not None:
            index = lineno_map.get(lineno - start)
            if index is not None and index < len(nodes):
                found = nodes[index]
    return found if found is not None else _module_node(gm, nodes, pairs)


def _module_node(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node], pairs: list) -> torch.fx.Node | None:
    """Return the first call_module node whose module's forward holds the outermost of ``pairs``."""
    for filename, lineno in pairs:
        for node in nodes:
            if node.op != "call_module" or lineno is None:
                continue
            code = getattr(type(gm.get_submodule(cast(str, node.target))).forward, "__code__", None)
            if code is not None and code.co_filename == filename \
                    and code.co_firstlineno <= lineno <= max((ln for *_, ln in code.co_lines() if ln), default=0):
                return node
    return None


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


def raised_in_stage(exc: BaseException) -> bool:
    """Tell whether :func:`note_failure` has noted ``exc`` as raised inside a stage."""
    return any(str(n).startswith(_NOTE) for n in getattr(exc, "__notes__", ()))


def note_failure(exc: BaseException, gm: torch.fx.GraphModule, index: int, device: torch.device,
                 in_pass: str = "forward") -> None:
    """Add a note to ``exc`` naming stage ``index``, its device, the failing node and the pass it was in (once)."""
    if not raised_in_stage(exc):
        node = failing_node(gm, exc)
        at = f", node {describe_node(gm, node)}" if node is not None else ""
        add_note(exc, f"{_NOTE} {index} ({device}){at}, in {in_pass}")
        if "Expected more than 1 value per channel when training" in str(exc):
            add_note(exc, "fxpipe: a batch norm in training saw a micro-batch of one row: a batch splits into chunks "
                          "micro-batches (6 rows at chunks=4: 2, 2, 1, 1 under fxpipe.compile; 5 rows: 2, 2, 1 under "
                          "the torchgpipe drop-in), so the last, smaller batch of an epoch may leave one row. Give every micro-batch 2 rows or more: fewer chunks, or drop the uneven "
                          "last batch (DataLoader(..., drop_last=True))")
        if "doesn't require gradient" in str(exc) and in_pass == "checkpointed forward":
            add_note(exc, "fxpipe: a checkpointed stage's first forward runs without grad (its recomputation in "
                          "backward runs with it), so a tensor there does not require a gradient: guard what needs "
                          "one (`if torch.is_grad_enabled(): h.register_hook(...)`, which also keeps a hook on a "
                          "stage's input from being registered twice), or compile with checkpoint='never'")
        nones = [a.target for a in (node.all_input_nodes if node is not None else ()) if a.op == "placeholder"]
        if "NoneType" in str(exc) and nones:  # an input None here, traced as a value (compiled without examples)
            add_note(exc, f"fxpipe: if '{nones[0]}' was None in this call: torch.fx traced it as a value, for which "
                          "a check `is not None` holds, so the code using it runs. Compile with example inputs "
                          f"giving {nones[0]}=None (the trace then fixes it to None and runs eager's code), pass a "
                          "tensor, or use tracer='export'")
        if "Proxy(" in str(exc):  # an assertion's message formatted while tracing (timm's _assert on the image size)
            add_note(exc, "fxpipe: this message was formatted while the model was traced, so Proxy(...) stands for "
                          "the value this call had: run the model eagerly on these inputs to see it; the model "
                          "refuses them as it would eagerly (another image size than it was built for, say)")
        if "out of bounds for dimension 0 with size" in str(exc):
            add_note(exc, "fxpipe: an index ran past dim 0 of a value: a tensor input the model indexes by values (a "
                          "lookup table, a codebook) is split into micro-batches like the batch when its dim 0 has as "
                          "many rows; compile with unbatched=['<that input>'] to give every micro-batch all of it")


def add_note(exc: BaseException, note: str) -> None:
    """Attach ``note`` to ``exc`` (PEP 678; a plain attribute before Python 3.11)."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # pragma: no cover - Python 3.10
        vars(exc)["__notes__"] = [*getattr(exc, "__notes__", []), note]  # 3.10's BaseException declares none
