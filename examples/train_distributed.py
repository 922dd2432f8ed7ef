"""Train a decoder built on meta across ranks: 2 pipeline ranks x 2 replicas, save, resume.

    torchrun --nproc-per-node 4 examples/train_distributed.py            # CPU: gloo; GPUs: NCCL
    torchrun --nproc-per-node 2 examples/train_distributed.py --replicas 1 --schedule zbv

What it shows, in the order a real run does it:

1. the model is built on ``meta`` (no memory), and each rank materializes only the stage(s)
   it runs, initialised from ``seed=`` per FQN (the same weights whatever the split);
2. ``data_parallel=`` replicas of the pipeline each take their own shard of the batch;
   ``fxpipe.clip_grad_norm_`` clips by the norm over every stage and replica;
3. ``fxpipe.save`` writes each rank's own tensors and optimizer state; ``fxpipe.load`` reads
   them back into a freshly built pipe, and training continues exactly.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fxpipe


class Decoder(nn.Module):
    """Token embedding, pre-norm MLP blocks, and a head tied to the embedding."""

    def __init__(self, vocab: int = 256, d: int = 64, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(),
                                                  nn.Linear(4 * d, d)) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(self.norm(x))


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Return the mean cross-entropy over every token."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def build(args: argparse.Namespace, ids: torch.Tensor) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Build the model on meta, compile it for this rank, and make its optimizer."""
    with torch.device("meta"):
        model = Decoder()
    pipe = fxpipe.compile(model, 2 * args.stages_per_rank, example_inputs=(ids,), chunks=4,
                          schedule=args.schedule, runtime="distributed", data_parallel=args.replicas,
                          stages_per_rank=args.stages_per_rank, seed=0)
    return pipe, torch.optim.AdamW(pipe.parameters(), lr=1e-2)


def train(pipe: nn.Module, opt: torch.optim.Optimizer, batches: list, first: int, last: int) -> list[float]:
    """Run steps ``first`` to ``last - 1``; return their losses."""
    losses = []
    for ids, target in batches[first:last]:
        opt.zero_grad(set_to_none=True)
        losses.append(pipe.step(ids, target=target, loss_fn=loss_fn).item())
        fxpipe.clip_grad_norm_(pipe, 1.0)
        opt.step()
    return losses


def main() -> None:
    """Train 4 steps, save, load into a fresh pipe, train 2 more; compare with 6 straight steps."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--ckpt", help="checkpoint directory on a file system every rank sees (default: a "
                                       "temporary one, which works on one machine)")
    args = parser.parse_args()
    args.stages_per_rank = 2 if args.schedule in ("interleaved", "zbv") else 1
    fxpipe.init_distributed()  # NCCL with a GPU per process, else gloo; safe across torchrun restarts
    rank, world = dist.get_rank(), dist.get_world_size()
    replica = rank // (world // args.replicas)  # ranks 0..pp-1 are replica 0 (dims ("dp", "pp"))
    generator = torch.Generator().manual_seed(100 + replica)  # each replica its own shard of data
    batches = [(torch.randint(0, 256, (8, 16), generator=generator),
                torch.randint(0, 256, (8, 16), generator=generator)) for _ in range(6)]

    pipe, opt = build(args, batches[0][0])
    before = train(pipe, opt, batches, 0, 4)
    path = [args.ckpt or (tempfile.mkdtemp() + "/ckpt") if rank == 0 else None]
    dist.broadcast_object_list(path, src=0)  # one directory that every rank writes its part into
    fxpipe.save(pipe, path[0], optimizer=opt, extra={"step": 4})
    fresh, fresh_opt = build(args, batches[0][0])  # as a restarted job would
    extra = fxpipe.load(fresh, path[0], optimizer=fresh_opt)
    after = train(fresh, fresh_opt, batches, extra["step"], 6)
    straight, straight_opt = build(args, batches[0][0])
    unbroken = train(straight, straight_opt, batches, 0, 6)  # the same 6 steps without a restart
    if rank == 0:
        print(f"{world} ranks: {world // args.replicas} pipeline ranks x {args.replicas} replicas, "
              f"schedule {args.schedule!r}")
        print("losses before saving:", " ".join(f"{v:.4f}" for v in before))
        print("losses after loading:", " ".join(f"{v:.4f}" for v in after))
        print("6 steps without a restart, last 2:", " ".join(f"{v:.4f}" for v in unbroken[4:]),
              "(equal)" if unbroken[4:] == after else "(differ)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
