"""What users look at: the ``fxpipe`` command, graph pictures, the divergence finder.

Reads a model factory or a compiled pipe; produces the CLI's tables, pictures and plans
(:mod:`~fxpipe.tools.cli` dispatching to :mod:`~fxpipe.tools.inspectcmd` and
:mod:`~fxpipe.tools.plancmd`), DOT pictures (:mod:`~fxpipe.tools.dot`), model factories loaded
from ``file.py:function`` (:mod:`~fxpipe.tools.factory`) and the first node where a pipe departs
from eager (:mod:`~fxpipe.tools.diverge`).
"""
