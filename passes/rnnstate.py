"""Find model inputs an RNN reads as its initial state, whose batch is on dim 1.

Reads:  the graph (``call_module`` nodes of ``nn.RNN``/``nn.LSTM``/``nn.GRU``; torch.export's
        ``aten.lstm``/``gru``/``rnn_tanh``/``rnn_relu``) and the placeholders' ``fxpipe.value``.
Writes: nothing; :func:`state_inputs` names each input handed to such a layer as its ``hx``.

An RNN's initial state is ``(layers * directions, batch, hidden)`` whatever ``batch_first``
says: split on dim 0 into micro-batches, each would get some layers of the whole batch. Where
the layers happen to number the batch's rows the inputs' sizes agree and nothing else tells::

    forward(x, h0, c0): self.lstm(x, (h0, c0))     h0: (4 = 2 layers x 2 directions, B = 4, H)
"""

from __future__ import annotations

from collections.abc import Collection

import torch
import torch.fx
from fxpipe.passes.spec import TensorSpec
from torch import nn
from torch.utils._pytree import tree_flatten

__all__ = ["state_inputs"]

_RNN_OPS = frozenset(getattr(torch.ops.aten, name).input for name in ("lstm", "gru", "rnn_tanh", "rnn_relu")
                     if hasattr(torch.ops.aten, name))


def _state_arg(gm: torch.fx.GraphModule, node: torch.fx.Node) -> object:
    """Return the initial-state argument of an RNN call, or None when ``node`` is none."""
    if node.op == "call_module" and isinstance(gm.get_submodule(str(node.target)), nn.RNNBase):
        return node.args[1] if len(node.args) > 1 else node.kwargs.get("hx")
    if node.op == "call_function" and node.target in _RNN_OPS:
        return node.args[1] if len(node.args) > 1 else None
    return None


def state_inputs(gm: torch.fx.GraphModule, unbatched: Collection[str] = ()) -> list[str]:
    """Return the inputs (placeholder names) an RNN takes unchanged as its 3-dim initial state, split on dim 0."""
    found: list[str] = []
    for node in gm.graph.nodes:
        for value in tree_flatten(_state_arg(gm, node))[0]:
            spec = value.meta.get("fxpipe.value") if isinstance(value, torch.fx.Node) else None
            if isinstance(value, torch.fx.Node) and value.op == "placeholder" and value.target not in unbatched \
                    and isinstance(spec, TensorSpec) and len(spec.shape) == 3 and value.target not in found:
                found.append(str(value.target))
    return found
