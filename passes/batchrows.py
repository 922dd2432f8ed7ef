"""Tell which outputs of a graph do not follow the batch row by row, and so cannot be gathered.

Reads:  ``fxpipe.value`` of the placeholders and of the nodes the output returns (the example
        batch's specs, from :mod:`fxpipe.passes.annotate`), and the graph, which it runs once
        more on fake tensors for a micro-batch's rows (:mod:`fxpipe.passes.infer`).
Writes: nothing; :func:`batch_coupled_outputs` returns one description per such output, and
        :func:`scalar_outputs` names the 0-dim outputs (reduced over the batch: no dim to join on).

A pipeline runs each micro-batch alone and joins the outputs on dim 0. That is the model's
output only when every output row comes from its own input rows. An output whose other dims
follow the batch (CLIP's ``logits_per_image``, each image against every text of the batch:
``(B, B)``), or whose dim 0 does not (a mean over the batch), couples the rows of a batch: per
micro-batch it is another value than on the whole batch.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection
from dataclasses import replace
from typing import Any

import torch
import torch.fx
from fxpipe.passes.infer import Propagator
from fxpipe.passes.modes import pick
from fxpipe.passes.records import built_record
from fxpipe.passes.spec import TensorSpec
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_map, tree_unflatten

__all__ = ["batch_coupled_outputs", "listed_batches", "micro_specs", "paired_inputs", "scalar_outputs", "sequence_first_modules",
           "sequence_first_splits"]

log = logging.getLogger(__name__)


def _leaves(gm: torch.fx.GraphModule, training: bool | None = None) -> list[tuple[str, torch.fx.Node]]:
    """Return each node the graph outputs, named by its place in the model's output structure.

    With ``training``, an output that differs by mode (a ``pick`` of a merged graph) is the node
    of that mode, or left out where that mode returns a constant (``None``).
    """
    out = gm.graph.output_node()
    flat = [(keystr(path), leaf) for path, leaf in tree_flatten_with_path(out.args[0])[0]]
    info = getattr(gm.graph._codegen, "pytree_info", None)
    if info is not None and info.out_spec is not None:  # torch.export: flat outputs of the model's structure
        try:
            paths = [keystr(p) for p, _ in tree_flatten_with_path(tree_unflatten(list(range(len(flat))),
                                                                                 info.out_spec))[0]]
            flat = [(paths[k], leaf) for k, (_, leaf) in enumerate(flat)]
        except Exception as exc:  # noqa: BLE001 - names are for the message only
            log.debug("outputs named by position: %s", exc)
    if training is not None:
        flat = [(name, _of_mode(leaf, training)) for name, leaf in flat]
    flat = [pair for name, leaf in flat for pair in _opened(name, leaf)]
    return [(name or "the output", leaf) for name, leaf in flat if isinstance(leaf, torch.fx.Node)]


def _opened(name: str, leaf: Any, depth: int = 0) -> list[tuple[str, Any]]:
    """Return the fields of a record torch.fx builds in the graph (a dataclass, NamedTuple or OrderedDict), named.

    torch.fx returns such an output as one node calling the record's class on its fields: the
    checks look at the fields, as they do at torch.export's flat outputs.
    """
    target = built_record(getattr(leaf, "target", None))
    if depth > 8 or not isinstance(leaf, torch.fx.Node) or leaf.op != "call_function" or \
            target is None or not (dataclasses.is_dataclass(target) or issubclass(target, (tuple, dict))):
        return [(name, leaf)]
    if issubclass(target, dict) and len(leaf.args) == 1 and isinstance(leaf.args[0], (list, tuple)):
        fields = [(f"[{k!r}]", v) for k, v in leaf.args[0]]  # OrderedDict([(key, value), ...])
    else:
        fields = [(f"[{k}]", v) for k, v in enumerate(leaf.args)] + [(f".{k}", v) for k, v in leaf.kwargs.items()]
    found = []
    for key, value in fields:
        found += [(name + key + keystr(path), v) for path, v in tree_flatten_with_path(value)[0]]
    return [pair for sub, v in found for pair in _opened(sub, v, depth + 1)]


def _of_mode(value: Any, training: bool) -> Any:
    """Follow ``pick`` nodes to the value of mode ``training``."""
    while isinstance(value, torch.fx.Node) and value.op == "call_function" and value.target is pick:
        value = value.args[1] if training else value.args[2]
    return value


def scalar_outputs(gm: torch.fx.GraphModule, training: bool | None = None) -> list[str]:
    """Return the outputs that are 0-dim tensors (a loss the model computes), named by their place in the output.

    With ``training``, those of that mode in a graph merged from both (an auxiliary loss of
    training mode only); the specs read are the compile's (the nodes of both modes carry them).
    """
    return [name for name, node in _leaves(gm, training)
            if isinstance(spec := node.meta.get("fxpipe.value"), TensorSpec) and len(spec.shape) == 0]


def _scaled(value: Any, batch: int, rows: int) -> Any:
    """Return a placeholder's spec with ``rows`` rows where the example has ``batch``."""
    def scale(s: Any) -> Any:
        if isinstance(s, TensorSpec) and len(s.shape) > 0 and s.shape[0] == batch:
            return replace(s, shape=(rows, *s.shape[1:]))
        return s
    return tree_map(scale, value, is_leaf=lambda v: isinstance(v, TensorSpec))


