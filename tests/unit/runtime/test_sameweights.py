"""The weights' fingerprints that tell ranks built with other weights apart."""

import torch
from torch import nn

from fxpipe.runtime.transport.sameweights import fingerprints


def test_a_nan_among_the_sampled_entries_does_not_hide_the_others():
    # the fingerprint summed the sample: one NaN made every tensor's NaN, and NaN == NaN was taken as "alike", so
    # two ranks' other weights went unwarned
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    with torch.no_grad():
        a.weight[0, 0] = b.weight[0, 0] = float("nan")
    assert fingerprints(a)["weight"] != fingerprints(b)["weight"]
    assert fingerprints(a)["weight"] == fingerprints(a)["weight"]
