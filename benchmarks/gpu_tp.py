"""Part 5 of ``gpu_check.py``: tensor parallelism over 2 GPUs under NCCL, against one GPU.

Two spawned ranks, one GPU each, compile one decoder stage with ``tensor_parallel=2``
(``tp_plan="auto"``: column-wise q, k, v and MLP input, row-wise output projections, the
embedding vocabulary-parallel, the tied head gathered; the head count written into the model's
views made local by the graph rewrite); rank 0 also runs the same model whole on its GPU. One
training step each: the loss against the whole model's (float32, TF32 off), the collectives
counted against the plan's, and the median step time of each (barrier to barrier, GPUs
synchronized), with the ratio. ``--standin`` runs it on CPU with gloo at a toy size: it checks
the script, its times mean nothing.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import sys
import time
from collections import Counter

import torch

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(BENCH), BENCH]
from ports import run_two_ranks  # noqa: E402

SIZES = {"gpu": {"vocab": 8192, "d": 2048, "heads": 16, "layers": 4, "batch": 16, "seq": 512, "chunks": 2},
         "standin": {"vocab": 128, "d": 64, "heads": 4, "layers": 2, "batch": 4, "seq": 16, "chunks": 2}}


def _rank(rank: int, port: int, standin: bool, deadline: float, out: str) -> None:
    """One rank: the tensor-parallel stage (both ranks) and the whole model (rank 0); rank 0 writes the results."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from tp_collectives import Decoder
    from torch.utils._python_dispatch import TorchDispatchMode

    import fxpipe

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    if standin:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False
        dist.init_process_group("nccl")
    size = SIZES["standin" if standin else "gpu"]
    torch.manual_seed(0)
    base = Decoder(size["vocab"], size["d"], size["heads"], size["layers"])
    ids = torch.randint(0, size["vocab"], (size["batch"], size["seq"]))
    whole = copy.deepcopy(base).to(device) if rank == 0 else None
    pipe = fxpipe.compile(base, 1, example_inputs=(ids,), runtime="distributed", chunks=size["chunks"],
                          tensor_parallel=2, checkpoint="never", schedule="1f1b")
    ids = ids.to(device)
    target = ids.roll(1, dims=1)  # the next token's (the input itself: the tied head all but knows it)

    def loss_fn(logits, target):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

    def tp_step():
        return pipe.step(ids, target=target, loss_fn=loss_fn)

    def whole_step():
        if whole is None:
            return None
        total = 0.0
        for part_ids, part_target in zip(ids.chunk(size["chunks"]), target.chunk(size["chunks"])):
            loss = loss_fn(whole(part_ids), part_target) / size["chunks"]  # the same micro-batches, one GPU
            loss.backward()
            total += float(loss.detach())
        return total

    def timed(fn) -> float:
        dist.barrier(device_ids=None if standin else [rank])
        if not standin:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if not standin:
            torch.cuda.synchronize(device)
        dist.barrier(device_ids=None if standin else [rank])
        return time.perf_counter() - start

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen: Counter = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"):
                self.seen[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    loss_tp = float(tp_step())
    loss_whole = whole_step()
    with Count() as counted:
        tp_step()
    times: dict[str, list[float]] = {"tp=2": [], "one GPU": []}
    while time.time() < deadline and len(times["tp=2"]) < 15:
        times["tp=2"].append(timed(tp_step))
        times["one GPU"].append(timed(whole_step))
    if rank == 0:
        planned = sum(len(c["collectives"]) for c in pipe.plan.tensor_parallel["calls"]) * size["chunks"]
        with open(out, "w") as f:
            json.dump({"loss_tp": loss_tp, "loss_whole": loss_whole, "counted": sum(counted.seen.values()),
                       "planned": planned, "medians": {k: statistics.median(v) for k, v in times.items() if v}}, f)
    dist.destroy_process_group()


def measure_tp(seconds: float, rows: list, standin: bool) -> None:
    """Spawn the two ranks, wait at most ``seconds``, add the loss check, the collectives and the times to ``rows``."""
    res = run_two_ranks(_rank, seconds, 0.7, standin, "tp.json", "the tensor-parallel check")
    size = SIZES["standin" if standin else "gpu"]
    what = (f"decoder d={size['d']} layers={size['layers']} vocab={size['vocab']}, batch {size['batch']} x "
            f"{size['seq']}, m={size['chunks']}, {'gloo' if standin else 'NCCL'}")
    error = abs(res["loss_tp"] - res["loss_whole"]) / abs(res["loss_whole"])
    rows.append(["tp", "tp=2 loss against one GPU's, relative", f"{error:.1e}", what])
    rows.append(["tp", "collectives counted / planned", f"{res['counted']} / {res['planned']}",
                 "equal: the plan's count"])
    med = res["medians"]
    for name, t in med.items():
        rows.append(["tp", f"{name} step", f"{t * 1e3:.1f} ms", ""])
    if len(med) == 2:
        rows.append(["tp", "tp=2 step / one GPU's", f"{med['tp=2'] / med['one GPU']:.3f}", "below 1: tp faster"])
