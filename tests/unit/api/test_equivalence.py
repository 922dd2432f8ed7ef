"""Outputs and every gradient equal eager for every model, stage count, chunks and checkpoint mode."""

import pytest
from models import FACTORIES

from fxpipe.options import SINGLE_STAGE_SCHEDULES as SCHEDULES
from fxpipe.testing import assert_pipeline_equivalent

CHECKPOINTS = ["always", "except_last", "never"]
CHUNKS = [1, 3, 4]


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("chunks", CHUNKS)
@pytest.mark.parametrize("n_stages", [1, 2, 3, 4])
@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_equal_to_eager(name, n_stages, chunks, checkpoint):
    model, args, kwargs = FACTORIES[name]()
    # pipe.step too, once per (stage count, chunks): under one checkpoint mode and one schedule
    # in rotation, so that each model meets every pair of them
    k = 3 * (n_stages - 1) + CHUNKS.index(chunks)
    stepped = CHECKPOINTS[k % 3] == checkpoint
    pipe = assert_pipeline_equivalent(model, args, example_kwargs=kwargs, n_stages=n_stages,
                                      chunks=chunks, checkpoint=checkpoint, devices=["cpu"] * n_stages,
                                      schedules=[SCHEDULES[k // 3 % 3]] if stepped else ())
    assert len(pipe.stages) == n_stages
