"""fxpipe.simulate's predicted step time and memory against measured steps, and fxpipe plan's choice.

    python benchmarks/predict.py                 # 3 models x 3 schedules x chunks 2-16, 1 process and 2 ranks

Three models (a residual MLP, the example U-Net, a small GPT) in 2 stages, GPipe, 1F1B and zero
bubble, chunks 2, 4, 8 and 16, checkpoint "never", torch on one thread: in one process (both
stages on the CPU, one after the other) and on 2 spawned gloo ranks (a stage each). Each
step's time is the median of --reps, the schedules of one chunk count alternating; on ranks,
barrier to barrier on rank 0.

Two predictions per step. "measured": node times from the profile (each node alone, at the
micro-batch size) scaled to the whole graph's forward and backward at that size, timed in
alternation with the steps themselves (on ranks: by both ranks at once, so the prediction
sees the same sharing of the machine). "FLOPs": the CPU device model calibrated at the start
(GEMM and convolution rates, memory-bound kernels, overheads), no per-model measurement.

Memory: fresh processes (glibc returning freed blocks to the OS) measure each step's peak
resident growth with gradients set to None before it, against the simulated growth
(gradients + the most activations live at once). Last, ``fxpipe plan`` ranks the
configurations of each model for 2 ranks of this CPU (with --measure), and the first
five are measured on the ranks: its first choice against the fastest measured.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "examples"), HERE]
from distributed import _env, _spawn, report
from rss import peak_growth
from transformer import GPT
from unet import UNet

import fxpipe
from fxpipe.simulate.devices import calibrate_cpu
from fxpipe.simulate.measure import inputs_of_rows, node_profile, rescale, whole_graph
from fxpipe.simulate.planner import search

SCHEDULES = ("gpipe", "1f1b", "zb")


class Block(nn.Module):
    """A residual MLP block."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


