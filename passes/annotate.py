"""Annotate a GraphModule with shapes, dtypes, bytes and FLOPs, using fake tensors.

Reads:  the graph and the module's parameters and buffers (their shapes only).
Writes: ``node.meta`` keys

    fxpipe.value        the node's value with every tensor replaced by a :class:`TensorSpec`
                        (non-tensor values are kept as they are: ints, None, ...)
    fxpipe.bytes        bytes of the tensors in the node's value
    fxpipe.flops        forward FLOPs of the node (matmul/conv/attention formulas from
                        ``torch.utils.flop_counter``, one per output element for other kernels)
    fxpipe.flops_bwd    backward FLOPs: for the formula kernels, the forward count times the
                        number of their operands that need a gradient (at most 2: input and
                        weight, or both sides of a matmul); one per element for the rest;
                        0 when the node's output needs no gradient
    fxpipe.saved_bytes  bytes the node's output keeps alive for backward (0 for views)
    fxpipe.param_bytes  bytes of the parameters and buffers the node reads directly
                        (``get_attr``) or through its module (``call_module``)
    fxpipe.mutates      names of the earlier nodes (placeholders and computed values, not
                        ``get_attr``) whose tensor storage the node changed in place, directly
                        or through a view; seen as a bump of an input's version counter

Nothing real is computed and the model's parameters and buffers are never touched: each
node runs under :class:`~torch._subclasses.fake_tensor.FakeTensorMode`, a module with fake
copies of its own state swapped in by :func:`torch.func.functional_call`. Nodes with equal
signatures (:mod:`fxpipe.passes.signature`) run once; the others reuse the first one's result, so a
deep stack of identical layers costs little more than one layer.
"""

from __future__ import annotations

import inspect
import logging
import operator
import re
from typing import Any, cast

import torch
import torch.fx
import torch.fx._pytree as fx_pytree
from fxpipe.passes.fakemode import fake_mode
from fxpipe.passes.gcpause import gc_paused
from fxpipe.passes.propagate import Propagator, fetch
from fxpipe.passes.spec import TensorSpec, spec_of, value_bytes
from fxpipe.passes.structure import as_containers, difference
from fxpipe.passes.untouched import modules_untouched
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["FixedInputError", "TensorSpec", "annotate", "annotate_params", "bind_placeholders", "drop_guards",
           "input_placeholders", "same_constant", "spec_of", "value_bytes"]

log = logging.getLogger(__name__)


def _param_bytes(gm: torch.fx.GraphModule, node: torch.fx.Node, modules: dict, trainable: bool = False) -> int:
    """Return the bytes of parameters and buffers a node reads from the module (``trainable``: of the parameters
    requiring grad only, whose gradients are kept)."""
    if node.op == "call_module":
        mod = modules[node.target]
        held = list(mod.parameters()) + ([] if trainable else list(mod.buffers()))
        seen = {id(t): t for t in held if t.requires_grad or not trainable}
        return sum(t.numel() * t.element_size() for t in seen.values())
    if node.op == "get_attr":
        obj = fetch(gm, cast(str, node.target))  # a get_attr target is the attribute's path
        if isinstance(obj, torch.Tensor) and (obj.requires_grad or not trainable):
            return obj.numel() * obj.element_size()
    return 0


@gc_paused
def annotate(gm: torch.fx.GraphModule, example_args: tuple, example_kwargs: dict | None = None,
             *, real: bool = False, memoize: bool = True) -> torch.fx.GraphModule:
    """Record ``fxpipe.value/bytes/flops/flops_bwd/saved_bytes/param_bytes/grad_bytes`` on every node; return ``gm``.

    ``example_args`` and ``example_kwargs`` bind to the graph's placeholders as they would
    in a call of ``gm``. With ``real=False`` (the default) everything runs on fake tensors;
    ``real=True`` runs the real kernels, with autograd as the fake run has it, on copies of the buffers (for
    models whose data-dependent ops fake tensors cannot follow). ``memoize=False`` runs
    every node even when an equal one ran before (for checking the memo).
    """
    flat_inputs = bind_placeholders(gm, example_args, example_kwargs or {})
    with modules_untouched(gm):
        _propagate(gm, flat_inputs, real, memoize)
    return annotate_params(gm)


