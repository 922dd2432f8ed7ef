"""Modules the user compiled with ``torch.compile`` before handing them to fxpipe.

``torch.compile(module)`` returns an ``OptimizedModule`` wrapping the module as ``_orig_mod``.
A whole compiled model is pipelined as the module it wraps (its state-dict keys without the
``_orig_mod.`` prefix); fxpipe compiles stages itself with ``torch_compile=``. A compiled
submodule is kept as one call under fx (which cannot trace dynamo's frames), so it runs
compiled inside its stage.
"""

from __future__ import annotations

import sys
import warnings

from torch import nn

__all__ = ["is_compiled_module", "unwrap_compiled"]


def is_compiled_module(module: nn.Module) -> bool:
    """Tell whether ``module`` is what ``torch.compile(module)`` returned."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # nothing was compiled before it is imported
    return eval_frame is not None and isinstance(module, eval_frame.OptimizedModule)


def unwrap_compiled(model: nn.Module, stages_compiled: bool = False) -> nn.Module:
    """Return the module a ``torch.compile``'d model wraps, warning that fxpipe compiles stages itself."""
    if not is_compiled_module(model):
        return model
    inner = model._orig_mod
    assert isinstance(inner, nn.Module), "torch.compile wraps a module as _orig_mod"
    fix = ("torch_compile= compiles each stage instead" if stages_compiled else
           "To compile each stage, pass fxpipe.compile(..., torch_compile=True) or a dict of torch.compile's "
           "arguments")
    warnings.warn(f"fxpipe got a torch.compile'd {type(inner).__name__}: it pipelines the module that wraps "
                  f"(state-dict keys without '_orig_mod.'), and torch.compile's options do not apply. {fix} "
                  "(docs/guide/compiled.md)", stacklevel=3)
    return inner
