"""What each rank runs in the layout tests: ``fxpipe.simulate(pipe, measured=True)`` on every rank of a layout,
and a plan written by the cluster search compiled back into its layout.

A layout is named ``pp<p>[xdp<d>][:shard][:v<v>][:tp<t>]`` with a schedule after ``@``, e.g.
``pp2xdp2:shard@1f1b`` or ``pp2:v2@interleaved``; global rank = (replica * pp + pipeline rank) * tp + tp index.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import fxpipe


def _mlp():
    """Return a residual-free MLP of 8 linears (4 stages cut evenly) and its batch."""
    layers = []
    for _ in range(8):
        layers += [nn.Linear(16, 16), nn.Tanh()]
    return nn.Sequential(*layers), torch.randn(8, 16), torch.randn(8, 16)


def parse(name: str) -> dict:
    """Return the layout named ``name`` as compile's keywords (and ``pp``)."""
    spec, _, schedule = name.partition("@")
    out = {"pp": 1, "data_parallel": 1, "data_parallel_shard": False, "stages_per_rank": 1, "tensor_parallel": 1,
           "schedule": schedule or "1f1b"}
    for part in spec.replace("x", ":").split(":"):
        if part.startswith("pp"):
            out["pp"] = int(part[2:])
        elif part.startswith("dp"):
            out["data_parallel"] = int(part[2:])
        elif part == "shard":
            out["data_parallel_shard"] = True
        elif part.startswith("v"):
            out["stages_per_rank"] = int(part[1:])
        elif part.startswith("tp"):
            out["tensor_parallel"] = int(part[2:])
    return out


def simulate_layout(rank, world, name):
    """Compile the tiny MLP in layout ``name``, run a step, then simulate it measured; return what it predicts."""
    kw = parse(name)
    pp, dp, tp, v = kw.pop("pp"), kw["data_parallel"], kw["tensor_parallel"], kw["stages_per_rank"]
    torch.manual_seed(0)
    model, x, y = _mlp()
    rows = x.shape[0] // dp
    replica, pp_rank = rank // (pp * tp), rank // tp % pp
    xs, ys = x[replica * rows:(replica + 1) * rows], y[replica * rows:(replica + 1) * rows]
    pipe = fxpipe.compile(model, pp * v, example_inputs=(xs,), runtime="distributed", timeout=60, chunks=2, **kw)
    last = pipe.plan.stages[-1].on_rank == pp_rank
    pipe.step(xs if pp_rank == 0 else None, target=ys if last else None, loss_fn=F.mse_loss)
    sim = fxpipe.simulate(pipe, device="cpu", measured=True, optimizer="sgd")
    return {"step": sim.step_time, "dp": sim.data_parallel, "shard": sim.shard, "tp": sim.tensor_parallel,
            "ranks": sorted({s.rank for s in sim.stages}), "stages": len(sim.stages), "schedule": sim.schedule,
            "params": [s.memory.params for s in sim.stages], "optimizer": [s.memory.optimizer for s in sim.stages],
            "throughput": sim.throughput, "layout": pipe.plan.layout,
            "links": [sim.device.link_latency, sim.device.link_bandwidth, sim.device.tp_latency,
                      sim.device.tp_bandwidth, sim.device.slots], "wake": sim.device.wake_latency,
            "scale": sim.device.collective_scale}


def written_plan(rank, world, wanted):
    """Search 4 GPUs for the tiny MLP, save the first layout shaped ``wanted`` (``dp2xpp2``, ``pp2xtp2``, ...),
    compile it from the file alone and run a step; return the plan's layout and what the pipe runs."""
    import os

    from fxpipe.simulate.cluster import cluster_search

    torch.manual_seed(0)
    model, x, y = _mlp()
    found = cluster_search(model, (x,), gpus=world, gpus_per_node=world, device="h100", batch=x.shape[0],
                           optimizer="sgd", keep=1000)
    want = parse(wanted)
    choice = next(c for c in found.ranked if c.shape.dp == want["data_parallel"] and c.shape.pp == want["pp"]
                  and c.shape.tp == want["tensor_parallel"] and c.shape.v == want["stages_per_rank"])
    path = os.path.join(os.environ["FXPIPE_TEST_DIR"], f"plan{rank}.json")
    found.plan(choice).save(path)
    s = choice.shape
    rows = x.shape[0] // s.dp
    replica, pp_rank = rank // (s.pp * s.tp), rank // s.tp % s.pp
    xs, ys = x[replica * rows:(replica + 1) * rows], y[replica * rows:(replica + 1) * rows]
    pipe = fxpipe.compile(model, s.n_stages, example_inputs=(xs,), runtime="distributed", timeout=60, plan=path)
    last = pipe.plan.stages[-1].on_rank == pp_rank
    loss = pipe.step(xs if pp_rank == 0 else None, target=ys if last else None, loss_fn=F.mse_loss)
    saved = fxpipe.PipelinePlan.load(path)
    return {"layout": pipe.plan.layout, "chosen": saved.layout, "schedule": pipe.plan.schedule,
            "chosen_schedule": s.schedule, "chunks": pipe.plan.chunks, "chosen_chunks": s.chunks,
            "same_split": [st.nodes for st in pipe.plan.stages] == [st.nodes for st in saved.stages],
            "ranks": [st.on_rank for st in pipe.plan.stages], "chosen_ranks": [st.on_rank for st in saved.stages],
            "policies": pipe.plan.policies(), "chosen_policies": saved.policies(), "loss": float(loss)}


def sharing_both_ways(rank, world, _):
    """Measure the ranks' sharing of the cores on the tiny MLP's passes, then on the GEMM loop (limit 0)."""
    import torch.distributed as dist

    from fxpipe import passes
    from fxpipe.simulate.sharing import measure_sharing

    if not dist.is_initialized():
        dist.init_process_group("gloo")

    model, x, _ = _mlp()
    gm = fxpipe.trace(model)
    passes.annotate(gm, (x,))
    return {"model": measure_sharing(gm, 16, trials=2), "gemm": measure_sharing(gm, 16, trials=2, limit=0)}
