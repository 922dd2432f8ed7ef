"""Refuse, on every rank and at compile, a pipeline whose ranks were given different options.

Every rank runs the same plan: a rank compiled with another ``schedule=``, ``chunks=`` or
``checkpoint=`` than its peers would wait for messages they never send, until the timeout.
One ``all_gather_object`` of a few strings per compile compares them.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import torch.distributed as dist

from fxpipe.errors import OptionMismatchError, PeerFailure, WeightsError

__all__ = ["agree_on_options", "summary"]

_COMPARED = ("n_stages", "schedule", "chunks", "checkpoint", "stages_per_rank", "data_parallel",
             "data_parallel_shard", "tensor_parallel", "deferred_batch_norm", "balance_by", "split_points",
             "max_memory", "tracer", "torch_compile", "unbatched", "export_dims")


def _describe(value: Any) -> str:
    """Describe an option's value so that equal values give equal text on every rank."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if callable(value) and not isinstance(value, (list, tuple)):
        return f"a callable {getattr(value, '__qualname__', type(value).__name__)}"
    text = re.sub(r" at 0x[0-9a-fA-F]+", "", repr(list(value)) if isinstance(value, (list, tuple)) else repr(value))
    if isinstance(value, (list, tuple)) and len(text) > 120:  # a user's action list: its length and a digest
        return f"a list of {len(value)} entries (digest {hashlib.sha1(text.encode()).hexdigest()[:10]})"
    return text


def summary(options: Any) -> dict[str, str]:
    """Return the options every rank must agree on, each described as text."""
    values = {name: getattr(options, name) for name in _COMPARED}
    if values["torch_compile"] is False:  # as check() leaves it (a rank refused before check() keeps False)
        values["torch_compile"] = None
    return {name: _describe(value) for name, value in values.items()}


def agree_on_options(options: Any, refused: Exception | None = None) -> None:
    """Compare this rank's options with every other rank's; refuse on every rank where they differ.

    ``refused`` is what this rank refused before joining (a ``weights=`` path it cannot see, on a
    node's local disk; an option read per rank, wrong on one): it is raised here, and the other
    ranks raise a :class:`PeerFailure` naming it (an :class:`OptionMismatchError` where the options
    differ, on every rank).
    """
    told: list[Any] = [None] * dist.get_world_size()
    why = None if refused is None else (type(refused).__name__, str(refused), isinstance(refused, WeightsError))
    dist.all_gather_object(told, (summary(options), why))
    gathered = [t[0] for t in told]
    for rank, theirs in enumerate(gathered):
        differ = [k for k in _COMPARED if theirs.get(k) != gathered[0].get(k)]
        if differ:
            k = differ[0]
            raise OptionMismatchError(
                f"fxpipe.compile got {k}={gathered[0][k]} on rank 0 but {k}={theirs[k]} on rank {rank} (options "
                f"differing: {', '.join(differ)}); every rank runs one plan and would wait for messages its peers "
                "never send: pass the same compile options on every rank (only the data may differ)")
    if refused is not None:
        raise refused
    other = next(((r, why) for r, (_, why) in enumerate(told) if why is not None), None)
    if other is None:
        return
    rank, (kind, message, weights) = other
    if weights:
        raise PeerFailure(f"rank {dist.get_rank()} stopped because rank {rank} refused its weights=: {message} "
                          "(every rank reads weights= itself: give a path that every rank sees, such as one on a "
                          "shared file system)")
    raise PeerFailure(f"rank {dist.get_rank()} stopped because rank {rank} refused its fxpipe.compile arguments "
                      f"({kind}: {message}); every rank compiles together, so every rank stops: fix the arguments "
                      "on that rank (and pass the same ones on every rank)")
