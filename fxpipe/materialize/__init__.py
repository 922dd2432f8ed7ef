"""Materialization: a model built on meta gets real tensors, only where a stage owns them.

Reads a model whose tensors are on meta, a placement (tensor -> device) and what fills them:
``weights=`` sources by FQN (:mod:`~fxpipe.materialize.weights`, :mod:`~fxpipe.materialize.weightfiles`,
:mod:`~fxpipe.materialize.pages`), a seeded ``init=`` or ``reset_parameters()``, or the recipes
:func:`fxpipe.deferred_init` recorded (:mod:`~fxpipe.materialize.deferred`,
:mod:`~fxpipe.materialize.recording`, :mod:`~fxpipe.materialize.recipes`); produces the placed
tensors, filled, in place (:mod:`~fxpipe.materialize.fill`, decided by
:mod:`~fxpipe.materialize.fillplan`), and releases the rest back to meta
(:mod:`~fxpipe.materialize.metatensors`).
"""
