"""Weight sources for ``weights=``: read chosen tensors by FQN, never the whole model.

    mapping           {fqn: tensor}, as given
    torch.save file   opened with mmap=True; pages of a tensor are dropped once it is copied
    safetensors file  optional ``safetensors`` package, imported only when such a file is given
    directory         Hugging Face shards (``*.index.json`` naming a file per FQN), an fxpipe
                      checkpoint (torch.distributed.checkpoint, FQNs under ``model.``), a plain
                      DCP directory (FQNs under ``model.`` or at the top, whichever names the
                      model's), or a directory holding one weights file; where a Hub directory
                      holds both, the safetensors copy

Every source tells each key's shape and dtype without reading data (:meth:`WeightSource.spec`)
and copies only the keys asked for into tensors the caller allocated (:meth:`WeightSource.read`).
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from fxpipe.errors import WeightsError
from fxpipe.materialize.weightfiles import MappingSource, SafetensorsFile, Spec, TorchFile, WeightSource

__all__ = ["MANIFEST", "MODEL_KEY", "PARTIAL", "WeightSource", "check_weights", "open_weights", "refuse_partial"]

log = logging.getLogger(__name__)

MODEL_KEY = "model"  # fxpipe checkpoints keep the model's state under this key
MANIFEST = "fxpipe.json"  # written last into an fxpipe checkpoint: it is complete
PARTIAL = ".incomplete"  # the suffix of a checkpoint being written
_TORCH_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
class _Sharded(WeightSource):
    """A Hugging Face directory: ``*.index.json`` maps each FQN to the shard file holding it."""

    def __init__(self, directory: str, index: str) -> None:
        with open(index) as f:
            self.weight_map: dict[str, str] = json.load(f)["weight_map"]
        self.directory = directory
        self.shards: dict[str, WeightSource] = {}
        self.description = f"weights directory {directory!r}"

    def _shard(self, name: str) -> WeightSource:
        """Open one shard file, once."""
        if name not in self.shards:
            self.shards[name] = _open_file(os.path.join(self.directory, name))
        return self.shards[name]

    def specs(self) -> dict[str, Spec]:
        """Return every tensor's shape and dtype from the shards' headers."""
        out: dict[str, Spec] = {}
        for name in sorted(set(self.weight_map.values())):
            specs = self._shard(name).specs()
            out.update({k: specs[k] for k, v in self.weight_map.items() if v == name and k in specs})
        return out

    def read(self, into: Mapping[str, torch.Tensor]) -> None:
        """Copy the asked tensors shard by shard, opening only the shards that hold them."""
        by_shard: dict[str, dict[str, torch.Tensor]] = {}
        for key, target in into.items():
            by_shard.setdefault(self.weight_map[key], {})[key] = target
        for name, part in by_shard.items():
            self._shard(name).read(part)

    def close(self) -> None:
        """Close every opened shard."""
        for shard in self.shards.values():
            shard.close()
        self.shards = {}


class _DcpDirectory(WeightSource):
    """A ``torch.distributed.checkpoint`` directory; an fxpipe checkpoint keeps FQNs under ``model.``."""

    def __init__(self, directory: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.directory = directory
        self.description = f"checkpoint {directory!r}"
        meta = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
        self._tensors = {k: (tuple(v.size), v.properties.dtype) for k, v in meta.items()
                         if isinstance(v, TensorStorageMetadata)}
        prefix = MODEL_KEY + "."
        manifest = os.path.join(directory, MANIFEST)
        self.fixed = os.path.exists(manifest)  # fxpipe's: always under model.
        self.prefix = prefix if self.fixed or any(k.startswith(prefix) for k in self._tensors) else ""
        self.aliases: dict[str, str] = {}  # a tied tensor's other FQNs -> the one it is saved under
        if self.fixed:
            with open(manifest) as f:
                self.aliases = dict(json.load(f).get("aliases", {}))

    def fit(self, names: set[str]) -> None:
        """Read a plain DCP directory at the top when that names more of the model's FQNs than ``model.``.

        A model's own FQNs may begin with ``model.`` (Hugging Face's ``*ForCausalLM``), so a
        directory saved from ``model.state_dict()`` and one saved as ``{"model": ...}`` both
        have keys under ``model.``.
        """
        if self.fixed or not self.prefix:
            return
        under = sum(k[len(self.prefix):] in names for k in self._tensors if k.startswith(self.prefix))
        if sum(k in names for k in self._tensors) > under:
            self.prefix = ""

    def specs(self) -> dict[str, Spec]:
        """Return every model tensor's shape and dtype from the checkpoint's metadata."""
        out = {k[len(self.prefix):]: v for k, v in self._tensors.items() if k.startswith(self.prefix)}
        out.update({alias: out[name] for alias, name in self.aliases.items() if name in out and alias not in out})
        return out

    def read(self, into: Mapping[str, torch.Tensor]) -> None:
        """Read the asked tensors straight into ``into`` (no process group needed)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import DefaultLoadPlanner

        if not into:
            return
        state: dict[str, Any] = {}
        copies = []  # (target, tensor read under the same saved name): a tied tensor saved once, untied here
        for key, target in into.items():
            name = key if self.prefix + key in self._tensors else self.aliases.get(key, key)
            if name in state:
                copies.append((target, state[name]))
            else:
                state[name] = target
        with warnings.catch_warnings():  # DCP warns that no_dist means one process: it does here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({MODEL_KEY: state} if self.prefix else state, storage_reader=dcp.FileSystemReader(self.directory),
                     planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
        with torch.no_grad():
            for target, value in copies:
                target.copy_(value)


