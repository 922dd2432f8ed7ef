"""What users look at: the ``fxpipe`` command, graph pictures, timelines, error notes.

The CLI (:mod:`fxpipe.tools.cli`), DOT pictures (:mod:`fxpipe.tools.dot`), the measured
timeline (:mod:`fxpipe.tools.recorder`), model factories (:mod:`fxpipe.tools.factory`), the
divergence finder (:mod:`fxpipe.tools.diverge`) and the error notes naming a stage and node
(:mod:`fxpipe.tools.blame`).
"""