def _propagate(gm: torch.fx.GraphModule, flat_inputs: list, real: bool, memoize: bool) -> None:
    """Run the graph on the inputs (fake tensors unless ``real``), writing each node's ``fxpipe.*`` keys."""
    if real:  # with autograd on, as on fake tensors: each node's requires_grad says which boundaries carry gradients
        with torch.enable_grad():
            Propagator(gm, None).propagate(flat_inputs, memoize=False)
    else:
        mode = fake_mode(gm)
        with mode:
            device = gm.meta.get("fxpipe.example_device", torch.device("cpu"))
            fake_inputs = tree_map(lambda v: _fake_input(mode, v, device), flat_inputs)
            propagator = Propagator(gm, mode)
            propagator.propagate(fake_inputs, memoize=memoize)
        log.debug("annotated %d nodes, %d from the memo", len(gm.graph.nodes), propagator.hits)


def _fake_input(mode: FakeTensorMode, v: Any, device: torch.device) -> Any:
    """Return the fake of one example input; a meta one on ``device``, where the model's meta state is faked too.

    An exported graph holds the device its trace ran on (``.to(device)`` checks, factory calls), which for
    meta examples is the stages' device (:mod:`fxpipe.frontend.exportmeta`), never ``meta``.
    """
    if not isinstance(v, torch.Tensor):
        return v
    if not v.is_meta:
        return mode.from_tensor(v)
    with mode:
        fake = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=device)
    return fake.requires_grad_(v.requires_grad)


