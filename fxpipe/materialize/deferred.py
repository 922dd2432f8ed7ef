"""Build a model on ``meta`` and record how each of its tensors gets its values, to replay later.

    with fxpipe.deferred_init():     every aten op runs on meta under a TorchDispatchMode; a factory's
        model = Model(cfg)           device (``device="cpu"`` or the default) becomes meta and is kept
                                     in the record; each op that creates or writes storage is recorded
    fxpipe.compile(model, ...)       each stage replays only its own tensors' recipes, on its device,
                                     seeded per module FQN (:mod:`fxpipe.materialize.recipes`)

An op is kept with its arguments, where a tensor is written as a view of a storage: its group
(one per storage made inside the context), shape, strides, offset and dtype. Views share their
base's storage, so they share its group; an op writes the groups of the arguments its schema marks
mutable (``Tensor(a!)``: in-place ops, ``out=``) and of the storages it creates. ``nn.Parameter``,
``register_buffer`` and ``.data`` make no op, but keep the storage, so a parameter is found by its
storage (:func:`fxpipe.materialize.recording.group_of`). Pure views and metadata ops write nothing and are not kept.

Construction that needs values (``.item()``, ``.tolist()``, ``if tensor:``, ``nonzero``) cannot run on
meta and is refused with :class:`DeferredInitError`. Ops on real tensors only (``torch.tensor(data)``,
made on the CPU before any op) run as in eager; a real tensor an op mixes with recorded ones is kept
by reference as a constant.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from fxpipe.errors import DeferredInitError
from fxpipe.frontend.source import model_line
from fxpipe.materialize.initcalls import recording_init_calls
from fxpipe.materialize.recording import Const, Op, Recording, Ref, ref_of

__all__ = ["deferred_init"]

log = logging.getLogger(__name__)

_META = torch.device("meta")
_ACTIVE = threading.local()
_VALUE_READS = frozenset({"tolist", "numpy", "item", "__bool__", "__float__", "__int__", "__index__",
                          "__complex__", "__array__"})
# methods whose factories (``self.new_empty``) take self's device and dtype: on a real tensor, eager ones
_LIKE_SELF = frozenset({"new_empty", "new_empty_strided", "new_zeros", "new_ones", "new_full", "new_tensor",
                        "__deepcopy__"})


def _where() -> str:
    """Name the innermost source line outside torch and fxpipe (the model's code)."""
    line = model_line()
    if line is not None:
        return f" at {line}"
    return ""


def _refusal(what: str) -> DeferredInitError:
    """Say that construction needs the values of a tensor, which a meta tensor has not."""
    return DeferredInitError(
        f"building the model under fxpipe.deferred_init() needs the values of a tensor ({what}{_where()}), "
        "but while recording every tensor is on meta and holds none; build the model on a real device "
        "(without deferred_init), or compute that value from Python numbers or on a real tensor made "
        "before the context, or build it with torch.device('meta') and pass init= a function "
        "init(module) that fills its tensors")


class _Guard(TorchFunctionMode):
    """Refuse reading a meta tensor's values into Python; run a real tensor's ``new_*`` and deepcopy as eager."""

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        """Refuse a value read of a meta tensor; run everything else as it is."""
        name = getattr(func, "__name__", None)
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if name in _VALUE_READS and first is not None and first.is_meta:
            raise _refusal(f"Tensor.{name}()")
        if name in _LIKE_SELF and first is not None and not first.is_meta:  # its factories take self's device
            self.recorder.paused += 1
            try:
                return func(*args, **(kwargs or {}))
            finally:
                self.recorder.paused -= 1
        return func(*args, **(kwargs or {}))


class _Recorder(TorchDispatchMode):
    """Run every aten op on meta and keep those that create or write storage."""

    def __init__(self, recording: Recording) -> None:
        super().__init__()
        self.recording = recording
        self.paused = 0  # inside a real tensor's new_* or deepcopy: ops run as in eager

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        """Run ``func`` on meta (a factory's device replaced), record it, return its meta result."""
        if self.paused:
            return func(*args, **(kwargs or {}))
        kwargs = dict(kwargs or {})
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        leaves, spec = tree_flatten((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        if tensors and not any(t.is_meta for t in tensors):  # real data from outside: as in eager
            return func(*args, **kwargs)
        if func is torch.ops.aten.is_nonzero.default or any(
                tag in func.tags for tag in (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)):
            raise _refusal(str(func))
        return self.record(func, leaves, spec, _mutated(func, args, kwargs))

    def record(self, func, leaves: list, spec: Any, mutated: list[torch.Tensor]) -> Any:
        """Run ``func`` on meta leaves and keep it if it creates or writes storage."""
        if any(not t.is_meta for t in mutated):
            raise DeferredInitError(f"{func} writes values made under fxpipe.deferred_init() into a real tensor"
                                    f"{_where()} (one made before the context, or by torch.tensor(data), which "
                                    "stays real); meta tensors hold no values to write: make that tensor with a "
                                    "factory (torch.zeros, torch.empty) inside the context, or build on a real device")
        rec, device = self.recording, None
        kept: list[Any] = []  # the leaves as recorded
        run: list[Any] = []  # the leaves as run now, on meta
        for x in leaves:
            if isinstance(x, torch.Tensor) and x.is_meta:
                if x.layout != torch.strided or x.is_conj() or x.is_neg():
                    raise DeferredInitError(f"fxpipe.deferred_init() records plain strided tensors only; {func} got "
                                            f"a {x.layout} tensor or a lazy conj/neg view{_where()}: build the "
                                            "model on a real device, or pass init=")
                kept.append(ref_of(x, rec.group(x, new=False)))
                run.append(x)
            elif isinstance(x, torch.Tensor):
                kept.append(Const(x, x._version))
                run.append(x.to(_META))
            elif isinstance(x, torch.device):
                device = x if device is None else device
                kept.append(x)
                run.append(_META)
            elif isinstance(x, torch.UntypedStorage):
                raise DeferredInitError(f"fxpipe.deferred_init() cannot record {func}, which takes a storage"
                                        f"{_where()}; build the model on a real device, or pass init=")
            else:
                kept.append(x)
                run.append(x)
        args, kwargs = tree_unflatten(run, spec)
        try:
            out = func(*args, **kwargs)
        except NotImplementedError as exc:
            raise DeferredInitError(f"{func} has no meta implementation, so fxpipe.deferred_init() cannot run it"
                                    f"{_where()}: build the model on a real device, or pass init=") from exc
        written = {rec.group(t, new=False) for t in mutated}
        creates = []
        for i, t in enumerate(tree_flatten(out)[0]):
            if isinstance(t, torch.Tensor) and not rec.knows(t):
                creates.append((i, ref_of(t, rec.group(t, new=True))))
        if written or creates:
            reads = frozenset(x.group for x in kept if isinstance(x, Ref))
            rec.add(Op(func, spec, kept, creates, frozenset(written | {r.group for _, r in creates}), reads, device))
        return out


def _mutated(func, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """Return the tensors ``func`` writes: the arguments its schema marks ``(a!)``."""
    out: list[torch.Tensor] = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
        out.extend(x for x in tree_flatten(value)[0] if isinstance(x, torch.Tensor))
    return out


@contextlib.contextmanager
def deferred_init() -> Iterator[None]:
    """Build the model made inside on ``meta``, recording how each tensor gets its values.

    ``with fxpipe.deferred_init(): model = LlamaForCausalLM(cfg)`` allocates nothing; the model's
    tensors are on meta, and :func:`fxpipe.compile` (or :func:`fxpipe.materialize`) later gives
    each stage's tensors the values the model's own ``__init__`` computes (``reset_parameters``,
    ``post_init``, buffers made from ``arange``), replayed on the stage's device with the random
    generator seeded per module FQN. No ``init=`` is needed; ``init=`` and ``weights=`` still win.
    Code that needs a tensor's values while building (``.item()``, ``.tolist()``, a branch on a
    tensor) raises :class:`~fxpipe.errors.DeferredInitError`.
    """
    if getattr(_ACTIVE, "on", False):
        raise RuntimeError("fxpipe.deferred_init() is already active in this thread; do not nest it")
    recording = Recording()
    _ACTIVE.on = True
    try:
        recorder = _Recorder(recording)
        with _Guard(recorder), recorder, recording_init_calls(recorder):
            yield
    finally:
        _ACTIVE.on = False
        log.debug("deferred_init recorded %d op(s) over %d storage(s)", len(recording.ops), len(recording.writers))
