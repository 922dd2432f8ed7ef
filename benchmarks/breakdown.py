"""Where a pipeline step's time goes: kernels, the W/I split, fxpipe's bookkeeping, messages, waiting.

    python benchmarks/breakdown.py             # 2 gloo ranks x 1 thread, small micro-batches, every schedule
    python benchmarks/breakdown.py --local     # one process: benchmarks/local.py's MLP, 4 stages, except_last
    python benchmarks/breakdown.py --quick     # a smoke run of either (add --local)

Across ranks (the residual MLP of ``benchmarks/distributed.py`` at d = 128, hidden 512, batch
2048, m = 8: 256-row micro-batches, 128 KiB messages), each rank times, in an order shuffled
anew every repetition and barrier to barrier, one fxpipe step of every schedule, the same
stages' forward and backward kernels under plain autograd over the same micro-batches (fused,
and split into I and W for the schedules that split), and eager over the micro-batches on rank
0 (the bound), plus a hand-written 1F1B of the same stages over raw gloo (the floor: no fxpipe
runtime at all). Probes around :class:`fxpipe.runtime.transport.comm.Comm` count the messages and
the main thread's CPU time posting and waiting for them. Per rank and schedule, with medians::

    step          wall time, barrier to barrier
    kernels       CPU time of the stage's F and B under plain autograd (the split's I + W: + split)
    bookkeeping   the step's main-thread CPU time less kernels, split and messages: the interpreter,
                  stage calls, autograd bookkeeping, the split and join, the loss, buffers
    messages      main-thread CPU time in posting and waiting (per message: / count)
    posting       wall time the main thread spends inside posting (a gloo send can block its caller)
    idle          wall less main-thread CPU: waiting for a peer (the bubble), descheduled
    gloo          CPU time of the process's other threads (gloo's transport)

plus two counts that do not move with the machine's load: Python function calls per action
(cProfile, the step's calls divided by its actions) and tensor allocations fxpipe makes per step.
Times are CPU time of the main thread (``time.thread_time``) where the load of other processes
would otherwise blur them; ratios are of medians from this run.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import json
import os
import pstats
import random
import resource
import statistics
import sys
import time
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path[:0] = [os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."),
                os.path.dirname(os.path.abspath(__file__))]
from distributed import ResidualMLP, _env, _spawn  # noqa: E402

import fxpipe  # noqa: E402
from fxpipe.runtime.stage import wgrad  # noqa: E402
from fxpipe.runtime.stage.worker import StageWorker  # noqa: E402
from fxpipe.runtime.transport.comm import Comm  # noqa: E402

ONE = ("gpipe", "1f1b", "zb")  # one stage per rank
TWO = ("interleaved", "zbv")  # two stages per rank
ALLOCATORS = ("empty", "zeros", "empty_like", "zeros_like")


class Probe:
    """Count messages and time the main thread's posting and waiting in :class:`Comm`."""

    def __init__(self) -> None:
        self.reset()
        batch, wait = Comm._batch, Comm.wait
        probe = self

        def _batch(comm, sends, recvs, what):
            c0, w0 = time.thread_time(), time.perf_counter()
            try:
                return batch(comm, sends, recvs, what)
            finally:
                probe.cpu += time.thread_time() - c0
                probe.posting += time.perf_counter() - w0
                probe.messages += len(sends) + len(recvs)
                probe.bytes += sum(t.numel() * t.element_size() for t, _, _ in list(sends) + list(recvs))

        def _wait(comm, works, what, peer=None):
            c0 = time.thread_time()
            try:
                return wait(comm, works, what, peer)
            finally:
                probe.cpu += time.thread_time() - c0

        Comm._batch, Comm.wait = _batch, _wait

    def reset(self) -> None:
        """Start counting afresh."""
        self.cpu, self.posting, self.messages, self.bytes = 0.0, 0.0, 0, 0


