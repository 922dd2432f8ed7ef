"""Device models: how fast a device computes, moves memory and talks to its pipeline neighbour.

:func:`fxpipe.simulate` turns FLOPs and bytes into seconds with a :class:`DeviceModel`::

    kernel time  = overhead + FLOPs / (peak[dtype] x efficiency[kind] x d / (d + d_half))
                            + elements x seconds_per_element            (the rest: memory-bound)
    message time = link_latency + bytes / link_bandwidth

Two levels of network (:mod:`fxpipe.simulate.network`): ``gpus_per_node`` devices share a node
and talk over its links (NVLink: ``link_bandwidth`` for pipeline hops, ``tp_bandwidth`` for
collectives); between nodes each device has ``inter_bandwidth`` (InfiniBand or RoCE, 400 Gb/s
per GPU by default) at ``inter_latency`` per message.

``kind`` is ``"gemm"`` (linears, matmuls, attention) or ``"conv"``; ``d`` is the kernel's
smallest GEMM dimension (a micro-batch of 8 rows, a convolution over 3 input channels), which
the efficiency approaches its plateau past ``d_half``.

The accelerators ship as **nominal** models: peak dense FLOP/s, memory bandwidth, memory
and NVLink bandwidth from NVIDIA's public spec sheets (SXM parts); the efficiencies,
overheads and link latency are assumptions stated below, not measurements. ``"cpu"``
measures this machine in about a second (:func:`calibrate_cpu`), at torch's current number
of threads; its link is gloo over loopback between two processes, and ranks on it share its
cores (``slots``: more ranks computing at once than it has cores for each run slower).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import statistics
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from fxpipe.passes.timing import median_seconds

__all__ = ["NOMINAL", "DeviceModel", "calibrate_cpu", "device_model", "parse_bytes"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeviceModel:
    """What a device does per second, and what each kernel, action and message costs on top."""

    name: str
    peak_flops: dict[str, float]  # dense FLOP/s by dtype name ("float32", "bfloat16", "float16")
    memory_bandwidth: float  # bytes/s
    memory: float  # bytes of device memory
    link_bandwidth: float  # bytes/s from one pipeline stage's device to the next, one direction
    link_latency: float  # seconds per message
    efficiency: dict[str, float] = field(default_factory=lambda: {"gemm": 0.7, "conv": 0.5})
    d_half: dict[str, float] = field(default_factory=lambda: {"gemm": 64.0, "conv": 64.0})
    element_seconds: float = 0.0  # per element of a memory-bound kernel (0: 8 bytes / bandwidth)
    kernel_overhead: float = 5e-6  # seconds per graph node in forward (launch, dispatch)
    backward_overhead: float = 10e-6  # seconds per graph node in backward
    action_overhead: float = 30e-6  # seconds of the runtime's own work per F, B, I or W action
    message_overhead: float = 5e-6  # seconds of a rank's own work per message it posts (send or receive)
    step_overhead: float = 0.0  # seconds per training step (splitting inputs, the loss)
    nominal: bool = True
    source: str = ""
    tp_bandwidth: float = 0.0  # bytes/s per rank inside a tensor-parallel group (the node's links); 0: link_bandwidth
    tp_latency: float = 0.0  # seconds per step of a collective inside the group; 0: link_latency
    gpus_per_node: int = 8  # devices that share a node's links
    inter_bandwidth: float = 50e9  # bytes/s per device to other nodes, one direction (400 Gb/s)
    inter_latency: float = 5e-6  # seconds per message between nodes
    slots: float = 0.0  # ranks of one node that compute at full speed at once (0: each rank its own device)
    wake_latency: float = 0.0  # seconds a rank that waited for a message takes to resume (an idle CPU waking)
    # a collective kind's measured seconds over the ring formula's ("reduce_scatter": 2-5 on gloo); absent: 1
    collective_scale: dict[str, float] = field(default_factory=dict)
    pooled_receives: bool = False  # the runtime keeps receive buffers across steps (on CPU: a step doesn't grow by them)

    def flops_per_second(self, dtype: torch.dtype | str, kind: str, d: float | None = None) -> float:
        """Return the FLOP/s a ``kind`` kernel of smallest dimension ``d`` reaches in ``dtype``."""
        name = str(dtype).replace("torch.", "")
        peak = self.peak_flops.get(name, self.peak_flops["float32"])
        rate = peak * self.efficiency.get(kind, self.efficiency["gemm"])
        half = self.d_half.get(kind, 0.0)
        if d is not None and half > 0:
            rate *= d / (d + half)
        return rate

    def seconds_per_element(self, itemsize: int = 4) -> float:
        """Return the seconds a memory-bound kernel takes per output element (read and write)."""
        return self.element_seconds or 2 * itemsize / (0.8 * self.memory_bandwidth)

    def message_seconds(self, nbytes: float) -> float:
        """Return the seconds one message of ``nbytes`` takes from stage to stage."""
        return self.link_latency + nbytes / self.link_bandwidth if nbytes else 0.0

    def replace(self, **changes: object) -> DeviceModel:
        """Return a copy with some fields changed (e.g. ``link_bandwidth=25e9`` for PCIe)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