def refuse_partial(path: str, error: type[Exception] = WeightsError) -> None:
    """Refuse a checkpoint whose save never finished (it is, or only exists as, ``<path>.incomplete``)."""
    partial = path.rstrip(os.sep)
    if not partial.endswith(PARTIAL):
        if os.path.exists(partial) or not os.path.exists(partial + PARTIAL):
            return
        partial += PARTIAL
    raise error(f"checkpoint {partial[:-len(PARTIAL)]!r} is half-written: its save was interrupted before "
                f"every rank finished (what it wrote is in {partial!r}); load an earlier checkpoint, or save "
                "again")


def check_weights(weights: Any) -> Any:
    """Reject a ``weights=`` of the wrong type or naming no file, before anything runs; return it."""
    if weights is None or isinstance(weights, (Mapping, WeightSource)):
        return weights
    if not isinstance(weights, (str, os.PathLike)):
        raise TypeError(f"weights= must be a state dict, a file or a directory, got {type(weights).__name__}")
    refuse_partial(os.fspath(weights))
    if not os.path.exists(weights):
        raise WeightsError(f"weights={os.fspath(weights)!r}: no such file or directory")
    return weights


def open_weights(weights: Any) -> WeightSource:
    """Open a ``weights=`` argument: a mapping, a file, or a directory (see the module docstring)."""
    if isinstance(weights, WeightSource):
        return weights
    if isinstance(weights, Mapping):
        return MappingSource(weights)
    if not isinstance(weights, (str, os.PathLike)):
        raise TypeError(f"weights= must be a state dict, a file or a directory, got {type(weights).__name__}")
    path = os.fspath(weights)
    refuse_partial(path)
    if os.path.isdir(path):
        return _open_directory(path)
    if not os.path.exists(path):
        raise WeightsError(f"weights={path!r}: no such file or directory")
    return _open_file(path)


def _open_file(path: str) -> WeightSource:
    """Open one weights file by its suffix (safetensors) or as a torch.save file."""
    if path.endswith(".safetensors"):
        return SafetensorsFile(path)
    return TorchFile(path)


def _open_directory(path: str) -> WeightSource:
    """Open a checkpoint, sharded or single-file directory."""
    if os.path.exists(os.path.join(path, ".metadata")):
        return _DcpDirectory(path)
    names = sorted(os.listdir(path))
    indexes = _prefer([n for n in names if n.endswith(".index.json")], ".safetensors.index.json")
    if len(indexes) == 1:
        return _Sharded(path, os.path.join(path, indexes[0]))
    files = [n for n in names if n.endswith((".safetensors", *_TORCH_SUFFIXES))]
    files = _prefer(_prefer(files, ".safetensors"), "pytorch_model.bin")
    if not indexes and len(files) == 1:
        return _open_file(os.path.join(path, files[0]))
    why = (f"it holds {len(indexes)} *.index.json files" if indexes else
           f"it holds {len(files)} weights files and no *.index.json" if files else
           "it holds no weights files")
    saved = sorted(n for n in names if os.path.exists(os.path.join(path, n, ".metadata")))
    if not files and not indexes and saved:  # a directory of checkpoints (ckpt/step-500, ...)
        why += (f" but checkpoints saved by fxpipe.save ({', '.join(saved[:3])}{', ...' if len(saved) > 3 else ''}): "
                f"give one of them, e.g. weights=fxpipe.latest_checkpoint({path!r}) for the newest")
    raise WeightsError(f"weights={path!r} is a directory that fxpipe cannot read: {why}. Give a "
                       "checkpoint saved by fxpipe.save, a directory of shards with one *.index.json "
                       "(the Hugging Face layout), or a single weights file")


def _prefer(names: list[str], ending: str) -> list[str]:
    """Narrow several candidates to the one ending in ``ending``, as transformers reads a Hub directory.

    A model directory from the Hugging Face Hub often holds the same weights twice (safetensors
    and ``pytorch_model.bin``, each with an index) next to other files (``training_args.bin``).
    """
    chosen = [n for n in names if n.endswith(ending)]
    if len(names) > 1 and len(chosen) == 1:
        log.info("reading %s, the directory's %s", chosen[0], ending.lstrip("."))
        return chosen
    return names
