"""Refuse, on a pipe's first call, the ranks of one pipeline given different batches.

A ``DistributedSampler`` left to its defaults shards the data over every rank, so the ranks
of one pipeline get different rows, and the first stage's inputs would be trained against
another shard's target, silently. On the first ``pipe.step`` and the first ``pipe(x)`` the
first stage's rank sends a digest of its inputs (and its target) with the step's layout; every
other rank that was given inputs or a target compares its own, and the pipeline agrees on one
verdict (under data parallel the replicas do too, so none waits for another in a reduction)::

    rank 0 (first stage)  digest(x0), digest(y0) ──▶ header ──▶ rank 1 .. p-1: digest(own) == ?
                          ◀── each rank's verdict ──┘
                          the first refusal ──────────────────▶ every rank raises it

Ranks that pass ``None`` compare nothing; a rank given another value for an input the trace
fixed (``mask=`` a tensor where the example's ``None`` was fixed) is refused on every rank too.
Under tensor parallelism a group takes its values from its first rank given them
(:mod:`tpinputs`): its ranks first compare what each was given with that rank's (one
``all_gather`` in the group), each tensor-parallel index then runs the above over its own
ranks, and the groups agree on the first refusal, so that no rank of a group waits alone in a
collective. At later calls (no glance under tensor parallelism) each rank given inputs still
binds them, refusing a value for an input the trace fixed (:func:`check_fixed`).
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from fxpipe.errors import PipelineInputError
from fxpipe.passes.annotate import FixedInputError
from fxpipe.runtime.transport.comm import on_every_rank, tell_all
from fxpipe.runtime.transport.tpinputs import inputs_given

__all__ = ["agree_on_batch", "check_fixed", "check_glance", "digest", "glance", "target_glance", "versions"]

_PLAIN = (bool, int, float, str, type(None))
_FIX = ("A DistributedSampler with its default num_replicas and rank gives every rank its own rows; shard over the "
        "replicas instead: DistributedSampler(dataset, *fxpipe.data_shard(pipe))")


def _leaf(value: Any) -> Any:
    """Return one leaf's fingerprint: a tensor's shape, dtype (not compared) and row-weighted sum; a plain value itself."""
    if isinstance(value, torch.Tensor):
        if value.device.type == "meta" or value.layout != torch.strided or value.is_quantized:
            return None  # not compared: no values, or no plain sum
        t = value.detach()
        t = torch.view_as_real(t.resolve_conj()) if t.is_complex() else t
        rows = t.reshape(t.shape[0], t[:1].numel()) if t.dim() else t.reshape(1, 1)
        weights = torch.arange(1, rows.shape[0] + 1, dtype=torch.float64, device=t.device)
        return (tuple(value.shape), str(value.dtype), float((rows.double().sum(1) * weights).sum()))
    return value if type(value) in _PLAIN else None  # another object's repr may differ between processes


def digest(value: Any) -> list[Any]:
    """Return a cheap fingerprint of a structure of values: one entry per leaf (``None`` where not compared)."""
    leaves, _ = tree_flatten(value)
    return [_leaf(v) for v in leaves]


def glance(value: Any) -> list[Any]:
    """Return a cheaper fingerprint than :func:`digest`, for every later step: shapes and each tensor's first entries."""
    found: list[Any] = []
    for v in tree_flatten(value)[0]:
        if isinstance(v, torch.Tensor) and v.device.type != "meta" and v.layout == torch.strided \
                and not v.is_quantized:
            t = v.detach().reshape(-1)[:64]
            t = torch.view_as_real(t.resolve_conj()) if t.is_complex() else t
            found.append((tuple(v.shape), str(v.dtype), float(t.double().sum()) if t.numel() else 0.0))
        else:
            found.append(v if type(v) in _PLAIN else None)
    return found