_GB = 1e9
_NVIDIA = ("nominal: NVIDIA {part} spec sheet (dense tensor-core peak, HBM bandwidth, NVLink per "
           "direction); efficiency 70% of peak for GEMMs and 50% for convolutions, 5/10 us per kernel "
           "forward/backward, 10 us per message and 30 us per action are assumptions")
NOMINAL: dict[str, DeviceModel] = {
    "a100": DeviceModel(
        "a100", {"float32": 19.5e12, "tfloat32": 156e12, "bfloat16": 312e12, "float16": 312e12},
        memory_bandwidth=2039 * _GB, memory=80 * 2**30, link_bandwidth=300 * _GB, link_latency=10e-6,
        source=_NVIDIA.format(part="A100 SXM4 80GB")),
    "h100": DeviceModel(
        "h100", {"float32": 67e12, "tfloat32": 494.7e12, "bfloat16": 989.4e12, "float16": 989.4e12},
        memory_bandwidth=3350 * _GB, memory=80 * 2**30, link_bandwidth=450 * _GB, link_latency=10e-6,
        source=_NVIDIA.format(part="H100 SXM5 80GB")),
    "h200": DeviceModel(
        "h200", {"float32": 67e12, "tfloat32": 494.7e12, "bfloat16": 989.4e12, "float16": 989.4e12},
        memory_bandwidth=4800 * _GB, memory=143771 * 2**20, link_bandwidth=450 * _GB, link_latency=10e-6,  # nvidia-smi, one H200
        source=_NVIDIA.format(part="H200 SXM 141GB")),
}

_CALIBRATED: dict[int, DeviceModel] = {}


def device_model(device: str | DeviceModel) -> DeviceModel:
    """Return the model named ``device`` (``"a100"``, ``"h100"``, ``"h200"``, ``"cpu"``), or ``device`` itself."""
    if isinstance(device, DeviceModel):
        return device
    key = str(device).lower().replace("nvidia", "").replace("-", "").replace(" ", "")
    if key in NOMINAL:
        return NOMINAL[key]
    if key == "cpu":
        threads = torch.get_num_threads()
        if threads not in _CALIBRATED:
            _CALIBRATED[threads] = calibrate_cpu()
        return _CALIBRATED[threads]
    raise ValueError(f"device={device!r}: use one of {', '.join(map(repr, [*NOMINAL, 'cpu']))} or a "
                     "DeviceModel of your own (from fxpipe.simulate.devices import DeviceModel)")


def _fit(d_big: float, rate_big: float, d_small: float, rate_small: float) -> tuple[float, float]:
    """Return ``(plateau, d_half)`` of ``rate(d) = plateau x d / (d + d_half)`` through two measurements."""
    q = min(max(rate_small / rate_big, 1e-3), 0.999)
    denominator = q * d_big - d_small
    if denominator <= 0:  # the small kernel is no slower per dimension: no visible knee
        return rate_big, 0.0
    half = d_big * d_small * (1 - q) / denominator
    return rate_big * (d_big + half) / d_big, half


def _layer_rate(layer: torch.nn.Module, x: torch.Tensor, reps: int) -> float:
    """Return the FLOP/s of a layer's forward and backward (input and weight gradients, added up)."""
    x.requires_grad_(True)
    with torch.no_grad():
        out = layer(x)
    flops = 3 * 2 * out.numel() * sum(p.numel() for n, p in layer.named_parameters() if n == "weight") \
        / (out.shape[1] if out.dim() > 2 else out.shape[-1])  # 3 GEMMs of 2 x output x (fan-in) each
    return flops / median_seconds(lambda: layer(x).sum().backward(), repeats=reps, warmup=3)