def capture(pipe, step) -> dict:
    """Run one step recording each of this rank's stage calls: inputs, output gradients, loss."""
    seen: dict = {}
    forward, backward = StageWorker.forward, StageWorker.backward

    def fwd(self, i, inputs, **kw):
        seen.setdefault(self.index, {}).setdefault(i, {})["inputs"] = [
            v.detach().clone() if isinstance(v, torch.Tensor) else v for v in inputs]
        seen[self.index][i]["loss"] = kw.get("loss")
        return forward(self, i, inputs, **kw)

    def bwd(self, i, grads, kind="B"):
        seen[self.index][i]["grads"] = None if grads is None else [
            g.detach().clone() if isinstance(g, torch.Tensor) else g for g in grads]
        return backward(self, i, grads, kind)

    StageWorker.forward, StageWorker.backward = fwd, bwd
    try:
        step()
    finally:
        StageWorker.forward, StageWorker.backward = forward, backward
    return seen


def plain(pipe, seen: dict, split: bool):
    """Return a run of this rank's stages under plain autograd, F then B per micro-batch.

    With ``split``, the micro-batches the step deferred run I, then W (those whose W directly
    follows their I run fused, as the step runs them).
    """
    workers = pipe._runtime.workers

    def run():
        for j, calls in seen.items():
            fn = workers[j].call.fn
            for i in sorted(calls):
                rec = calls[i]
                leaves = [v.detach().requires_grad_(v.is_floating_point()) if isinstance(v, torch.Tensor) else v
                          for v in rec["inputs"]]
                store: list = []
                deferred = split and workers[j].defer and i not in getattr(workers[j], "fused", ())  # as the step did
                with wgrad.collecting(store) if deferred else _nothing():
                    out = fn(*leaves)
                    if rec["loss"] is not None:
                        out = rec["loss"](out)
                if rec["loss"] is not None:
                    out.backward()
                else:
                    outs = out if isinstance(out, (tuple, list)) else [out]
                    pairs = [(o, g) for o, g in zip(outs, rec["grads"]) if isinstance(g, torch.Tensor)]
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                if deferred:
                    wgrad.run(store)
    return run


