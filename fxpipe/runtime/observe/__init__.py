"""What a run records: the timeline of stage calls and the notes that name a failing stage and node.

Reads the events the stage call emits; produces a :class:`~fxpipe.runtime.observe.timeline.Timeline`
(``fxpipe.timeline()``: Chrome trace, ASCII chart) and error notes
(:mod:`~fxpipe.runtime.observe.blame`). Imports nothing of the rest of the runtime: every layer
may emit into it, and the simulator draws its predictions with the same Timeline.
"""
