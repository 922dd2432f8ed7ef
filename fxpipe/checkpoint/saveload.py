"""Save and resume a pipeline's training state with torch.distributed.checkpoint, keyed by FQN.

A checkpoint is one directory, written by every rank (or the one process) together::

    ckpt/step-500/
      .metadata, __<rank>_0.distcp   torch.distributed.checkpoint (DCP): each rank's own file
      fxpipe.json                    written last: the checkpoint is complete

    DCP keys   model.<fqn>                      a tensor the process holds (a tied one once,
                                                under its first FQN; the manifest lists aliases)
               optim.state.<fqn>.<name>         the optimizer's state of that parameter (Adam's
               optim.param_groups.<fqn>         moments and step), and its group's hyperparameters
               rng.<rank>.cpu, rng.<rank>.cuda.<i>   each process's generator states
               fxpipe.<rank>.bn.<module>.*      deferred batch-norm sums in flight, if any
               extra                            ``extra=``, torch.save'd to bytes (rank 0)

Every key is an FQN of the model as written, never a stage's, so a checkpoint loads into any
other plan, runtime or the plain module, and is a ``weights=`` source. A save writes under
``<path>.incomplete`` and renames it to ``<path>`` once every rank has finished (a checkpoint
it replaces is moved aside to ``<path>.old`` first and removed after): a save killed half way
leaves the previous checkpoint as it was, and the half-written one is refused by name.

Saves use DCP collectives over the pipeline's process group (one process: none), after the
ranks tell each other whether they could get ready (a refusal on one rank, such as its
optimizer holding a tensor that is not the model's, is raised on all); loads read
each rank's own keys without collectives, so a refusal (made from the metadata alone, the
same on every rank) leaves no rank waiting. The optimizer goes by FQN through
:mod:`fxpipe.checkpoint.trainstate` rather than ``get/set_optimizer_state_dict``: those initialise a
fresh optimizer's state with a zero-gradient step (Adam's step count would be off by one
after a save at step 0) and drop the state silently when gradients are present.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import shutil
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.fx
from torch import nn
from torch.distributed.tensor import DTensor

from fxpipe.checkpoint.directory import FORMAT, VERSION, allocate, nest, publish, quiet, read_keys, read_manifest, under
from fxpipe.checkpoint.trainstate import (
    batch_norm_state,
    check_optimizer_groups,
    load_optimizer_state,
    optimizer_state,
    rng_state,
    set_batch_norm_state,
    set_rng_state,
    split_key,
)
from fxpipe.errors import CheckpointError, PeerFailure
from fxpipe.materialize.fill import fill
from fxpipe.materialize.fillplan import tensor_table
from fxpipe.materialize.weights import MANIFEST, PARTIAL, open_weights
from fxpipe.passes.order import draws_random
from fxpipe.pipe import Pipe
from fxpipe.runtime.transport.together import communication_failed, first_line, together

__all__ = ["load", "load_state_dict", "save"]

log = logging.getLogger(__name__)

@dataclass
class _Where:
    """Who is saving or loading: the model, this process's rank and how to reach the others."""

    model: nn.Module
    rank: int = 0
    world: int = 1
    group: Any = None  # the process group; None: one process, no collectives
    distributed: bool = False
    deferred: tuple = ()
    broke: Any = None  # the runtime's: a failed collective counts as a failed step there
    draws: bool = True  # whether the model draws random numbers (dropout): else its generators need no word

    def barrier(self) -> None:
        """Wait for every rank (nothing in one process)."""
        if self.distributed:
            dist.barrier(group=self.group)

    def agree(self, error: Exception | None, what: str, same: str | None = None) -> None:
        """Raise on every rank when any rank could not get ready (or did not call ``fxpipe.save``), naming it.

        ``same`` is a short description of a value every rank must pass alike (``extra=``); ranks
        that differ are refused on every rank too, naming them.
        """
        if self.distributed:
            told: list[Any] = [None] * self.world
            with together("fxpipe.save", dist.get_rank(), self.broke):
                dist.all_gather_object(told, (None if error is None else f"{type(error).__name__}: {error}", same),
                                       group=self.group)
            failed = [(r, m) for r, (m, _) in enumerate(told) if m is not None]
            if failed and error is None:
                r, message = failed[0]
                raise CheckpointError(f"rank {r} could not {what} ({message}); nothing was written")
            if not failed and len({v for _, v in told}) > 1:
                shown = "; ".join(f"rank {r}: {v}" for r, (_, v) in enumerate(told))
                raise CheckpointError(f"the ranks passed different paths or extra= to fxpipe.save ({shown}); a "
                                      "checkpoint is one directory holding one extra=, so pass the same path and "
                                      "value on every rank (a name made from the time or the rank differs). Nothing "
                                      "was written")
        if error is not None:
            raise error