def _ce(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


BATCH = {"mlp": 512, "unet": 32, "gpt": 16}
MEMORY_SCALE = 8  # memory runs take 8x the batch: activations well above allocator slack


def build(name: str, scale: int = 1):
    """Return ``(model, x, y, loss_fn)`` of a benchmark model (``scale`` x its batch), seeded."""
    torch.manual_seed(0)
    b = BATCH[name] * scale
    if name == "mlp":
        return nn.Sequential(*[Block(256, 1024) for _ in range(4)]), torch.randn(b, 256), torch.randn(b, 256), F.mse_loss
    if name == "unet":
        return UNet(), torch.randn(b, 3, 32, 32), torch.randn(b, 2, 32, 32), F.mse_loss
    return GPT(d=128, layers=4, seq=64), torch.randint(0, 256, (b, 64)), torch.randint(0, 256, (b, 64)), _ce


def compile_local(name: str, m: int, schedule: str, plan=None, checkpoint="never"):
    """Compile a benchmark model into 2 stages in this process; return the pipe and its data."""
    model, x, y, loss = build(name)
    pipe = fxpipe.compile(model, 2 if plan is None else plan.n_stages, example_inputs=(x,), chunks=m,
                          schedule=schedule, checkpoint=checkpoint, devices=["cpu"] * (plan.n_stages if plan else 2),
                          plan=plan)
    return pipe, x, y, loss


def _step(pipe, x, y, loss, rank=None):
    if rank is None:
        pipe.step(x, target=y, loss_fn=loss)
    else:
        last = rank == pipe.plan.n_stages - 1
        pipe.step(x if rank == 0 else None, target=y if last else None, loss_fn=loss)
    pipe.zero_grad(set_to_none=True)


def _timed(fn, barrier=False) -> float:
    if barrier:
        dist.barrier()
    start = time.perf_counter()
    fn()
    if barrier:
        dist.barrier()
    return time.perf_counter() - start


def time_group(runs: dict, reps: int, barrier: bool) -> dict[str, float]:
    """Time each run ``reps`` times in a shuffled order per repetition; return medians."""
    times: dict[str, list[float]] = {k: [] for k in runs}
    for fn in runs.values():
        _timed(fn, barrier)
    for r in range(reps):
        order = list(runs)
        random.Random(r).shuffle(order)
        for k in order:
            times[k].append(_timed(runs[k], barrier))
    return {k: statistics.median(v) for k, v in times.items()}


def whole_run(gm, rows, x):
    """Return a function timing the whole graph's forward and backward at ``rows`` rows (stored in a list)."""
    args = inputs_of_rows(gm, rows, (x,))
    got: list[tuple[float, float]] = []
    return (lambda: got.append(whole_graph(gm, args, torch.device("cpu"), repeats=3))), got


def measure_group(name: str, m: int, reps: int, rank=None, pipes=None) -> dict:
    """Time one model's schedules at ``m`` chunks, alternating with the whole graph at the micro-batch size."""
    pipes = pipes or {s: compile_local(name, m, s) for s in SCHEDULES}
    model, x = build(name)[:2]
    # a rank holds only its own stage's tensors (the rest are on meta): time the whole graph of a fresh model
    gm = fxpipe.trace(model) if rank is not None else next(iter(pipes.values()))[0]._gm
    fn, got = whole_run(gm, x.shape[0] // m, x)
    runs = {s: (lambda s=s: _step(*pipes[s], rank=rank)) for s in SCHEDULES}
    runs["whole graph"] = fn
    pings: list[float] = []
    if rank is not None:
        runs["link"] = lambda: pings.append(ping(rank))
    med = time_group(runs, reps, barrier=rank is not None)
    med["forward"] = statistics.median(f for f, _ in got)
    med["backward"] = statistics.median(b for _, b in got)
    med["latency"] = statistics.median(pings) if pings else 0.0
    return med


def ping(rank: int, rounds: int = 10) -> float:
    """Return the median one-way seconds of a small message between the two ranks."""
    t = torch.zeros(16)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        if rank == 0:
            dist.send(t, 1)
            dist.recv(t, 1)
        else:
            dist.recv(t, 0)
            dist.send(t, 0)
        times.append((time.perf_counter() - start) / 2)
    return statistics.median(times)


def _dist_rank(rank: int, port: int, args, plans, out: str) -> None:
    """One rank: time every (model, chunks) group on 2 ranks."""
    _env(rank, port)
    results = {}
    for name in args.models:
        for m in args.chunks:
            pipes = {}
            for s in SCHEDULES:
                model, x, y, loss = build(name)
                pipes[s] = (fxpipe.compile(model, 2, example_inputs=(x,), chunks=m, schedule=s, checkpoint="never",
                                           runtime="distributed", plan=plans[name]), x, y, loss)
            results[f"{name} {m}"] = measure_group(name, m, args.reps, rank, pipes)
    report(out, rank, results)
    dist.destroy_process_group()


def _memory_rank(rank: int, port: int, args, plans, out: str) -> None:
    """One rank (or the one process, with port 0): peak growth of one step per configuration."""
    if port:
        _env(rank, port)
    else:
        torch.set_num_threads(1)
    results = {}
    for name in args.models:
        for m in args.chunks:
            for s in SCHEDULES:
                model, x, y, loss = build(name, MEMORY_SCALE)
                kw: dict = {"runtime": "distributed"} if port else {"devices": ["cpu", "cpu"]}
                pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=m, schedule=s, checkpoint="never",
                                      plan=plans[name], **kw)
                _step(pipe, x, y, loss, rank if port else None)
                gc.collect()
                if port:
                    dist.barrier()
                with peak_growth() as growth:
                    _step(pipe, x, y, loss, rank if port else None)
                results[f"{name} {m} {s}"] = growth["bytes"]
                del pipe, model
    report(out, rank, results)
    if port:
        dist.destroy_process_group()


def _plan_rank(rank: int, port: int, args, candidates, out: str) -> None:
    """One rank: time each model's top candidates of ``fxpipe plan`` (1-stage ones on rank 0 alone)."""
    _env(rank, port)
    results = {}
    for name, cands in candidates.items():
        runs = {}
        for k, (plan, c) in enumerate(cands):
            model, x, y, loss = build(name)
            if c["stages"] == 1:
                if rank == 0:
                    pipe = fxpipe.compile(model, 1, example_inputs=(x,), chunks=c["chunks"], schedule=c["schedule"],
                                          checkpoint=c["checkpoint"], devices=["cpu"], plan=plan)
                    runs[k] = lambda p=pipe, x=x, y=y, loss=loss: _step(p, x, y, loss)
                else:
                    runs[k] = lambda: None
                continue
            pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=c["chunks"], schedule=c["schedule"],
                                  checkpoint=c["checkpoint"], runtime="distributed", plan=plan)
            runs[k] = lambda p=pipe, x=x, y=y, loss=loss: _step(p, x, y, loss, rank)
        results[name] = {str(k): v for k, v in time_group(runs, args.reps, barrier=True).items()}
    report(out, rank, results)
    dist.destroy_process_group()


