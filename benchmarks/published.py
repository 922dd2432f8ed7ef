"""Predict the layouts torchtitan published for Llama 3.1, and what ``fxpipe plan`` chooses on the same GPUs.

    python benchmarks/published.py               # the whole table (nominal H100 model; no timing on this machine)
    python benchmarks/published.py --quick       # the first 8B row only

Each model is built on meta from its configuration (``benchmarks/llama.py``: no weights). Every
published layout is simulated as fxpipe would run it (``fxpipe.simulate.cluster``: its replicas,
FSDP2 or DDP, tp inside a node, pipeline schedule, chunks, recomputation, the two-level network:
NVLink inside a node, 400 Gb/s per GPU between nodes) with the nominal H100 model (bf16 dense
peak 989 TFLOP/s at 70% for GEMMs), then ``fxpipe plan``'s search runs on the same GPUs and
global batch. Printed: predicted tokens/s/GPU, the published figure, their ratio.

The published figures are torchtitan's ``benchmarks/llama3_h100_202412_torchtitan.md`` (Tables 1,
3, 4 and 5: H100 96 GB HBM2e at 500 W, sequences of 8192 tokens, bf16; the budget here is 96 GB);
the micro-batch and stage counts marked "assumed" are not stated there and are ours. The simulation has no fp8,
no async TP and no torch.compile (rows that used them publish higher figures than the eager bf16
model predicts), no sequence parallelism, and FSDP2 as fxpipe runs it (the gathered parameters
and full gradients held through the step).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), HERE]
from llama import build

from fxpipe.simulate.cluster import cluster_search
from fxpipe.simulate.layouts import Shape
from fxpipe.simulate.planner import prepare

SEQ = 8192
MEMORY = 96 * 2**30  # the H100s of the published runs: 96 GB HBM2e (Grand Teton, 500 W)
# model, GPUs, global batch (rows of SEQ tokens), the published layout, its recomputation, tokens/s/GPU,
# memory GiB, what the run used, notes
ROWS = [
    ("8b", 8, 16, Shape(8, 1, 1, 1, "1f1b", 1, True), "selective", 5762, 82.4, "FSDP 8", "Table 1; eager"),
    ("8b", 8, 16, Shape(8, 1, 1, 1, "1f1b", 1, True), "selective", 6667, 77.0, "FSDP 8", "Table 1; torch.compile"),
    ("8b", 128, 256, Shape(128, 1, 1, 1, "1f1b", 1, True), "selective", 5605, 67.0, "FSDP 128", "Table 3; eager"),
    ("70b", 256, 512, Shape(32, 1, 8, 1, "1f1b", 16, True), "always", 829, 71.9, "FSDP 32 x TP 8",
     "Table 4; compile, fp8; local batch 16 as 16 micro-batches of 1 (assumed)"),
    ("405b", 512, 256, Shape(8, 8, 8, 1, "1f1b", 32, True), "always", 100, 82.5, "FSDP 8 x TP 8 x PP 8, 1F1B",
     "Table 5; compile, fp8, async TP; 32 micro-batches of 1 (assumed)"),
    ("405b", 512, 256, Shape(8, 8, 8, 2, "interleaved", 32, True), "always", 128, 72.7,
     "FSDP 8 x TP 8 x PP 8, interleaved 1F1B", "Table 5; as above, 2 stages per rank (assumed)"),
]


def _run(rows, keep: int, only_published: bool) -> list[str]:
    """Return the table's lines for ``rows``."""
    lines = [("| model | GPUs | published layout | published tok/s/GPU | predicted tok/s/GPU | predicted / published "
              "| published / predicted peak GiB | fxpipe plan's choice | its predicted tok/s/GPU |"),
             "|---|---|---|---|---|---|---|---|---|"]
    graphs: dict[str, torch.fx.GraphModule] = {}
    for name, gpus, batch, shape, ckpt, published, memory, used, notes in rows:
        if name not in graphs:
            model, args = build(name, SEQ)
            graphs[name] = prepare(model, args)
        gm = graphs[name]
        mine = cluster_search(gm, (), gpus=gpus, gpus_per_node=8, device="h100", batch=batch, memory=MEMORY,
                              dtype=torch.bfloat16, tokens=SEQ, only=[shape], checkpoints=[ckpt])
        c = (mine.ranked or mine.rejected)[0]
        predicted = mine.per_gpu(c) if c.sim is not None else 0.0
        fits = "" if c.fits else f" (does not fit: {c.overflow})"
        choice, theirs = "-", "-"
        if not only_published:
            found = cluster_search(gm, (), gpus=gpus, gpus_per_node=8, device="h100", batch=batch, memory=MEMORY,
                                   dtype=torch.bfloat16, tokens=SEQ, keep=keep)
            if found.best is not None:
                b = found.best
                choice = f"{b.shape.name()}, {b.shape.schedule}, chunks {b.shape.chunks}, {_policies(b.setting)}"
                theirs = f"{found.per_gpu(b):,.0f}"
        lines.append(f"| Llama 3.1 {name.upper()} | {gpus} | {used}; {notes} | {published:,} | {predicted:,.0f}{fits} | "
                     f"{predicted / published:.2f} | {memory} / {c.peak / 2**30:.1f} | {choice} | {theirs} |")
        print(lines[-1], flush=True)
    return lines


def _policies(setting) -> str:
    """Name a recomputation setting briefly: a mode, or how many stages take each mode."""
    if isinstance(setting, str):
        return setting
    return "per stage: " + ", ".join(f"{setting.count(m)} {m}" for m in dict.fromkeys(setting))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the first 8B row only")
    parser.add_argument("--published-only", action="store_true", help="skip fxpipe plan's own search")
    parser.add_argument("--keep", type=int, default=5, help="layouts the search keeps (default 5)")
    args = parser.parse_args()
    rows = ROWS[:1] if args.quick else ROWS
    lines = _run(rows, args.keep, args.published_only)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
