"""Tensor parallelism's collectives per step: fxpipe's plan and a measured step against Megatron's count.

    python benchmarks/tp_collectives.py            # 8 layers, d=256, 2 ranks (tp=2); about a minute on 2 cores
    python benchmarks/tp_collectives.py --quick    # 2 layers, d=64: a smoke run

A decoder whose attention views hard-code its head count (the graph rewrite makes them local)
and whose output head is tied to the token embedding, compiled with ``tp_plan="auto"`` on 2
spawned gloo ranks (one stage, ``tensor_parallel=2``). Three counts of every collective, forward
and backward, with the bytes of the whole value each one moves:

- Megatron's analytical count (Shoeybi et al. 2019; Narayanan et al. 2021, no sequence
  parallelism): per layer and micro-batch two all-reduces of b*s*h elements forward (after the
  attention output and the MLP down projection) and two backward (their inputs); the
  vocabulary-parallel embedding one forward; the output layer one backward;
- fxpipe's plan (``pipe.plan.tensor_parallel``), what the simulator reads;
- a training step, every collective DTensor and the region nodes run counted on rank 0.

Only counts and bytes are compared, no times (the CPU's gloo says nothing about NVLink). The
one difference by design: fxpipe gathers the logits (an all-gather of b*s*V) where Megatron's
parallel cross-entropy all-reduces three b*s vectors; it is shown on its own row.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import Counter

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

sys.path[:0] = [os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."), os.path.dirname(os.path.abspath(__file__))]
from ports import free_port  # noqa: E402

SIZES = {"full": {"vocab": 1024, "d": 256, "heads": 8, "layers": 8, "batch": 8, "seq": 64, "chunks": 4},
         "quick": {"vocab": 128, "d": 64, "heads": 4, "layers": 2, "batch": 4, "seq": 16, "chunks": 2}}


class Attention(nn.Module):
    """Causal self-attention with the head count written into its views, as many model files do."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads, self.dh = heads, d // heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        b, s, d = x.shape
        q = self.q(x).view(b, s, self.heads, self.dh).transpose(1, 2)
        k = self.k(x).view(b, s, self.heads, self.dh).transpose(1, 2)
        v = self.v(x).view(b, s, self.heads, self.dh).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, self.heads * self.dh))


class Layer(nn.Module):
    """Pre-norm attention and a GELU MLP, with residuals."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Decoder(nn.Module):
    """Token embedding, layers, a final norm and a head tied to the embedding."""

    def __init__(self, vocab: int, d: int, heads: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([Layer(d, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def megatron(size: dict, item: int = 4) -> dict[str, list]:
    """Return Megatron's count per micro-batch: (pass, kind) -> [count, bytes], and the head's own row."""
    rows = size["batch"] // size["chunks"]
    bsh = rows * size["seq"] * size["d"] * item
    count: dict[str, list] = {"forward all_reduce": [2 * size["layers"] + 1, (2 * size["layers"] + 1) * bsh],
                              "backward all_reduce": [2 * size["layers"] + 1, (2 * size["layers"] + 1) * bsh],
                              "head: cross-entropy all_reduce": [3, 3 * rows * size["seq"] * item]}
    return count


def _rank(rank: int, port: int, size: dict, checkpoint: str, out: str) -> None:
    """One of 2 ranks: compile with tensor_parallel=2, a warm-up step, a counted step; rank 0 writes the counts."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import fxpipe

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Decoder(size["vocab"], size["d"], size["heads"], size["layers"])
    ids = torch.randint(0, size["vocab"], (size["batch"], size["seq"]))
    pipe = fxpipe.compile(model, 1, example_inputs=(ids,), runtime="distributed", chunks=size["chunks"],
                          tensor_parallel=2, checkpoint=checkpoint, schedule="1f1b")

    def loss_fn(logits, target):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen: Counter = Counter()
            self.bytes: Counter = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"):
                key = f"{'backward' if torch._C._current_graph_task_id() != -1 else 'forward'} " \
                      f"{name.replace('_into_tensor', '').replace('_tensor', '')}"
                whole = args[0].numel() * args[0].element_size() * (2 if name == "all_gather_into_tensor" else 1)
                self.seen[key] += 1
                self.bytes[key] += whole
            return func(*args, **(kwargs or {}))

    target = ids.roll(1, dims=1)
    pipe.step(ids, target=target, loss_fn=loss_fn)
    with Count() as c:
        pipe.step(ids, target=target, loss_fn=loss_fn)
    if rank == 0:
        record = pipe.plan.tensor_parallel
        planned: Counter = Counter()
        planned_bytes: Counter = Counter()
        for call in record["calls"]:
            for when, kind, nbytes in call["collectives"]:
                planned[f"{when} {kind}"] += 1
                planned_bytes[f"{when} {kind}"] += nbytes
        with open(out, "w") as f:
            json.dump({"measured": [dict(c.seen), dict(c.bytes)], "planned": [dict(planned), dict(planned_bytes)]}, f)


