"""Check that pipelining a model changed nothing: outputs and gradients equal eager.

``assert_pipeline_equivalent`` is meant for users' own test suites; the pytest plugin
(:mod:`fxpipe.testing.plugin`, registered as an entry point) offers it as a fixture. It checks
both ways of training a pipe: ``pipe(x)`` with the caller's ``backward``, and ``pipe.step``
under each schedule asked for (a fresh pipe per schedule, since the schedule is fixed at
compile time). When ``pipe(x)`` differs, the assertion message names the first stage and
node where values diverge (:mod:`fxpipe.tools.diverge`).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from fxpipe import compiler
from fxpipe.options import SINGLE_STAGE_SCHEDULES
from fxpipe.passes.spec import differentiable
from fxpipe.pipe import Pipe
from fxpipe.testing.arbiter import LOW_PRECISION, exact_values, to_float64, within_eager_rounding

__all__ = ["assert_pipeline_equivalent", "default_loss", "default_step_loss", "default_tolerance",
           "max_relative_error"]

logger = logging.getLogger(__name__)

# rtol (relative to each tensor's largest eager magnitude) and atol per dtype: micro-batching
# reorders float sums, and a gradient accumulated over micro-batches rounds once per chunk.
_TOLERANCE = {
    torch.float64: (1e-10, 1e-12),
    torch.float32: (1e-5, 1e-6),
    torch.float16: (4e-3, 1e-3),
    torch.bfloat16: (3e-2, 1e-2),
}


def default_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """Return the (rtol, atol) that ``assert_pipeline_equivalent`` uses for ``dtype``."""
    return _TOLERANCE.get(dtype, _TOLERANCE[torch.float32])


def default_loss(output: Any) -> torch.Tensor:
    """Reduce every floating (and complex) tensor of an output to one scalar with fixed random weights."""
    leaves = _real_leaves(output)
    total: Any = 0.0
    for k, t in enumerate(leaves):
        g = torch.Generator().manual_seed(1234 + k)  # drawn in float32 for every dtype: the same weights in float64
        w = torch.randn(t.shape, generator=g).to(t.device, t.dtype)
        total = total + (t * w).sum()
    return total


def _real_leaves(output: Any, batched: bool = False) -> list[torch.Tensor]:
    """Return the output's floating tensors (with a batch dim if ``batched``), complex ones as real views."""
    return [torch.view_as_real(t) if t.is_complex() else t for t in tree_flatten(output)[0]
            if isinstance(t, torch.Tensor) and differentiable(t.dtype) and (t.dim() > 0 or not batched)]


def default_step_loss(output: Any, target: Any = None) -> torch.Tensor:
    """Average over the batch a fixed random weighting of every floating output (``target`` unused).

    The weights depend only on each tensor's shape past dim 0, so the loss of a batch is the
    row-weighted mean of its micro-batches' losses, as :meth:`fxpipe.Pipe.step` needs.
    """
    leaves = _real_leaves(output, batched=True)
    total: Any = 0.0
    for k, t in enumerate(leaves):
        g = torch.Generator().manual_seed(4321 + k)
        w = torch.randn(t.shape[1:], generator=g).to(t.device, t.dtype)
        total = total + (t * w).sum() / t.shape[0]
    return total