def floor_1f1b(pipe, seen: dict, rank: int):
    """Return a hand-written 1F1B of this rank's stage: plain autograd and raw gloo, no fxpipe runtime.

    The leanest 1F1B two ranks can run on these cores: every receive is posted up front into a
    buffer of its own, sends are ``isend`` and waited for at the end, and each stage is the same
    GraphModule fxpipe runs (called directly). What fxpipe's 1F1B spends beyond this is its own;
    what this spends beyond the bound is the messages' and the cores'.
    """
    (j, calls), = seen.items()
    fn, peer = pipe._runtime.workers[j].call.fn, 1 - rank
    m = len(calls)
    first = rank == 0
    if len(calls[0]["inputs"]) != 1:
        raise SystemExit("floor_1f1b: expects one tensor into and out of each stage")
    like = calls[0]["inputs"][0]  # what the last stage receives: its input
    if first:
        with torch.no_grad():
            made = fn(like)
        if not isinstance(made, (tuple, list)) or len(made) != 1:
            raise SystemExit("floor_1f1b: expects one tensor into and out of each stage")
        like = made[0]  # what the first stage receives: its output's gradient

    def run():
        bufs = [torch.empty_like(like) for _ in range(m)]
        recvs = [dist.irecv(b, peer, tag=i) for i, b in enumerate(bufs)]
        sends, outs = [], {}
        if first:
            def fwd(i):
                outs[i] = fn(calls[i]["inputs"][0])[0]
                sends.append(dist.isend(outs[i].detach(), peer, tag=i))

            def bwd(i):
                recvs[i].wait()
                torch.autograd.backward(outs.pop(i), bufs[i])
            fwd(0)
            for i in range(1, m):
                fwd(i)
                bwd(i - 1)
            bwd(m - 1)
        else:
            for i in range(m):
                recvs[i].wait()
                leaf = bufs[i].requires_grad_()
                calls[i]["loss"](fn(leaf)).backward()
                sends.append(dist.isend(leaf.grad, peer, tag=i))
        for w in sends:
            w.wait()
    return run


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _faults() -> int:
    """Return this process's minor page faults so far (fresh pages the allocator had given back)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def calls_per_step(step) -> tuple[int, dict[str, int]]:
    """Return the Python function calls of one run of ``step`` and its tensor allocations by kind."""
    prof = cProfile.Profile()
    prof.enable()
    step()
    prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    total = sum(v[1] for v in stats.values())
    allocs = {k: 0 for k in ALLOCATORS}
    for (_, _, name), v in stats.items():
        for k in ALLOCATORS:
            if name == f"<built-in method torch.{k}>":
                allocs[k] += v[1]
    return total, allocs


def _dist_rank(rank: int, port: int, args, out: str) -> None:
    """One rank: time each schedule's step, its plain kernels and eager over the micro-batches."""
    _env(rank, port)
    probe = Probe()
    torch.manual_seed(0)
    base = ResidualMLP(args.dim, args.hidden, args.blocks)
    x, y = torch.randn(args.batch, args.dim), torch.randn(args.batch, args.dim)
    quarter = args.blocks // 4
    pipes = {}
    for s in args.schedules:
        layout = ({"split_points": [f"blocks.{k * quarter}" for k in (1, 2, 3)], "stages_per_rank": 2}
                  if s in TWO else {"split_points": [f"blocks.{args.blocks // 2}"]})
        pipes[s] = fxpipe.compile(copy.deepcopy(base), 4 if s in TWO else 2, example_inputs=(x,), chunks=args.chunks,
                                  schedule=s, checkpoint="never", runtime="distributed", **layout)

    def fx_step(s):
        last = pipes[s].plan.stages[-1].on_rank == rank
        return lambda: pipes[s].step(x if rank == 0 else None, target=y if last else None, loss_fn=F.mse_loss)

    eager = copy.deepcopy(base)

    def eager_micro():
        if rank == 0:
            for xs, ys in zip(x.chunk(args.chunks), y.chunk(args.chunks)):
                (F.mse_loss(eager(xs), ys) / args.chunks).backward()

    runs = {"eager micro": eager_micro}
    for s in args.schedules:
        step = fx_step(s)
        step()  # a first step sizes the buffers, lowers the programs
        seen = capture(pipes[s], step)
        runs[f"fxpipe {s}"] = step
        runs[f"kernels {s}"] = plain(pipes[s], seen, split=False)
        if pipes[s].schedule.deferring(args.chunks):
            runs[f"split {s}"] = plain(pipes[s], seen, split=True)
        if s == "1f1b":
            runs["floor 1f1b"] = floor_1f1b(pipes[s], seen, rank)
    rows: dict[str, dict[str, list[float]]] = {k: defaultdict(list) for k in runs}
    for fn in runs.values():
        fn()
    for r in range(args.reps):
        order = list(runs)
        random.Random(r).shuffle(order)
        for name in order:
            dist.barrier()
            probe.reset()
            f0 = _faults()
            w0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
            runs[name]()
            c1, p1 = time.thread_time(), time.process_time()
            f1 = _faults()
            dist.barrier()
            row = rows[name]
            row["wall"].append(time.perf_counter() - w0)
            row["cpu"].append(c1 - c0)
            row["others"].append((p1 - p0) - (c1 - c0))
            row["msg_cpu"].append(probe.cpu)
            row["posting"].append(probe.posting)
            row["messages"].append(probe.messages)
            row["bytes"].append(probe.bytes)
            row["faults"].append(f1 - f0)
    result = {k: {f: statistics.median(v) for f, v in row.items()} for k, row in rows.items()}
    for s in args.schedules:  # counts that do not move with the load
        dist.barrier()
        calls, allocs = calls_per_step(runs[f"fxpipe {s}"])
        kcalls, kallocs = calls_per_step(runs[f"kernels {s}"])
        program = pipes[s]._runtime._programs_for("train", args.chunks)[rank]
        actions = [a for clock in program.clocked for g in clock for a in g]
        result[f"fxpipe {s}"].update(calls=calls, kernel_calls=kcalls, actions=len(actions),
                                     compute=sum(a.kind in "FBIW" for a in actions),
                                     allocs=sum(allocs.values()), kernel_allocs=sum(kallocs.values()))
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def report_dist(args, per_rank: list[dict]) -> None:
    """Print the breakdown per schedule and rank, then the ratios against the bound."""
    print(f"residual MLP d={args.dim} hidden={args.hidden} blocks={args.blocks} batch={args.batch} m={args.chunks}, "
          f"2 gloo ranks x 1 thread, {args.reps} shuffled repetitions, medians (ms, and share of the step)")
    head = ("schedule", "rank", "step", "kernels", "split", "bookkeeping", "messages", "posting", "idle", "gloo",
            "msgs", "us/msg", "calls/action", "allocs", "faults")
    print(" ".join(f"{h:>12}" for h in head))
    for s in args.schedules:
        for r, res in enumerate(per_rank):
            step, k = res[f"fxpipe {s}"], res[f"kernels {s}"]["cpu"]
            split = res[f"split {s}"]["cpu"] - k if f"split {s}" in res else 0.0
            book = step["cpu"] - k - split - step["msg_cpu"]
            idle = step["wall"] - step["cpu"]
            msgs = step["messages"]
            extra_calls = (step["calls"] - step["kernel_calls"]) / max(step["actions"], 1)

            def cell(v: float, wall: float = step["wall"]) -> str:
                return f"{v * 1e3:6.1f} {v / wall:4.0%}"
            print(" ".join(f"{c:>12}" for c in (
                s, r, f"{step['wall'] * 1e3:.1f}", cell(k), cell(split), cell(book), cell(step["msg_cpu"]),
                cell(step["posting"]), cell(idle), cell(step["others"]), f"{msgs:.0f}",
                f"{step['msg_cpu'] / max(msgs, 1) * 1e6:.0f}", f"{extra_calls:.0f}",
                f"{step['allocs'] - step['kernel_allocs']}",
                f"{step['faults']:.0f}/{res[f'kernels {s}']['faults']:.0f}")))
    eager = per_rank[0]["eager micro"]["wall"]
    p, m = 2, args.chunks
    bound = (m + p - 1) / m * eager / p
    med = {s: per_rank[0][f"fxpipe {s}"]["wall"] for s in args.schedules}
    print(f"\nbound of 1F1B, (m + p - 1)/m x eager over the micro-batches / p: fxpipe 1f1b / bound = "
          f"{med['1f1b'] / bound:.3f}" if "1f1b" in med else "")
    print("each schedule / the same bound: " + ", ".join(f"{s} {v / bound:.3f}" for s, v in med.items()))
    if "floor 1f1b" in per_rank[0]:
        floor = per_rank[0]["floor 1f1b"]["wall"]
        print(f"hand-written 1F1B (plain autograd, raw gloo isend/irecv, receives posted up front): "
              f"{floor * 1e3:.1f} ms = {floor / bound:.3f} x the bound; fxpipe 1f1b / it = {med['1f1b'] / floor:.3f}")
    if "zb" in med and "1f1b" in med:
        print(f"zb / 1f1b: {med['zb'] / med['1f1b']:.3f}")
    print("calls/action: Python calls per action beyond plain autograd's; allocs: tensors fxpipe allocates "
          "per step beyond plain autograd's; us/msg: main-thread CPU per message; posting: wall time the main "
          "thread spends inside posting sends and receives (blocked in gloo, or descheduled); faults: minor page "
          "faults per step / of the plain kernels")


