"""Tell a model that fails on its example inputs outside torch.export from one export cannot trace.

torch.export runs the model's code on the example inputs; when that code raises (a
``ValueError`` of the model's own: T5 given ``input_ids`` without ``labels=`` or
``decoder_input_ids=``), the export refusal would read as a batch-size problem. One eager
forward on the same inputs, under ``torch.no_grad()``, tells the two apart: the same error
there is the inputs', named as such. It runs only once export has failed, with the buffers and
the parameters (values and objects), the Python state of the model's own modules and the
random state put back after it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils._pytree import tree_flatten

from fxpipe.errors import TraceError
from fxpipe.frontend.userframe import user_frame
from fxpipe.passes.untouched import modules_untouched

__all__ = ["eager_failure"]


def eager_failure(model: nn.Module, args: tuple, kwargs: dict, exc: BaseException) -> TraceError | None:
    """Return the refusal naming the inputs if ``model`` raises what export met on them eagerly too, else None."""
    frame = user_frame(exc) if type(exc).__module__ == "builtins" else None
    if frame is None or not _plain(model, args, kwargs):
        return None
    state = _State(model)
    try:
        with torch.no_grad(), modules_untouched(model), torch.random.fork_rng(devices=[]):
            model(*args, **kwargs)
    except type(exc) as again:
        if str(again).strip() != str(exc).strip():
            return None
    except Exception:  # noqa: BLE001 - another failure: nothing to tell from it
        return None
    else:
        return None
    finally:
        changed = state.put_back()
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    note = (f" (that forward changed {', '.join(changed[:3])} in place, too large to have been copied first: "
            "load the weights again)") if changed else ""
    decoder = getattr(getattr(model, "config", None), "is_encoder_decoder", False) is True and not (
        {"labels", "decoder_input_ids", "decoder_inputs_embeds"} & kwargs.keys())
    return TraceError(
        f"{type(model).__name__} raises {type(exc).__name__}: {first} at {frame.filename}:{frame.lineno} "
        f"({(frame.line or '').strip()}) on the example inputs outside torch.export too: the inputs do not fit the "
        "model, whatever the batch size. Give example inputs the model runs on eagerly"
        + (" (an encoder-decoder needs labels= or decoder_input_ids= beside input_ids)" if decoder else "")
        + f"{note}.")


class _State:
    """Each module's buffers and parameters (the objects and their values), to put back."""

    _COPY_LIMIT = 1 << 30  # parameters copied whole up to 1 GiB; above, changes in place are only told

    def __init__(self, model: nn.Module) -> None:
        self.registries: list[tuple[dict[str, Any], dict[str, Any]]] = [
            (r, dict(r)) for m in model.modules() for r in (m._buffers, m._parameters)]
        self.buffers = [(b, b.detach().clone()) for b in model.buffers()]
        params = list(model.named_parameters())
        small = sum(p.numel() * p.element_size() for _, p in params) <= self._COPY_LIMIT
        self.params = [(name, p, p._version, p.detach().clone() if small else None) for name, p in params]

    def put_back(self) -> list[str]:
        """Put the buffers and parameters back; return the parameters changed in place that were not copied."""
        lost: list[str] = []
        with torch.no_grad():
            for registry, held in self.registries:  # a buffer or a parameter reassigned (self.count += 1)
                registry.clear()
                registry.update(held)
            for b, value in self.buffers:
                b.copy_(value)
            for name, p, version, copied in self.params:  # a weight clamped in place (through .data too)
                if copied is not None:
                    if not torch.equal(p, copied):  # a write through .data leaves the version as it was
                        p.copy_(copied)
                elif p._version != version:
                    lost.append(name)
        return lost


def _plain(model: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Tell whether the model's tensors and the inputs all hold data (none on meta, none fake)."""
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    tensors += [*model.parameters(), *model.buffers()]
    return not any(t.is_meta or is_fake(t) or type(t) is not torch.Tensor and not isinstance(t, nn.Parameter)
                   for t in tensors)  # a Parameter built inside a trace is fake too
