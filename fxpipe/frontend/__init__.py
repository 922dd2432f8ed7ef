"""The front end: a model becomes a GraphModule.

Reads an ``nn.Module`` (real or on meta) and example inputs; produces a ``torch.fx``
GraphModule whose parameters are the model's own objects: :mod:`~fxpipe.frontend.tracing`
(``fxpipe.trace``: symbolic tracing, or another tracer's graph), :mod:`~fxpipe.frontend.export`
(``torch.export``, with :mod:`~fxpipe.frontend.exportmeta` for meta models) and
:mod:`~fxpipe.frontend.markers` (``torch.distributed.pipelining``'s split markers).
"""