def _local(args) -> None:
    """One process: fxpipe's GPipe step against the same kernels with the same recomputation, and torchgpipe."""
    from local import mlp, split_points_for, train_step

    torch.set_num_threads(1)
    torch.manual_seed(0)
    seq = mlp(args.local_dim, args.local_depth)
    x, y = torch.randn(args.local_batch, args.local_dim), torch.randn(args.local_batch, args.local_dim)
    m = args.chunks
    balance = [len(seq) // 4] * 4
    fx = fxpipe.compile(copy.deepcopy(seq), 4, example_inputs=(x,), chunks=m, checkpoint="except_last",
                        devices=["cpu"] * 4, split_points=split_points_for(seq, balance))
    eager = copy.deepcopy(seq)
    mbs = list(zip(x.chunk(m), y.chunk(m)))

    def eager_micro():
        for xs, ys in mbs:
            (F.mse_loss(eager(xs), ys) / m).backward()

    def kernels():  # the same work: a no_grad forward more for each recomputed micro-batch
        for k, (xs, ys) in enumerate(mbs):
            if k < m - 1:
                with torch.no_grad():
                    eager(xs)
            (F.mse_loss(eager(xs), ys) / m).backward()

    runs = {"eager micro": eager_micro, "kernels with recomputation": kernels, "fxpipe": train_step(fx, x, y)}
    try:
        from torchgpipe import GPipe

        runs["torchgpipe"] = train_step(GPipe(copy.deepcopy(seq), balance=balance, devices=["cpu"] * 4, chunks=m,
                                              checkpoint="except_last"), x, y)
    except ImportError:
        print("torchgpipe is not installed (pip install torchgpipe==0.0.7 --no-deps): its row is left out")
    for fn in runs.values():
        fn()
    wall: dict[str, list[float]] = defaultdict(list)
    cpu: dict[str, list[float]] = defaultdict(list)
    faults: dict[str, list[float]] = defaultdict(list)
    for r in range(args.reps):
        order = list(runs)
        random.Random(r).shuffle(order)
        for name in order:
            f0, w0, c0 = _faults(), time.perf_counter(), time.process_time()
            runs[name]()
            cpu[name].append(time.process_time() - c0)
            wall[name].append(time.perf_counter() - w0)
            faults[name].append(_faults() - f0)
    med = {k: statistics.median(v) for k, v in cpu.items()}
    limit = med["eager micro"] * (1 + (m - 1) / m / 3)
    print(f"MLP {args.local_depth} x Linear({args.local_dim}) + ReLU, batch {args.local_batch}, 4 stages, chunks {m}, "
          f"except_last, 1 thread; {args.reps} shuffled repetitions, medians of the process's CPU time")
    print(f"{'run':28} {'cpu ms':>8} {'wall ms':>8} {'/ limit':>8} {'/ kernels':>10} {'calls/stage call':>17} "
          f"{'faults':>8}")
    base_calls = calls_per_step(runs["eager micro"])[0]
    for name in runs:
        per_call = (calls_per_step(runs[name])[0] - base_calls) / (4 * m)
        print(f"{name:28} {med[name] * 1e3:8.1f} {statistics.median(wall[name]) * 1e3:8.1f} "
              f"{med[name] / limit:8.3f} {med[name] / med['kernels with recomputation']:10.3f} {per_call:17.1f} "
              f"{statistics.median(faults[name]):8.0f}")
    print(f"limit = eager over the micro-batches x (1 + (m - 1)/m x 1/3); kernels with recomputation: the "
          f"same micro-batches with a no_grad forward more for each of the {m - 1} recomputed ones; CPU time of "
          "every thread (torchgpipe computes on threads of its own); faults: minor page faults per step")


def main() -> None:
    """Parse arguments; run the distributed breakdown or the one-process one."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--schedules", nargs="+", default=list(ONE + TWO), choices=ONE + TWO)
    parser.add_argument("--local", action="store_true", help="the one-process breakdown instead")
    parser.add_argument("--local-dim", type=int, default=1024)
    parser.add_argument("--local-depth", type=int, default=16)
    parser.add_argument("--local-batch", type=int, default=1024)
    parser.add_argument("--quick", action="store_true", help="a tiny smoke run")
    args = parser.parse_args()
    if args.quick:
        args.reps = 2
        args.batch, args.local_batch, args.local_dim = 256, 128, 256
    if args.local:
        _local(args)
        return
    report_dist(args, _spawn(_dist_rank, args))


if __name__ == "__main__":
    main()
