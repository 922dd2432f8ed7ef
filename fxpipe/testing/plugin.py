"""A pytest plugin that offers :mod:`fxpipe.testing` to users' own test suites as fixtures.

Installed with fxpipe through the ``pytest11`` entry point, so a test only names it::

    def test_my_model_pipelines(assert_pipeline_equivalent):
        assert_pipeline_equivalent(MyModel(), (torch.randn(8, 3, 32, 32),), n_stages=4, chunks=4)

fxpipe (and torch) are imported when a test first asks for the fixture, not when pytest
starts, so the plugin costs nothing in test runs that do not use it.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

__all__ = ["assert_pipeline_equivalent"]


@pytest.fixture
def assert_pipeline_equivalent() -> Callable:
    """Return :func:`fxpipe.testing.assert_pipeline_equivalent`."""
    from fxpipe.testing import assert_pipeline_equivalent as check

    return check
