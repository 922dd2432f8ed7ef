"""The plan: which node runs in which stage, and what crosses between stages.

Reads a traced GraphModule; annotates and cuts it (:mod:`~fxpipe.plan.assign`, over the graph
passes of :mod:`fxpipe.passes`), splits it into stage GraphModules (:mod:`~fxpipe.plan.stages`,
copying inputs a stage changes: :mod:`~fxpipe.plan.mutation`) and produces a
:class:`PipelinePlan` (:mod:`~fxpipe.plan.pipeline`): stages, boundary values, skip routes,
costs; saved and reloaded as JSON (:mod:`~fxpipe.plan.saved`). :mod:`~fxpipe.plan.batches`
says how a batch splits into micro-batches.
"""

from fxpipe.plan.pipeline import PipelinePlan, SkipRoute, StagePlan

__all__ = ["PipelinePlan", "SkipRoute", "StagePlan"]
