"""Keep a stage's running statistics through its recomputation: the checkpointed forward updated them.

Reads:  the stage GraphModule: its batch norms that track running statistics (fx: the
        ``nn.BatchNorm*`` submodules; torch.export: the buffers ``aten.batch_norm`` reads,
        which it updates in place) and the buffers its in-place ops write (``add_`` on
        ``num_batches_tracked``).
Writes: nothing in the graph; :func:`kept` puts those buffers' values back as they were before
        the block (the same tensor objects, holding a copy made before it).

A whole-stage recomputation runs the stage's forward once more in training mode, and a batch
norm there updates its running mean, variance and count a second time for the same
micro-batch (``checkpoint="except_last"``, the default, counted every micro-batch but the last
twice). The gradients do not depend on the running statistics in training mode, so putting
them back after the recomputation leaves the model as eager's. (``checkpoint="selective"``
keeps batch norms out of what it recomputes; deferred batch norm skips recomputations itself.)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.fx
from torch.nn.modules.batchnorm import _NormBase

from fxpipe.passes.mutates import op_name, written_args

__all__ = ["kept", "written_buffers"]


def written_buffers(gm: torch.fx.GraphModule) -> list[str]:
    """Return the names of the buffers a forward of ``gm`` updates: running statistics and in-place writes."""
    names: list[str] = []
    for path, module in gm.named_modules():
        if isinstance(module, _NormBase) and module.track_running_stats:
            names += [f"{path}.{k}" if path else k for k, b in module.named_buffers(recurse=False) if b is not None]
    buffers = dict(gm.named_buffers())
    for node in gm.graph.nodes:
        written = written_args(node)
        if node.op == "call_function" and "batch_norm" in op_name(node.target):
            written = node.all_input_nodes  # aten.batch_norm updates its running statistics unannounced
        for arg in written:
            if isinstance(arg, torch.fx.Node) and arg.op == "get_attr" and arg.target in buffers:
                names.append(str(arg.target))
    return list(dict.fromkeys(names))


@contextmanager
def kept(gm: torch.fx.GraphModule, names: list[str]) -> Iterator[None]:
    """Put the buffers ``names`` of ``gm`` back as they were before the block, after it."""
    if not names:
        yield
        return
    buffers = dict(gm.named_buffers())
    tensors = [buffers[n] for n in names if n in buffers and not buffers[n].is_meta]
    with torch.no_grad():
        saved = [t.clone() for t in tensors]
    try:
        yield
    finally:
        for t, s in zip(tensors, saved):
            # swapped in, not copied: autograd saved the running statistics for the backward
            # being computed, and an in-place copy would fail its version check (their values
            # are not read by a training-mode backward)
            t.data = s