def assert_pipeline_equivalent(model: nn.Module, example_inputs: tuple = (), *, n_stages: int = 2,
                               chunks: int = 1, checkpoint: str | Sequence[str] = "except_last",
                               example_kwargs: dict | None = None, rtol: float | None = None,
                               atol: float | None = None,
                               loss: Callable[[Any], torch.Tensor] = default_loss,
                               schedules: Sequence[str] | None = None,
                               step_loss: Callable[[Any, Any], torch.Tensor] = default_step_loss,
                               target: Any = None,
                               diagnose: bool = True, **compile_kwargs: Any) -> Pipe:
    """Compile ``model`` and assert outputs and every parameter's gradient equal eager's.

    Two checks: ``pipe(x)`` followed by ``loss(output).backward()``, and ``pipe.step(x,
    target=target, loss_fn=step_loss)`` under each of ``schedules`` (default: the
    ``schedule=`` given, else each of ``"gpipe"``, ``"1f1b"`` and ``"zb"``; ``()`` skips
    them), against ``step_loss(model(x), target).backward()``. ``step_loss`` must average
    over the batch (a mean-reduced loss), as :meth:`fxpipe.Pipe.step` requires; the default
    weights every floating output with fixed random numbers.

    The eager reference runs on a deep copy of ``model``; ``model`` itself is compiled, so
    it is moved to the stages' devices (each ``pipe.step`` check compiles another deep copy).
    Each tensor is compared with ``rtol`` relative to its largest eager magnitude
    (micro-batching changes the order of float sums, so elements that cancel to near zero
    carry the rounding of their larger terms), or ``atol``, whichever is larger (for
    gradients, ``atol`` defaults to the smaller of the dtype's and its epsilon times the
    model's largest gradient: each gradient is held to its own scale); by default both follow
    the tensor's dtype (:func:`default_tolerance`). Where a low-precision value differs and
    neither is given, a float64 run of the model settles it (:mod:`~fxpipe.testing.arbiter`):
    a gradient that is zero in exact arithmetic, such as a bias before a normalization, holds
    only rounding, as eager's does. The model's existing gradients are dropped first. Mappings of
    different types with the same keys (a tracer's ``dict`` for a ``ModelOutput``) compare
    equal. On a difference, the message names the first stage and node where values diverge
    (``diagnose=False`` skips that). Returns the compiled pipe (the one of ``pipe(x)``).
    """
    kwargs = example_kwargs or {}
    for p in model.parameters():  # what an earlier call or training left is no part of the comparison
        p.grad = None
    if schedules is None:
        schedules = (compile_kwargs["schedule"],) if "schedule" in compile_kwargs else SINGLE_STAGE_SCHEDULES
    pristine = _copy(model) if schedules else None
    reference = _copy(model)
    # each run gets its own copy of the inputs, in case the model changes them in place
    with _seeded():
        expected = reference(*_clone(example_inputs), **_clone(kwargs))
        loss(expected).backward()

    pipe = compiler.compile(model, n_stages, example_inputs=example_inputs, example_kwargs=kwargs,
                          chunks=chunks, checkpoint=checkpoint, **compile_kwargs)
    with _seeded():
        actual = pipe(*_clone(example_inputs), **_clone(kwargs))
        loss(actual).backward()

    failure = _first_difference(expected, actual, reference, model, rtol, atol)
    if failure is not None and _arbitrated(rtol, atol, expected):
        exact = exact_values(_copy(reference), _clone(example_inputs), _clone(kwargs), loss, _seeded)
        failure = _first_difference(expected, actual, reference, model, rtol, atol, exact)
    if failure is not None:
        if diagnose:
            from fxpipe.tools.diverge import divergence

            d_rtol, d_atol = default_tolerance(_dtype(expected))  # each defaults alone, as in _difference
            failure += "\n" + divergence(pipe, reference, example_inputs, kwargs, d_rtol if rtol is None else rtol,
                                         d_atol if atol is None else atol, loss)
        raise AssertionError(failure)
    if pristine is not None:
        compile_kwargs = {k: v for k, v in compile_kwargs.items() if k != "schedule"}
        failure = _step_difference(pristine, example_inputs, kwargs, schedules, step_loss, target,
                                   rtol, atol, dict(n_stages=n_stages, chunks=chunks,
                                                    checkpoint=checkpoint, **compile_kwargs))
        if failure is not None:
            raise AssertionError(failure)
    return pipe


def _copy(model: nn.Module) -> nn.Module:
    """Deep-copy a model without its gradients, keeping its training mode."""
    clone = copy.deepcopy(model)
    if clone.training != model.training:  # torchvision's DualGraphModule loses its mode in a copy
        clone.train(model.training)
    for p in clone.parameters():
        p.grad = None
    return clone


