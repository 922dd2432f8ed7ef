"""A float64 run of the model that settles a float32 difference: whose rounding is it?

A gradient summing many terms that cancel (a convolution's bias over every position of the
batch) carries float32 rounding of the size of ``assert_pipeline_equivalent``'s tolerance in
eager itself; micro-batching sums the same terms in another order and rounds otherwise. When
the pipeline and eager differ, :func:`exact_values` runs a float64 copy of the model on the
same inputs, and :func:`within_eager_rounding` accepts the pipeline's value if it is as close
to the float64 value as eager's own is (up to a factor of 4, plus the tolerance):

    eager ──e──▶ exact ◀──p── pipeline       accept when p <= 4 e + tolerance

A real defect (a wrong skip, a lost gradient) is off by far more than eager's rounding, so it
still fails. Random numbers are drawn per dtype, so a model that draws them from the default
generators (dropout in training mode, ``randn_like`` noise) gets no float64 values, and its
difference stands.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from fxpipe.runtime.stage.rng import held_generators

__all__ = ["LOW_PRECISION", "exact_values", "to_float64", "within_eager_rounding"]

logger = logging.getLogger(__name__)

LOW_PRECISION = (torch.float32, torch.float16, torch.bfloat16)


def to_float64(value: Any) -> Any:
    """Return ``value`` with every low-precision floating tensor in float64 (requires_grad kept)."""
    return tree_map(lambda t: t.detach().double().requires_grad_(t.requires_grad)
                    if isinstance(t, torch.Tensor) and t.dtype in LOW_PRECISION else t, value)


def exact_values(model: nn.Module, inputs: tuple, kwargs: dict, loss: Callable[[Any], torch.Tensor],
                 seeded: Callable[[], Any]) -> dict[str, torch.Tensor] | None:
    """Run ``model`` (a fresh copy without gradients, made float64 here) forward and backward; return its values.

    The values are keyed by the report's labels: ``"output leaf k"``, ``"the loss"`` and
    ``"gradient of NAME"``. None where the model cannot run in float64.
    """
    model = model.double()
    try:
        with seeded():
            generators = [g for m in model.modules() for g in held_generators(m)] + held_generators((inputs, kwargs))
            before = _random_state(generators)
            out = model(*to_float64(inputs), **to_float64(kwargs))
            drew = not all(torch.equal(a, b) for a, b in zip(before, _random_state(generators)))
            value = loss(out)
            value.backward()
    except Exception as exc:  # noqa: BLE001 - an op without float64 kernels: no arbiter, the difference stands
        logger.info("no float64 run to settle the difference: %s: %s", type(exc).__name__, exc)
        return None
    if drew:  # other numbers than float32's (randn_like noise): eager would look far off, passing anything
        logger.info("no float64 run to settle the difference: the model draws random numbers")
        return None
    exact = {f"output leaf {k}": t.detach() for k, t in enumerate(tree_flatten(out)[0])
             if isinstance(t, torch.Tensor)}
    exact["the loss"] = value.detach()
    exact.update({f"gradient of {n}": p.grad for n, p in model.named_parameters() if p.grad is not None})
    return exact


def _random_state(generators: list[torch.Generator]) -> list[torch.Tensor]:
    """Return the generators' states: the CPU's, the current CUDA device's once CUDA is in use, then ``generators``'."""
    return [torch.get_rng_state(), *([torch.cuda.get_rng_state()] if torch.cuda.is_initialized() else []),
            *(g.get_state() for g in generators)]


def within_eager_rounding(actual: torch.Tensor, expected: torch.Tensor, exact: torch.Tensor | None,
                          tolerance: float) -> tuple[bool, str]:
    """Tell whether ``actual`` is as close to ``exact`` as eager's ``expected`` is; say how close both are."""
    if exact is None or exact.shape != expected.shape or not expected.is_floating_point():
        return False, ""
    exact = exact.detach().cpu()
    eager = (expected.detach().cpu().double() - exact).abs().max().item() if exact.numel() else 0.0
    pipeline = (actual.detach().cpu().double() - exact).abs().max().item() if exact.numel() else 0.0
    note = (f"against a float64 run of the model, eager is {eager:.3g} off and the pipeline {pipeline:.3g} "
            f"(a pass needs the pipeline within 4x eager's distance plus {tolerance:.3g})")
    return pipeline <= 4 * eager + tolerance, note