def check_glance(runtime: Any, args: tuple, kwargs: dict, target: Any, header: dict) -> None:
    """On a rank other than the first stage's, at a later step: refuse inputs or a target other than the first's.

    The batches agreed at the first call; a loop out of step later (a loader one batch shorter on
    one rank: its next epoch's inputs met the other rank's last target) is refused on this rank,
    and its peers learn of it as of any failed step.
    """
    values = _bound(runtime, args, kwargs)
    mine = (None if values is None else glance(values), target_glance(runtime, target))
    theirs = header["glance"]
    what = None
    if mine[0] is not None and _differs(mine[0], theirs[0]) is not None:
        what = "inputs"
    elif mine[1] is not None and _differs(mine[1], theirs[1]) is not None:
        what = "target"
    if what is None:
        return
    me, first = runtime.layout.global_ranks[runtime.rank], runtime.layout.global_ranks[runtime.first]
    raise PipelineInputError(
        f"rank {me} was given other {what} than rank {first} (the first stage's) at this step, though they agreed "
        "at the first: the ranks' training loops are out of step (a data loader of another length on one rank, a "
        "rank that skipped a step or started an epoch early). Give every rank of a pipeline the same batches in "
        "the same order (DistributedSampler(dataset, *fxpipe.data_shard(pipe)) with drop_last=True, and "
        "sampler.set_epoch(epoch) on every rank), or pass the inputs only on the first stage's rank and the target "
        "only on the last's (None elsewhere)")


def check_fixed(runtime: Any, args: tuple, kwargs: dict) -> None:
    """On a rank other than the first stage's, at a later step: refuse a value for an input the trace fixed."""
    _bound(runtime, args, kwargs)


def _bound(runtime: Any, args: tuple, kwargs: dict) -> list[Any] | None:
    """Return the inputs this rank was given as the model binds them (``None``: none given, or not the model's)."""
    if not inputs_given(args, kwargs):
        return None
    try:
        return runtime.binding.bind(args, kwargs)
    except FixedInputError:
        raise  # another value for an input the trace fixed: ignored on this rank, silently, if let pass
    except TypeError:
        return None  # not the model's inputs (a loader's whole tuple): the first rank's are the ones that run


def versions(target: Any) -> list[tuple[weakref.ref, int]]:
    """Return each tensor of ``target`` with its version, to tell at the next step whether it was written since."""
    return [(weakref.ref(t), t._version) for t in tree_flatten(target)[0] if isinstance(t, torch.Tensor)]


def target_glance(runtime: Any, target: Any) -> list[Any] | None:
    """Return the glance of this rank's target, or None: none given, or written in place by loss_fn since."""
    return None if target is None or _written(runtime) else glance(target)


def _written(runtime: Any) -> bool:
    """Tell whether the target this rank was given at the last step was written in place since.

    A ``loss_fn`` masking its labels in place (``t[t == pad] = -100``) writes the last rank's
    target, not the first's: the same batch given again then differs, and is not compared.
    """
    return any((t := ref()) is not None and t._version != version for ref, version in runtime.target_versions)


def _same(a: Any, b: Any) -> bool:
    """Return whether two leaves' fingerprints agree (sums within float64 rounding of a layout change)."""
    if a is None or b is None:
        return True
    if isinstance(a, tuple) and isinstance(b, tuple):
        (sa, _, xa), (sb, _, xb) = a, b  # the same rows in another dtype are the same batch
        return sa == sb and (xa == xb or (math.isnan(xa) and math.isnan(xb))
                             or math.isclose(xa, xb, rel_tol=1e-9, abs_tol=1e-12))
    return a == b


def _differs(mine: list[Any], theirs: list[Any] | None) -> int | None:
    """Return the index of the first leaf that differs, -1 for another structure, ``None`` when they agree."""
    if theirs is None:
        return None
    if len(mine) != len(theirs):
        return -1
    return next((i for i, (a, b) in enumerate(zip(mine, theirs)) if not _same(a, b)), None)


def _given(runtime: Any, args: tuple, kwargs: dict, target: Any) -> tuple[list | None, list | None]:
    """Return the digests of the inputs and the target this rank was given (``None`` for what it was not)."""
    values = _bound(runtime, args, kwargs)
    return None if values is None else digest(values), None if target is None else digest(target)


def _what_differs(runtime: Any, mine: tuple[list | None, list | None],
                  theirs: tuple[list | None, list | None]) -> str | None:
    """Name what of this rank's (inputs, target) digests differs from ``theirs``; ``None`` when nothing does."""
    at = None if mine[0] is None else _differs(mine[0], theirs[0])
    if at is not None:
        names = runtime.binding.names
        return "inputs" if at < 0 or at >= len(names) else f"input {names[at]!r}{_shapes(mine[0], theirs[0], at)}"
    at = None if mine[1] is None else _differs(mine[1], theirs[1])
    return None if at is None else f"target{_shapes(mine[1], theirs[1], at)}"