def _where(target: nn.Module) -> _Where:
    """Describe a Pipe (local or one rank of a distributed one) or a plain module."""
    if not isinstance(target, nn.Module):
        raise TypeError(f"expected a fxpipe Pipe or an nn.Module, got {type(target).__name__}")
    if not isinstance(target, Pipe):
        return _Where(target)
    runtime = target.runtime
    runtime.ready()  # after a failed step: every rank back on fresh connections
    place = runtime.place()
    return _Where(target._model, place.rank, place.world, place.group, place.distributed, tuple(runtime.deferred),
                  runtime.broke, _draws(target._model, target.__dict__.get("_gm")))


def _draws(model: nn.Module, gm: torch.fx.GraphModule | None) -> bool:
    """Tell whether ``model`` may draw random numbers: a dropout module, or a graph node drawing them."""
    if any("dropout" in type(m).__name__.lower() for m in model.modules()):
        return True
    return gm is None or any(draws_random(gm, n) for n in gm.graph.nodes)


def _bytes(value: Any) -> torch.Tensor:
    """Serialize ``value`` as torch.save does, into a uint8 tensor."""
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
    except Exception as exc:  # noqa: BLE001 - a lambda, a lock, an open file: re-raised naming the argument
        raise TypeError(f"extra= must hold what torch.load(weights_only=True) reads back (numbers, strings, "
                        f"lists, dicts, tensors); it cannot even be saved: {type(exc).__name__}: {exc}") from None
    data = buffer.getvalue()
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - re-raised naming the argument
        raise TypeError(f"extra= must hold what torch.load(weights_only=True) reads back (numbers, strings, "
                        f"lists, dicts, tensors): {exc}") from None
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def save(pipe: nn.Module, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None,
         extra: Any = None) -> None:
    """Save ``pipe``'s parameters and buffers (and ``optimizer``'s state, the RNG, ``extra``) to ``path``.

    Every rank of a distributed pipe calls it; each writes only what its stage holds. The
    checkpoint appears at ``path`` only when every rank has finished. ``extra`` (anything
    ``torch.load(weights_only=True)`` reads back) is saved once; every rank must pass the same.
    """
    where = _where(pipe)
    path = os.path.normpath(os.fspath(path))  # "ckpt/" is "ckpt": its ".incomplete" goes beside it
    partial = path + PARTIAL
    table = tensor_table(where.model)
    state: dict[str, Any] = {
        "model": {info.names[0]: info.tensor.detach() for info in table.values()
                  if info.persistent and not info.tensor.is_meta},
        "rng": rng_state(where.rank),
    }
    error: Exception | None = None
    same = f"path {path!r}, extra=None"
    try:  # a refusal on one rank (its optimizer, extra=, the directory) is told to all
        unfilled = [info.names[0] for info in table.values() if info.persistent and info.tensor.is_meta]
        if unfilled and not where.distributed:  # across ranks the other ranks' tensors stay on meta
            raise CheckpointError(
                f"{len(unfilled)} tensor(s) of the model are on the meta device, never filled "
                f"({', '.join(unfilled[:3])}{' ...' if len(unfilled) > 3 else ''}): the checkpoint would hold none "
                "of their values. Fill them first (fxpipe.compile(..., weights=) or init=, fxpipe.materialize, "
                "or model.to_empty(device=...) and your init), then save")
        if optimizer is not None:
            state["optim"] = optimizer_state(optimizer, where.model)
        in_flight = batch_norm_state(where.rank, where.deferred, where.model)
        if in_flight:
            state["fxpipe"] = in_flight
        if extra is not None:  # written once, by rank 0; every rank must pass the same
            packed = _bytes(extra)
            digest = hashlib.sha256(bytes(packed.tolist())).hexdigest()[:12]
            same = f"path {path!r}, extra={_short(extra)} (sha256 {digest})"
            if where.rank == 0:
                state["extra"] = packed
        _refuse_foreign(path)  # on every rank: each sees the path (a node-local one differs: told to all)
        if where.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)  # what a killed save left
            os.makedirs(partial)
    except (CheckpointError, TypeError, OSError) as exc:
        error = exc
    try:
        where.agree(error, f"get ready to save {path!r}", same)
    except Exception:
        if where.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise
    with _written_together(path, where):
        quiet(dcp.save, state, storage_writer=dcp.FileSystemWriter(partial), process_group=where.group,
               no_dist=not where.distributed)
        where.barrier()
        if where.rank == 0:
            aliases = {n: info.names[0] for info in table.values() if info.persistent for n in info.names[1:]}
            publish(partial, path, {"format": FORMAT, "version": VERSION, "world": where.world,
                                     "model": type(where.model).__name__, "aliases": aliases,
                                     "optimizer": None if optimizer is None else type(optimizer).__name__})
        where.barrier()
    log.info("saved %s (rank %d of %d)", path, where.rank, where.world)