def tiny(m: int, schedule: str, **kw):
    """Compile a model whose compute is negligible: what is left of a step is the runtime's own cost."""
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    return fxpipe.compile(model, 2, example_inputs=(x,), chunks=m, schedule=schedule, checkpoint="never", **kw), x


def _overhead_rank(rank: int, port: int, args, out: str) -> None:
    """One rank: time the negligible model's steps at 16 chunks, every schedule."""
    _env(rank, port)
    runs = {}
    for s in SCHEDULES:
        pipe, x = tiny(16, s, runtime="distributed")
        runs[s] = lambda p=pipe, x=x: _step(p, x, x, F.mse_loss, rank)
    report(out, rank, time_group(runs, 15, barrier=True))
    dist.destroy_process_group()


def fit_message_overhead(cpu, measured: dict[str, float]) -> float:
    """Return the seconds per message that make the negligible model's predicted steps match ``measured``."""
    fits = []
    for s, t in measured.items():
        pipe, _ = tiny(16, s, devices=["cpu", "cpu"])
        lo, hi = 0.0, 5e-3
        for _ in range(30):
            mid = (lo + hi) / 2
            step = fxpipe.simulate(pipe, device=cpu.replace(message_overhead=mid), runtime="distributed").step_time
            lo, hi = (mid, hi) if step < t else (lo, mid)
        fits.append((lo + hi) / 2)
    return statistics.median(fits)


def _spawn_one(target, *extra):
    """Run ``target(0, 0, *extra, out)`` in one fresh spawned process; return what it reported."""
    import json
    import multiprocessing as mp
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "report")
        p = mp.get_context("spawn").Process(target=target, args=(0, 0, *extra, out))
        p.start()
        p.join()
        if p.exitcode:
            raise SystemExit(f"the memory process failed with exit code {p.exitcode}")
        with open(f"{out}.0") as f:
            return json.load(f)


def _err(pred: float, meas: float) -> float:
    return pred / meas - 1 if meas else 0.0


def _summary(label: str, errors: list[float]) -> str:
    a = sorted(abs(e) for e in errors)
    return (f"{label}: median |error| {statistics.median(a):.1%}, worst {a[-1]:.1%} "
            f"({len(a)} steps)") if a else f"{label}: none"


