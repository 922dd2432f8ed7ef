"""Give every rank of a tensor-parallel group the inputs and the target one of its ranks was given.

The ranks of a group compute on the same inputs (the first stage's group) and the same target
(the last stage's group). A user may pass them on every rank of the group, or on one: its first
rank, or, as often, the last rank of the world, the group's last. The group takes them from
its first rank that has them::

    tp group of the last stage:   rank 2: target=None    rank 3: target=y
                                        \\                     |
         one all-reduce (MIN) of "my tp index if I have it" -> 1
                                         \\                    |
         broadcast from tp index 1:   rank 2: y            rank 3: y

One all-reduce of two integers per step and group, then one broadcast of the value; none
without tensor parallelism.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["from_tp_holder", "group_names", "inputs_given"]


def inputs_given(args: tuple, kwargs: dict) -> bool:
    """Return whether a call passed any input that is not ``None``."""
    return any(a is not None for a in args) or any(v is not None for v in kwargs.values())


def from_tp_holder(runtime: Any, value: Any, given: bool, flag: bool = False) -> tuple[Any, bool]:
    """Return the value of the group's first rank that has one (``given``), and whether any rank set ``flag``.

    Without tensor parallelism: ``value`` and ``flag`` as they are. When no rank of the group
    has a value, each keeps its own (``None``, or inputs that are all ``None``).
    """
    layout = runtime.layout
    if layout.tp == 1:
        return value, flag
    found = torch.tensor([layout.tp_index if given else layout.tp, -int(flag)], dtype=torch.int64,
                         device=runtime.device)  # NCCL: on the GPU
    dist.all_reduce(found, op=dist.ReduceOp.MIN, group=layout.tp_group)
    source, flag = int(found[0]), bool(-int(found[1]))
    if source == layout.tp:
        return value, flag
    box = [value if layout.tp_index == source else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(layout.tp_group, source), group=layout.tp_group,
                               device=runtime.device)
    return box[0], flag


def group_names(runtime: Any) -> list[str]:
    """Name, for each pipeline rank, the global rank(s) whose inputs and target count there.

    ``"rank 3"`` without tensor parallelism; ``"ranks 2, 3"`` (this replica's group) with it.
    """
    layout = runtime.layout
    if layout.tp == 1:
        return [f"rank {r}" for r in layout.global_ranks]
    rows = layout.pipelines()[layout.replica * layout.tp:(layout.replica + 1) * layout.tp]
    return [f"ranks {', '.join(str(row[p]) for row in rows)}" for p in range(len(rows[0]))]
