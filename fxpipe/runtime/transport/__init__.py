"""Moving values between stages: in one process, or between ranks.

Reads a stage's outputs and input gradients; delivers them to the stages that read them:
:mod:`~fxpipe.runtime.transport.mailbox` (one process, copy streams),
:mod:`~fxpipe.runtime.transport.messages` (point-to-point messages between ranks, over
:mod:`~fxpipe.runtime.transport.comm`'s bounded waits), :mod:`~fxpipe.runtime.transport.steplayout`
(what the first rank tells the others before a step), :mod:`~fxpipe.runtime.transport.failure`
(a failed step told to every rank, and the rejoin after it) and
:mod:`~fxpipe.runtime.transport.procgroup` (the process groups: pipeline, replicas, ties).
"""
