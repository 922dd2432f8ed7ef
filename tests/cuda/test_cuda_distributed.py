"""The distributed runtime under NCCL, one GPU per rank (fxpipe picks NCCL when CUDA is present)."""

import pytest
import torch
from checks import assert_equal_to_eager as _assert_equal_to_eager

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb"])
def test_tied_embeddings_under_nccl(schedule, tmp_path, launch):
    results = launch("tied_nccl", 2, schedule, tmp_path)
    _assert_equal_to_eager(results)
    for rank, res in enumerate(results):
        assert res["backend"] == "nccl" and res["device"] == str(rank)
        assert res["devices"] == ["rank 0 (cuda)", "rank 1 (cuda)"]


def test_unet_skips_under_nccl(tmp_path, launch):
    results = launch("unet_nccl", 2, "1f1b", tmp_path)
    _assert_equal_to_eager(results)
