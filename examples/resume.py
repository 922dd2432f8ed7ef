"""A long run that survives restarts: save every k steps; on every start, resume from the last complete save.

    torchrun --nproc-per-node 2 --max-restarts 3 examples/resume.py --ckpt ckpt/
    torchrun --nproc-per-node 2 --max-restarts 1 examples/resume.py --ckpt ckpt/ --die-at 4   # try it

The pattern, in the order a job runs it:

1. ``fxpipe.init_distributed()`` joins the job (or let ``fxpipe.compile`` do it): unlike a bare
   ``torch.distributed.init_process_group()``, it keeps each torchrun restart round's keys apart,
   so a restarted round never connects to an address of the round before;
2. build and compile the pipe the same way every start;
3. ``fxpipe.latest_checkpoint(dir)`` finds the newest *complete* checkpoint (a save cut off by
   a crash is never chosen); ``fxpipe.load`` puts the weights, the optimizer state, each rank's
   random generators and your ``extra=`` back;
4. train, and ``fxpipe.save`` every ``--every`` steps under a new name, with the step in ``extra=``.

``--die-at N`` kills rank 1 in step N of the first round (as a crashed node would); torchrun
restarts every rank, and the job goes on from the last save. Rank 0 prints each step's loss:
the steps after the restart print the same losses as a run that never stopped.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

import fxpipe
from transformer import GPT


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return step ``step``'s tokens and targets (a real job reads its data loader from that step)."""
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 256, (8, 32), generator=g), torch.randint(0, 256, (8, 32), generator=g)


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Return the mean cross-entropy over every token."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def main() -> None:
    """Resume from the newest complete checkpoint under --ckpt, then train to --steps."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ckpt", required=True, help="a directory every rank sees")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--every", type=int, default=1, help="save every this many steps")
    parser.add_argument("--die-at", type=int, default=None, help="kill rank 1 in this step of the first round")
    args = parser.parse_args()
    fxpipe.init_distributed()
    rank = int(os.environ["RANK"])
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    torch.manual_seed(0)
    model = GPT(vocab=256, d=64, layers=4, heads=4, seq=32)
    pipe = fxpipe.compile(model, 2, example_inputs=(batch(0)[0],), chunks=4, schedule="1f1b",
                          runtime="distributed")
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    start = 0
    latest = fxpipe.latest_checkpoint(args.ckpt)
    if latest is not None:
        start = fxpipe.load(pipe, latest, optimizer=opt)["step"]
        if rank == 0:
            print(f"round {restarts}: resuming from {os.path.basename(latest)} (step {start})", flush=True)

    for step in range(start, args.steps):
        if step == args.die_at and restarts == 0 and rank == 1:
            os._exit(1)  # a crash: no error, no goodbye
        ids, target = batch(step)
        opt.zero_grad(set_to_none=True)
        loss = pipe.step(ids, target=target, loss_fn=loss_fn)
        opt.step()
        if rank == 0:
            print(f"step {step} loss {loss.item()!r}", flush=True)
        if (step + 1) % args.every == 0:
            fxpipe.save(pipe, os.path.join(args.ckpt, f"step-{step + 1}"), optimizer=opt,
                        extra={"step": step + 1})


if __name__ == "__main__":
    main()
