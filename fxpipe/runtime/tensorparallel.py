"""Split this rank's stages over its tensor-parallel group: PyTorch's styles on the stage modules.

    per stage this rank holds, per styled call (the plan's, :mod:`fxpipe.plan.tensorparallel`):
      a functional linear or embedding (torch.export)  ─▶ an nn.Linear / nn.Embedding module call
                                                          holding the same parameters, under its FQN
      its tensors on meta                               ─▶ filled whole, this module only
      parallelize_module(module, mesh["tp"], style)     ─▶ its weights become DTensor shards
    then the graph's baked-in sizes become the local ones (:func:`fxpipe.passes.tpviews.rewrite_sizes`),
    and the new parameters replace the old wherever they were registered (model, graph, stages);
    the whole graph (which sizes receive buffers on fake tensors, with global shapes) calls copies
    of the styled modules without their hooks

A module's tensors are filled one module at a time and sharded at once, so a model built on
meta never holds more than one module's whole weights beside its shards. When fxpipe filled
them, every rank of the group has the same values and slices its own shard (no communication);
a model built with real tensors is scattered from the group's first rank instead, and its
tensors left whole are broadcast from it, so the ranks of a group agree as DDP's replicas do.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.fx
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication
from torch.distributed.tensor.parallel import parallelize_module

from fxpipe.passes.tplayout import localize
from fxpipe.passes.tpviews import rewrite_sizes
from fxpipe.plan.tensorparallel import TensorParallelPlan
from fxpipe.runtime.placement import named_tensors, register_everywhere
from fxpipe.runtime.tpregion import share_input_gradients

__all__ = ["TPGradScaler", "local_specs", "match_grads", "shard_stages"]

log = logging.getLogger(__name__)


def shard_stages(model: nn.Module, gm: torch.fx.GraphModule, stages: Sequence[torch.fx.GraphModule],
                 mine: Sequence[int], plan: TensorParallelPlan, layout: Any,
                 fill: Callable[[set[int]], None] | None) -> dict[int, nn.Parameter]:
    """Style the stages ``mine`` (this rank's) with ``plan`` over ``layout.tp_mesh``; return ``id(old) -> new``.

    ``fill(ids)`` materializes the listed tensors (those on meta) before their module is sharded.
    """
    of_node = {name: fqn for fqn, site in plan.sites.items() for name in site.nodes}
    swapped: dict[int, nn.Parameter] = {}
    old: list[torch.Tensor] = []  # the replaced parameters, alive until every holder has the new ones
    done: set[int] = set()
    for j in mine:
        st = stages[j]
        colwise = []  # the column-wise calls reading a whole input, which may share one all-reduce
        for node in list(st.graph.nodes):
            fqn = of_node.get(node.name) if node.op in ("call_module", "call_function") else None
            if fqn is None or fqn not in plan.styles:
                continue
            module, call = _module_call(st, node, plan.sites[fqn])
            if plan.shares_input(fqn):
                colwise.append(call)
            if id(module) in done:
                continue
            done.add(id(module))
            _style(module, plan.styles[fqn], layout, fill, swapped, old)
        st.recompile()
        share_input_gradients(st, colwise, layout.tp_mesh)
        rewritten = rewrite_sizes(st, plan.size)
        log.debug("stage %d: %d size(s) made local: %s", j, len(rewritten), rewritten[:8])
    register_everywhere([model, gm, *stages], swapped)
    _unhooked(gm, plan, done)
    for site in plan.sites.values():  # drop the plan's references to the whole weights
        site.weight = swapped.get(id(site.weight), site.weight)
        site.bias = swapped.get(id(site.bias), site.bias)
    if fill is None:
        _broadcast_whole(stages, mine, layout)
    return swapped


def _style(module: nn.Module, style: Any, layout: Any, fill: Callable[[set[int]], None] | None,
           swapped: dict[int, nn.Parameter], old: list[torch.Tensor]) -> None:
    """Fill ``module``'s tensors if asked, shard it with ``style``; keep a tied weight one parameter."""
    before = dict(module._parameters)
    if fill is not None:
        fill({id(p) for p in before.values() if p is not None and p.is_meta})
        before = dict(module._parameters)
    for name, p in before.items():  # a weight tied to one sharded already: the same DTensor
        if p is not None and id(p) in swapped:
            module._parameters[name] = swapped[id(p)]
    parallelize_module(module, layout.tp_mesh, style, src_data_rank=None if fill is not None else 0)
    for name, p in before.items():
        new = module._parameters[name]
        if p is None or new is p:
            continue
        if id(p) in swapped:
            module._parameters[name] = swapped[id(p)]
        elif isinstance(new, DTensor):
            swapped[id(p)] = new
            old.append(p)


def _module_call(st: torch.fx.GraphModule, node: torch.fx.Node, site: Any) -> tuple[nn.Module, torch.fx.Node]:
    """Return the module a site node calls, and the call; turn a functional linear or embedding into a module call."""
    if node.op == "call_module":
        return st.get_submodule(str(node.target)), node
    linear = site.kind == "linear"
    module: nn.Module = nn.Linear.__new__(nn.Linear) if linear else nn.Embedding.__new__(nn.Embedding)
    nn.Module.__init__(module)
    out, inp = site.weight.shape
    if linear:
        module.in_features, module.out_features = inp, out  # type: ignore[assignment]
        module.weight, module.bias = site.weight, site.bias
        x = node.args[0]
    else:
        module.num_embeddings, module.embedding_dim = out, inp  # type: ignore[assignment]
        module.padding_idx = _padding(node, out)  # type: ignore[assignment]
        options = _embedding_options(node)
        module.max_norm, module.norm_type, module.scale_grad_by_freq, module.sparse = options  # type: ignore[assignment]
        module.weight = site.weight
        x = node.args[1] if node.target is torch.ops.aten.embedding.default else node.args[0]
    _keep_other_tensors(st, site.fqn, module)
    _install(st, site.fqn, module)
    with st.graph.inserting_before(node):
        call = st.graph.call_module(site.fqn, (x,))
    call.meta = dict(node.meta)
    node.replace_all_uses_with(call)
    st.graph.erase_node(node)
    return module, call


def _padding(node: torch.fx.Node, rows: int) -> int | None:
    """Return the padding row of a functional embedding call over ``rows`` rows (None: every row learns)."""
    pad: Any
    if node.target is torch.ops.aten.embedding.default:  # (weight, indices, padding_idx=-1, ...): -1 is none
        pad = node.args[2] if len(node.args) > 2 else node.kwargs.get("padding_idx", -1)
        return None if pad is None or int(pad) < 0 else int(pad)
    pad = node.args[2] if len(node.args) > 2 else node.kwargs.get("padding_idx")  # F.embedding(input, weight, ...)
    return None if pad is None else int(pad) % rows


def _embedding_options(node: torch.fx.Node) -> tuple[float | None, float, bool, bool]:
    """Return a functional embedding call's max_norm, norm_type, scale_grad_by_freq and sparse."""
    if node.target is torch.ops.aten.embedding.default:  # (weight, indices, padding_idx, scale_grad_by_freq, sparse)
        args = list(node.args) + [None] * 5
        return None, 2.0, bool(args[3] or node.kwargs.get("scale_grad_by_freq", False)), \
            bool(args[4] or node.kwargs.get("sparse", False))
    names = ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")
    given: dict[str, Any] = dict(zip(names, node.args)) | dict(node.kwargs)
    norm = given.get("norm_type")
    return given.get("max_norm"), 2.0 if norm is None else float(norm), bool(given.get("scale_grad_by_freq")), \
        bool(given.get("sparse"))


def _unhooked(gm: torch.fx.GraphModule, plan: TensorParallelPlan, styled: set[int]) -> None:
    """Give the whole graph copies of the styled modules without parallelize_module's hooks.

    The graph keeps global shapes for the propagation of receive buffers, whose stand-ins of the
    DTensor weights are whole tensors; a hook turning the input into a DTensor would mix the two.
    """
    for fqn, site in plan.sites.items():
        if site.functional or fqn not in plan.styles:
            continue
        module = gm.get_submodule(fqn)
        if id(module) not in styled:
            continue
        copy = type(module).__new__(type(module))
        copy.__dict__ = dict(module.__dict__)
        for hooks in ("_forward_pre_hooks", "_forward_hooks", "_forward_pre_hooks_with_kwargs",
                      "_forward_hooks_with_kwargs", "_forward_hooks_always_called"):
            if hooks in copy.__dict__:
                copy.__dict__[hooks] = type(copy.__dict__[hooks])()
        copy._parameters = dict(module._parameters)
        _install(gm, fqn, copy)


def _keep_other_tensors(st: torch.fx.GraphModule, fqn: str, module: nn.Module) -> None:
    """Point the graph's reads of other tensors under ``fqn`` (Gemma's ``embed_tokens.embed_scale``) at the stage's root.

    The styled module replaces the one at ``fqn``: a read of another tensor there would find
    nothing, and one registered on the styled module would be distributed by ``parallelize_module``.
    """
    try:
        before = st.get_submodule(fqn)
    except AttributeError:
        return
    for node in st.graph.nodes:
        rest = str(node.target)[len(fqn) + 1:] if node.op == "get_attr" and str(node.target).startswith(f"{fqn}.") \
            else None
        if rest is None or rest in module._parameters:
            continue
        *path, name = rest.split(".")
        owner = before.get_submodule(".".join(path))
        tensor = getattr(owner, name)
        flat = "_fxpipe_" + str(node.target).replace(".", "_")
        if isinstance(tensor, nn.Parameter):
            st.register_parameter(flat, tensor)
        else:
            st.register_buffer(flat, tensor, persistent=False)  # the model's own keeps it in its state dict
        node.target = flat


def _install(root: nn.Module, fqn: str, module: nn.Module) -> None:
    """Put ``module`` at ``fqn`` under ``root`` (replacing what is there), making the parents it needs."""
    *parents, last = fqn.split(".")
    at = root
    for part in parents:
        if not hasattr(at, part):
            setattr(at, part, nn.Module())
        at = getattr(at, part)
    setattr(at, last, module)


def _broadcast_whole(stages: Sequence[torch.fx.GraphModule], mine: Sequence[int], layout: Any) -> None:
    """Make the tensors left whole equal on every rank of the group (a model built with real tensors)."""
    src = dist.get_global_rank(layout.tp_group, 0)
    seen: set[int] = set()
    with torch.no_grad():
        for j in mine:
            for _, t in named_tensors(stages[j]):
                if id(t) in seen or isinstance(t, DTensor) or t.is_meta:
                    continue
                seen.add(id(t))
                dist.broadcast(t.data, src=src, group=layout.tp_group)


def local_specs(specs: dict[str, Any], layouts: dict[str, Any], t: int) -> dict[str, Any]:
    """Return the receive specs a rank holds of crossing values (their shards' shapes)."""
    if not layouts:
        return specs
    return {name: localize(spec, layouts.get(name), t) for name, spec in specs.items()}


def match_grads(params: Sequence[torch.Tensor]) -> None:
    """Give every DTensor parameter's gradient the parameter's own placements.

    A vocabulary-parallel embedding's backward gives its sharded weight a replicated gradient;
    the reductions that follow (ties, replicas, the norm) work on each rank's local shard, so
    the gradient is cut to the parameter's shard (a local slice, no communication).
    """
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
            p.grad = g.redistribute(p.device_mesh, p.placements)


class TPGradScaler(ShardedGradScaler):
    """FSDP's ``ShardedGradScaler`` for stages split over ranks: DTensor shards and whole gradients unscale together.

    Its scale and inf/NaN flag are plain tensors, which DTensor ops take as replicated here; the
    flag is all-reduced over every rank, so every rank skips the same steps.
    """

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale the optimizer's gradients (shards and whole), agreeing on inf/NaN with every rank."""
        with implicit_replication(), warnings.catch_warnings():
            # the scale and flag are one-element tensors, replicated here by design: not the user's to hear of
            warnings.filterwarnings("ignore", message="Found a non-scalar tensor with numel=1")
            super().unscale_(optimizer)

    def _unscale_grads_(self, optimizer: Any, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool = True) -> dict[torch.device, torch.Tensor]:
        """Unscale the whole gradients and the DTensor shards in calls of their own; return the inf/NaN flags.

        One foreach call over both kinds is dispatched by DTensor, which reads the placements of
        the list's first gradient: a whole one first (an untied head, a norm) raised
        ``'Tensor' object has no attribute 'placements'``.
        """
        kinds: tuple[list[Any], list[Any]] = ([], [])
        for group in optimizer.param_groups:
            for param in group["params"]:
                kinds[isinstance(param.grad, DTensor)].append(param)
        found: dict[torch.device, torch.Tensor] = {}
        for params in kinds:
            if params or not found:  # no gradient at all: the flags are made on the scale's device
                only: Any = SimpleNamespace(param_groups=[{"params": params}])  # all the parent reads of it
                part = super()._unscale_grads_(only, inv_scale, found_inf, allow_fp16)
                for device, flag in part.items():
                    found[device] = torch.maximum(found[device], flag) if device in found else flag
        return found

