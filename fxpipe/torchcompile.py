"""What ``torch_compile=`` asks of ``torch.compile`` for every stage, and the checks on it.

:func:`torch_compile_config` turns the option's value into a :class:`TorchCompile`, importing
the backend and checking ``mode`` and ``options`` against inductor, so that a backend that
cannot load is named before anything is traced. :mod:`fxpipe.options` re-exports it with
the other options.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

from fxpipe.errors import CompileError

__all__ = ["SPLIT_BACKENDS", "TORCH_COMPILE_KEYS", "TorchCompile", "torch_compile_config"]

TORCH_COMPILE_KEYS = ("backend", "mode", "dynamic", "options", "fullgraph")  # what torch_compile={...} takes
SPLIT_BACKENDS = ("inductor", "aot_eager")  # the backends whose backward fxpipe splits into I and W
_PACKAGES = {"tvm": "tvm", "openxla": "torch_xla", "openxla_eval": "torch_xla", "onnxrt": "onnxruntime",
             "tensorrt": "torch_tensorrt", "torch_tensorrt": "torch_tensorrt",
             "ipex": "intel_extension_for_pytorch"}  # a registered backend -> the package it imports lazily


@dataclass(frozen=True)
class TorchCompile:
    """What ``torch_compile=`` asks of ``torch.compile`` for every stage (checked)."""

    backend: Any = "inductor"  # a registered backend's name, or a callable backend(gm, example_inputs)
    mode: str | None = None  # inductor's mode
    dynamic: bool | None = None  # None: dim 0 static first, dynamic from a second size
    options: dict[str, Any] | None = None  # inductor's config
    fullgraph: bool = False  # refuse a stage with a graph break

    @property
    def name(self) -> str:
        """Return the backend's name, for messages."""
        return self.backend if isinstance(self.backend, str) else getattr(self.backend, "__name__", "a callable")

    @property
    def splits_backward(self) -> bool:
        """Tell whether fxpipe can split this backend's backward into I and W (zero bubble)."""
        return self.backend in SPLIT_BACKENDS

    def inductor_config(self) -> dict[str, Any]:
        """Return the inductor config patches that ``mode`` and ``options`` make (torch.compile's own)."""
        from torch import _TorchCompileInductorWrapper

        return dict(_TorchCompileInductorWrapper(self.mode, self.options, self.dynamic).config)


def torch_compile_config(value: Any) -> TorchCompile | None:
    """Check a ``torch_compile=`` value and return it as a :class:`TorchCompile` (None: off).

    The backend is looked up (and imported) here, so a backend that cannot load is named before
    anything is traced; so are unknown keys, modes and inductor options.
    """
    if value is None or value is False:
        return None
    if value is True:
        value = {}
    if not isinstance(value, dict):
        raise TypeError(f"torch_compile= takes True, False or a dict of torch.compile's arguments "
                        f"({', '.join(TORCH_COMPILE_KEYS)}), got {type(value).__name__}")
    unknown = sorted(set(value) - set(TORCH_COMPILE_KEYS))
    if unknown:
        raise TypeError(f"torch_compile= got {', '.join(map(repr, unknown))}; it takes {', '.join(TORCH_COMPILE_KEYS)}")
    config = TorchCompile(**value)
    if not (isinstance(config.backend, str) or callable(config.backend)):
        raise TypeError(f"torch_compile backend= must be a backend's name or a callable, got {config.backend!r}")
    if config.dynamic not in (None, True, False) or not isinstance(config.fullgraph, bool):
        raise TypeError("torch_compile dynamic= takes None, True or False, and fullgraph= True or False")
    if config.options is not None and not isinstance(config.options, dict):
        raise TypeError(f"torch_compile options= must be a dict of inductor options, got {config.options!r}")
    _load_backend(config)
    return config


def _load_backend(config: TorchCompile) -> None:
    """Import the backend and check ``mode`` and ``options`` against it (CompileError naming what fails)."""
    if config.mode is not None and config.options:
        raise CompileError("torch_compile got both mode= and options=, which torch.compile refuses together; give "
                           "one (a mode's settings can be written as options=)")
    if isinstance(config.backend, str) and "cudagraphs" in config.backend:
        raise CompileError(f"torch_compile backend={config.backend!r} captures CUDA graphs, whose replays reuse one "
                           "memory pool: with several micro-batches in flight a replay would overwrite activations "
                           "that a pending backward still needs; use backend='inductor' (its default mode)")
    if (config.mode is not None or config.options) and config.backend != "inductor":
        raise CompileError(f"torch_compile mode= and options= configure inductor, but backend={config.name!r}; "
                           "drop them or use backend='inductor'")
    if isinstance(config.backend, str):
        import torch._dynamo

        try:
            torch._dynamo.lookup_backend(config.backend)
            if config.backend == "inductor":
                import torch._inductor.compile_fx
            package = _PACKAGES.get(config.backend)  # imported by the backend only when it first compiles
            if package is not None and importlib.util.find_spec(package) is None:
                raise ImportError(f"it needs the package {package!r}, which is not installed")
        except Exception as exc:
            raise CompileError(f"torch_compile backend={config.backend!r} cannot be loaded ({type(exc).__name__}: "
                               f"{str(exc).splitlines()[0] if str(exc) else ''}); the backends torch knows here: "
                               f"{', '.join(torch._dynamo.list_backends(exclude_tags=()))}") from exc
    if config.backend != "inductor":
        return
    try:
        patches = config.inductor_config()
    except RuntimeError as exc:  # an unknown option, or a value of the wrong type
        raise CompileError(f"torch_compile options: {str(exc).split(', known options')[0]} (inductor's config: "
                           "torch._inductor.config)") from None
    if patches.get("triton.cudagraphs"):
        asked = f"mode={config.mode!r}" if config.mode is not None else "options={'triton.cudagraphs': True}"
        raise CompileError(f"torch_compile {asked} captures CUDA graphs, whose replays reuse one memory "
                           "pool: with several micro-batches in flight a replay would overwrite activations that a "
                           "pending backward still needs; use mode='max-autotune-no-cudagraphs' or the default")
