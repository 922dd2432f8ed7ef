"""A checkpoint directory: published whole, its manifest, its DCP keys read in one process.

    publish        write the manifest last, then rename ``<path>.incomplete`` to ``<path>``
    read_manifest  refuse a missing, half-written or foreign directory; return its manifest
    latest         the newest complete checkpoint under a directory (what a restarted job loads)
    read_keys      read chosen flat DCP keys, no collectives (each rank reads its own)
    allocate       tensors to read keys into, sized from the DCP metadata
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from fxpipe.errors import CheckpointError
from fxpipe.materialize.weights import MANIFEST, refuse_partial

__all__ = ["FORMAT", "VERSION", "allocate", "latest", "nest", "publish", "quiet", "read_keys", "read_manifest",
           "under"]

log = logging.getLogger(__name__)

FORMAT = "fxpipe.checkpoint"
VERSION = 1


def quiet(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """Call a DCP function without its warning that one process without a group is one process."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return fn(*args, **kwargs)


def publish(partial: str, path: str, manifest: dict) -> None:
    """Write the manifest last, then move the finished directory to ``path`` in one rename."""
    manifest = {**manifest, "saved_at": time.time()}
    with open(os.path.join(partial, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    old = path + ".old"
    if os.path.exists(path):
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(partial, path)
    shutil.rmtree(old, ignore_errors=True)
    parent = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(parent)  # the rename itself survives a crash
    finally:
        os.close(parent)


def read_manifest(path: str) -> dict:
    """Read a complete checkpoint's manifest; refuse a missing, half-written or foreign directory."""
    refuse_partial(path, CheckpointError)
    if not os.path.isdir(path):
        old = " (an overwrite of it was interrupted: the previous one is in '" + path + ".old')" \
            if os.path.isdir(path + ".old") else ""
        near = os.path.dirname(os.path.abspath(path))
        saves = sorted(n for n in os.listdir(near) if os.path.exists(os.path.join(near, n, MANIFEST))) \
            if os.path.isdir(near) else []
        where = f"; checkpoints beside it: {', '.join(saves[-3:])}" if saves else ""
        raise CheckpointError(f"no checkpoint at {path!r}{old}{where}: pass the directory fxpipe.save wrote "
                              "(fxpipe.latest_checkpoint(folder) gives the newest one under a folder)")
    if not os.path.exists(os.path.join(path, MANIFEST)):
        raise CheckpointError(f"{path!r} is not a complete fxpipe checkpoint: it lacks {MANIFEST}, which "
                              "fxpipe.save writes last (load a plain DCP directory as weights= instead)")
    with open(os.path.join(path, MANIFEST)) as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT or manifest.get("version", 0) > VERSION:
        raise CheckpointError(f"{path!r} holds a checkpoint of format {manifest.get('format')!r} version "
                              f"{manifest.get('version')}; this fxpipe reads {FORMAT!r} up to version {VERSION}")
    return manifest


def latest(directory: str | os.PathLike) -> str | None:
    """Return the newest complete checkpoint directly under ``directory``, or None if there is none.

    Complete means published by :func:`fxpipe.save` on every rank (its manifest is there);
    a save killed half way (``*.incomplete``) and a replaced one (``*.old``) are skipped, but
    for the ``*.old`` of a name that is missing: an overwrite stopped between its two renames
    (``latest`` moved to ``latest.old``, the new one not yet moved to ``latest``) leaves the
    previous checkpoint there, which is resumed from (logged).
    Newest is the one saved last (the manifest's time; its file's time for older ones).
    """
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        return None
    found: list[tuple[float, str]] = []
    names = set(os.listdir(directory))
    for name in sorted(names):
        path = os.path.join(directory, name)
        manifest = os.path.join(path, MANIFEST)
        stranded = name.endswith(".old") and name[:-len(".old")] not in names
        if (name.endswith((".incomplete", ".old")) and not stranded) or not os.path.isfile(manifest):
            continue
        try:
            with open(manifest) as f:
                info = json.load(f)
        except (OSError, ValueError):
            continue  # unreadable: not a checkpoint to resume from
        if info.get("format") == FORMAT:
            found.append((float(info.get("saved_at") or os.path.getmtime(manifest)), path))
    if not found:
        return None
    chosen = max(found)[1]
    if chosen.endswith(".old"):
        log.warning("%s: an overwrite of %r stopped before it was put in place; resuming from the previous "
                    "checkpoint, kept in %r", directory, os.path.basename(chosen)[:-len(".old")],
                    os.path.basename(chosen))
    return chosen


def read_keys(path: str, wanted: dict[str, Any]) -> dict[str, Any]:
    """Read the flat DCP keys of ``wanted`` (tensors are filled in place) in this process alone."""
    if wanted:
        quiet(dcp.load, wanted, storage_reader=dcp.FileSystemReader(path),
               planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
    return wanted


def allocate(meta: dict, keys: list[str]) -> dict[str, Any]:
    """Return a flat dict to read ``keys`` into: tensors allocated from the metadata, others None."""
    return {k: torch.empty(tuple(meta[k].size), dtype=meta[k].properties.dtype)
            if isinstance(meta[k], TensorStorageMetadata) else None for k in keys}


def under(meta: dict, prefix: str) -> list[str]:
    """Return the metadata keys under ``prefix.``."""
    return [k for k in meta if k.startswith(prefix + ".")]


def nest(flat: dict[str, Any], prefix: str) -> dict[str, Any]:
    """Return the part of a flat dict under ``prefix.``, with the prefix cut off."""
    return {k[len(prefix) + 1:]: v for k, v in flat.items() if k.startswith(prefix + ".")}
