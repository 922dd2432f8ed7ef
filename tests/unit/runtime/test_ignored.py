import pytest
import torch
import torch.nn.functional as F

from fxpipe.runtime.ignored import warn_uneven_ignored


def _labels(counted: list[int], length: int = 1000) -> torch.Tensor:
    """Give one row per count, each with that many entries that count and the rest -100."""
    rows = torch.full((len(counted), length), -100)
    for row, n in zip(rows, counted):
        row[:n] = 1
    return rows


def test_close_shares_are_told_apart_with_decimals():
    labels = _labels([341, 344])  # 34.1% and 34.4%: whole percents would read "34% to 34%"
    with pytest.warns(UserWarning, match=r"\(34\.1% to 34\.4% of each micro-batch's entries count\)"):
        assert warn_uneven_ignored({"labels": labels}, 2, 2, F.cross_entropy)


def test_distant_shares_keep_whole_percents():
    with pytest.warns(UserWarning, match=r"\(20% to 70% of each"):
        warn_uneven_ignored({"labels": _labels([200, 700])}, 2, 2, F.cross_entropy)