def _step_difference(pristine: nn.Module, inputs: tuple, kwargs: dict, schedules: Sequence[str],
                     step_loss: Callable, target: Any, rtol: float | None, atol: float | None,
                     compile_kwargs: dict) -> str | None:
    """Run ``pipe.step`` under each schedule on a fresh copy; describe the first difference, or None."""
    reference = _copy(pristine)
    with _seeded():
        expected = step_loss(reference(*_clone(inputs), **_clone(kwargs)), target)
    if not (isinstance(expected, torch.Tensor) and expected.requires_grad):
        return None  # nothing to differentiate: no floating output depends on a parameter
    expected.backward()
    exact: dict[str, torch.Tensor] | None = None
    for schedule in schedules:
        model = _copy(pristine)
        pipe = compiler.compile(model, example_inputs=inputs, example_kwargs=kwargs, schedule=schedule,
                              **compile_kwargs)
        with _seeded():
            actual = pipe.step(*_clone(inputs), target=target, loss_fn=step_loss, **_clone(kwargs))
        problem = (_difference(actual.detach(), expected.detach(), rtol, atol, "the loss")
                   or _grad_difference(reference, model, rtol, atol))
        if problem and _arbitrated(rtol, atol, expected):
            if exact is None:
                exact = exact_values(_copy(pristine), _clone(inputs), _clone(kwargs),
                                     functools.partial(_step_loss_on, step_loss, to_float64(target)), _seeded) or {}
            problem = (_difference(actual.detach(), expected.detach(), rtol, atol, "the loss", exact)
                       or _grad_difference(reference, model, rtol, atol, exact))
        if problem:
            return f"pipe.step with schedule={schedule!r}: {problem}"
    return None


@contextlib.contextmanager
def _seeded(seed: int = 0) -> Any:
    """Draw from a fixed seed, restoring the caller's random state after: eager and the pipe see the same."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        yield


def _clone(value: Any) -> Any:
    """Return ``value`` with every tensor in it cloned."""
    return tree_map(lambda t: t.detach().clone().requires_grad_(t.requires_grad)
                    if isinstance(t, torch.Tensor) else t, value)


def _step_loss_on(step_loss: Callable, target: Any, output: Any) -> torch.Tensor:
    """Return ``step_loss(output, target)`` (a step loss with its target bound, for the float64 run)."""
    return step_loss(output, target)


def _arbitrated(rtol: float | None, atol: float | None, expected: Any) -> bool:
    """Tell whether a float64 run may settle a difference: default tolerances, a low-precision output."""
    return rtol is None and atol is None and _dtype(expected) in LOW_PRECISION


def _dtype(output: Any) -> torch.dtype:
    """Return the dtype of an output's first floating tensor (float32 if none)."""
    floats = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return floats[0].dtype if floats else torch.float32


def _first_difference(expected: Any, actual: Any, reference: nn.Module, model: nn.Module,
                      rtol: float | None, atol: float | None,
                      exact: Mapping[str, torch.Tensor] | None = None) -> str | None:
    """Return a message for the first output or gradient that differs from eager, or None."""
    problem = _structure_difference(expected, actual)
    if problem:
        return problem
    for k, (e, a) in enumerate(zip(tree_flatten(expected)[0], tree_flatten(actual)[0])):
        if isinstance(e, torch.Tensor):
            problem = _difference(a.detach(), e.detach(), rtol, atol, f"output leaf {k}", exact)
        elif a != e:
            problem = f"output leaf {k} differs from eager: {a!r} != {e!r}"
        if problem:
            return problem
    return _grad_difference(reference, model, rtol, atol, exact)


