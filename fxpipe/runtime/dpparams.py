"""Parameters data parallel cannot reduce as they are: sparse gradients, rows renormalised in place, strides.

- ``sparse=True`` gives a sparse gradient. FSDP2 cannot reduce-scatter it (``fsdp::chunk_cat``
  has no sparse kernel), and DDP cannot take the one an exported graph's ``aten.embedding``
  makes ("Cannot access storage of SparseTensorImpl"); DDP over an fx stage, which calls the
  ``nn.Embedding`` module itself, reduces it. Refused before the first step, naming the fix.
- ``max_norm=`` renormalises the rows a forward looks up, in place: each replica renormalises
  the rows of its own share of the batch, and data parallel averages only gradients, so the
  replicas' weights drift apart. Warned of.
- A non-contiguous parameter (a ``channels_last`` model's convolution weight) FSDP2 cannot shard
  ("FSDP does not support non-contiguous parameters yet"): refused naming the fix. So are a
  stage's parameters of several dtypes (FSDP2 shards a module in one).
"""

from __future__ import annotations

import warnings

import torch
import torch.fx
from torch import nn

from fxpipe.errors import CompileError

__all__ = ["check_embeddings", "check_layouts"]

_SPARSE_ARG = {torch.ops.aten.embedding.default: 4, torch.ops.aten.embedding_bag.default: 5,
               torch.ops.aten.embedding_bag.padding_idx: 5, torch.ops.aten._embedding_bag.default: 5}


def _sparse_ops(module: nn.Module) -> list[str]:
    """Return the nodes of a graph's embedding ops asked for a sparse gradient (torch.export's)."""
    if not isinstance(module, torch.fx.GraphModule):
        return []
    found = []
    for node in module.graph.nodes:
        k = _SPARSE_ARG.get(node.target) if node.op == "call_function" else None  # type: ignore[call-overload]
        if k is not None and len(node.args) > k and node.args[k] is True:
            found.append(node.name)
    return found


def check_layouts(j: int, module: nn.Module, shard: bool) -> None:
    """Refuse stage ``j``'s non-contiguous parameters (a ``channels_last`` model's weights), or of several dtypes,
    where FSDP2 shards them."""
    if not shard:
        return
    first: dict[torch.dtype, str] = {}
    for name, p in module.named_parameters():
        first.setdefault(p.dtype, name)
    if len(first) > 1:
        held = ", ".join(f"{dtype} ({name!r})" for dtype, name in first.items())
        raise CompileError(f"stage {j} holds parameters of several dtypes, {held}, and FSDP2 shards a module's "
                           "parameters in one dtype (data_parallel_shard=True; it failed at the first step: 'FSDP "
                           "expects uniform original parameter dtype'); cast the model to one dtype (torch.autocast "
                           "for lower-precision math), put a split point between them (split_points=), or use "
                           "data_parallel_shard=False (DDP)")
    for name, p in module.named_parameters():
        if p.requires_grad and not p.is_contiguous():
            layout = " (channels_last)" if p.dim() == 4 and p.is_contiguous(memory_format=torch.channels_last) else ""
            raise CompileError(
                f"stage {j}'s parameter {name!r} is not contiguous{layout}, which FSDP2 cannot shard "
                "(data_parallel_shard=True); keep the weights contiguous and make only the inputs channels_last "
                "(x.to(memory_format=torch.channels_last): the convolutions' activations follow them), or use "
                "data_parallel_shard=False (DDP takes channels_last weights)")


def check_embeddings(j: int, module: nn.Module, shard: bool) -> None:
    """Refuse stage ``j``'s sparse embedding gradients where its data parallel cannot reduce them; warn of ``max_norm``."""
    modules = [name for name, m in module.named_modules()
               if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad]
    ops = _sparse_ops(module)
    if shard and (modules or ops):
        raise CompileError(
            f"stage {j}'s embedding {(modules or ops)[0]!r} has sparse=True, whose sparse gradient FSDP2 cannot "
            "reduce-scatter (data_parallel_shard=True); use sparse=False (a dense gradient, with any optimizer), or "
            "data_parallel_shard=False (DDP reduces it under tracer='fx')")
    if ops:
        raise CompileError(
            f"stage {j}'s embedding {ops[0]!r} has sparse=True in a graph from tracer='export', whose sparse gradient "
            "DDP cannot reduce (torch: 'Cannot access storage of SparseTensorImpl'); compile with tracer='fx' (the "
            "stage then calls the nn.Embedding itself, whose sparse gradient DDP reduces), or use sparse=False")
    renormed = [name for name, m in module.named_modules()
                if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None]
    if not renormed and isinstance(module, torch.fx.GraphModule):
        renormed = [n.name for n in module.graph.nodes if n.op == "call_function"
                    and n.target in (torch.ops.aten.embedding_renorm_.default, torch.embedding_renorm_)]
    if renormed:
        warnings.warn(
            f"stage {j}'s embedding {renormed[0]!r} has max_norm=, which renormalises the rows a forward looks up in "
            "place: under data parallel each replica renormalises the rows of its own share of the batch, and only "
            "gradients are averaged, so the replicas' weights drift apart. Leave max_norm out and renormalise the "
            "whole weight after optimizer.step() on every replica (torch.renorm), or use data_parallel=1",
            stacklevel=2)
