"""The process groups of a distributed pipeline: join them, agree on the plan, tie shared tensors.

Every rank traces and plans the whole model; :func:`agree_on_stages` makes them all use rank
0's cut. Parameters read by stages on several ranks (tied embeddings) live on each of those
ranks; :func:`tied_groups` makes them equal at the start and gives the group their
gradients are summed over after each step, like DeepSpeed's tied layers.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.fx

from fxpipe import passes
from fxpipe.errors import GraphMismatchError
from fxpipe.runtime.placement import named_tensors
from fxpipe.runtime.transport.mesh import (
    Layout,
    check_launched_world,
    check_world,
    init_distributed,
    join_default_group,
    setup_distributed,
)

__all__ = ["Layout", "Ties", "agree_on_stages", "check_launched_world", "check_world", "init_distributed",
           "join_default_group", "reopen_pipeline", "setup_distributed", "tied_groups"]

log = logging.getLogger(__name__)


def agree_on_stages(gm: torch.fx.GraphModule, n_stages: int) -> None:
    """Make every process use global rank 0's stage assignment (measured costs may differ by rank).

    The assignment is by node name, so every rank must have traced the same graph. A rank whose
    trace computes the same values in another order (a forward iterating a set of strings,
    whose order follows the process's hash seed) takes rank 0's node names
    (:func:`fxpipe.passes.fingerprint.rename_like`); a graph computing other values is refused
    on every rank with a :class:`GraphMismatchError` naming the ranks, the first differing node
    and the fix.
    """
    shape, state = passes.fingerprint(gm), passes.state_signature(gm)
    box = [({n.name: n.meta["fxpipe.stage"] for n in passes.compute_nodes(gm)}, shape, passes.structure(gm), state)]
    dist.broadcast_object_list(box, src=0)
    chosen, first, keys, first_state = box[0]
    differ = passes.first_difference(first, shape)
    renamed = differ is not None and passes.rename_like(gm, keys)
    built = passes.first_difference(first_state, state) if differ is None or renamed else None
    verdicts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, ("built", built) if built else None if renamed else differ)
    built_by = {r: v[1] for r, v in enumerate(verdicts) if isinstance(v, tuple)}
    if built_by:
        r, what = next(iter(built_by.items()))
        raise GraphMismatchError(
            f"rank {r} built another model than rank 0 (ranks differing: {sorted(built_by)}): rank {r} has {what}. "
            "Its graph has the same nodes, but a stage would hold other sizes, dtypes or settings on each rank "
            "(and ranks exchanging values of other sizes fail, or train silently on the wrong model). Build the "
            "model from the same config, in the same dtype, on every rank")
    refused = {r: d for r, d in enumerate(verdicts) if d is not None}
    if refused:
        r, what = next(iter(refused.items()))
        raise GraphMismatchError(
            f"rank {r} traced another graph of the model than rank 0 (ranks differing: {sorted(refused)}): "
            f"rank {r} has {what}, and its graph computes other values. A pipeline cuts every rank's graph "
            "by node name, so the ranks would exchange the wrong values. The model's forward depends on the "
            "process; give every rank the same example inputs, and if the forward iterates over a set of "
            "strings, launch every rank with the same hash seed (PYTHONHASHSEED=0 torchrun ...)")
    if renamed:
        log.info("rank %d traced the model's nodes in another order than rank 0 (%s); it takes rank 0's names",
                 dist.get_rank(), differ)
    if chosen != {n.name: n.meta["fxpipe.stage"] for n in passes.compute_nodes(gm)}:
        log.info("rank %d adopts rank 0's stage assignment", dist.get_rank())
        passes.assign_by_name(gm, chosen, n_stages)


def tied_groups(stages: Sequence[torch.fx.GraphModule], rank_of: Sequence[int], layout: Layout,
                timeout: float) -> Ties:
    """Create a group per set of ranks sharing tensors; return this rank's ties (:class:`Ties`).

    ``rank_of`` gives each stage's rank. Every rank calls this with the same stages, so groups
    are created in the same order. The shared tensors are made equal to those of the lowest
    rank that holds them. Stages on one rank share a tensor as one object: nothing to sum.
    """
    holders: dict[int, list[int]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for j, gm in enumerate(stages):
        for _, t in named_tensors(gm):
            if rank_of[j] not in holders.setdefault(id(t), []):
                holders[id(t)].append(rank_of[j])
                tensors[id(t)] = t
    by_ranks: dict[tuple[int, ...], list[torch.Tensor]] = {}
    for key, holding in holders.items():
        if len(holding) > 1:
            by_ranks.setdefault(tuple(sorted(holding)), []).append(tensors[key])
    ties = Ties(timeout=timeout)
    rows = layout.pipelines()
    for ranks in sorted(by_ranks):
        for row in rows:  # every process creates every pipeline's group (replica, tp index), in the same order
            members = [row[r] for r in ranks]
            ties.members.append(members)
            group = dist.new_group(members, timeout=timedelta(seconds=timeout))
            if row is rows[layout.row] and layout.rank in ranks:
                assert isinstance(group, dist.ProcessGroup)  # a member's group (torch 2.14 types a non-member's too)
                for t in by_ranks[ranks]:  # a DTensor's shard: the same tp index holds the same one
                    dist.broadcast(t.data.to_local() if hasattr(t.data, "to_local") else t.data, src=members[0],
                                   group=group)
                ties.index.append(len(ties.members) - 1)
                ties.mine.append((group, [t for t in by_ranks[ranks] if isinstance(t, torch.nn.Parameter)],
                                  layout.rank == ranks[0]))
    return ties


@dataclass
class Ties:
    """This rank's tied tensors: per tie its (group, parameters, first) in ``mine``.

    ``first`` tells whether this rank is the tie's lowest, which counts the parameters once
    (in a gradient norm). ``members`` lists every tie group the processes created, in order,
    and ``index`` which of them each of ``mine`` is, so that :meth:`reopen` can create them
    anew the same way on every rank after a failed step.
    """

    timeout: float
    mine: list[tuple[Any, list, bool]] = field(default_factory=list)
    members: list[list[int]] = field(default_factory=list)
    index: list[int] = field(default_factory=list)

    def close(self) -> None:
        """Drop this rank's tie groups, so that a peer waiting in a tie's reduction fails at once."""
        for group, _, _ in self.mine:
            try:
                dist.destroy_process_group(group)
            except Exception as exc:  # noqa: BLE001 - closing after a failure: nothing more to do
                log.debug("closing a tie group: %s", exc)
        self.mine = [(None, params, first) for _, params, first in self.mine]

    def reopen(self) -> None:
        """Create every tie group anew (every rank, the same order) after a failed step."""
        groups = [dist.new_group(m, timeout=timedelta(seconds=self.timeout)) for m in self.members]
        self.mine = [(groups[k], params, first) for k, (_, params, first) in zip(self.index, self.mine)]


def reopen_pipeline(layout: Layout, timeout: float) -> Any:
    """Create this pipeline's group anew (every rank of the world, in the same order) and return it."""
    rows = layout.pipelines()
    backend = dist.get_backend()
    groups = [dist.new_group(row, timeout=timedelta(seconds=timeout), backend=backend) for row in rows]
    layout.pp_group = groups[layout.row]
    return layout.pp_group
