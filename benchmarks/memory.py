"""Peak resident memory per rank: a model built on meta with ``weights=`` against full builds.

    python benchmarks/memory.py            # 2 ranks, a 218M-parameter (872 MB float32) decoder

Each build runs in two fresh spawned ranks (gloo, one thread each) and is measured from before
the model is built to after the first training step (forward and backward, no optimizer):

    full           model = LM() on CPU (random init), compile, step
    full + load    model = LM(), model.load_state_dict(torch.load(weights, mmap=True)), compile, step
    meta           with torch.device("meta"): model = LM(); compile(..., weights=weights), step
    full, kept     as "full", but every rank keeps the whole model after compile (what fxpipe did
                   before a rank let go of the other stages' tensors)

"full + load" and "meta" end with the same weights; every build has the same 2-stage plan. Per rank the script prints
the peak growth of the resident set over the whole build and step, the growth left after the
step, and what ``compile`` itself allocated beyond the rank's own stage, against the largest
single parameter outside the stage. Freed tensors go back to the OS
(``MALLOC_MMAP_THRESHOLD_=65536``), so the peaks follow the live tensors, and file pages
mapped by ``torch.load(mmap=True)`` count while mapped, as they do in ``VmRSS``.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path[:0] = [os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."),
                os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"),
                os.path.dirname(os.path.abspath(__file__))]
import fxpipe  # noqa: E402
from distributed import _env, _spawn, report  # noqa: E402
from rss import peak, reset_peak, resident  # noqa: E402
from transformer import Block  # noqa: E402

BUILDS = ("full", "full + load", "meta", "full, kept")


class LM(nn.Module):
    """A decoder: embedding, ``layers`` pre-norm blocks, a final norm and an untied head."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _rank(rank: int, port: int, args, build: str, weights: str, out: str) -> None:
    """Build, compile and step one rank; report its memory figures."""
    _env(rank, port)
    dist.init_process_group("gloo")  # as torchrun scripts do, before anything is measured
    if build == "full, kept":
        importlib.import_module("fxpipe.runtime.build").release = lambda model, keep: 0  # nothing let go
    torch.manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq))
    target = torch.randint(0, args.vocab, (args.batch, args.seq))
    dims = (args.vocab, args.dim, args.layers, args.heads)
    gc.collect()
    reset_peak()
    base = resident()
    if build == "meta":
        with torch.device("meta"):
            model = LM(*dims)
    else:
        model = LM(*dims)
        if build == "full + load":
            model.load_state_dict(torch.load(weights, mmap=True, weights_only=True))
    gc.collect()
    built = peak() - base
    reset_peak()
    start = resident()
    pipe = fxpipe.compile(model, 2, example_inputs=(tokens,), chunks=args.chunks, runtime="distributed",
                          split_points=[f"blocks.{args.layers // 2}"],
                          weights=weights if build == "meta" else None)
    compiled = peak() - start
    after_compile = resident() - base
    reset_peak()
    pipe.step(tokens if rank == 0 else None, target=target if rank == 1 else None, loss_fn=_loss)
    stepped = peak() - base
    mine = {id(t) for t in (*pipe.stages[rank].parameters(), *pipe.stages[rank].buffers())}
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    own = sum(t.numel() * t.element_size() for k, t in tensors.items() if k in mine)
    foreign = max(t.numel() * t.element_size() for k, t in tensors.items() if k not in mine)
    ready = max(built, compiled + (start - base))
    report(out, rank, {"peak": max(ready, stepped), "ready": ready, "after": resident() - base,
                       "compile": compiled, "own": own, "foreign": foreign, "after_compile": after_compile})
    dist.destroy_process_group()


def main() -> None:
    """Save the weights once, measure each build in fresh ranks, print the table and ratios."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--chunks", type=int, default=2)
    args = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by each spawned rank's allocator
    mib = 2 ** 20
    with tempfile.TemporaryDirectory() as tmp:
        weights = os.path.join(tmp, "weights.pt")
        torch.manual_seed(1)
        model = LM(args.vocab, args.dim, args.layers, args.heads)
        n = sum(p.numel() for p in model.parameters())
        torch.save(model.state_dict(), weights)
        del model
        results = {build: _spawn(_rank, args, build, weights) for build in BUILDS}
    print(f"LM vocab={args.vocab} d={args.dim} layers={args.layers}: {n / 1e6:.0f}M parameters "
          f"({n * 4 / mib:.0f} MiB float32), 2 ranks, batch {args.batch} x {args.seq} tokens, "
          f"chunks {args.chunks}; MiB per rank, from before the model is built to after one step")
    print(f"{'build':12} {'rank':>4} {'peak to compiled':>16} {'peak to stepped':>15} {'after step':>10} "
          f"{'own stage':>9}")
    for build in BUILDS:
        for r, res in enumerate(results[build]):
            print(f"{build:12} {r:4} {res['ready'] / mib:16.0f} {res['peak'] / mib:15.0f} "
                  f"{res['after'] / mib:10.0f} {res['own'] / mib:9.0f}")
    for r in range(2):
        meta = results["meta"][r]
        for key, what in (("ready", "peak to compiled"), ("peak", "peak to stepped")):
            ratios = "   ".join(f"meta / {b}: {meta[key] / results[b][r][key]:.2f}" for b in BUILDS if b != "meta")
            print(f"rank {r}, {what}: {ratios}")
        extra = meta["compile"] - meta["own"]
        print(f"rank {r}: compile allocated its own stage + {extra / mib:.1f} MiB (largest parameter outside "
              f"the stage: {meta['foreign'] / mib:.1f} MiB)")


if __name__ == "__main__":
    main()