def _shapes(mine: list[Any] | None, theirs: list[Any] | None, at: int) -> str:
    """Say the two shapes where leaf ``at`` differs in shape (another batch size), else nothing."""
    a = mine[at] if mine is not None and at >= 0 else None
    b = theirs[at] if theirs is not None and at >= 0 else None
    if isinstance(a, tuple) and isinstance(b, tuple) and a[0] != b[0]:
        return f" (shape {a[0]}, not {b[0]})"
    return ""


def _verdict(runtime: Any, mine: tuple[list | None, list | None], header: dict) -> str | None:
    """On a rank other than the first stage's: compare the inputs and the target it was given with the first's."""
    what = _what_differs(runtime, mine, (header.get("digest"), header.get("target_digest")))
    if what is None:
        return None
    me, first = runtime.layout.global_ranks[runtime.rank], runtime.layout.global_ranks[runtime.first]
    return (f"rank {me} was given another {what} than rank {first}, which splits the inputs: the ranks of one "
            f"pipeline train on one batch (the first stage's inputs with the last stage's target). {_FIX}, or pass "
            + ("the target only on the rank computing the loss (the last stage's; None elsewhere)"
               if what.startswith("target")
               else "None on the ranks that do not split the inputs"))


def _group_verdict(runtime: Any, mine: tuple[list | None, list | None]) -> str | None:
    """Under tensor parallelism: compare what each rank of this rank's group was given with its first holder's."""
    layout = runtime.layout
    seen: list[Any] = [None] * layout.tp
    dist.all_gather_object(seen, mine, group=layout.tp_group)
    holders = [next((i for i, given in enumerate(seen) if given[part] is not None), 0) for part in (0, 1)]
    reference = (seen[holders[0]][0], seen[holders[1]][1])  # the group takes each from its first rank given it
    for i, given in enumerate(seen):
        what = _what_differs(runtime, given, reference)
        if what is not None:
            ranks = [dist.get_global_rank(layout.tp_group, j) for j in range(layout.tp)]
            holder = ranks[holders[what.startswith("target")]]
            return (f"rank {ranks[i]} was given another {what} than rank {holder}, the first of its tensor-parallel "
                    f"group (ranks {', '.join(map(str, ranks))}) given one, whose values the group computes on: the "
                    f"ranks of one pipeline, its tensor-parallel groups included, train on one batch. {_FIX}, or pass "
                    f"the inputs and the target on one rank of each group")
    return None


def _first_of(verdict: str | None, group: Any) -> tuple[int, str] | None:
    """Return the first refusal among a process group's ranks and its index there (every rank gets the same)."""
    seen: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(seen, verdict, group=group)
    return next(((i, v) for i, v in enumerate(seen) if v is not None), None)


def agree_on_batch(runtime: Any, args: tuple, kwargs: dict, target: Any, header: dict) -> None:
    """Refuse on every rank a first call whose pipeline's ranks were given different batches (see above)."""
    if "digest" not in header:  # published only where it is checked (one pipeline rank per stage group)
        return
    layout = runtime.layout
    try:
        mine = _given(runtime, args, kwargs, target)
        refused = None
    except FixedInputError as exc:  # told to every rank as this rank's verdict
        mine, refused = (None, None if target is None else digest(target)), \
            f"rank {layout.global_ranks[runtime.rank]} was given inputs the pipe refuses: {exc}"
    group = _group_verdict(runtime, mine) if layout.tp > 1 else None  # the same on every rank of the group
    if runtime.rank == runtime.first:
        found = [group] + [runtime.comm.recv_object(r, "waiting for the other ranks' check of the batch")
                           for r in range(runtime.world) if r != runtime.rank]
        verdict = next((v for v in found if v is not None), None)
        tell_all(runtime, verdict)
        runtime.comm.flush()
    else:
        runtime.comm.send_object(group or refused or _verdict(runtime, mine, header), runtime.first)
        runtime.comm.flush()
        verdict = runtime.comm.recv_object(runtime.first, "waiting for the first rank's check of the batch")
    if layout.tp > 1:  # each index's ranks agreed; a stage's group spans the indices
        found_in_group = _first_of(verdict, layout.tp_group)
        verdict = None if found_in_group is None else found_in_group[1]
    if layout.dp > 1:  # a replica refusing alone would leave the others waiting in their reductions
        other = _first_of(verdict, layout.dp_group)
        if verdict is None and other is not None:
            verdict = (f"replica {other[0]} refused this step ({other[1]}); the replicas run each step together, "
                       f"so replica {layout.replica} did not run it either")
    if verdict is not None:
        raise on_every_rank(PipelineInputError(verdict))
