"""Activation offload on CUDA: a stage's saved activations wait in pinned host memory between F and B.

Under ``checkpoint="offload"`` a stage's forward runs with autograd on, under saved-tensor hooks
that hold each saved tensor as a parcel item; nothing is recomputed. When the forward ends, every
storage the items live in (but the stage's state, inputs and outputs, which stay anyway, and
storages under ``least`` bytes) is copied to pinned host memory on the stage's side stream, and
its device memory is let go once the copy is done. Before the micro-batch's backward the copies
come back on the side stream; the compute stream waits for them only when autograd unpacks::

    compute stream  F(i) ──────────── F(i+1) ─── B(i-1) ─────────────── B(i): unpack waits ─▶
    side stream           └─ D2H(i) ─┘               └─ H2D(i) (prefetch) ─┘

The action interpreter prefetches the next backward's micro-batch at the start of each action
of the stage (:meth:`Offload.prefetch`); ``pipe(x)`` followed by ``backward()`` fetches at the
first unpack. Only CUDA devices have the streams and pinned memory this needs: the build refuses
``"offload"`` for a stage on any other device.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten

__all__ = ["Offload"]

LEAST = 1 << 20  # bytes: smaller storages stay on the device (a copy costs more than it saves)


class _Item:
    """One saved tensor: on the device, or a view into one of its parcel's offloaded storages."""

    __slots__ = ("dtype", "geometry", "gpu", "parcel", "slot")

    def __init__(self, parcel: _Parcel, t: torch.Tensor) -> None:
        self.parcel = parcel
        self.gpu: torch.Tensor | None = t  # None once its storage waits in host memory
        self.slot = -1
        self.dtype = t.dtype
        self.geometry = (t.size(), t.stride(), t.storage_offset())


def _unpack(obj: Any) -> Any:
    """Saved-tensor hook: return the tensor, from the device or fetched back from host memory."""
    if not isinstance(obj, _Item):
        return obj
    if obj.gpu is not None:
        return obj.gpu
    return obj.parcel.back(obj)


class _Parcel:
    """The saved tensors of one micro-batch of one stage, and their storages' copies in host memory."""

    def __init__(self, offload: Offload) -> None:
        self.offload = offload
        self.items: list[_Item] = []
        self.host: list[torch.Tensor] = []  # per offloaded storage: its bytes in pinned memory
        self.device_copies: list[torch.Tensor] | None = None  # the bytes fetched back
        self.sent: torch.cuda.Event | None = None
        self.fetched: torch.cuda.Event | None = None
        self.outputs: Any = None  # the stage's return value, set by the stage call

    def pack(self, t: torch.Tensor) -> Any:
        """Saved-tensor hook of the forward: hold ``t`` until the forward ends."""
        if not isinstance(t, torch.Tensor) or t.device.type != "cuda" or t.layout != torch.strided:
            return t
        item = _Item(self, t.detach())
        self.items.append(item)
        return item

    def send(self, stay: set) -> None:
        """Copy the held storages (but those in ``stay`` and small ones) to pinned memory; let the device's go."""
        side, device = self.offload.stream, self.offload.device
        groups: dict[StorageWeakRef, int] = {}
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for item in self.items:
                storage = item.gpu.untyped_storage()  # type: ignore[union-attr]
                ref = StorageWeakRef(storage)
                if ref in stay or storage.nbytes() < self.offload.least:
                    continue
                if ref not in groups:
                    raw = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
                    host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=True)
                    host.copy_(raw, non_blocking=True)
                    raw.record_stream(side)  # the device memory is reused only once the copy is done
                    groups[ref] = len(self.host)
                    self.host.append(host)
                item.slot, item.gpu = groups[ref], None
            self.sent = torch.cuda.Event()
            self.sent.record(side)
        self.items = []

    def fetch(self) -> None:
        """Start copying the offloaded storages back to the device on the side stream (once)."""
        if self.device_copies is not None or not self.host:
            return
        side, device = self.offload.stream, self.offload.device
        with torch.cuda.stream(side):
            if self.sent is not None:
                side.wait_event(self.sent)
            self.device_copies = [torch.empty(h.numel(), dtype=torch.uint8, device=device) for h in self.host]
            for dev, host in zip(self.device_copies, self.host):
                dev.copy_(host, non_blocking=True)
            self.fetched = torch.cuda.Event()
            self.fetched.record(side)

    def back(self, item: _Item) -> torch.Tensor:
        """Return ``item``'s tensor on the device, once its storage is back (fetching it if not yet asked)."""
        self.fetch()
        assert self.device_copies is not None and self.fetched is not None
        compute = torch.cuda.current_stream(self.offload.device)
        compute.wait_event(self.fetched)
        raw = self.device_copies[item.slot]
        raw.record_stream(compute)  # used on the compute stream from here on
        size, stride, offset = item.geometry
        return torch.empty(0, dtype=item.dtype, device=raw.device).set_(
            raw.untyped_storage(), offset, size, stride)


class Offload:
    """One stage's activation offload: a parcel per micro-batch, a side stream for the copies."""

    def __init__(self, gm: torch.fx.GraphModule, device: torch.device, index: int, least: int = LEAST) -> None:
        if device.type != "cuda":
            raise ValueError(f"checkpoint='offload' needs a CUDA device; stage {index} runs on {device}")
        self.gm, self.device, self.index, self.least = gm, device, index, least
        self.stream = torch.cuda.Stream(device)
        self.parcels: dict[int, weakref.ref] = {}  # micro-batch -> its parcel, while its graph lives

    @contextlib.contextmanager
    def recording(self, i: int, inputs: Sequence[Any]) -> Iterator[_Parcel]:
        """Hold micro-batch ``i``'s saved tensors during the block; offload them when it ends.

        The caller sets the parcel's ``outputs`` (the stage's return value) before the block ends.
        """
        parcel = _Parcel(self)
        with torch.autograd.graph.saved_tensors_hooks(parcel.pack, _unpack):
            yield parcel
        stay = {StorageWeakRef(t.untyped_storage()) for t in self._state()}
        for value in (inputs, parcel.outputs):
            stay |= {StorageWeakRef(t.untyped_storage()) for t in tree_flatten(value)[0]
                     if isinstance(t, torch.Tensor) and t.layout == torch.strided}
        parcel.send(stay)
        self.parcels[i] = weakref.ref(parcel)

    def _state(self) -> list[torch.Tensor]:
        """Return the stage's parameters and buffers (they stay on the device)."""
        return [t for t in (*self.gm.parameters(), *self.gm.buffers()) if t.layout == torch.strided]

    def prefetch(self, i: int) -> None:
        """Start bringing micro-batch ``i``'s saved activations back, ahead of its backward."""
        ref = self.parcels.pop(i, None)
        parcel = ref() if ref is not None else None
        if parcel is not None:
            parcel.fetch()
