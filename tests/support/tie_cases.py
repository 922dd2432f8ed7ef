"""What each rank runs in the tests of parameters tied across ranks whose gradients accumulate over steps."""

from __future__ import annotations

import copy

import torch
from models import TiedTransformer, token_loss

import fxpipe
from fxpipe.testing import max_relative_error


def accumulate(rank, world, schedule):
    """Steps without zero_grad, a no_sync step, and zero_grad between: tied gradients equal eager's each time.

    The embedding is tied to the head on the last rank; a synced step used to sum the whole
    accumulated gradient over the tie, so what an earlier step had already summed counted twice.
    """
    torch.manual_seed(0)
    model = TiedTransformer()
    eager = copy.deepcopy(model)
    batches = [(torch.randint(0, 32, (4, 8)), torch.randint(0, 32, (4, 8))) for _ in range(4)]
    pipe = fxpipe.compile(model, world, example_inputs=(batches[0][0],), chunks=2, runtime="distributed",
                          timeout=60, schedule=schedule)
    held = {id(p) for j in pipe.plan.stages_of(rank) for p in pipe.stages[j].parameters()}
    tied = {id(p) for _, params, _ in pipe.runtime.tied for p in params}
    own = dict(eager.named_parameters(remove_duplicate=False))

    def errors():
        return max(max_relative_error(p.grad, own[n].grad)
                   for n, p in model.named_parameters(remove_duplicate=False) if id(p) in held)

    def both(i, no_sync=False):
        x, y = batches[i]
        if no_sync:
            with pipe.no_sync():
                pipe.step(x, target=y, loss_fn=token_loss)
        else:
            pipe.step(x, target=y, loss_fn=token_loss)
        token_loss(eager(x), y).backward()

    out = {"tied_here": len(held & tied)}
    both(0)
    both(1)  # no zero_grad: the second sum must not count the first step's again
    out["two_steps"] = errors()
    both(2, no_sync=True)
    both(3)
    out["no_sync_then_synced"] = errors()
    pipe.zero_grad()
    eager.zero_grad()
    both(0)
    out["after_zero_grad"] = errors()
    # a step refused on every rank before anything ran, after a synced one: the window it opened held that
    # step's summed gradient, and the next step after zero_grad took it off and added it back
    try:
        pipe.step(batches[1][0].unsqueeze(-1), target=batches[1][1], loss_fn=token_loss)
    except fxpipe.PipelineInputError:
        out["refused"] = True
    pipe.zero_grad(set_to_none=True)
    eager.zero_grad(set_to_none=True)
    both(2)
    out["after_refused"] = errors()
    # the tie frozen: no gradient on any rank, as eager (a zero one let AdamW's weight decay move it)
    for m in (model, eager):
        m.zero_grad(set_to_none=True)
        m.embed.weight.requires_grad_(False)
    both(1)
    out["frozen_tie_grads"] = [n for n, p in model.named_parameters(remove_duplicate=False)
                               if id(p) in held and id(p) in tied and p.grad is not None]
    out["frozen_tie_others"] = max(max_relative_error(p.grad, own[n].grad)
                                   for n, p in model.named_parameters(remove_duplicate=False)
                                   if id(p) in held and id(p) not in tied)
    return out


class ActorCritic(torch.nn.Module):
    """SAC's shape: the actor read twice (once under no_grad for the target), the two calls on two ranks."""

    def __init__(self):
        super().__init__()
        self.actor = torch.nn.Linear(4, 4)
        self.q = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def forward(self, o, a):
        with torch.no_grad():
            target_action = self.actor(o)
        q = self.q(torch.cat([o, a], -1))[:, 0]
        return q, target_action, self.actor(o + q[:, None])


def unreached(rank, world, schedule):
    """A step whose loss reaches no part of a tie leaves its gradient None on every rank, as eager (not zeros)."""
    torch.manual_seed(0)
    model = ActorCritic()
    eager = copy.deepcopy(model)
    x, a, y = torch.randn(6, 4), torch.randn(6, 4), torch.randn(6)
    losses = {"critic": lambda out, y: torch.nn.functional.mse_loss(out[0], y),
              "actor": lambda out, y: out[2].pow(2).mean()}
    pipe = fxpipe.compile(model, world, example_inputs=(x, a), chunks=2, runtime="distributed", timeout=60,
                          schedule=schedule, split_points=["q.2"])
    held = {id(p) for j in pipe.plan.stages_of(rank) for p in pipe.stages[j].parameters()}
    tied = {id(p) for _, params, _ in pipe.runtime.tied for p in params}
    own = dict(eager.named_parameters())
    out: dict = {"tied_here": len(held & tied)}
    for which in ("actor", "critic"):
        pipe.step(x, a, target=y, loss_fn=losses[which])
        losses[which](eager(x, a), y).backward()
        out[which] = {n: ("None" if p.grad is None else max_relative_error(p.grad, own[n].grad))
                      for n, p in model.named_parameters() if id(p) in held}
        out[which + "_eager_none"] = sorted(n for n, p in own.items() if p.grad is None)
        pipe.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)
    return out


