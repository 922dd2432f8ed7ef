"""copy and wait without streams (the CPU path): tensors at any depth move, other values pass."""

import torch

from fxpipe.runtime.stage.copy import copy, wait


def test_copy_moves_tensors_at_any_depth():
    # a tuple model input read by a later stage on another device arrives as one nested value
    values = ((torch.ones(2), {"k": torch.zeros(3)}), 3, None)
    (a, d), three, none = copy(values, None, None, torch.device("meta"))
    assert a.device.type == "meta" and d["k"].device.type == "meta"
    assert three == 3 and none is None


def test_copy_of_values_without_tensors_returns_them():
    values = (1, "two", None)
    assert copy(values, None, None, torch.device("meta")) is values


def test_wait_without_streams_returns_the_values():
    values = ((torch.ones(2),), torch.zeros(1))
    assert wait(values, None, None) is values
