"""The runtime: what runs a plan's stages over micro-batches.

One stage-call primitive (:mod:`fxpipe.runtime.stagecall`) runs a stage on a micro-batch;
schedules are action lists (:mod:`fxpipe.runtime.schedule`); the GPipe program
(:mod:`fxpipe.runtime.codegen`) and the action interpreter (:mod:`fxpipe.runtime.actions`)
run them, in one process (:mod:`fxpipe.runtime.local`) or one stage per rank
(:mod:`fxpipe.runtime.distributed`), moving values over copy streams or point-to-point
messages (:mod:`fxpipe.runtime.transport`).
"""
