"""Choose the inputs torch.fx should fix to constants where a model does not trace with them as inputs.

torch.fx traces every input of ``forward`` as a tensor, so a flag (``if not return_dict:``) or
an input left at its ``None`` default (``if class_labels is not None:``) breaks the trace or
takes the branch eager does not. Hugging Face's tracer fixes the inputs not given; fxpipe does
so only where the plain trace failed, for plain constants: a flag, a string or ``None`` given in
the example inputs, or left at such a default; and, where the trace passed, for every ``None``
input (:func:`none_inputs`): one the graph never reads (a check ``if extra is not None:`` held
while traced and kept a branch eager does not take), and one it reads (also
passed to an op that takes ``None``, ``attn_mask=mask``, beside such a check), that one only
where example inputs are given; where that retrace fails, again with the flags and strings fixed
too (``if mask is not None or is_causal:`` reads the flag only once ``mask`` is ``None``). The
pipe then takes no other value for them (:func:`fxpipe.passes.bind_placeholders` says so).
"""

from __future__ import annotations

import inspect
import operator
from typing import Any

import torch.fx
from torch import nn

from fxpipe.errors import TraceError

__all__ = ["constant_inputs", "none_inputs", "refuse_name_clash", "unread_none_entries"]

_PARAMETER = inspect.Parameter


def constant_inputs(model: nn.Module, example_inputs: Any, example_kwargs: dict[str, Any] | None,
                    concrete_args: dict[str, Any] | None) -> dict[str, Any]:
    """Return forward's inputs to fix: the constants given in the examples, and those left at a constant default."""
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):  # a builtin's forward: nothing to read
        return {}
    args = _as_args(example_inputs)
    params = [p for p in sig.parameters.values() if p.kind not in (_PARAMETER.VAR_POSITIONAL, _PARAMETER.VAR_KEYWORD)]
    positional = [p for p in params if p.kind in (_PARAMETER.POSITIONAL_ONLY, _PARAMETER.POSITIONAL_OR_KEYWORD)]
    if len(args) > len(positional):  # forward's *args takes some: leave the trace as it was
        return {}
    given = {**{p.name: v for p, v in zip(positional, args)}, **(example_kwargs or {})}
    fixed: dict[str, Any] = {}
    for p in params:
        if p.name in (concrete_args or {}):
            continue
        if p.name in given:
            if _constant(given[p.name]):
                fixed[p.name] = given[p.name]
        elif p.default is not _PARAMETER.empty and _constant(p.default):
            fixed[p.name] = p.default
    return fixed


def _constant(value: Any) -> bool:
    """Tell whether ``value`` is a constant a trace may fix: ``None``, a flag or a string."""
    return value is None or type(value) in (bool, str)


def none_inputs(model: nn.Module, gm: torch.fx.GraphModule, example_inputs: Any, example_kwargs: dict[str, Any] | None,
                concrete_args: dict[str, Any] | None, read_too: bool) -> dict[str, None]:
    """Return forward's ``None`` inputs (given so, or left at that default) that ``gm`` never reads (``read_too``: all).

    Traced as a value, such an input passes ``is not None`` checks: the graph keeps the code
    under them, which eager skips for ``None``. One the graph never reads tells that by itself;
    one it reads may be passed to an op that takes ``None`` beside such a check (``attn_mask=``),
    fixed only where the examples said ``None`` (without examples, a default may be a tensor).
    """
    placeholders = {n.target: bool(n.users) for n in gm.graph.nodes if n.op == "placeholder"}
    return {name: None for name, value in constant_inputs(model, example_inputs, example_kwargs, concrete_args).items()
            if value is None and name in placeholders and (read_too or not placeholders[name])}


def refuse_name_clash(model: nn.Module, fixed: dict[str, Any] | None) -> None:
    """Raise ``TraceError`` where a fixed input ``mask`` has a namesake input ``mask_1``.

    torch.fx names the placeholder of a fixed input ``mask`` ``mask_1``; a forward that has an
    input of that name too gets two arguments named alike, a ``SyntaxError`` in fx's code.
    """
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return
    for name, value in (fixed or {}).items():
        if f"{name}_1" in params:
            raise TraceError(
                f"{type(model).__name__}.forward has inputs '{name}' and '{name}_1', and '{name}' is fixed to "
                f"{value!r} for tracing (the example's value, as eager runs it): torch.fx names the placeholder of a "
                f"fixed '{name}' '{name}_1' too and cannot build the graph. Rename the input '{name}_1', pass "
                f"'{name}' a value of its own in the example if the pipe will take one, or use tracer='export'")


def unread_none_entries(model: nn.Module, gm: torch.fx.GraphModule, example_inputs: Any,
                        example_kwargs: dict[str, Any] | None) -> list[str]:
    """Return the entries of container inputs (``batch["extra"]``) that are ``None`` in the example and read by nothing.

    The graph takes such an entry out of its input and uses it nowhere: a check ``is not None``
    on it held while traced (its branch kept, which eager skips), or it is read and dropped.
    """
    try:
        bound = inspect.signature(model.forward).bind_partial(*_as_args(example_inputs), **(example_kwargs or {}))
    except (TypeError, ValueError):
        return []
    found = []
    for node in gm.graph.nodes:
        value = bound.arguments.get(node.target) if node.op == "placeholder" else None
        if not isinstance(value, (dict, list, tuple)):
            continue
        for user in node.users:
            key = _constant_key(user)
            if key is _NO_KEY or user.users:
                continue
            try:
                entry = value[key]
            except (KeyError, IndexError, TypeError):
                continue
            if entry is None:
                found.append(f"{node.target}[{key!r}]")
    return found


_NO_KEY = object()


def _constant_key(node: torch.fx.Node) -> Any:
    """Return the constant key ``node`` reads its input at (``x[k]``, ``x.get(k)``), or ``_NO_KEY``."""
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[1], (str, int)):
        return node.args[1]
    if node.op == "call_method" and node.target == "get" and len(node.args) > 1 and isinstance(node.args[1], str):
        return node.args[1]
    return _NO_KEY


def _as_args(example_inputs: Any) -> tuple:
    """Return the example inputs as a tuple of positional inputs."""
    return example_inputs if isinstance(example_inputs, tuple) else (() if example_inputs is None else (example_inputs,))
