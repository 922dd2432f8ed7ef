"""One stage on one micro-batch: the call every schedule makes, and what it keeps for backward.

Reads a stage GraphModule and a micro-batch's inputs; produces outputs and, later, input and
weight gradients: :mod:`~fxpipe.runtime.stage.stagecall` (the primitive: forward, recompute,
stream waits, timeline, error notes), :mod:`~fxpipe.runtime.stage.recompute` (activation
checkpointing with random numbers replayed), :mod:`~fxpipe.runtime.stage.worker` (F, B, I, W on
detached boundaries), :mod:`~fxpipe.runtime.stage.wgrad` (weight gradients deferred to W),
:mod:`~fxpipe.runtime.stage.batchnorm` (deferred batch norm),
:mod:`~fxpipe.runtime.stage.dependency` (fork/join ordering), and the device plumbing
(:mod:`~fxpipe.runtime.stage.stream`, :mod:`~fxpipe.runtime.stage.copy`, :mod:`~fxpipe.runtime.stage.threads`).
"""
