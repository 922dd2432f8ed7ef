"""Predicted against measured steps and peak memory for the layouts ``fxpipe plan --gpus`` chooses among, on 4 gloo ranks.

    python benchmarks/validate_layouts.py            # 3 models x 8 layouts, 4 spawned gloo ranks on this CPU
    python benchmarks/validate_layouts.py --quick    # 1 model x 3 layouts, few steps (a smoke run)

Layouts: pp4 (1F1B); pp2 x dp2 replicated and sharded (FSDP2); pp2 x 2 stages per rank x dp2,
interleaved and ZB-V; dp4; pp2 x tp2; pp4 zero bubble. Models: a deep MLP, and two Llama-style
decoders (``benchmarks/llama.py``: "small", "medium", real weights). Each layout runs for real:
every rank compiles it, runs warm-up steps, then ``--reps`` steps timed barrier to barrier (the
median is the measured step). Then new ranks run it again with every allocation above 4 KiB its
own mapping (``MALLOC_MMAP_THRESHOLD_=4096``, so the resident set follows live memory), and the
peak resident growth of one step (gradients set to None before it) is each rank's measured
memory; the timed ranks keep glibc's default, as a user's do (a page fault on every allocation
slowed the small models' steps by up to 1.4x), or with ``--keep-pages`` start with glibc keeping
the pages it frees (no faults from a heap given back to the kernel and filled again, which the
W/I split and schedules that hold several micro-batches meet: docs/benchmarks/breakdown.md).
The prediction is ``fxpipe.simulate(pipe, device="cpu", measured=True)`` on every rank of the
timed run, as a user would call it: rank 0 times the nodes of a plain copy of the whole model
alone, the ranks time their links, and the CPU device model shares the machine's cores among
the ranks computing at once (4 ranks on 2 cores: each at about half speed while all four
compute). With ``--rounds k`` it predicts k
times, each before its share of the timed steps, and compares the median prediction (the first
one's ratio is printed beside it).

Printed per layout: measured and predicted step, their ratio; per rank measured and predicted
growth. Then the summary the issue asks for: step error at the median and worst, the share of
ranks whose memory is within 15%, and per model the measured step of the layout predicted
fastest over the fastest measured.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), HERE]
from llama import build
from ports import run_ranks
from rss import peak_growth

import fxpipe

WORLD = 4
LAYOUTS = ["pp4@1f1b", "pp2xdp2@1f1b", "pp2xdp2:shard@1f1b", "pp2:v2xdp2@interleaved", "pp2:v2xdp2@zbv",
           "pp1xdp4@1f1b", "pp2:tp2@1f1b", "pp4@zb"]


def _mlp():
    layers = []
    for _ in range(8):
        layers += [nn.Linear(512, 512), nn.Tanh()]
    return nn.Sequential(*layers), torch.randn(256, 512), torch.randn(256, 512), F.mse_loss


def _token_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _llama(name):
    def make():
        model, (tokens,) = build(name, seq=128, batch=32, meta=False)
        return model, tokens, torch.randint(0, 256, tokens.shape), _token_loss
    return make


MODELS = {"mlp": _mlp, "llama-small": _llama("small"), "llama-medium": _llama("medium")}


def parse(name: str) -> dict:
    """Return layout ``name`` (``pp2:v2xdp2@zbv``) as compile's keywords and ``pp``."""
    spec, _, schedule = name.partition("@")
    out = {"pp": 1, "data_parallel": 1, "data_parallel_shard": False, "stages_per_rank": 1, "tensor_parallel": 1,
           "schedule": schedule}
    for part in spec.replace("x", ":").split(":"):
        key = {"pp": "pp", "dp": "data_parallel", "v": "stages_per_rank", "tp": "tensor_parallel"}
        for prefix, k in key.items():
            if part.startswith(prefix) and part[len(prefix):].isdigit():
                out[k] = int(part[len(prefix):])
        if part == "shard":
            out["data_parallel_shard"] = True
    return out