@contextlib.contextmanager
def _written_together(path: str, where: _Where) -> Iterator[None]:
    """Turn a collective failing while the ranks write (a rank died saving) into a :class:`PeerFailure` saying what to do."""
    try:
        yield
    except Exception as exc:
        if not where.distributed or not communication_failed(exc):
            raise
        if where.broke is not None:
            where.broke(exc)
        raise PeerFailure(f"rank {where.rank}: fxpipe.save lost a peer while the ranks wrote {path!r} (a rank probably "
                          f"died: {first_line(exc)}); nothing was published there, and fxpipe.latest_checkpoint "
                          "skips what was written: restart the job and resume from the last complete checkpoint "
                          "(fxpipe.latest_checkpoint(folder))") from exc


def _refuse_foreign(path: str) -> None:
    """Refuse to replace ``path`` unless it is absent, an empty directory or an fxpipe checkpoint."""
    if not os.path.lexists(path):
        return
    if os.path.isdir(path) and not os.path.islink(path):
        entries = os.listdir(path)
        if not entries:
            return
        try:
            with open(os.path.join(path, MANIFEST)) as f:
                if json.load(f).get("format") == FORMAT:
                    return
        except (OSError, ValueError):
            pass
        raise CheckpointError(f"{path!r} holds {len(entries)} entries and is not an fxpipe checkpoint "
                              f"({_some(sorted(entries), 5)}); fxpipe.save replaces the directory it is given "
                              "whole, so pass a new name inside it (fxpipe.save(pipe, 'ckpt/step-500')) or remove it")
    raise CheckpointError(f"{path!r} is a file, not a checkpoint directory; fxpipe.save would replace it. "
                          "Pass another path")


def _short(value: Any, width: int = 60) -> str:
    """Return ``repr(value)``, cut to ``width`` characters."""
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def _like_params(flat: dict[str, Any], params: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Read a sharded parameter's optimizer state (FSDP2's ``DTensor``) sharded as the parameter is."""
    for key, value in flat.items():
        kind, fqn, _ = split_key(key[len("optim."):])
        p = params.get(fqn)
        if kind == "state" and isinstance(value, torch.Tensor) and isinstance(p, DTensor) \
                and value.shape == p.shape:
            flat[key] = torch.empty_like(p.detach(), dtype=value.dtype)
    return flat


def _some(names: list[str], shown: int = 10) -> str:
    """List at most ``shown`` names."""
    return str(names[:shown])[:-1] + (f", ... {len(names) - shown} more]" if len(names) > shown else "]")


def _observer_sizes(table: dict, specs: dict, model: nn.Module) -> list[tuple[torch.Tensor, tuple]]:
    """Return ``(tensor, saved shape)`` for each quantization observer's buffer saved at another shape.

    A fresh observer's ``scale`` is ``(1,)`` until its first forward makes it per channel; torch's
    ``load_state_dict`` resizes it to what is loaded, so a QAT run resumes into a fresh model.
    """
    from torch.ao.quantization.fake_quantize import FakeQuantizeBase
    from torch.ao.quantization.observer import ObserverBase
    found = []
    for info in table.values():
        hit = next((n for n in info.names if n in specs), None)
        if hit is None or info.tensor.is_meta or specs[hit] == (tuple(info.tensor.shape), info.tensor.dtype) \
                or specs[hit][1] != info.tensor.dtype:
            continue
        try:
            owner = model.get_submodule(hit.rpartition(".")[0])
        except AttributeError:
            continue
        if isinstance(owner, (FakeQuantizeBase, ObserverBase)):
            found.append((info.tensor, specs[hit][0]))
    return found


def _check_model(table: dict, specs: dict, path: str,
                 resized: Collection[int] = ()) -> None:
    """Refuse a checkpoint whose FQNs or shapes are not the model's; list every difference (``resized``: ids let be)."""
    known = {n for info in table.values() for n in info.names}
    unexpected = sorted(k for k in specs if k not in known)
    missing, mismatched = [], []
    for info in table.values():
        hit = next((n for n in info.names if n in specs), None)
        if hit is None:
            if info.persistent:
                missing.append(info.names[0])
        elif specs[hit] != (tuple(info.tensor.shape), info.tensor.dtype) and id(info.tensor) not in resized:
            (shape, dtype) = specs[hit]
            mismatched.append(f"'{hit}': {shape} {dtype} there, {tuple(info.tensor.shape)} {info.tensor.dtype} here")
    if missing or unexpected or mismatched:
        problems = [f"{len(missing)} missing FQN(s) {_some(missing)}" if missing else "",
                    f"{len(unexpected)} unexpected FQN(s) {_some(unexpected)}" if unexpected else "",
                    f"shape or dtype mismatches: {'; '.join(mismatched[:10])}" if mismatched else ""]
        raise CheckpointError(f"checkpoint {path!r} is not of this model: {'; '.join(p for p in problems if p)}. "
                              "Nothing was loaded")