def run(size: dict, checkpoint: str) -> dict:
    """Spawn the two ranks for one checkpoint mode; return rank 0's counts."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "counts.json")
        mp.start_processes(_rank, args=(free_port(), size, checkpoint, out), nprocs=2, start_method="spawn")
        with open(out) as f:
            return json.load(f)


def main() -> None:
    """Print, per micro-batch and per step, Megatron's count, fxpipe's plan and a measured step, with ratios."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small model: checks the script")
    args = parser.parse_args()
    size = SIZES["quick" if args.quick else "full"]
    m = size["chunks"]
    print(f"decoder vocab={size['vocab']} d={size['d']} heads={size['heads']} layers={size['layers']}, batch "
          f"{size['batch']} x {size['seq']} tokens, chunks {m}, tensor_parallel=2 (tp_plan='auto'), 2 gloo ranks")
    mega = megatron(size)
    for checkpoint in ("never", "except_last"):
        got = run(size, checkpoint)
        (seen, seen_bytes), (planned, planned_bytes) = got["measured"], got["planned"]
        redo = m - 1 if checkpoint == "except_last" else 0  # recomputed micro-batches repeat their forward
        print(f"\ncheckpoint={checkpoint!r}: collectives per step of {m} micro-batches (bytes of the whole values)"
              + (f"; {redo} recomputed in backward, their forward collectives again" if redo else ""))
        print(f"{'':22}{'Megatron':>22}{'fxpipe plan':>22}{'measured':>22}{'measured / Megatron':>22}")
        keys = ("forward all_reduce", "backward all_reduce", "forward all_gather")
        if redo:  # recomputation runs inside backward: compare the step's totals per kind
            table = {"all_reduce": ("forward all_reduce", "backward all_reduce"), "all_gather": ("forward all_gather",)}
        else:
            table = {k: (k,) for k in keys}
        for label, parts in table.items():
            def total(counts, per_micro, parts=parts):
                return sum(counts.get(k, 0) * (m + (redo if k.startswith("forward") else 0)) if per_micro
                           else counts.get(k, 0) for k in parts)
            w_n = total({k: v[0] for k, v in mega.items()}, True)
            w_b = total({k: v[1] for k, v in mega.items()}, True)
            p_n, p_b = total(planned, True), total(planned_bytes, True)
            s_n, s_b = total(seen, False), total(seen_bytes, False)
            ratio = f"{s_n / w_n:.2f} (n), {s_b / w_b:.2f} (B)" if w_n else "fxpipe only: logits"
            print(f"{label:22}{f'{w_n} / {w_b / 2**20:.2f} MiB':>22}{f'{p_n} / {p_b / 2**20:.2f} MiB':>22}"
                  f"{f'{s_n} / {s_b / 2**20:.2f} MiB':>22}{ratio:>22}")
        n, b = mega["head: cross-entropy all_reduce"]
        print(f"{'Megatron CE':22}{f'{n * (m + redo)} / {b * (m + redo) / 2**20:.3f} MiB':>22}"
              f"{'':>44}{'(gathered instead)':>22}")

if __name__ == "__main__":
    main()