def annotate_params(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Record ``fxpipe.param_bytes`` on every node (needs no example inputs); return ``gm``."""
    modules = dict(gm.named_modules())
    for node in gm.graph.nodes:
        node.meta["fxpipe.param_bytes"] = _param_bytes(gm, node, modules)
        node.meta["fxpipe.grad_bytes"] = _param_bytes(gm, node, modules, trainable=True)
    return gm


def bind_placeholders(gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> list:
    """Return one value per placeholder of ``gm`` for a call ``gm(*args, **kwargs)``."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    info = getattr(gm.graph._codegen, "pytree_info", None)
    if info is not None and info.in_spec is not None:
        return _bind_pytree(gm, info.in_spec, args, kwargs)
    values: list = []
    positional, keywords = list(args), dict(kwargs)  # what is left to bind
    left_out: TypeError | None = None  # a fixed input left at another default: refused after too many positionals
    for node in placeholders:
        name, variadic = node.target, node.meta.get("fxpipe.variadic")
        if variadic == "**":  # the one input of forward's **kwargs: the keywords left
            values.append(keywords)
            keywords = {}
        elif variadic == "*":  # of forward's *args: the positional inputs left
            values.append(tuple(positional))
            positional = []
        elif positional and not node.meta.get("fxpipe.keyword_only"):
            fixed_to = _specialized(node)
            if fixed_to is not _NOT_FIXED and not same_constant(positional[0], fixed_to):
                raise _fixed_refusal(gm, name[:-2], fixed_to)
            values.append(positional.pop(0))
        elif name in keywords:
            values.append(keywords.pop(name))
        elif _specialized(node) is not _NOT_FIXED:  # concrete_args: the value the trace fixed, not the default
            left = gm.meta.get("fxpipe.fixed_by_example", {}).get(name[:-2])  # (its value, forward's default)
            if name[:-2] not in keywords and left is not None and left[1] is inspect.Parameter.empty:
                left_out = left_out or FixedInputError(
                    f"missing a value for the model input '{name[:-2]}' (forward has no default for it): pass "
                    f"{name[:-2]}={left[0]!r}, as the example did")
            elif name[:-2] not in keywords and left is not None and not same_constant(left[1], left[0]):
                left_out = left_out or FixedInputError(
                    f"{name[:-2]}= was fixed to {left[0]!r} when the model was traced (the example's value: "
                    f"tracer='fx' cannot trace it as an input), and this call leaves it at forward's default "
                    f"{left[1]!r}, which the pipe does not run: pass {name[:-2]}={left[0]!r}, or compile with "
                    "tracer='export' (which takes it as an input)")
            values.append(_specialized(node))
        elif node.args:
            values.append(node.args[0])
        elif node.meta.get("fxpipe.keyword_only"):
            raise TypeError(f"missing a value for the model's keyword-only input '{name}': pass it as the keyword "
                            f"{name}=... (forward takes it by keyword only"
                            + (f"; {len(positional)} input(s) were left over positionally)" if positional else ")"))
        else:
            raise TypeError(f"missing a value for the model input '{name}': pass it positionally "
                            f"or as the keyword {name}=...")
    if positional:
        only = [n.target[:-2] if _specialized(n) is not _NOT_FIXED else n.target  # a fixed `flag_1`: flag=
                for n in placeholders if n.meta.get("fxpipe.keyword_only")]
        raise TypeError(f"the model takes {len(placeholders) - len(only)} input(s) positionally but "
                        f"{len(placeholders) - len(only) + len(positional)} were given"
                        + (f"; {only} {'is' if len(only) == 1 else 'are'} keyword-only: pass "
                           f"{', '.join(f'{n}=...' for n in only)}" if only else ""))
    if left_out is not None:
        raise left_out
    fixed = {n.target[:-2]: _specialized(n) for n in placeholders  # torch.fx's concrete_args: `flag_1 = value`
             if n.target.endswith("_1") and n.target[:-2] in keywords and _specialized(n) is not _NOT_FIXED}
    for name in [k for k, v in fixed.items() if type(keywords[k]) is type(v) and keywords[k] == v]:
        del keywords[name], fixed[name]  # the value it was traced with: nothing to bind
    if keywords:
        if fixed:
            raise _fixed_refusal(gm, *next(iter(fixed.items())))
        raise TypeError(f"unexpected keyword input(s) {sorted(keywords)}; the model's inputs are "
                        f"{[n.target for n in placeholders]}")
    return values


_NOT_FIXED = object()


class FixedInputError(TypeError):
    """A call giving another value for an input the trace fixed (``concrete_args``), or leaving it at another default."""


def _fixed_refusal(gm: torch.fx.GraphModule, name: str, value: Any) -> FixedInputError:
    """Refuse another value for an input the trace fixed to ``value``."""
    left = gm.meta.get("fxpipe.fixed_by_example", {}).get(name)  # (its value, forward's default): left out, refused
    how = f"pass {value!r}" if left is not None and not same_constant(left[1], left[0]) else \
        f"pass {value!r} or leave it out"
    other = (f"compile with an example tensor for it (example_inputs= or example_kwargs={{{name!r}: ...}}) if the pipe "
             "is to take one" if value is None else f"trace again with concrete_args={{{name!r}: ...}} for another value")
    return FixedInputError(f"{name}= was fixed to {value!r} when the model was traced (concrete_args=; under "
                           "tracer='fx' "
                     "fxpipe fixes a flag, a string or a None input to its example's value or its default where the "
                     "model does not trace with it as an input, and a None input wherever it traces so), so the "
                     f"pipe takes no other {name}=: {how}, compile with tracer='export' (which takes it as an input), "
                     f"or {other}")


def _specialized(node: torch.fx.Node) -> Any:
    """Return the value torch.fx's ``concrete_args`` fixed placeholder ``node`` to (its guard's), or ``_NOT_FIXED``.

    torch.fx names such a placeholder ``flag_1``, gives it the signature's default, and guards
    the value it fixed: ``_assert(flag_1 == False)``, or ``_assert_is_none(flag_1)``;
    :func:`drop_guards` moves that value into ``node.meta["fxpipe.fixed"]``.
    """
    if "fxpipe.fixed" in node.meta:
        return node.meta["fxpipe.fixed"]
    for user in node.users:
        if user.op != "call_function":
            continue
        if user.target is operator.eq and user.args[0] is node and not isinstance(user.args[1], torch.fx.Node) \
                and any(u.target is torch._assert for u in user.users):
            return user.args[1]
        if getattr(user.target, "__name__", "") == "_assert_is_none":
            return None
    return _NOT_FIXED


def drop_guards(graph: torch.fx.Graph) -> None:
    """Keep each ``concrete_args`` value in its placeholder's ``node.meta["fxpipe.fixed"]``; erase its guard nodes.

    A call's value is checked where it is bound (:func:`bind_placeholders`); the guards, read by
    nothing, would land in whichever stage the balancer leaves them (the last, across ranks).
    """
    for node in [n for n in graph.nodes if n.op == "placeholder"]:
        value = _specialized(node)
        if value is _NOT_FIXED:
            continue
        node.meta["fxpipe.fixed"] = value
        for user in list(node.users):
            if user.op != "call_function":
                continue
            if user.target is operator.eq and all(u.target is torch._assert for u in user.users):
                for guard in list(user.users):
                    graph.erase_node(guard)
                graph.erase_node(user)
            elif getattr(user.target, "__name__", "") == "_assert_is_none":
                graph.erase_node(user)


def _with_defaults(sig: inspect.Signature, gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Drop inputs given as the model's default that the graph was exported without; add those it was exported with.

    ``torch.export`` keeps the inputs given at compile only; eager takes ``mask=None`` passed
    (by keyword or by position) or left out alike, and so does the pipe where ``None`` (or the
    constant) is the default.
    """
    defaults, order = gm.meta.get("fxpipe.defaults", {}), gm.meta.get("fxpipe.positional", [])
    taken = sum(p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                for p in sig.parameters.values())
    while len(args) > taken and len(args) <= len(order) and order[len(args) - 1] in defaults \
            and same_constant(args[-1], defaults[order[len(args) - 1]]):
        args = args[:-1]  # a trailing positional default the graph does not take
    open_keywords = gm.meta.get("fxpipe.keywords", False)  # forward(..., **kwargs): an entry's default is None
    kwargs = {k: v for k, v in kwargs.items() if k in sig.parameters or not (
        same_constant(v, defaults[k]) if k in defaults else open_keywords and v is None)}
    for k, (name, p) in enumerate(sig.parameters.items()):
        if k < len(args) or name in kwargs or name not in defaults:
            continue
        if p.kind is not inspect.Parameter.POSITIONAL_ONLY:
            kwargs[name] = defaults[name]
        elif k == len(args):
            args = (*args, defaults[name])
    return args, kwargs


def same_constant(value: Any, default: Any) -> bool:
    """Return whether ``value`` is ``default`` (``None``) or a constant of the same type and value."""
    return value is default or (type(value) is type(default) and value == default)


def input_difference(gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> str | None:
    """Say where a call's inputs part from the structure an exported graph was traced for (``None``: they do not).

    ``torch.export`` flattens each input by the example's structure: a list one longer had
    its last item dropped, silently (:func:`difference` names it instead). Containers it reads
    alike stand in for each other (a list for a tuple, any mapping for a dict, keys it does not
    read left out). A call that does not bind is left to :func:`bind_placeholders`, which says why.
    """
    info = getattr(gm.graph._codegen, "pytree_info", None)
    if info is None or info.in_spec is None:
        return None
    try:
        (values, keywords), names = _bound_call(gm, info.in_spec, args, kwargs)
    except TypeError:
        return None
    args_spec, kwargs_spec = _children(info.in_spec)
    pairs = [*zip(names, values, args_spec.children()),
             *((k, keywords[k], spec) for k, spec in zip(kwargs_spec.context, kwargs_spec.children()))]
    for name, value, spec in pairs:  # the graph reads only the example's keys: others are left, as eager may
        found = difference(tree_flatten(as_containers(value))[1], spec, name, extra_keys=True)
        if found is not None:
            return found
    return None


def _children(in_spec: Any) -> tuple[Any, ...]:
    """Return a tree spec's child specs (of a call: its positional and keyword inputs')."""
    return tuple(in_spec.children() if hasattr(in_spec, "children") else in_spec.children_specs)


def _bound_call(gm: torch.fx.GraphModule, in_spec: Any, args: tuple, kwargs: dict) -> tuple[tuple[tuple, dict], list[str]]:
    """Bind a call as the exported graph takes it: ``((args, kwargs), the positional inputs' names)``."""
    sig = inspect.signature(gm.forward)
    args, kwargs = _with_defaults(sig, gm, args, kwargs)
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as exc:
        missing = re.search(r"missing a required argument: '(\w+)'", str(exc))
        extra = re.search(r"unexpected keyword argument '(\w+)'", str(exc))
        hint = ("; torch.export traced the model with the inputs given at compile (example_inputs=, "
                "example_kwargs=) and takes those only: "
                + (f"pass {missing.group(1)}= to this call as at compile (pipe.step(..., {missing.group(1)}=...), "
                   "also a constant such as use_cache=False), or leave it out of the example"
                   if missing else
                   f"{extra.group(1)}= had no example at compile, so the exported graph has no such input: compile "
                   f"with example_kwargs={{'{extra.group(1)}': ...}} (the value this call passes; a constant such as "
                   "return_dict=False is traced as that constant)" if extra else
                   "give every input the pipe will be called with an example at compile (an "
                   "optional one, such as attention_mask=, too)")
                if gm.meta.get("fxpipe.tracer") == "export" else "")
        raise TypeError(f"the inputs do not match the traced graph's inputs {sig}: {exc}{hint}") from None
    bound.apply_defaults()
    names = list(sig.parameters)
    args_spec, kwargs_spec = _children(in_spec)
    n_args = args_spec.num_children
    kw_keys = kwargs_spec.context
    call = (tuple(bound.arguments[p] for p in names[:n_args]), {k: bound.arguments[k] for k in kw_keys})
    return call, names[:n_args]


def _bind_pytree(gm: torch.fx.GraphModule, in_spec: Any, args: tuple, kwargs: dict) -> list:
    """Flatten a call of a GraphModule whose codegen flattens inputs (``torch.export``)."""
    call, _ = _bound_call(gm, in_spec, args, kwargs)
    return list(fx_pytree.tree_flatten_spec(call, in_spec))


def input_placeholders(gm: torch.fx.GraphModule) -> dict[str, list[str]]:
    """Return the placeholders each forward input flattens to (``rope=(cos, sin)``: ``rope_0``, ``rope_1``).

    Reads the exported graph's input spec; a graph without one (torch.fx) has one placeholder
    per input, named as the input, and gets ``{}``.
    """
    info = getattr(gm.graph._codegen, "pytree_info", None)
    if info is None or info.in_spec is None:
        return {}
    names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    args_spec, kwargs_spec = _children(info.in_spec)
    specs = list(zip(list(info.orig_args)[:args_spec.num_children], _children(args_spec)))
    specs += list(zip(kwargs_spec.context, _children(kwargs_spec)))
    if sum(spec.num_leaves for _, spec in specs) != len(names):
        return {}
    found, at = {}, 0
    for name, spec in specs:
        found[name] = names[at:at + spec.num_leaves]
        at += spec.num_leaves
    return found
