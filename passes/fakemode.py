"""Make the fake-tensor mode the passes run a graph under, and keep torch's dispatch cache bounded.

Reads the module's attributes (for TorchScript objects); writes nothing on the graph.
torch's fake-tensor dispatch cache is one for every fake mode, keyed partly by the arguments
of each call. A quantized module's packed parameters (a TorchScript object) hash but cannot
be compared: the second trace of the same model finds the first's entry under that hash and
fails in ``__eq__``. A graph holding such objects runs with the cache off.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

__all__ = ["bound_dispatch_cache", "fake_mode"]

_DISPATCH_CACHE_LIMIT = 8192  # entries of torch's fake-tensor dispatch cache kept before it is cleared


def fake_mode(gm: torch.nn.Module) -> FakeTensorMode:
    """Return a fake mode taking real inputs, with torch's dispatch cache off if ``gm`` holds TorchScript objects."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    if _holds_script_objects(gm):
        mode.cache_enabled = False
    return mode


def _holds_script_objects(gm: torch.nn.Module) -> bool:
    """Tell whether a submodule of ``gm`` holds a TorchScript object (a quantized module's packed parameters)."""
    return any(isinstance(v, torch._C.ScriptObject) for m in gm.modules() for v in vars(m).values())


def bound_dispatch_cache() -> None:
    """Clear torch's fake-tensor dispatch cache once it holds more than a bound of entries.

    The cache is torch's, one for every fake mode, keyed by shapes and never emptied: a job
    meeting a new sequence length at every step grew the first stage's rank by ~240 kB a step
    (a tiny decoder; more nodes, more), past fxpipe's own bounded cache of layouts.
    """
    if len(FakeTensorMode.cache) > _DISPATCH_CACHE_LIMIT:
        FakeTensorMode.cache_clear()
