"""How a batch splits into micro-batches: its size, and the rows of each micro-batch.

Every tensor with at least one dimension is split on dim 0 (tuples, lists, dicts and nesting
are followed), but those of the inputs named in ``unbatched=``, which every micro-batch gets whole; a batch of B rows with ``chunks`` > B gives B micro-batches; uneven batches give
sizes that differ by at most one row. The plan counts micro-batches with these; the runtime
splits and gathers values by them (:mod:`fxpipe.runtime.microbatch`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import torch
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path

from fxpipe.errors import PipelineInputError

__all__ = ["batch_size", "index_like", "is_batched", "micro_sizes", "refuse_batched_masks", "refuse_nested_or_sparse"]


def is_batched(x: Any) -> bool:
    """Tell whether ``x`` is a tensor that is split on dim 0."""
    return isinstance(x, torch.Tensor) and x.dim() > 0


def refuse_nested_or_sparse(value: Any, where: str) -> None:
    """Refuse a nested (jagged) or sparse tensor anywhere in ``value``, naming where it is and what to pass instead."""
    for path, leaf in tree_flatten_with_path(value)[0]:
        if isinstance(leaf, torch.Tensor) and not leaf.is_nested and leaf.layout != torch.strided:
            raise PipelineInputError(
                f"{where}{keystr(path)} is a sparse tensor ({leaf.layout}), which fxpipe can neither trace nor split "
                "into micro-batches by rows (nor can torch.export or fake tensors follow sparse ops); pass what it "
                "is made of as dense tensors (adj = adj.coalesce(): adj.indices().clone() and adj.values().clone(), "
                "an edge_index and its weights, in unbatched= where every micro-batch needs them whole) and "
                "aggregate with index_add_ (torch.zeros_like(h).index_add_(0, index[0], weight[:, None] * "
                "h[index[1]]) for adj @ h), or pass it dense")
        if isinstance(leaf, torch.Tensor) and leaf.is_nested:
            raise PipelineInputError(
                f"{where}{keystr(path)} is a nested tensor (torch.nested), which fxpipe can neither trace nor split "
                "into micro-batches by rows; pass it padded as a dense tensor with its lengths or a mask "
                "(nt.to_padded_tensor(0), and each sample's length) and unpad inside the forward if needed")


def refuse_batched_masks(values: Sequence[Any], names: Sequence[str], whole: Collection[str], micro: int) -> None:
    """Refuse a flex attention ``BlockMask`` input of several batch rows where the batch is split (``micro > 1``).

    A mask is no tensor, so it would go whole to every micro-batch, each attending with the first
    rows' masks; slicing it drops its ``mask_mod``, which flex attention reads for partial blocks.
    """
    if micro <= 1:
        return
    for value, name in zip(values, names):
        for path, leaf in tree_flatten_with_path(value)[0]:
            if type(leaf).__name__ == "BlockMask" and hasattr(leaf, "kv_num_blocks") \
                    and leaf.kv_num_blocks.dim() == 3 and leaf.kv_num_blocks.shape[0] > 1:
                raise PipelineInputError(
                    f"input '{name}{keystr(path)}' is a flex attention BlockMask of {leaf.kv_num_blocks.shape[0]} "
                    "batch rows, which fxpipe cannot split into micro-batches (it is no tensor; a slice of it loses "
                    "its mask_mod), so every micro-batch would attend with the first rows' masks. Build the mask "
                    "inside the forward from a tensor input (per-token document ids: create_block_mask over "
                    "x.shape[0]), pass a mask of batch size None (one for every row), or use chunks=1")


def index_like(t: torch.Tensor) -> bool:
    """Tell whether a tensor may hold offsets, lengths or indices into rows: integer, of one or two dims."""
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool) and t.dim() <= 2


def batch_size(values: Sequence[Any], names: Sequence[str], whole: Collection[str] = (),
               agree: bool = True) -> int | None:
    """Return the common dim-0 size of the batched tensors in ``values``, or None if there are none.

    The values named in ``whole`` (``unbatched=``) are not split and do not count. Raises
    :class:`PipelineInputError` naming the argument whose batch size disagrees; with ``agree``
    off (one micro-batch: nothing is split) not where one of them is index-like (offsets,
    lengths, a group per row, ``edge_index``: a flat batch's), and returns the first one's.
    """
    first: tuple[str, int] | None = None
    first_leaf: tuple[str, Any] = ("", None)
    for value, name in zip(values, names):
        refuse_nested_or_sparse(value, f"input '{name}'")
        if name in whole:
            continue
        for path, leaf in tree_flatten_with_path(value)[0]:
            if not is_batched(leaf):
                continue
            where = name + keystr(path)
            if first is None:
                first, first_leaf = (where, leaf.shape[0]), (where, leaf)
            elif leaf.shape[0] != first[1] and (agree or not (index_like(leaf) or index_like(first_leaf[1]))):
                fix = ("name an input that has no batch dimension in fxpipe.compile(..., unbatched=[...]) to give "
                       "it whole to every micro-batch")
                if name == "target":  # the loss's own: nothing of it reaches the forward
                    fix = ("if one of them is not per row (class weights, a constant of the loss), give it to "
                           "loss_fn another way, not in target=: a closure or functools.partial (lambda out, y: "
                           "F.cross_entropy(out, y, weight=w)); target= is split with the rows")
                elif path and not any(is_batched(t) and t.shape[0] == first[1]
                                      for t in tree_flatten(value)[0]):  # none of the input's tensors is per row
                    fix = (f"name '{name}' in fxpipe.compile(..., unbatched=['{name}']) to give all of it whole to every "
                           f"micro-batch (none of its tensors has the batch's {first[1]} rows)")
                elif path:  # a leaf inside an input: unbatched= names whole inputs only
                    fix = (f"pass '{where}' to the forward as an argument of its own, named in "
                           f"fxpipe.compile(..., unbatched=[...]) to give it whole to every micro-batch (unbatched= "
                           f"names whole inputs, and naming '{name}' would leave all of it unsplit)")
                index = next((w for w, t in ((where, leaf), first_leaf) if index_like(t)), None)
                flat = (f" If '{index}' holds offsets, lengths or indices into rows (cu_seqlens, edge_index, a "
                        "group per row, flat ids for nn.EmbeddingBag), it can be neither split with the rows nor "
                        "given whole (unbatched= gives every micro-batch indices into rows it does not hold): pad "
                        "the batch to one row per sample, (batch, length, ...) with a mask or padding_idx, or use "
                        "chunks=1, which splits nothing." if index is not None else "")
                (few, _), (many, more) = sorted([(first[1], first[0]), (leaf.shape[0], where)])
                rows = leaf if more == where else first_leaf[1]
                if few > 1 and many % few == 0 and not index_like(rows):  # several rows per sample
                    k = many // few
                    flat = (f" If '{more}' holds {k} rows per sample (several images of each sample), "
                             "unbatched= is wrong for it too (every micro-batch would get every sample's rows): pass "
                             f"it batch-first, ({few}, {k}, ...), and flatten it inside the forward "
                             "(x.flatten(0, 1)).")
                split = ("every tensor input is split into micro-batches on dim 0" if agree else
                         "with one micro-batch nothing is split, but fxpipe takes dim 0 of every tensor input for "
                         "the batch's rows")
                other = (" An input whose batch is on another dim (an RNN's initial state (h0, c0), of shape "
                         "(layers, batch, hidden)) is not unbatched: pass it batch-first and move the dim inside the "
                         f"forward (h0.transpose(0, 1).contiguous()).{flat}" if name != "target" else "")
                raise PipelineInputError(
                    f"batch sizes disagree: '{first[0]}' has {first[1]} rows on dim 0 but "
                    f"'{where}' has {leaf.shape[0]}; {split}, so give them the same batch size, or {fix}.{other}")
    if first is not None and first[1] == 0:
        raise PipelineInputError(f"'{first[0]}' has batch size 0; a pipeline needs at least one row")
    return None if first is None else first[1]


def micro_sizes(batch: int | None, chunks: int) -> list[int]:
    """Return the number of rows of each micro-batch for a batch of ``batch`` rows."""
    if batch is None:
        return [0]
    m = min(chunks, batch)
    base, extra = divmod(batch, m)
    return [base + (1 if i < extra else 0) for i in range(m)]
