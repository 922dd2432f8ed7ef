"""Recomputation policies side by side: peak activation memory, step time, the auto choice, the prediction.

    python benchmarks/memory_policies.py            # 2 ranks x 1 thread, 12 Llama-style blocks, 1F1B, m = 8
    python benchmarks/memory_policies.py --quick    # a small stack, 2 repetitions: a smoke run

A stack of 12 pre-norm decoder blocks (d 512, RMSNorm, rotary attention through
scaled_dot_product_attention, a SwiGLU MLP of 1408) on 2 spawned ranks (gloo, one thread each),
6 blocks each, 1F1B over m = 8 micro-batches of 2 sequences of 128 tokens, MSE loss. For each policy (checkpoint="never", "selective", "except_last",
"always") fresh ranks run a warm-up step (so the gradients exist, zeroed, not freed), then
measure the peak growth of the resident set over one step: the activation memory at its
highest, which the simulator predicts too (``fxpipe.simulate``, the stage's "activations").
The budget for checkpoint="auto" is then set halfway between the measured peaks (parameters,
gradients and activations, the larger rank's) of "always" and "never"; auto's ranks are measured
the same way. Last, two ranks compile all five and time their steps alternating in an order
shuffled every repetition; each ratio is of medians from this one run.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path[:0] = [os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."),
                os.path.dirname(os.path.abspath(__file__))]
import fxpipe  # noqa: E402
from distributed import _env, _spawn, report, time_shuffled  # noqa: E402
from rss import peak_growth  # noqa: E402

POLICIES = ("never", "selective", "except_last", "always")


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class Block(nn.Module):
    """Pre-norm rotary attention and a SwiGLU MLP, each with a residual connection."""

    def __init__(self, d: int, heads: int, hidden: int, seq: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)
        freqs = torch.outer(torch.arange(seq, dtype=torch.float32),
                            1.0 / 10000 ** (torch.arange(0, d // heads, 2, dtype=torch.float32) / (d // heads)))
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def rope(self, x):
        x1, x2 = x[..., 0::2], x[..., 1::2]
        cos, sin = self.cos[: x.shape[-2]], self.sin[: x.shape[-2]]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)

    def forward(self, x):
        b, t, d = x.shape
        h = self.norm1(x)
        q, k, v = (m(h).view(b, t, self.heads, d // self.heads).transpose(1, 2) for m in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(self.rope(q), self.rope(k), v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Stack(nn.Module):
    """``layers`` blocks."""

    def __init__(self, d: int, heads: int, hidden: int, seq: int, layers: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[Block(d, heads, hidden, seq) for _ in range(layers)])

    def forward(self, x):
        return self.blocks(x)


def _setup(args):
    """Return the model and a batch with its target (the same on every rank)."""
    torch.manual_seed(0)
    model = Stack(args.dim, args.heads, args.hidden, args.seq, args.layers)
    x, y = torch.randn(args.batch, args.seq, args.dim), torch.randn(args.batch, args.seq, args.dim)
    return model, x, y


def _compile(model, x, args, policy, budget=None):
    """Compile the 2-stage 1F1B pipe of ``policy`` ("auto" with ``budget``)."""
    return fxpipe.compile(model, 2, example_inputs=(x,), chunks=args.chunks, schedule="1f1b", checkpoint=policy,
                          max_memory=budget, runtime="distributed", split_points=[f"blocks.{args.layers // 2}"])


def _memory_rank(rank: int, port: int, args, policy: str, budget, out: str) -> None:
    """One rank of one policy: the peak growth over one step after a warm-up, and the prediction."""
    _env(rank, port)
    dist.init_process_group("gloo")
    model, x, y = _setup(args)
    try:
        pipe = _compile(model, x, args, policy, budget)
    except fxpipe.MemoryBudgetError as exc:  # auto: nothing predicted to fit (every rank says so)
        report(out, rank, {"error": str(exc)})
        dist.destroy_process_group()
        return
    last = rank == pipe.plan.stages[-1].on_rank

    def step():
        pipe.step(x if rank == 0 else None, target=y if last else None, loss_fn=F.mse_loss)

    step()
    pipe.zero_grad(set_to_none=False)  # the gradients stay allocated: the growth is the activations'
    gc.collect()
    dist.barrier()
    with peak_growth() as growth:
        step()
    sim = fxpipe.simulate(pipe, device="h100", runtime="distributed")  # the memory walk needs no speeds
    mine = pipe.plan.stages_of(rank)[0]
    state = sum(p.numel() * p.element_size() for p in pipe.stages[mine].parameters()) * 2  # and their gradients
    report(out, rank, {"measured": growth["bytes"], "predicted": sim.stages[mine].memory.activations,
                       "state": state, "policy": pipe.plan.policies()[mine]})
    dist.destroy_process_group()


def _speed_rank(rank: int, port: int, args, budget: float, out: str) -> None:
    """Both ranks: compile every policy and auto, then time their steps in shuffled order."""
    _env(rank, port)
    dist.init_process_group("gloo")
    model, x, y = _setup(args)
    pipes = {p: _compile(copy.deepcopy(model), x, args, p) for p in POLICIES}
    if budget is not None:
        pipes["auto"] = _compile(copy.deepcopy(model), x, args, "auto", budget)
    last = rank == pipes["never"].plan.stages[-1].on_rank

    def run(pipe):
        return lambda: pipe.step(x if rank == 0 else None, target=y if last else None, loss_fn=F.mse_loss)

    time_shuffled({p: run(pipe) for p, pipe in pipes.items()}, args.reps, rank, out)


def main() -> None:
    """Measure every policy's memory in fresh ranks, choose auto's budget, time all; print tables and ratios."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1408)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="a small stack and 2 repetitions (a smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.dim, args.heads, args.hidden, args.seq, args.layers, args.batch, args.reps = 128, 4, 352, 128, 4, 16, 2
    mib = 2 ** 20
    # the memory ranks map every block over 64 KiB on its own, so freed tensors go back to the OS and the
    # peak follows live memory; the timed ranks run with glibc's defaults, as a user's do (a mapping per
    # tensor costs page faults on every allocation, more for the policies that allocate more)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    memory = {p: _spawn(_memory_rank, args, p, None) for p in POLICIES}
    total = {p: max(r["measured"] + r["state"] for r in memory[p]) for p in POLICIES}
    budget = (total["always"] + total["never"]) / 2
    memory["auto"] = _spawn(_memory_rank, args, "auto", budget)
    del os.environ["MALLOC_MMAP_THRESHOLD_"]
    refused = memory["auto"][0].get("error")
    times = {k: statistics.median(v) for k, v in _spawn(_speed_rank, args, None if refused else budget)[0].items()}
    names = (*POLICIES, "auto") if not refused else POLICIES

    print(f"decoder stack d={args.dim} heads={args.heads} hidden={args.hidden} seq={args.seq} layers={args.layers} "
          f"batch={args.batch}, 2 ranks x 1 thread, 1F1B, m={args.chunks}; {args.reps} alternating steps, medians")
    print(f"{'policy':12} {'rank':>4} {'chosen':>12} {'measured MiB':>12} {'predicted MiB':>13} {'pred/meas':>9} "
          f"{'+ state MiB':>11} {'step s':>7}")
    for p in names:
        for r, res in enumerate(memory[p]):
            print(f"{p:12} {r:4} {res['policy']:>12} {res['measured'] / mib:12.1f} {res['predicted'] / mib:13.1f} "
                  f"{res['predicted'] / max(res['measured'], 1):9.2f} {(res['measured'] + res['state']) / mib:11.1f} "
                  f"{times[p]:7.3f}")
    peak = {p: max(r["measured"] for r in memory[p]) for p in names}
    ranks = "  ".join(f"rank {r} {memory['selective'][r]['measured'] / memory['never'][r]['measured']:.2f}"
                      for r in range(2))
    print(f"selective / never: peak activation memory {peak['selective'] / peak['never']:.2f} (target <= 0.60; "
          f"{ranks}), step {times['selective'] / times['never']:.3f} (target <= 1.10); always / never: memory "
          f"{peak['always'] / peak['never']:.2f}, step {times['always'] / times['never']:.3f} (about one more forward)")
    fits = {p: all(r["measured"] + r["state"] <= budget for r in memory[p]) for p in names}
    uniform = [p for p in POLICIES if fits[p]]
    best = min(uniform, key=times.__getitem__) if uniform else None
    if refused:
        print(f"auto under max_memory={budget / mib:.1f} MiB (halfway between always and never): refused: {refused}")
    else:
        print(f"auto under max_memory={budget / mib:.1f} MiB (halfway between always and never): "
              f"{'fits' if fits['auto'] else 'DOES NOT FIT'} on every rank, policies "
              f"{[r['policy'] for r in memory['auto']]}; uniform modes that fit: {uniform}"
              + (f"; auto / best of them ({best}): step {times['auto'] / times[best]:.3f} (target <= 1.0)" if best else ""))
    errors = [abs(r["predicted"] / r["measured"] - 1) for p in names for r in memory[p] if r["measured"]]
    print(f"predicted / measured peak activations: worst error {max(errors):.1%}, median "
          f"{statistics.median(errors):.1%} over {len(errors)} (policy, rank) pairs (target: each within 15%)")


if __name__ == "__main__":
    main()
