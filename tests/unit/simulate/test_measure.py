"""Node times measured on this machine for the simulator."""

import torch
from torch import nn

import fxpipe
from fxpipe import passes
from fxpipe.simulate.measure import inputs_of_rows, measure_nodes


def test_every_compute_node_gets_times_and_the_model_is_untouched():
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4)).train()
    x = torch.randn(16, 16)
    gm = fxpipe.trace(model)
    passes.annotate(gm, (x,))
    mean = model[1].running_mean.clone()
    times = measure_nodes(gm, 8, (x,), repeats=1)
    assert set(times) == {n.name for n in passes.compute_nodes(gm)}
    assert all(f > 0 for f, _ in times.values())
    assert all(p.grad is None for p in model.parameters())  # copies ran, not the model
    assert torch.equal(model[1].running_mean, mean)
    assert not any("fxpipe.time" in n.meta for n in gm.graph.nodes)  # no profile left behind


def test_inputs_of_rows_repeat_or_cut_the_example_and_fill_from_shapes():
    gm = fxpipe.trace(nn.Embedding(10, 4))
    tokens = torch.randint(0, 10, (3, 5))
    assert inputs_of_rows(gm, 7, (tokens,))[0].shape == (7, 5)
    assert inputs_of_rows(gm, 2, (tokens,))[0].shape == (2, 5)
    passes.annotate(gm, (tokens,))
    (made,) = inputs_of_rows(gm, 4)
    assert made.shape == (4, 5) and made.dtype == torch.int64 and made.abs().sum() == 0  # valid indices


def test_measure_sharing_needs_a_process_group():
    from fxpipe.simulate.sharing import measure_sharing

    gm = fxpipe.trace(nn.Linear(8, 8))
    passes.annotate(gm, (torch.randn(4, 8),))
    assert measure_sharing(gm, 4) is None  # one process: nothing shares the cores
