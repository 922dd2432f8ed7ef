"""The runtime: what runs a plan's stages over micro-batches.

Reads a :class:`~fxpipe.plan.PipelinePlan`, its stage GraphModules and the model's tensors;
produces a runtime implementing :class:`~fxpipe.runtime.contract.Runtime`, which a
:class:`~fxpipe.Pipe` holds. :mod:`~fxpipe.runtime.build` places the parameters and starts it,
in one process (:mod:`~fxpipe.runtime.local`) or this rank's share across ranks
(:mod:`~fxpipe.runtime.distributed`). Every schedule runs each stage through one primitive
(:mod:`fxpipe.runtime.stage`); the schedules are data (:mod:`fxpipe.runtime.schedules`), run by
GPipe's generated program (:mod:`~fxpipe.runtime.codegen`) or the action interpreter
(:mod:`~fxpipe.runtime.interpreter`); values move over :mod:`fxpipe.runtime.transport`;
replicas reduce gradients in :mod:`~fxpipe.runtime.dataparallel`; what a run records is in
:mod:`fxpipe.runtime.observe`.
"""
