"""What each rank runs in the tests of the runtime's per-step costs (imported by spawned processes)."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.testing import max_relative_error


def reused_buffers(rank, world, schedule):
    """Run three steps; compare each with eager; count the receive buffers the transport allocated."""
    torch.manual_seed(0)
    v = 2 if schedule in ("interleaved", "zbv") else 1
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])
    eager = copy.deepcopy(model)
    pipe = fxpipe.compile(model, world * v, example_inputs=(torch.randn(8, 8),), chunks=4, schedule=schedule,
                          runtime="distributed", timeout=60, stages_per_rank=v)
    last = rank == pipe.plan.stages[-1].on_rank
    held = {id(p) for j in pipe.plan.stages_of(rank) for p in pipe.stages[j].parameters()}
    errors, allocated = [], []
    for step in range(3):
        x, target = torch.randn(8, 8), torch.randn(8, 8)
        for p in list(model.parameters()) + list(eager.parameters()):
            p.grad = None
        F.mse_loss(eager(x), target).backward()
        loss = pipe.step(x if rank == 0 else None, target=target if last else None, loss_fn=F.mse_loss)
        grads = dict(eager.named_parameters())
        errors.append(max([max_relative_error(loss, F.mse_loss(eager(x), target))] +
                          [max_relative_error(p.grad, grads[n].grad) for n, p in model.named_parameters()
                           if id(p) in held]))
        transport = next(iter(pipe._runtime._transports.values()))
        allocated.append(transport.pool.allocated)
    return {"errors": errors, "allocated": allocated}


def small_values(rank, world, schedule):
    """Send values shorter and longer than one small message's room between the ranks, both ways."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    pipe = fxpipe.compile(model, world, example_inputs=(torch.randn(4, 4),), chunks=2, runtime="distributed",
                          timeout=60)
    comm = pipe._runtime.comm
    values = [1.5, {"text": "x" * 10000, "n": list(range(500))}, "y" * 4088, "z" * 4089]
    got = []
    for value in values:
        if rank == 0:
            comm.send_object(value, 1)
            got.append(comm.recv_object(1, "a test value"))
        else:
            got.append(comm.recv_object(0, "a test value"))
            comm.send_object(got[-1], 0)
        comm.flush()
    return {"equal": [g == v for g, v in zip(got, values)]}