class SparseTable(torch.nn.Module):
    """A sparse embedding table read by both stages (users' and items' ids), as a recommender shares one."""

    def __init__(self):
        super().__init__()
        self.e = torch.nn.Embedding(50, 8, sparse=True)
        self.a, self.b, self.c = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)

    def forward(self, users, items):
        h = self.b(torch.relu(self.a(self.e(users).sum(1))))
        return self.c(h * self.e(items).sum(1)).squeeze(1)


def sparse(rank, world, schedule):
    """A sparse tied gradient sums over the tie (it failed in .is_contiguous()), accumulating and under SparseAdam."""
    torch.manual_seed(0)
    model = SparseTable()
    eager = copy.deepcopy(model)
    batches = [(torch.randint(0, 50, (6, 3)), torch.randint(0, 50, (6, 2)), torch.rand(6)) for _ in range(3)]
    pipe = fxpipe.compile(model, world, example_inputs=batches[0][:2], chunks=2, runtime="distributed", timeout=60,
                          schedule=schedule, split_points=["b"])
    held = {id(p) for j in pipe.plan.stages_of(rank) for p in pipe.stages[j].parameters()}
    own = dict(eager.named_parameters())
    opts = [(torch.optim.SparseAdam([m.e.weight], lr=0.1), torch.optim.Adam(
        [p for n, p in m.named_parameters() if n != "e.weight"], lr=0.1)) for m in (model, eager)]
    loss = torch.nn.functional.mse_loss
    out: dict = {"tied_here": sum(id(p) in held for _, ps, _ in pipe.runtime.tied for p in ps)}
    for step, (u, i, y) in enumerate(batches):
        pipe.step(u, i, target=y, loss_fn=loss)
        loss(eager(u, i), y).backward()
        if step == 0:  # accumulate over the first two steps: only what was added since is summed again
            continue
        out[f"sparse_grad_{step}"] = model.e.weight.grad is not None and model.e.weight.grad.is_sparse
        if step == 2:  # the norm over a sparse gradient (torch's has no sparse kernel; it failed on one rank alone)
            total = fxpipe.clip_grad_norm_(pipe, 1e9)
            out["norm"] = max_relative_error(total, torch.nn.utils.get_total_norm(
                [p.grad.to_dense() for p in eager.parameters()]))
        out[f"grads_{step}"] = max(max_relative_error(p.grad.to_dense(), own[n].grad.to_dense())
                                   for n, p in model.named_parameters() if id(p) in held and p.grad is not None)
        for pair in opts:
            for opt in pair:
                opt.step()
                opt.zero_grad()
    out["params"] = max(max_relative_error(p.detach(), own[n].detach()) for n, p in model.named_parameters()
                        if id(p) in held)
    return out


CASES = {"accumulate": accumulate, "unreached": unreached, "sparse": sparse}


class _RootPositions(torch.nn.Module):
    """An embedding tied to the head, and positions held by the model itself (not a submodule)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16)
        self.pos = torch.nn.Parameter(torch.randn(8, 16) * 0.02)
        self.mix = torch.nn.Linear(16, 16)

    def forward(self, ids):
        return torch.relu(self.mix(self.emb(ids) + self.pos)) @ self.emb.weight.t()


def accumulate_sharded(rank, world, schedule):
    """pp2 x dp2 under FSDP2, the embedding tied to the head across the pipeline ranks: a no_sync step, then a synced
    one, then another; return each rank's largest gradient error against eager over the global batches."""
    torch.manual_seed(0)
    model = _RootPositions()
    eager = copy.deepcopy(model)
    batches = [(torch.randint(0, 32, (8, 8)), torch.randint(0, 32, (8, 8))) for _ in range(3)]
    pipe = fxpipe.compile(model, 2, example_inputs=(batches[0][0][:4],), chunks=2, runtime="distributed",
                          timeout=60, schedule=schedule, data_parallel=2, data_parallel_shard=True)
    replica = fxpipe.data_shard(pipe)[1]
    own = dict(eager.named_parameters(remove_duplicate=False))
    errors = []
    for i, (x, y) in enumerate(batches):
        mine = slice(4 * replica, 4 * replica + 4)
        if i == 0:
            with pipe.no_sync():
                pipe.step(x[mine], target=y[mine], loss_fn=token_loss)
        else:
            pipe.step(x[mine], target=y[mine], loss_fn=token_loss)
        token_loss(eager(x), y).backward()
        if i > 0:  # after a synced step the replicas' gradients are reduced
            errors.append(max(max_relative_error(p.grad.full_tensor(), own[n].grad)
                              for n, p in model.named_parameters(remove_duplicate=False)
                              if p.grad is not None and hasattr(p.grad, "full_tensor")))
    return {"errors": errors}
