"""What a weights source is, and the sources that are one file or one mapping.

    WeightSource      tensors by FQN: shapes and dtypes up front (:meth:`specs`), data on demand
    MappingSource     {fqn: tensor}, as given
    TorchFile         a torch.save file, opened with mmap=True; a tensor's pages go once copied
    SafetensorsFile   a safetensors file (the optional ``safetensors`` package)

Directories of such files (Hugging Face shards, checkpoints) are in :mod:`fxpipe.materialize.weights`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fxpipe.errors import WeightsError
from fxpipe.materialize.pages import copy_dropping

__all__ = ["MappingSource", "SafetensorsFile", "Spec", "TorchFile", "WeightSource"]

_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
              "I32": "int32", "I16": "int16", "I8": "int8", "U64": "uint64", "U32": "uint32", "U16": "uint16",
              "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E4M3FNUZ": "float8_e4m3fnuz",
              "F8_E5M2": "float8_e5m2", "F8_E5M2FNUZ": "float8_e5m2fnuz", "C64": "complex64"}

Spec = tuple[tuple[int, ...], torch.dtype]


class WeightSource:
    """Tensors by FQN: their shapes and dtypes up front, their data on demand."""

    description = "weights"

    def specs(self) -> dict[str, Spec]:
        """Return ``{fqn: (shape, dtype)}`` for every tensor the source holds, reading no data."""
        raise NotImplementedError

    def read(self, into: Mapping[str, torch.Tensor]) -> None:
        """Copy the source's tensor ``fqn`` into ``into[fqn]`` for every key of ``into``."""
        raise NotImplementedError

    def fit(self, names: set[str]) -> None:
        """Learn the model's FQNs before :meth:`specs`, where the source's naming is ambiguous."""

    def close(self) -> None:
        """Release open files."""


class MappingSource(WeightSource):
    """A state dict given as a mapping."""

    def __init__(self, state: Mapping[str, Any]) -> None:
        bad = [k for k, v in state.items() if not isinstance(v, torch.Tensor)]
        if bad:
            raise WeightsError(f"weights= maps {bad[:5]} to values that are not tensors; give a "
                               "state dict {fqn: tensor}")
        self.state = state
        self.description = "the weights mapping"

    def specs(self) -> dict[str, Spec]:
        """Return every tensor's shape and dtype."""
        return {k: (tuple(v.shape), v.dtype) for k, v in self.state.items()}

    def read(self, into: Mapping[str, torch.Tensor]) -> None:
        """Copy the asked tensors."""
        with torch.no_grad():
            for key, target in into.items():
                target.copy_(self.state[key])


class TorchFile(WeightSource):
    """A ``torch.save`` file of a state dict, memory-mapped."""

    def __init__(self, path: str) -> None:
        with open(path, "rb") as f:
            head = f.read(4)
        if not head.startswith((b"PK", b"\x80")):  # a zip (torch.save), or a pickle (its legacy format)
            raise WeightsError(f"weights={path!r} is not a weights file (it starts {head!r}): pass a .safetensors file, "
                               "a torch.save file of a state dict, a directory of them (Hugging Face's "
                               "save_pretrained), or a checkpoint fxpipe.save wrote")
        try:
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except Exception as exc:  # noqa: BLE001 - re-raised naming the file
            raise WeightsError(f"weights={path!r} cannot be read as a torch.save file: {exc}") from None
        if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise WeightsError(f"weights={path!r} holds a {type(state).__name__}, not a state dict "
                               "{fqn: tensor}; save model.state_dict()")
        self.state = state
        self.description = f"weights file {path!r}"

    def specs(self) -> dict[str, Spec]:
        """Return every tensor's shape and dtype (from the file's index; no data read)."""
        return {k: (tuple(v.shape), v.dtype) for k, v in self.state.items()}

    def read(self, into: Mapping[str, torch.Tensor]) -> None:
        """Copy the asked tensors, giving their file pages back as they go (they count as resident)."""
        with torch.no_grad():
            for key, target in into.items():
                copy_dropping(target, self.state[key])

    def close(self) -> None:
        """Unmap the file."""
        self.state = {}


class SafetensorsFile(WeightSource):
    """A safetensors file (needs the optional ``safetensors`` package)."""

    def __init__(self, path: str) -> None:
        try:
            from safetensors import safe_open
        except ImportError:
            raise WeightsError(f"weights={path!r} is a safetensors file; install the optional "
                               "dependency: pip install safetensors") from None
        self.file: Any = safe_open(path, framework="pt", device="cpu")
        self.description = f"weights file {path!r}"

    def specs(self) -> dict[str, Spec]:
        """Return every tensor's shape and dtype from the file's header."""
        out = {}
        for key in self.file.keys():  # noqa: SIM118 - a safetensors handle, not a dict
            piece = self.file.get_slice(key)
            name = piece.get_dtype()
            dtype = getattr(torch, _ST_DTYPES.get(name, ""), None)
            if not isinstance(dtype, torch.dtype):
                raise WeightsError(f"{self.description} holds '{key}' of safetensors dtype {name}, which "
                                   f"this torch has no dtype for")
            out[key] = (tuple(piece.get_shape()), dtype)
        return out

    def read(self, into: Mapping[str, torch.Tensor]) -> None:
        """Copy the asked tensors, one at a time."""
        with torch.no_grad():
            for key, target in into.items():
                target.copy_(self.file.get_tensor(key))

    def close(self) -> None:
        """Close the file."""
        self.file = None