def micro_specs(gm: torch.fx.GraphModule, batch: int, rows: int, unbatched: Collection[str] = (),
                paired: torch.fx.Node | None = None) -> dict[str, Any] | None:
    """Return every node's spec for a micro-batch of ``rows`` rows where the example has ``batch``.

    The inputs named in ``unbatched`` keep their example's shapes; the ``paired`` input has every
    dim of the batch's size cut to ``rows`` (:func:`paired_inputs`). None when the graph cannot
    run for ``rows`` rows on fake tensors (a model fixed to its example's batch).
    """
    def cut(s: Any) -> Any:  # every dim of the batch's size: the paired input's
        return replace(s, shape=tuple(rows if d == batch else d for d in s.shape)) if isinstance(s, TensorSpec) else s

    inputs = [n.meta.get("fxpipe.value") if n.target in unbatched else
              tree_map(cut, n.meta.get("fxpipe.value"), is_leaf=lambda v: isinstance(v, TensorSpec))
              if paired is not None and n.name == paired.name else _scaled(n.meta.get("fxpipe.value"), batch, rows) for n in gm.graph.nodes if n.op == "placeholder"]
    try:
        return Propagator(gm, [n.name for n in gm.graph.nodes if n.op != "output"])(inputs)
    except Exception as exc:  # noqa: BLE001 - nothing to compare: the runtime's own checks apply
        log.debug("the graph does not run for %d rows: %s: %s", rows, type(exc).__name__, exc)
        return None


def paired_inputs(gm: torch.fx.GraphModule, batch: int, rows: int, unbatched: Collection[str] = ()) -> list[str]:
    """Describe each input whose other dims pair the batch's rows (an adjacency ``(N, N)``).

    An input split on dim 0 with the batch's size on another dim is one where the graph, which
    does not run for ``rows`` rows, runs once that dim is cut to ``rows`` too (on fake tensors:
    :func:`micro_specs` with it ``paired``).
    """
    found = []
    for node in gm.graph.nodes:
        if node.op != "placeholder" or node.target in unbatched:
            continue
        for path, spec in tree_flatten_with_path(node.meta.get("fxpipe.value"))[0]:
            if isinstance(spec, TensorSpec) and len(spec.shape) > 1 and spec.shape[0] == batch \
                    and batch in spec.shape[1:] and micro_specs(gm, batch, rows, unbatched, node) is not None:
                found.append(f"'{node.target}{keystr(path)}' {tuple(spec.shape)}")
    return found


