"""Read a Hugging Face model's own tensor-parallel plan: its style names as PyTorch's styles.

Every transformers model carries a plan (``model._tp_plan``, ``config.base_model_tp_plan``)
whose values are names, not style objects. fxpipe takes the names whose meaning is one of
PyTorch's styles on a module call; ``replicated_with_grad_allreduce`` (a weight left whole
whose gradient the group sums) needs no style here, since fxpipe sums those gradients itself
(:mod:`fxpipe.passes.tppartial`). Other names are refused naming what to write instead.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from fxpipe.errors import TensorParallelError

__all__ = ["WHOLE", "from_name"]

WHOLE = ("replicated_with_grad_allreduce", "replicate")  # left whole (fxpipe sums such gradients itself)

_STYLES = {
    "colwise": lambda: ColwiseParallel(),
    "rowwise": lambda: RowwiseParallel(),
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
}


def from_name(name: str, key: str) -> Any:
    """Return the PyTorch style a Hugging Face plan's ``name`` stands for (None: leave the module whole)."""
    if name in WHOLE:
        return None
    make = _STYLES.get(name)
    if make is None:
        raise TensorParallelError(
            f"tp_plan['{key}'] = '{name}' is Hugging Face's notation, and fxpipe reads only "
            f"{', '.join(repr(n) for n in [*_STYLES, *WHOLE])} of it; write that module's style as a "
            "PyTorch style object (ColwiseParallel(), RowwiseParallel(...)), or pass tp_plan='auto'")
    return make()
