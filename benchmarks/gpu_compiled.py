"""Part 5 of ``gpu_check.py``: compiled stages (``torch_compile=``) on one GPU.

Two stages of a transformer-like stack (tests/support/models.py's ``Stack``: LayerNorm, GELU
MLP, residual adds) on cuda:0, zero bubble, m = 8: the compiled pipe (inductor) against the
same pipe eager, median step times (:func:`gpu_measure.race`); its gradients against eager's;
its first step's compile time; and, from a timeline of one compiled step, that every ``W``
comes after its ``I`` and the share of the backward's time the ``W`` steps hold (the weight
gradients' GEMMs run there). On CPU stand-ins it compiles with ``aot_eager`` at toy sizes.
"""

from __future__ import annotations

import copy
import os
import sys

import torch

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path[:0] = [ROOT, BENCH, os.path.join(ROOT, "tests", "support"), os.path.join(ROOT, "examples")]
from gpu_measure import race

SIZES = {"gpu": {"d": 1024, "hidden": 4096, "layers": 8, "batch": 4096, "m": 8},
         "standin": {"d": 32, "hidden": 64, "layers": 4, "batch": 32, "m": 4}}


def measure_compiled(out: str, seconds: float, rows: list, standin: bool, batch: int | None = None) -> None:
    """Time the compiled zero-bubble pipe against the eager one on one GPU; check it; add rows."""
    import torch.nn.functional as F
    from models import Stack

    import fxpipe
    from fxpipe.testing import max_relative_error

    size = dict(SIZES["standin" if standin else "gpu"], **({"batch": batch} if batch else {}))
    gpu = "cpu:0" if standin else "cuda:0"
    backend = "aot_eager" if standin else "inductor"
    torch.manual_seed(0)
    base = Stack(d=size["d"], hidden=size["hidden"], layers=size["layers"], out=size["d"])
    x = torch.randn(size["batch"], size["d"], device=gpu)
    y = torch.randn(size["batch"], size["d"], device=gpu)
    reference = copy.deepcopy(base).to(gpu)
    F.mse_loss(reference(x), y).backward()
    models, pipes = {}, {}
    for kind in ("compiled", "eager"):
        models[kind] = copy.deepcopy(base)
        pipes[kind] = fxpipe.compile(models[kind], 2, example_inputs=(x.cpu(),), chunks=size["m"], schedule="zb",
                                     checkpoint="never", devices=[gpu, gpu],
                                     torch_compile={"backend": backend} if kind == "compiled" else False)

    def step(kind: str) -> None:
        models[kind].zero_grad(set_to_none=True)
        pipes[kind].step(x, target=y, loss_fn=F.mse_loss)

    step("compiled")  # the first step compiles
    compile_s = sum(s["seconds"] for s in pipes["compiled"].compile_stats.values())
    error = max(max_relative_error(p.grad, q.grad) for p, q in zip(models["compiled"].parameters(),
                                                                   reference.parameters()))
    with fxpipe.timeline(os.path.join(out, "compiled_zb.json")) as tl:
        step("compiled")
    spans = {(e["cat"], e["args"]["stage"], e["args"]["micro_batch"]): e for e in tl.events}
    ordered = all(w["ts"] + 1 >= spans[("backward", j, i)]["ts"] + spans[("backward", j, i)]["dur"]
                  for (k, j, i), w in spans.items() if k == "weight")  # microseconds: 1 of slack
    weight_ms = sum(e["dur"] for e in tl.events if e["cat"] == "weight") / 1e3
    backward_ms = sum(e["dur"] for e in tl.events if e["cat"] in ("backward", "weight")) / 1e3
    times = race({"compiled": lambda: step("compiled"), "eager": lambda: step("eager")}, seconds / 2, [gpu])
    what = (f"2 stages on {gpu}, zb, Stack d={size['d']} hidden={size['hidden']} x{size['layers']}, "
            f"batch {size['batch']}, m={size['m']}")
    rows.append(["compiled", f"zb step, {backend} / eager", f"{times['compiled'] / times['eager']:.3f}x",
                 f"{what}; {times['compiled'] * 1e3:.1f} vs {times['eager'] * 1e3:.1f} ms"])
    rows.append(["compiled", "first step's compile time", f"{compile_s:.1f} s", "all stages, forward and backward"])
    rows.append(["compiled", "gradients against eager (max relative error)", f"{error:.1e}",
                 "float32, TF32" if torch.backends.cuda.matmul.allow_tf32 else "float32, no TF32"])
    rows.append(["compiled", "W after its I; W's share of backward time", f"{'yes' if ordered else 'NO'}; "
                 f"{weight_ms / backward_ms:.0%}" if backward_ms else "no backward", "compiled_zb.json"])

    if not standin:  # where the time goes: GEMMs or the kernels inductor fuses
        for kind in ("compiled", "eager"):
            gemm, other, launched = kernels(lambda kind=kind: step(kind), os.path.join(out, f"kernels_{kind}.txt"))
            rows.append(["compiled", f"{kind}: GPU time per step in GEMMs / other kernels",
                         f"{gemm:.1f} / {other:.1f} ms", f"{launched} kernels; kernels_{kind}.txt"])


def kernels(step, path: str) -> tuple[float, float, int]:
    """Profile one step: return its GPU milliseconds in GEMMs and in other kernels, and the kernel count.

    The 20 kernels with the most GPU time go to ``path``: why a compiled step is slower or
    faster than the eager one shows there (which GEMMs, which fused kernels, how many launches).
    """
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    gemm = other = 0.0
    launched = 0
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        launched += 1
        us = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        if any(w in e.name.lower() for w in ("gemm", "cutlass", "matmul", "sm90_xmma", "cublas")):
            gemm += us
        else:
            other += us
    with open(path, "w") as f:
        f.write(prof.key_averages().table(sort_by="device_time_total", row_limit=20))
    return gemm / 1e3, other / 1e3, launched
