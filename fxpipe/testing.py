"""Check that pipelining a model changed nothing: outputs and gradients equal eager."""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

import fxpipe

__all__ = ["assert_pipeline_equivalent", "default_loss", "max_relative_error"]


def default_loss(output: Any) -> torch.Tensor:
    """Reduce every floating tensor of an output to one scalar with fixed random weights."""
    leaves = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
    total = 0.0
    for k, t in enumerate(leaves):
        g = torch.Generator().manual_seed(1234 + k)
        w = torch.randn(t.shape, generator=g, dtype=t.dtype).to(t.device)
        total = total + (t * w).sum()
    return total


def assert_pipeline_equivalent(model: nn.Module, example_inputs: tuple, *, n_stages: int = 2,
                               chunks: int = 1, checkpoint: str = "except_last",
                               example_kwargs: dict | None = None, rtol: float = 1e-5,
                               atol: float = 1e-6, loss: Callable[[Any], torch.Tensor] = default_loss,
                               **compile_kwargs: Any) -> "fxpipe.Pipe":
    """Compile ``model`` and assert outputs and every parameter's gradient equal eager's.

    The eager reference runs on a deep copy of ``model``; ``model`` itself is compiled, so
    it is moved to the stages' devices. Each tensor is compared with ``rtol`` relative to its
    largest eager magnitude (micro-batching changes the order of float sums, so elements that
    cancel to near zero carry the rounding of their larger terms), or ``atol``, whichever is
    larger. Returns the compiled pipe.
    """
    kwargs = example_kwargs or {}
    reference = copy.deepcopy(model)
    expected = reference(*example_inputs, **kwargs)
    loss(expected).backward()

    pipe = fxpipe.compile(model, n_stages, example_inputs=example_inputs, example_kwargs=kwargs,
                          chunks=chunks, checkpoint=checkpoint, **compile_kwargs)
    actual = pipe(*example_inputs, **kwargs)
    loss(actual).backward()

    exp_leaves, exp_spec = tree_flatten(expected)
    act_leaves, act_spec = tree_flatten(actual)
    assert exp_spec == act_spec, f"output structure differs: eager {exp_spec}, pipeline {act_spec}"
    for k, (e, a) in enumerate(zip(exp_leaves, act_leaves)):
        if isinstance(e, torch.Tensor):
            _assert_close(a.detach(), e.detach(), rtol, atol, f"output leaf {k}")
        else:
            assert a == e, f"output leaf {k} differs from eager: {a!r} != {e!r}"
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        q = ref_params[name]
        if q.grad is None:
            assert p.grad is None or not p.grad.any(), f"{name} has a gradient that eager lacks"
            continue
        assert p.grad is not None, f"{name} got no gradient through the pipeline"
        _assert_close(p.grad, q.grad, rtol, atol, f"gradient of {name}")
    return pipe


def max_relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Return max |actual - expected| over max |expected| (0 for two zero tensors)."""
    actual, expected = actual.cpu().double(), expected.cpu().double()
    scale = expected.abs().max().item() if expected.numel() else 0.0
    diff = (actual - expected).abs().max().item() if expected.numel() else 0.0
    return diff / scale if scale else diff


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float, what: str) -> None:
    """Assert two tensors agree to ``rtol`` of the expected tensor's scale, or ``atol``."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != eager {tuple(expected.shape)}"
    scale = expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(actual.cpu(), expected.cpu(), rtol=0.0, atol=max(atol, rtol * scale),
                               msg=lambda m: f"{what} differs from eager: {m}")
