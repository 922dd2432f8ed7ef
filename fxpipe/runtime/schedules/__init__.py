"""Schedules as data: what each stage does, in which order, for ``m`` micro-batches.

Reads a schedule's name or a user's action lists and the stage count; produces validated
action lists (:mod:`~fxpipe.runtime.schedules.actions`: ``F``, ``B``, ``I``, ``W``, their text,
completeness and deadlock checks, lowering with sends and receives), from the built-in
producers (:mod:`~fxpipe.runtime.schedules.builtin`: GPipe, 1F1B, zero bubble;
:mod:`~fxpipe.runtime.schedules.multistage`: interleaved 1F1B and ZB-V). Imports nothing of the
rest of the runtime, so the simulator reads the same data the runtime runs.
"""