def main() -> None:
    """Measure, predict, print the tables."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--models", type=lambda s: s.split(","), default=["mlp", "unet", "gpt"])
    parser.add_argument("--chunks", type=lambda s: [int(c) for c in s.split(",")], default=[2, 4, 8, 16])
    parser.add_argument("--skip", type=lambda s: s.split(","), default=[], help="parts to skip: dist,memory,plan")
    args = parser.parse_args()
    torch.set_num_threads(1)
    began = time.perf_counter()
    cpu = calibrate_cpu()
    print(f"torch {torch.__version__}, 1 thread; load average {os.getloadavg()[0]:.1f}; device model: {cpu.source}")
    tiny_steps = _spawn(_overhead_rank, args)[0]
    ranks_cpu = cpu.replace(message_overhead=fit_message_overhead(cpu, tiny_steps))
    print(f"2 ranks: {ranks_cpu.message_overhead * 1e6:.0f} us of a rank's time per message, fitted to a model with "
          "negligible compute (" + ", ".join(f"{s} {t * 1e3:.1f} ms" for s, t in tiny_steps.items()) + " at 16 chunks)")

    plans, alone, local, steps = {}, {}, {}, []
    for name in args.models:
        plans[name] = compile_local(name, 1, "gpipe")[0].plan  # one 2-stage cut for every run
        for m in args.chunks:
            pipes = {s: compile_local(name, m, s, plans[name]) for s in SCHEDULES}
            x = pipes["gpipe"][1]
            gm = pipes["gpipe"][0]._gm
            alone[(name, m)] = node_profile(gm, inputs_of_rows(gm, x.shape[0] // m, (x,)), repeats=5)
            local[(name, m)] = (measure_group(name, m, args.reps, None, pipes), pipes)
    dist_res = {} if "dist" in args.skip else _spawn(_dist_rank, args, plans)[0]

    print("\nstep time, ms: measured | predicted from measured node times (error) | predicted from FLOPs (error)")
    header = f"{'model':6} {'m':>3} {'schedule':8} {'runtime':8} {'measured':>9} {'pred.':>8} {'err':>7} {'FLOPs':>8} {'err':>7}"
    print(header)
    errors: dict[str, list[float]] = {"measured": [], "flops": [], "measured local": [], "measured ranks": []}
    for name in args.models:
        for m in args.chunks:
            med, pipes = local[(name, m)]
            for runtime, res in (("1 proc", med), ("2 ranks", dist_res.get(f"{name} {m}"))):
                if res is None:
                    continue
                times = rescale(alone[(name, m)], res["forward"], res["backward"])
                here = ranks_cpu.replace(link_latency=res["latency"]) if runtime != "1 proc" else cpu
                for s in SCHEDULES:
                    rt = "local" if runtime == "1 proc" else "distributed"
                    p1 = fxpipe.simulate(pipes[s][0], device=here, runtime=rt, measured=times).step_time
                    p2 = fxpipe.simulate(pipes[s][0], device=ranks_cpu if rt != "local" else cpu, runtime=rt).step_time
                    e1, e2 = _err(p1, res[s]), _err(p2, res[s])
                    errors["measured"].append(e1)
                    errors["flops"].append(e2)
                    errors["measured local" if rt == "local" else "measured ranks"].append(e1)
                    steps.append((name, m, s, runtime, res[s], p1, p2))
                    print(f"{name:6} {m:3} {s:8} {runtime:8} {res[s] * 1e3:9.1f} {p1 * 1e3:8.1f} {e1:+7.1%} "
                          f"{p2 * 1e3:8.1f} {e2:+7.1%}" + (f"  link {res['latency'] * 1e6:.0f} us" if rt != "local" else ""))
    print(_summary("predicted from measured node times", errors["measured"]))
    print(_summary("  one process", errors["measured local"]))
    print(_summary("  2 ranks", errors["measured ranks"]))
    print(_summary("predicted from FLOPs (device model only)", errors["flops"]))

    if "memory" not in args.skip:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "4096"  # a page or more is its own mapping, freed to the OS: RSS follows live memory
        mem_local = _spawn_one(_memory_rank, args, plans)
        mem_dist = _spawn(_memory_rank, args, plans)
        del os.environ["MALLOC_MMAP_THRESHOLD_"]
        print(f"\npeak memory growth over one step ({MEMORY_SCALE}x the batch), MiB: measured | predicted (error)")
        print(f"{'model':6} {'m':>3} {'schedule':8} {'where':14} {'measured':>9} {'pred.':>8} {'err':>7}")
        merr = []
        for name in args.models:
            for m in args.chunks:
                for s in SCHEDULES:
                    pipe = local[(name, m)][1][s][0]
                    key = f"{name} {m} {s}"
                    batch = BATCH[name] * MEMORY_SCALE
                    sims = {rt: fxpipe.simulate(pipe, device=cpu, runtime=rt, batch=batch)
                            for rt in ("local", "distributed")}
                    cases = [("1 proc", mem_local[key], sims["local"].devices[0].growth)]
                    cases += [(f"2 ranks, rank {r}", mem_dist[r][key], sims["distributed"].devices[r].growth)
                              for r in range(2)]
                    for where, meas, pred in cases:
                        merr.append(_err(pred, meas))
                        print(f"{name:6} {m:3} {s:8} {where:14} {meas / 2**20:9.1f} {pred / 2**20:8.1f} "
                              f"{merr[-1]:+7.1%}")
        print(_summary("memory", merr) + f"; {sum(abs(e) <= 0.15 for e in merr)} of {len(merr)} within 15%")

    if "plan" not in args.skip:
        candidates, predicted = {}, {}
        for name in args.models:
            model, x, _, _ = build(name)
            found = search(model, (x,), ranks=2, device=ranks_cpu, chunks=[1, 2, 4, 8, 16], optimizer="none", measure=True)
            top = found.ranked[:5]
            predicted[name] = top
            candidates[name] = [(found.plan(c), {"stages": c.stages, "chunks": c.chunks, "schedule": c.schedule,
                                                 "checkpoint": c.checkpoint}) for c in top]
        measured = _spawn(_plan_rank, args, candidates)[0]
        print("\nfxpipe plan --ranks 2 --device cpu --measure: its top five, measured on 2 ranks")
        for name in args.models:
            meas = [measured[name][str(k)] for k in range(len(predicted[name]))]
            for k, (c, t) in enumerate(zip(predicted[name], meas)):
                print(f"{name:6} #{k + 1} {c.stages} stages, chunks {c.chunks:2}, {c.schedule:5}, {c.checkpoint:11} "
                      f"predicted {c.sim.step_time * 1e3:7.1f} ms, measured {t * 1e3:7.1f} ms")
            print(f"{name:6} first choice / fastest measured: {meas[0] / min(meas):.3f}")
    print(f"\n({time.perf_counter() - began:.0f} s; load average {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
