"""Choose the inputs torch.fx should fix to constants where a model does not trace with them as inputs.

torch.fx traces every input of ``forward`` as a tensor, so a flag (``if not return_dict:``) or
an input left at its ``None`` default (``if class_labels is not None:``) breaks the trace or
takes the branch eager does not. Hugging Face's tracer fixes the inputs not given; fxpipe does
so only where the plain trace failed, for plain constants: a flag, a string or ``None`` given in
the example inputs, or left at such a default. The pipe then takes no other value for them
(:func:`fxpipe.passes.bind_placeholders` says so).
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

__all__ = ["constant_inputs"]

_PARAMETER = inspect.Parameter


def constant_inputs(model: nn.Module, example_inputs: Any, example_kwargs: dict[str, Any] | None,
                    concrete_args: dict[str, Any] | None) -> dict[str, Any]:
    """Return forward's inputs to fix: the constants given in the examples, and those left at a constant default."""
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):  # a builtin's forward: nothing to read
        return {}
    args = example_inputs if isinstance(example_inputs, tuple) else (
        () if example_inputs is None else (example_inputs,))
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
