"""Warn of module hooks a traced graph does not run: those on modules the tracer traced through.

A tracer runs the model's Python once. A forward hook (or pre-hook) on a module it traces
through runs then: what it returns is recorded in the graph, its side effects (appending an
activation to a list) happen once, at compile. A backward hook never runs. Hooks on a module
the graph calls as a leaf (fx: torch.nn's modules, ``leaf_modules=``) run at every call, as in
eager; torch.export calls none. transformers' own hooks, which capture outputs the model
returns (``output_router_logits=True``), are recorded in the graph and not warned of.
"""

from __future__ import annotations

import warnings

import torch.fx
from torch import nn

from fxpipe.errors import TraceError, user_stacklevel
from fxpipe.passes.linears import HOOK_KINDS

__all__ = ["warn_lost_hooks"]


def warn_lost_hooks(model: nn.Module, gm: torch.fx.GraphModule, tracer: str = "fx") -> list[str]:
    """Warn once naming each hooked module of ``model`` that ``gm`` traced through; return their descriptions."""
    leaves = [str(n.target) for n in gm.graph.nodes if n.op == "call_module"]
    lost = []
    for name, module in model.named_modules():
        hooks = [h for attr, _ in HOOK_KINDS for h in getattr(module, attr, {}).values()]
        if any(_timm_feature_hook(h) for h in hooks):
            if tracer == "fx":
                raise TraceError(
                    f"{type(model).__name__} collects its features with timm's forward hooks (features_only=True, "
                    "feature_cls='hook'), which file each output under its input's device: torch.fx's proxy has "
                    "none, so the traced model returns no features. Use tracer='export' (the features the hooks "
                    "collect are in its graph), or timm's default feature extractor (leave out feature_cls='hook')")
            continue  # exported: what the hooks collect and forward returns is in the graph
        kinds = [kind for attr, kind in HOOK_KINDS if any(not _captures(h) for h in getattr(module, attr, {}).values())]
        if kinds and not any(name == leaf or name.startswith(leaf + ".") for leaf in leaves):
            lost.append(f"{name or 'the model'} ({', '.join(kinds)})")
    if lost:
        warnings.warn(
            f"hooks on modules that were traced through do not run when the pipe runs: {', '.join(lost)}. "
            "A forward hook ran once while tracing (what it returns is in the graph; its side effects, such as "
            "saving an activation, do not happen per call); a backward hook never runs. Return what a hook "
            "collects as a model output, hook a module the graph calls as a leaf (tracer='fx' with "
            "leaf_modules=), or hook tensors (p.register_hook).", stacklevel=user_stacklevel())
    return lost


def _timm_feature_hook(hook: object) -> bool:
    """Tell whether a hook is timm's feature collector (``FeatureHooks``, behind ``feature_cls='hook'``)."""
    fn = getattr(hook, "func", hook)
    return getattr(fn, "__name__", "") == "_collect_output_hook" and \
        str(getattr(fn, "__module__", "") or "").startswith("timm.")


def _captures(hook: object) -> bool:
    """Tell whether a hook's effect is in the graph: transformers' output capture (router logits, attentions),
    torch.ao.quantization's observer hooks (a call of the module's ``activation_post_process``, traced as such),
    or the old ``nn.utils.spectral_norm``/``weight_norm`` pre-hooks (the weight they compute, traced as such)."""
    fn = getattr(hook, "func", hook)  # a functools.partial's function
    module = str(getattr(fn, "__module__", "") or "")
    return module.startswith(("transformers.", "torch.ao.quantization", "torch.nn.utils.spectral_norm",
                              "torch.nn.utils.weight_norm"))
