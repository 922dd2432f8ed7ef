"""Outputs and every gradient equal eager for every model, stage count, chunks and checkpoint mode."""

import pytest

from fxpipe.testing import SCHEDULES, assert_pipeline_equivalent
from models import FACTORIES

CHECKPOINTS = ["always", "except_last", "never"]


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("chunks", [1, 3, 4])
@pytest.mark.parametrize("n_stages", [1, 2, 3, 4])
@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_equal_to_eager(name, n_stages, chunks, checkpoint):
    model, args, kwargs = FACTORIES[name]()
    # pipe.step under one schedule per case, in rotation: each model meets every schedule with
    # every stage count, chunks and checkpoint mode, at a third of the cost of all three
    schedule = SCHEDULES[(n_stages + chunks + CHECKPOINTS.index(checkpoint)) % 3]
    pipe = assert_pipeline_equivalent(model, args, example_kwargs=kwargs, n_stages=n_stages,
                                      chunks=chunks, checkpoint=checkpoint, devices=["cpu"] * n_stages,
                                      schedules=[schedule])
    assert len(pipe.stages) == n_stages
