"""Put back the Python state a model's forward left holding fx proxies while it was traced.

A forward that caches a value in a plain attribute (timm's LeViT keeps its attention biases in
``attention_bias_cache`` in eval mode, filled on first use) fills it, while fx traces it, with a
``Proxy`` (under torch.export, a fake tensor): the user's model then held one after
``fxpipe.compile``, and failed in its next eval call or ``torch.save(model)``.
:func:`no_proxies_left` snapshots every module's attributes (containers by their contents)
and puts back each that holds a tracing value after the block.

A forward that flips a flag of its module (Glow's ActNorm: ``if not self.initialized:``, the
parameters set from the batch, then ``self.initialized = True``) ran that branch while fx traced
it: the graph holds the initialisation, which every step would run again on each micro-batch,
and the flag said the module was set up though no batch had reached it. :func:`flags_kept`
puts such a flag back and names it, for the caller to warn of.

Reads and writes the modules' ``__dict__``, but their parameters, buffers and submodules.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

__all__ = ["flags_kept", "no_proxies_left"]

_OWN = frozenset({"_parameters", "_buffers", "_modules"})


@contextmanager
def no_proxies_left(model: nn.Module) -> Iterator[None]:
    """Run the block; then put back every module attribute it left holding an fx proxy."""
    before = {id(m): {k: (v, _contents(v)) for k, v in vars(m).items() if k not in _OWN} for m in model.modules()}
    try:
        yield
    finally:
        for m in model.modules():
            was = before.get(id(m), {})
            for k in [k for k, v in vars(m).items() if k not in _OWN and _holds_proxy(v)]:
                if k not in was:
                    delattr(m, k)
                    continue
                value, contents = was[k]
                if contents is not None and value is vars(m)[k]:  # a container filled in place: refill it
                    value.clear()
                    if isinstance(value, list):
                        value.extend(contents)
                    else:
                        value.update(contents)
                else:
                    m.__dict__[k] = value


def _contents(value: Any) -> Any:
    """Return a shallow copy of a dict, list or set (what it holds now); None for anything else."""
    return copy.copy(value) if type(value) in (dict, list, set) else None


def _holds_proxy(value: Any) -> bool:
    """Tell whether ``value`` is a tracing value or a dict, list, tuple or set holding one (one level deep)."""
    if type(value) is dict:
        return any(_traced(v) for v in value.values())
    if type(value) in (list, tuple, set):
        return any(_traced(v) for v in value)
    return _traced(value)


def _traced(value: Any) -> bool:
    """Tell whether ``value`` exists only while tracing: an fx proxy, a fake or functional tensor."""
    return isinstance(value, (torch.fx.Proxy, FakeTensor, FunctionalTensor))


@contextmanager
def flags_kept(model: nn.Module, changed: list[str]) -> Iterator[None]:
    """Run the block; then put back every bool attribute of a module it flipped, naming each in ``changed``."""
    names = {id(m): name for name, m in model.named_modules()}
    before = {id(m): {k: v for k, v in vars(m).items() if type(v) is bool and k != "training"} for m in model.modules()}
    try:
        yield
    finally:
        for m in model.modules():
            for k, was in before.get(id(m), {}).items():
                now = vars(m).get(k, was)
                if now is not was:
                    m.__dict__[k] = was
                    prefix = names.get(id(m), "")
                    changed.append(f"'{prefix + '.' if prefix else ''}{k}' ({type(m).__name__}: {was} -> {now})")