def calibrate_cpu(reps: int = 15) -> DeviceModel:
    """Measure this CPU at torch's current thread count: GEMM and convolution rates (a layer's
    forward and backward), memory-bound kernels, per-kernel overheads; under a second.

    The link is gloo over loopback between two processes on this machine, measured once: a
    ping-pong takes about 50 us one way at 2-4 GB/s (taken as 60 us and 1.5 GB/s), and the
    distributed runtime's own cost per message (posting, waiting, waking up) came to 250-450 us
    of a rank's time, fitted to 2-rank steps of a model with negligible compute (taken as 300 us;
    ``benchmarks/predict.py`` fits it anew each run).
    """
    gemm = _layer_rate(torch.nn.Linear(512, 512), torch.randn(256, 512), reps)
    gemm8 = _layer_rate(torch.nn.Linear(512, 512), torch.randn(8, 512), reps * 4)
    conv = _layer_rate(torch.nn.Conv2d(32, 32, 3, padding=1), torch.randn(8, 32, 32, 32), reps)
    conv3 = _layer_rate(torch.nn.Conv2d(3, 16, 3, padding=1), torch.randn(8, 3, 32, 32), reps * 2)
    with torch.no_grad():  # memory-bound kernels: the median per element of five common ones
        big, other = torch.randn(1024, 1024), torch.randn(1024, 1024)
        light = [lambda: torch.relu(big), lambda: F.gelu(big), lambda: big + other, lambda: big.softmax(-1),
                 lambda: F.layer_norm(big, (1024,))]
        element = statistics.median(median_seconds(fn, repeats=reps, warmup=3) for fn in light) / big.numel()
    tiny = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(32)])
    t8 = torch.randn(8, 8)
    with torch.no_grad():
        forward = median_seconds(lambda: tiny(t8), repeats=reps * 4, warmup=3) / 32
    both = median_seconds(lambda: tiny(t8).sum().backward(), repeats=reps * 4, warmup=3) / 32
    gemm, gemm_half = _fit(256, gemm, 8, gemm8)  # d: the smallest GEMM dimension
    conv, conv_half = _fit(32 * 9, conv, 3 * 9, conv3)  # d: input channels x kernel size
    model = DeviceModel(
        "cpu", {"float32": gemm, "float64": gemm / 2, "bfloat16": gemm, "float16": gemm},
        memory_bandwidth=8 / element, memory=_ram(), link_bandwidth=1.5e9, link_latency=60e-6,
        efficiency={"gemm": 1.0, "conv": conv / gemm}, d_half={"gemm": gemm_half, "conv": conv_half},
        element_seconds=element, kernel_overhead=forward, backward_overhead=max(both - forward, 0.0),
        action_overhead=40e-6, message_overhead=300e-6, step_overhead=200e-6, nominal=False,
        gpus_per_node=1 << 20, inter_bandwidth=1.5e9, inter_latency=60e-6, slots=_slots(), pooled_receives=True,
        source=f"calibrated on this CPU with {torch.get_num_threads()} thread(s): GEMM {gemm / 1e9:.0f} "
               f"GFLOP/s, convolution {conv / 1e9:.0f} GFLOP/s, {element * 1e9:.2f} ns per element, "
               f"{forward * 1e6:.1f}/{max(both - forward, 0.0) * 1e6:.1f} us per kernel forward/backward")
    log.info("%s", model.source)
    return model


def _slots() -> float:
    """Return how many ranks of torch's current thread count this machine's cores run at once."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(cores / max(torch.get_num_threads(), 1), 1.0)


def _ram() -> float:
    """Return this machine's memory in bytes (Linux), or 16 GiB if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return float(int(line.split()[1]) * 1024)
    except OSError:
        pass
    return float(16 * 2**30)


_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20,
          "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | float) -> float:
    """Read a memory size: ``80GB``, ``80 GiB``, ``512MB``, or a number of bytes."""
    if isinstance(text, (int, float)):
        return float(text)
    written = text.strip().replace(" ", "")
    if re.fullmatch(r"[0-9.]+[KMGT]i?b", written):  # 80Gb: gigabits, as --inter-node-bandwidth 400Gb/s reads it
        raise ValueError(f"{text!r} reads as bits (a lowercase b, as in 400Gb/s); a memory size is in bytes: write "
                         f"{written[:-1]}B")
    s = written.lower()
    digits = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(digits):]
    try:
        value = float(digits)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or value <= 0:
        raise ValueError(f"{text!r} is not a memory size; write e.g. 80GB, 80GiB or 512MB")
    if not unit and value < 2**20:  # '80' meant 80GB, not 80 bytes
        raise ValueError(f"{text!r} has no unit, so it would be {value:g} bytes; write the unit, e.g. {digits}GB "
                         f"or {digits}GiB")
    return value * _UNITS[unit]
