"""The batch norms whose statistics data parallel copies from the first replica: found alike on every replica."""

from __future__ import annotations

import torch
from torch import nn

import fxpipe
from fxpipe.runtime.replicanorms import norms_of


def test_norms_called_as_functions_are_found_in_one_order_whatever_the_hash_seed():
    # the records came in a set's order, which follows each process's string hashing: the first replica's
    # flat broadcast was split into other norms' buffers on the next (statistics swapped, or torn apart)
    widths = [3, 4, 5, 6, 7]
    model = nn.Sequential(*[m for a, b in zip(widths, widths[1:]) for m in (nn.Conv2d(a, b, 3, padding=1),
                                                                              nn.BatchNorm2d(b))])
    pipe = fxpipe.compile(model, 1, example_inputs=(torch.randn(4, 3, 6, 6),), devices=["cpu"], tracer="export")
    found = norms_of(pipe.stages)
    names = {id(b): name for name, b in model.named_buffers()}
    held = [names[id(record.running_mean)] for record in found]
    assert held == sorted(held) == [f"{k}.running_mean" for k in (1, 3, 5, 7)]
    assert all(names[id(r.running_var)] == names[id(r.running_mean)].replace("mean", "var") for r in found)