def load(pipe: nn.Module, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None) -> Any:
    """Load a checkpoint saved by :func:`save` (under any plan) into ``pipe`` or a plain module.

    Each rank reads only what it holds; ``optimizer`` (built over the pipe's or the module's
    parameters) gets each parameter's state by FQN; the RNG states come back when the
    checkpoint was saved by as many ranks. Everything is checked before anything changes.
    Returns the ``extra`` that was saved (or None).
    """
    where = _where(pipe)
    path = os.path.normpath(os.fspath(path))  # "ckpt/" is "ckpt": its ".incomplete" goes beside it
    manifest = read_manifest(path)
    _refuse_missing_files(path)
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    table = tensor_table(where.model)
    source = open_weights(path)
    observers = _observer_sizes(table, source.specs(), where.model)
    _check_model(table, source.specs(), path, {id(t) for t, _ in observers})
    if optimizer is not None:
        if not under(meta, "optim"):
            raise CheckpointError(f"checkpoint {path!r} holds no optimizer state; load it without optimizer=")
        if manifest.get("optimizer") not in (None, type(optimizer).__name__):
            raise CheckpointError(f"checkpoint {path!r} holds {manifest['optimizer']} state; the optimizer given is "
                                  f"{type(optimizer).__name__}: build the optimizer it was saved with "
                                  f"(class {manifest['optimizer']}) to load it, or load without optimizer= "
                                  "(the weights alone)")
        params = {table[id(p)].names[0]: p for p in where.model.parameters()
                  if not (where.distributed and p.is_meta)}  # what the fill below makes real
        keys = [k for k in under(meta, "optim") if split_key(k[len("optim."):])[1] in params]
        optim = nest(read_keys(path, _like_params(allocate(meta, keys), params)), "optim")
        check_optimizer_groups(optimizer, where.model, optim)
    with torch.no_grad():
        for tensor, shape in observers:  # as torch's observers resize on load_state_dict
            tensor.resize_(shape)
    held = {k: (torch.device("cpu") if info.tensor.is_meta else info.tensor.device)
            for k, info in table.items() if not (where.distributed and info.tensor.is_meta)}
    # across ranks what no checkpoint holds stays as it is (non-persistent buffers, the other ranks' meta
    # tensors); a plain module on meta gets it from its recipe or init, as a compile would
    fill(where.model, held, source=source, init=None, seed=0, leave=where.distributed)
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
        load_optimizer_state(optimizer, where.model, optim)
    mine = nest(read_keys(path, allocate(meta, under(meta, f"rng.{where.rank}"))), "rng")
    if manifest["world"] == where.world and mine:
        set_rng_state(where.rank, mine)
    elif where.draws:
        log.warning("checkpoint %s was saved by %d process(es), this is %d: random generators not restored, so "
                    "dropout draws from this process's generators from here (seed them, torch.manual_seed, for a "
                    "reproducible run); weights and optimizer state are loaded", path, manifest["world"], where.world)
    set_batch_norm_state(where.rank, where.deferred, where.model,
                         nest(read_keys(path, allocate(meta, under(meta, f"fxpipe.{where.rank}"))), "fxpipe"))
    if "extra" not in meta:
        return None
    raw = read_keys(path, allocate(meta, ["extra"]))["extra"]
    return torch.load(io.BytesIO(bytes(raw.tolist())), weights_only=True)


def _refuse_missing_files(path: str) -> None:
    """Refuse a checkpoint whose metadata names files it lacks (ranks that wrote elsewhere, a partial copy)."""
    storage = dcp.FileSystemReader(path).read_metadata().storage_data or {}
    named = {str(info.relative_path) for info in storage.values() if getattr(info, "relative_path", None)}
    missing = sorted(n for n in named if not os.path.exists(os.path.join(path, n)))
    if missing:
        raise CheckpointError(f"checkpoint {path!r} lacks {missing}, written by other ranks (did every rank pass "
                              "the same path, on a file system every rank sees?); nothing was loaded")


def load_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Return the model's ``state_dict`` saved in a checkpoint, in this process (tied FQNs included)."""
    path = os.path.normpath(os.fspath(path))  # "ckpt/" is "ckpt": its ".incomplete" goes beside it
    manifest = read_manifest(path)
    _refuse_missing_files(path)
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    state = nest(read_keys(path, allocate(meta, under(meta, "model"))), "model")
    for alias, name in manifest.get("aliases", {}).items():
        state[alias] = state[name]
    return state