def _rank(rank: int, port: int, model_name: str, layout: str, reps: int, chunks: int, what: str, rounds: int,
          out: str) -> None:
    """One rank: compile the layout, then time steps and predict (``what="time"``) or measure a step's memory."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    kw = parse(layout)
    pp, dp, tp, v = kw.pop("pp"), kw["data_parallel"], kw["tensor_parallel"], kw["stages_per_rank"]
    torch.manual_seed(0)
    model, x, y, loss_fn = MODELS[model_name]()
    rows = x.shape[0] // dp
    replica, pp_rank = rank // (pp * tp), rank // tp % pp
    xs, ys = x[replica * rows:(replica + 1) * rows], y[replica * rows:(replica + 1) * rows]
    pipe = fxpipe.compile(model, pp * v, example_inputs=(xs,), runtime="distributed", timeout=300,
                          chunks=chunks, checkpoint="never", **kw)
    last = pipe.plan.stages[-1].on_rank == pp_rank
    opt = torch.optim.SGD([p for p in pipe.parameters() if p.requires_grad], lr=1e-3)

    def step():
        pipe.step(xs if pp_rank == 0 else None, target=ys if last else None, loss_fn=loss_fn)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    if what == "memory":
        with peak_growth() as growth:
            step()
        result: dict = {"growth": growth["bytes"]}
    else:
        times, predicted = [], []
        for block in range(rounds):
            # as a user asks: rank 0 times the nodes alone, the others waiting; the model shares the cores among ranks
            sim = fxpipe.simulate(pipe, device="cpu", measured=True, optimizer="sgd")
            predicted.append(sim.step_time)
            for _ in range(reps // rounds + (block < reps % rounds)):
                dist.barrier()
                start = time.perf_counter()
                step()
                dist.barrier()
                times.append(time.perf_counter() - start)
        where = pipe.plan.stages_of(pp_rank)[0]
        result = {"measured": statistics.median(times), "predicted": statistics.median(predicted),
                  "first_prediction": predicted[0], "predicted_growth": sim.devices[sim.stages[where].rank].growth}
    every = [None] * WORLD
    dist.all_gather_object(every, result)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(every, f)
    dist.destroy_process_group()


KEEP_PAGES = {"MALLOC_TRIM_THRESHOLD_": str(2**30), "MALLOC_MMAP_THRESHOLD_": str(2**30)}  # glibc keeps freed pages
FOLLOW_LIVE = {"MALLOC_MMAP_THRESHOLD_": "4096"}  # every block above 4 KiB its own mapping: RSS follows live memory


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """Set ``values`` in the environment the spawned ranks start with (glibc reads them at a process's start)."""
    os.environ.update(values)
    try:
        yield
    finally:
        for k in values:
            del os.environ[k]


def run_layout(model_name: str, layout: str, reps: int, chunks: int, keep_pages: bool = False,
               rounds: int = 1) -> list[dict] | None:
    """Run one layout on 4 spawned ranks, timed then (new processes) its memory; return each rank's result
    (None if it failed). The timed ranks keep glibc's default, as a user's do (page faults on every allocation
    slow a step down), or with ``keep_pages`` start with glibc keeping the pages it frees."""
    with _environ(KEEP_PAGES if keep_pages else {}):
        timed = _spawn(model_name, layout, reps, chunks, "time", rounds)
    with _environ(FOLLOW_LIVE):
        grown = _spawn(model_name, layout, reps, chunks, "memory")
    if timed is None or grown is None:
        return None
    return [t | g for t, g in zip(timed, grown)]


def _spawn(model_name: str, layout: str, reps: int, chunks: int, what: str, rounds: int = 1) -> list[dict] | None:
    """Run :func:`_rank` on 4 spawned ranks; return each rank's result (None if it failed)."""
    return run_ranks(_rank, WORLD, model_name, layout, reps, chunks, what, rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 model, 3 layouts, 3 steps")
    parser.add_argument("--reps", type=int, default=15, help="timed steps per layout (default 15)")
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches (default 4)")
    parser.add_argument("--keep-pages", action="store_true",
                        help="time the steps with glibc keeping the pages it frees (MALLOC_TRIM_THRESHOLD_ and "
                             "MALLOC_MMAP_THRESHOLD_ at 1 GiB): no page faults from a heap given back and refilled")
    parser.add_argument("--rounds", type=int, default=1,
                        help="predict this many times, each before its share of the timed steps, and compare the "
                             "median prediction (the first one is printed too): the host's speed drifts between a "
                             "prediction's measurement and steps timed later")
    args = parser.parse_args()
    models = ["mlp"] if args.quick else list(MODELS)
    layouts = LAYOUTS[:3] if args.quick else LAYOUTS
    reps = 3 if args.quick else args.reps
    errors, firsts, memory, choice = [], [], [], {}
    for m in models:
        runs = {}
        for layout in layouts:
            res = run_layout(m, layout, reps, args.chunks, args.keep_pages, args.rounds)
            if res is None:
                print(f"{m:13s} {layout:24s} failed (see the ranks' output above)", flush=True)
                continue
            meas, pred = res[0]["measured"], res[0]["predicted"]
            runs[layout] = (meas, pred)
            errors.append(pred / meas - 1)
            firsts.append(res[0]["first_prediction"] / meas - 1)
            mem = [(r["growth"], r["predicted_growth"]) for r in res]
            memory += [p / g - 1 for g, p in mem if g > 0]
            print(f"{m:13s} {layout:24s} step measured {meas * 1e3:8.2f} ms, predicted {pred * 1e3:8.2f} ms "
                  f"({pred / meas:.3f}x, first {firsts[-1] + 1:.3f}x); memory MiB measured | predicted: "
                  + " ".join(f"{g / 2**20:.1f}|{p / 2**20:.1f}" for g, p in mem), flush=True)
        if runs:
            best = min(runs, key=lambda k: runs[k][1])
            choice[m] = (best, runs[best][0] / min(t for t, _ in runs.values()))
    if not errors:
        raise SystemExit("no layout ran")
    worst = max(errors, key=abs)
    print(f"\nstep: {len(errors)} layouts, error at the median {statistics.median(abs(e) for e in errors):.1%}, "
          f"worst {worst:+.1%}")
    if args.rounds > 1:
        print(f"      (the first of the {args.rounds} predictions alone: error at the median "
              f"{statistics.median(abs(e) for e in firsts):.1%}, worst {max(firsts, key=abs):+.1%})")
    print(f"peak memory growth: {sum(abs(e) <= 0.15 for e in memory)} of {len(memory)} ranks within 15% "
          f"(median error {statistics.median(abs(e) for e in memory):.1%})")
    for m, (best, ratio) in choice.items():
        print(f"{m}: predicted fastest {best}, measured {ratio:.3f}x the fastest measured")


if __name__ == "__main__":
    main()
