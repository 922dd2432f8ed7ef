"""Find a model's quantized modules (``torch.ao.quantization``'s ``convert``, ``quantize_dynamic``).

Their packed parameters neither export nor run on fake tensors, and dynamic quantization picks
its inputs' range per call: the front end, the compile and the distributed build each refuse or
warn of them by name (:func:`quantized_modules`).
"""

from __future__ import annotations

from torch import nn

__all__ = ["quantized_modules"]


def quantized_modules(model: nn.Module, dynamic: bool = False) -> list[str]:
    """Return the names of the outermost quantized modules of ``model`` (dynamically quantized only, if ``dynamic``)."""
    prefix = "torch.ao.nn.quantized.dynamic" if dynamic else "torch.ao.nn.quantized"
    found: list[str] = []
    for name, m in model.named_modules():
        if type(m).__module__.startswith(prefix) and not any(name.startswith(f"{o}.") for o in found):
            found.append(name)
    return found