def _grad_difference(reference: nn.Module, model: nn.Module, rtol: float | None,
                     atol: float | None, exact: Mapping[str, torch.Tensor] | None = None) -> str | None:
    """Return a message for the first parameter whose gradient differs from eager's, or None."""
    ref_params = dict(reference.named_parameters())
    grads = [q.grad for q in ref_params.values() if q.grad is not None and q.grad.is_floating_point()]
    if grads and atol is None:  # each gradient at rtol of its own scale, above a floor for gradients that are
        # zero in exact arithmetic (a bias before a norm: the float64 run settles what exceeds it); rtol of the
        # largest gradient as the floor let a 33x smaller gradient be zeroed unnoticed in bfloat16
        dtype = grads[0].dtype
        eps = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
        atol = min(default_tolerance(dtype)[1], eps * max(g.abs().max().item() for g in grads))
    for name, p in model.named_parameters():
        q = ref_params[name]
        if q.grad is None:
            if p.grad is not None and p.grad.any():
                return f"{name} has a gradient that eager lacks"
            continue
        if p.grad is None:
            return f"{name} got no gradient through the pipeline"
        problem = _difference(p.grad, q.grad, rtol, atol, f"gradient of {name}", exact)
        if problem:
            return problem
    return None


def _structure_difference(expected: Any, actual: Any) -> str | None:
    """Describe how two outputs' structures differ (mappings compare by keys), or None."""
    if isinstance(expected, Mapping) and isinstance(actual, Mapping):
        if list(expected.keys()) != list(actual.keys()):
            return f"output keys differ: eager {list(expected.keys())}, pipeline {list(actual.keys())}"
        for key in expected:
            problem = _structure_difference(expected[key], actual[key])
            if problem:
                return f"under key {key!r}: {problem}"
        return None
    if isinstance(expected, (tuple, list)) and isinstance(actual, (tuple, list)) \
            and type(expected) is type(actual) and len(expected) == len(actual):
        for k, (e, a) in enumerate(zip(expected, actual)):
            problem = _structure_difference(e, a)
            if problem:
                return f"at index {k}: {problem}"
        return None
    exp_spec, act_spec = tree_flatten(expected)[1], tree_flatten(actual)[1]
    if exp_spec != act_spec:
        return f"output structure differs: eager {exp_spec}, pipeline {act_spec}"
    return None


def max_relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Return max |actual - expected| over max |expected| (0 for two zero tensors)."""
    actual, expected = actual.cpu().double(), expected.cpu().double()
    scale = expected.abs().max().item() if expected.numel() else 0.0
    diff = (actual - expected).abs().max().item() if expected.numel() else 0.0
    return diff / scale if scale else diff


def _difference(actual: torch.Tensor, expected: torch.Tensor, rtol: float | None, atol: float | None,
                what: str, exact: Mapping[str, torch.Tensor] | None = None) -> str | None:
    """Describe how two tensors differ beyond ``rtol`` of the expected scale or ``atol``, or None.

    With ``exact`` (a float64 run's values by label), a difference within eager's own rounding passes.
    """
    if actual.shape != expected.shape:
        return f"{what}: shape {tuple(actual.shape)} != eager {tuple(expected.shape)}"
    if actual.dtype != expected.dtype:
        return f"{what}: dtype {actual.dtype} != eager {expected.dtype}"
    d_rtol, d_atol = default_tolerance(expected.dtype)
    rtol = d_rtol if rtol is None else rtol
    atol = d_atol if atol is None else atol
    scale = expected.abs().max().item() if expected.numel() and differentiable(expected.dtype) else 0.0
    tolerance = max(atol, rtol * scale)
    try:
        torch.testing.assert_close(actual.cpu(), expected.cpu(), rtol=0.0, atol=tolerance)
    except AssertionError as exc:
        if exact is None:
            return f"{what} differs from eager: {exc}"
        ok, note = within_eager_rounding(actual, expected, exact.get(what), tolerance)
        if ok:
            logger.info("%s differs from eager within eager's own rounding: %s", what, note)
            return None
        return f"{what} differs from eager: {exc}" + (f"\n{note}" if note else "")
    return None
