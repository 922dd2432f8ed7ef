"""Warn when the automatic tensor-parallel plan splits little of a model: every rank then computes it whole.

``tp_plan="auto"`` splits ``nn.Linear`` and ``nn.Embedding`` (``aten.linear``, ``aten.embedding``
in an exported graph). A model whose projections are written otherwise (transformers' GPT-2
``Conv1D``: an ``addmm`` on its own weight) gets a plan that splits nothing, and ``tensor_parallel=2``
would only duplicate the work on both ranks.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch.fx
from torch import nn

__all__ = ["SPLIT_AT_LEAST", "little_split", "warn_little_split"]

SPLIT_AT_LEAST = 0.5  # the share of the parameters below which the plan is said to split little


def warn_little_split(gm: torch.fx.GraphModule, plan: Any) -> None:
    """Warn, naming the largest whole modules, when the plan splits less than half of ``gm``'s parameters."""
    message = little_split(gm, plan)
    if message is not None:
        warnings.warn(message, UserWarning, stacklevel=3)


def little_split(gm: torch.fx.GraphModule, plan: Any) -> str | None:
    """Say how little of ``gm``'s parameters the plan splits and the largest modules left whole (None: half or more)."""
    params = dict(gm.named_parameters())
    total = sum(p.numel() for p in params.values())
    split = plan.sharded_weights()
    done = sum(p.numel() for p in params.values() if id(p) in split)
    if not total or done >= SPLIT_AT_LEAST * total:
        return None
    owners: dict[str, int] = {}
    for name, p in params.items():
        if id(p) not in split:
            owner = name.rsplit(".", 1)[0] if "." in name else name
            owners[owner] = owners.get(owner, 0) + p.numel()
    largest = sorted(owners.items(), key=lambda kv: -kv[1])[:4]
    shown = ", ".join(f"'{m}' ({100 * n / total:.0f}%)" for m, n in largest)
    head = (f"tensor_parallel={plan.size} with tp_plan='auto' splits {100 * done / total:.0f}% of the parameters: "
            f"every rank computes the rest whole, e.g. {shown}. ")
    sites = getattr(plan, "sites", {})  # an exported graph keeps no modules: its linear calls are the plan's sites

    def linear(m: str) -> bool:
        return isinstance(_module(gm, m), nn.Linear) or getattr(sites.get(m), "kind", None) == "linear"

    if all(linear(m) for m, _ in largest):  # linears whose pairing did not close
        return head + ("They are nn.Linear layers the automatic plan could not pair column-wise then row-wise: the "
                       "shard of a layer's output meets an op that needs it whole (a residual add, a norm, a "
                       "reduction, a fused projection such as qkv_proj or gate_up_proj split along the sharded dim) "
                       "before a layer that could take it row-wise. Write tp_plan= yourself (a fused projection "
                       "split into one nn.Linear each pairs), or use tensor_parallel=1")
    return head + ("The automatic plan splits nn.Linear and nn.Embedding (aten.linear, aten.embedding); layers "
                   "written otherwise (transformers' Conv1D, a matmul or addmm on a parameter) stay whole: replace "
                   "them by nn.Linear, or use tensor_parallel=1")


def _module(gm: torch.fx.GraphModule, name: str) -> Any:
    """Return ``gm``'s submodule ``name``, or None where the graph keeps no such module (an exported one)."""
    try:
        return gm.get_submodule(name)
    except AttributeError:
        return None
