"""Testing a model under fxpipe: equality with eager for every schedule, and a pytest fixture.

Reads a model and example inputs; produces a pass, or the first stage, node and schedule where
the pipeline departs from eager (:mod:`~fxpipe.testing.equivalence`); :mod:`~fxpipe.testing.plugin`
gives pytest users the ``fxpipe_equivalent`` fixture.
"""

from fxpipe.testing.equivalence import (
    assert_pipeline_equivalent,
    default_loss,
    default_step_loss,
    default_tolerance,
    max_relative_error,
)

__all__ = ["assert_pipeline_equivalent", "default_loss", "default_step_loss", "default_tolerance",
           "max_relative_error"]