def _is_int(value: Any) -> bool:
    """Tell whether ``value`` is a Python int (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool)


def batch_coupled_outputs(gm: torch.fx.GraphModule, batch: int, rows: int,
                          unbatched: Collection[str] = (), part: dict[str, Any] | None = None) -> list[str]:
    """Return a description of each output whose shape does not follow ``batch`` -> ``rows`` on dim 0 alone.

    An int output that changes with the rows (``x.shape[0]``) is one too: joined, the micro-batches'
    values would give a micro-batch's size, or be refused where they differ.

    ``part`` holds :func:`micro_specs`' answer when the caller has it (computed here otherwise).
    An empty list when every output does, and when the graph cannot run for ``rows`` rows on
    fake tensors (nothing then is known; the runtime's own checks apply).
    """
    if rows == batch:
        return []
    leaves = [(name, node) for name, node in _leaves(gm)
              if isinstance(node.meta.get("fxpipe.value"), TensorSpec) or _is_int(node.meta.get("fxpipe.value"))]
    if not leaves:
        return []
    specs = part if part is not None else micro_specs(gm, batch, rows, unbatched)
    if specs is None:
        return []
    found = []
    for name, node in leaves:
        if _is_int(node.meta["fxpipe.value"]):  # a size the model returns (x.shape[0])
            if _is_int(specs.get(node.name)) and specs[node.name] != node.meta["fxpipe.value"]:
                found.append(f"{name} (node '{node.name}'): {node.meta['fxpipe.value']} for {batch} rows but "
                             f"{specs[node.name]} for {rows}: an int that follows the batch size")
            continue
        whole, part = node.meta["fxpipe.value"].shape, getattr(specs.get(node.name), "shape", None)
        if part is None or len(part) != len(whole) or not whole:
            continue
        moved = [d for d in range(1, len(whole)) if whole[d] != part[d]]
        if moved or whole[0] == part[0]:
            if moved and whole[0] == part[0] and len(moved) == 1 and whole[moved[0]] == batch:
                why = (f"the batch is on dim {moved[0]}, and micro-batches are joined on dim 0: return it "
                       f"batch-first (.transpose(0, {moved[0]})) and transpose it back after the pipeline")
                if any(k in name for k in ("mems", "past_key_values", "cache")):  # XLNet's mems in eval mode
                    why += (" (a Hugging Face model's cache: turn it off instead, use_cache=False or XLNet's "
                            "use_mems=False, in example_kwargs= and in every call)")
            else:
                why = (f"dim {moved[0]} follows the batch too" if moved
                       else "dim 0 does not follow the batch")
            found.append(f"{name} (node '{node.name}'): shape {tuple(whole)} for {batch} rows but "
                         f"{tuple(part)} for {rows}: {why}")
    return found


def sequence_first_splits(gm: torch.fx.GraphModule, batch: int, rows: int, part: dict[str, Any] | None) -> list[str]:
    """Return a description of each sequence-first module (``batch_first=False``) whose dim 0 is the split one.

    torch's attention and recurrent modules default to ``(seq, batch, ...)`` inputs. Where the
    model's own dim 0 reaches such a module's dim 0 (its input has ``rows`` there for a
    micro-batch of ``rows`` rows), the micro-batches split the sequence, not the batch: each
    attends over its own slice of positions. A model transposing to sequence-first before the
    module is not named (its batch reaches dim 1).
    """
    if part is None or rows == batch:
        return []
    found = []
    modules = dict(gm.named_modules())
    calls = [(str(n.target), n.args[0], type(modules[str(n.target)]).__name__) for n in gm.graph.nodes
             if n.op == "call_module" and n.args and _batch_first(modules[str(n.target)]) is False]
    for target, arg, kind in [*calls, *_module_inputs(gm)]:
        if not isinstance(arg, torch.fx.Node):
            continue
        whole, split = arg.meta.get("fxpipe.value"), part.get(arg.name)
        if not isinstance(whole, TensorSpec) or not isinstance(split, TensorSpec):
            continue
        if len(whole.shape) == 3 and whole.shape[0] == batch and split.shape[0] == rows and \
                whole.shape[1] == split.shape[1]:
            found.append(f"'{target}' ({kind}, batch_first=False) reads dim 0 of its input {tuple(whole.shape)} as "
                         "the sequence")
    return found


def _module_inputs(gm: torch.fx.GraphModule) -> list[tuple[str, torch.fx.Node, str]]:
    """Return ``(module, its input, its type)`` for each outermost sequence-first module an exported graph inlined.

    torch.export keeps no ``call_module`` nodes: a module's ops carry its path in
    ``nn_module_stack``, and its input is the first value from outside it that its first op reads.
    The sequence-first modules are those the front end recorded (``gm.meta["fxpipe.sequence_first"]``).
    """
    kinds = gm.meta.get("fxpipe.sequence_first", {})
    seen: set[str] = set()
    found = []
    for node in gm.graph.nodes:
        path = next((p for p in _paths(node) if p in kinds and p not in seen), None)
        if path is None:
            continue
        seen.update(p for p in kinds if p == path or p.startswith(path + "."))  # its inner modules: not again
        outside = [a for a in node.all_input_nodes if path not in _paths(a) and a.op != "get_attr"]
        if outside:
            found.append((path, outside[0], kinds[path]))
    return found


def _paths(node: torch.fx.Node) -> list[str]:
    """Return the paths of the modules an exported node ran inside, outermost first."""
    stack = node.meta.get("nn_module_stack") or {}
    return [entry[0] for entry in stack.values() if isinstance(entry, tuple) and entry]


def sequence_first_modules(model: torch.nn.Module) -> dict[str, str]:
    """Return ``{path: type name}`` of the model's modules that take sequence-first inputs (``batch_first=False``)."""
    return {name: type(m).__name__ for name, m in model.named_modules() if name and _batch_first(m) is False}


_JOINS = {torch.stack, torch.cat, torch.concat, torch.concatenate, torch.vstack, torch.row_stack}


def listed_batches(gm: torch.fx.GraphModule) -> list[tuple[str, bool]]:
    """Return a description of each input that is a list of tensors the model may join into its batch, and
    whether it is a stack (a new dim 0 of one entry per tensor) rather than a concatenation.

    A detection model's ``images`` (a list of ``(3, H, W)`` tensors, ``torch.stack(images)`` in
    the forward), per-sample sequences stacked: the batch is the list, but micro-batches split
    every tensor in an input on its own dim 0, so each image would be cut along its channels and
    each sequence along its tokens. Tensors batched on dim 0 already are rather concatenated
    (two views joined with ``torch.cat(views)``), which the caller tells apart by whether the
    graph runs on the split.
    """
    found = []
    for node in gm.graph.nodes:
        spec = node.meta.get("fxpipe.value")
        if node.op != "placeholder" or not isinstance(spec, (list, tuple)) or len(spec) < 2 or \
                not all(isinstance(t, TensorSpec) and t.shape for t in spec):
            continue
        for user in node.users:
            dim = user.kwargs.get("dim", user.args[1] if len(user.args) > 1 else 0)
            if user.op == "call_function" and user.target in _JOINS and user.args and user.args[0] is node and dim == 0:
                text = (f"input '{node.target}' is a {type(spec).__name__} of {len(spec)} tensors of shape "
                        f"{tuple(spec[0].shape)} that node '{user.name}' ({user.target.__name__}) joins into the batch")
                found.append((text, user.target is torch.stack))
                break
    return found


def _batch_first(module: torch.nn.Module) -> bool | None:
    """Return a module's ``batch_first`` (its own, or its first attention or recurrent layer's); None if it has none."""
    if isinstance(getattr(module, "batch_first", None), bool):
        return bool(module.batch_first)
    for sub in module.modules():
        if isinstance(sub, (torch.nn.MultiheadAttention, torch.nn.RNNBase)):
            return bool(sub.batch_first)
    return None
