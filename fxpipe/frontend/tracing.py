"""Trace a model into a ``torch.fx`` GraphModule, explaining failures."""

from __future__ import annotations

import collections
import dataclasses
import inspect
import linecache
import logging
import operator
import os
import sys
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.autograd.function import FunctionCtx

from fxpipe.errors import TraceError, user_stacklevel, with_distributions_hint
from fxpipe.frontend.amp import autocast_blocks, recording_autocast_blocks
from fxpipe.frontend.assign import recording_assignments
from fxpipe.frontend.astensor import TENSOR_MAKERS, tracing_tensor_makers, unmark_wrapped
from fxpipe.frontend.autogradfns import applying, check_functions, watching_functions
from fxpipe.frontend.compiledmodule import is_compiled_module, unwrap_compiled
from fxpipe.frontend.constinputs import constant_inputs, none_inputs, refuse_name_clash, unread_none_entries
from fxpipe.frontend.leftovers import flags_kept, no_proxies_left
from fxpipe.frontend.markers import recording_markers
from fxpipe.frontend.modes import in_other_mode, may_read_mode, quieted
from fxpipe.frontend.nograd import detach_no_grad_blocks
from fxpipe.frontend.pyrandom import recording_python_random, warn_python_random
from fxpipe.frontend.tensorhooks import HookOnProxy, refuse_tensor_hook
from fxpipe.frontend.tracewrites import refuse_writes_while_tracing, state_versions
from fxpipe.frontend.userframe import user_frame
from fxpipe.options import check_tracer
from fxpipe.passes.amp import run_under_autocast
from fxpipe.passes.annotate import drop_guards
from fxpipe.passes.freshconstants import fresh_constants
from fxpipe.passes.modes import merge_modes
from fxpipe.passes.mutates import alias_closure, written_args
from fxpipe.passes.records import extras, record_builder, register_graph_records

__all__ = ["detector_note", "refuse_parallel_wrapper", "trace"]

log = logging.getLogger(__name__)



class _Proxy(torch.fx.Proxy):
    """A proxy that records index assignment (``y[:, :4] = 0``) as ``operator.setitem``."""

    # numpy defers its binary operators to ours (``np.float64(0.5) * h`` calls ``h.__rmul__``)
    # instead of reading ``__array_struct__`` off the proxy.
    __array_ufunc__ = None

    def __setitem__(self, key: Any, value: Any) -> None:
        self.tracer.create_proxy("call_function", operator.setitem, (self, key, value), {})

    def register_hook(self, hook: Any) -> None:
        """Refuse a gradient hook registered in forward: no graph can hold it (see :mod:`.tensorhooks`)."""
        raise HookOnProxy(hook)


class _Tracer(torch.fx.Tracer):
    """A symbolic tracer that also treats the user's ``leaf_modules`` as opaque calls."""

    def __init__(self, leaf_types: tuple[type, ...], leaf_names: frozenset[str]) -> None:
        super().__init__(autowrap_functions=TENSOR_MAKERS)  # `from torch import as_tensor` (fxpipe.frontend.astensor)
        # buffers as get_attr nodes even where code runs on them alone (``self.scale * 2``):
        # otherwise the trace computes such code once and freezes the result into the graph,
        # which goes stale when the buffer changes (load_state_dict, an update in forward)
        self.proxy_buffer_attributes = True
        self.leaf_types = leaf_types
        self.leaf_names = leaf_names

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        """Treat torch.nn's own modules and the user's leaf modules as single calls."""
        if isinstance(m, self.leaf_types) or module_qualified_name in self.leaf_names or is_compiled_module(m):
            return True  # a torch.compile'd submodule: fx cannot trace dynamo's frames, it runs compiled
        return super().is_leaf_module(m, module_qualified_name)

    def create_node(self, kind: str, target: Any, args: Any, kwargs: Any, name: str | None = None,
                    type_expr: Any = None) -> torch.fx.Node:
        """Create a node; mark it if the forward made it with grad mode off or inside its own autocast blocks."""
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        if not torch.is_grad_enabled() and not _in_function_forward():
            node.meta["fxpipe.no_grad"] = True
        blocks = autocast_blocks()
        if blocks:
            node.meta["fxpipe.autocast"] = blocks
        return node

    def create_arg(self, a: Any) -> Any:
        """Record the dataclasses and ``OrderedDict``s the forward builds as calls that rebuild them; numpy scalars as Python's.

        A plain dataclass is rebuilt from its fields without ``__init__`` (torch.fx's own call of
        the class ran ``__post_init__`` again); one that is also a dict (a Hugging Face-style
        ``ModelOutput``) by its constructor, since torch.fx takes it for a plain dict and
        ``out.logits`` would fail. An ``OrderedDict`` stays one too.
        """
        if isinstance(a, dict) and dataclasses.is_dataclass(a) and not isinstance(a, type):
            kwargs = {f.name: self.create_arg(getattr(a, f.name)) for f in dataclasses.fields(a) if f.init}
            return self.create_node("call_function", type(a), (), kwargs)
        if type(a).__module__ == "numpy" and hasattr(a, "item") and getattr(a, "ndim", None) == 0:
            return a.item()  # a numpy scalar (np.sqrt(d)): fx wrote np.float64(4.0), which its code cannot name
        if dataclasses.is_dataclass(a) and not isinstance(a, type) and not isinstance(a, (dict, list, tuple)):
            # torch.fx's own call of the class would run __post_init__ again on the fields it made
            kwargs = {f.name: self.create_arg(getattr(a, f.name)) for f in dataclasses.fields(a) if hasattr(a, f.name)}
            for name in extras(a):
                try:
                    kwargs[name] = self.create_arg(getattr(a, name))
                except NotImplementedError:  # an object a graph cannot hold: the record comes back without it
                    warnings.warn(
                        f"the {type(a).__name__} record the forward returns has an attribute {name!r} (a "
                        f"{type(getattr(a, name)).__name__}, not a field) that a traced graph cannot hold: the pipe's "
                        "records come back without it. Make it a field of tensors, numbers or strings, or compute "
                        "it from the record after the pipe", stacklevel=user_stacklevel())
            return self.create_node("call_function", record_builder(type(a)), (), kwargs)
        if type(a) is collections.OrderedDict:  # torchvision's segmentation models: fx would return a plain dict
            return self.create_node("call_function", collections.OrderedDict, (super().create_arg(dict(a)),), {})
        return super().create_arg(a)

    def proxy(self, node: torch.fx.Node) -> torch.fx.Proxy:
        """Wrap a node in a proxy that also records index assignment."""
        return _Proxy(node, self)




def trace(model: nn.Module, *, leaf_modules: Iterable[type | str] = (),
          concrete_args: dict[str, Any] | None = None,
          tracer: str | Callable[[nn.Module], torch.fx.GraphModule] = "fx",
          example_inputs: Any = None, example_kwargs: dict[str, Any] | None = None,
          device: Any = None, unbatched: Iterable[str] = (), export_dims: str = "auto") -> torch.fx.GraphModule:
    """Trace ``model`` into the GraphModule whose node names a plan uses.

    ``tracer="fx"`` (the default) traces symbolically: ``leaf_modules`` lists module classes
    or qualified names (``"encoder.block3"``) to keep as single ``call_module`` nodes, for
    example because their forward has data-dependent control flow, and ``concrete_args``
    fixes inputs to constants, as in :func:`torch.fx.symbolic_trace`. ``tracer="export"``
    uses ``torch.export`` on ``example_inputs``/``example_kwargs`` with dim 0 dynamic (but for
    the inputs named in ``unbatched``; its other dims free, or the example's with
    ``export_dims="batch"``; see
    :mod:`fxpipe.frontend.export`); a model built on meta is exported with its tensors as fake
    tensors on the example inputs' device (``device`` where they are on meta too, else CPU),
    so code branching on ``x.device.type`` sees a real device type. A callable
    ``tracer(model)`` may return the GraphModule of any other tracer (Hugging Face's, timm's). Every front end keeps the model's own parameter
    objects and names. The model is not modified. Raises :class:`TraceError` naming the
    module and source line where tracing failed.

    With fx, what torch.fx does not record is kept: a forward's assignments to buffers become
    in-place copies (:mod:`~fxpipe.frontend.assign`), its ``torch.no_grad()`` blocks are
    detached (:mod:`~fxpipe.frontend.nograd`), and the calls inside its ``torch.autocast`` blocks
    run under them (:mod:`~fxpipe.frontend.amp`). With fx or a callable tracer, a forward reading
    ``self.training`` is traced in both modes and the graphs merged (:mod:`fxpipe.passes.modes`; where they cannot
    be, ``gm.meta`` keeps the difference and the other mode is refused by
    :func:`fxpipe.runtime.validate.check_inputs`).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fxpipe.trace expects an nn.Module, got {type(model).__name__}")
    model = unwrap_compiled(model)
    refuse_parallel_wrapper(model)
    check_tracer(tracer)
    if tracer == "export":
        from fxpipe.frontend.export import export_trace

        if list(leaf_modules or ()):
            warnings.warn(f"leaf_modules={list(leaf_modules)!r} is ignored under tracer='export': torch.export traces "
                          "every module through to ATen ops. Use split_points= to choose where stages begin, or "
                          "tracer='fx' to keep modules whole", stacklevel=3)

        args = example_inputs if isinstance(example_inputs, tuple) else (
            () if example_inputs is None else (example_inputs,))
        try:
            return export_trace(model, args, dict(example_kwargs or {}), device=device, unbatched=frozenset(unbatched),
                                export_dims=export_dims)
        except TraceError as exc:
            if not _detector(model):
                raise
            raise TraceError(f"{exc}{_DETECTOR}", module=exc.module, filename=exc.filename,
                             lineno=exc.lineno) from exc
    if callable(tracer):
        gm = _user_trace(model, tracer)
        _note_mode_branch(model, gm, lambda: _user_trace(model, tracer))
        return gm
    leaf_modules = list(leaf_modules or ())  # None: none, as the default
    bad = [m for m in leaf_modules if not (isinstance(m, str) or (isinstance(m, type) and issubclass(m, nn.Module)))]
    if bad:
        raise TypeError(f"leaf_modules must hold nn.Module classes or qualified module names, got {bad!r}")
    qualified = {name for name, _ in model.named_modules()}
    classes = {type(m).__name__: type(m) for _, m in model.named_modules()}  # 'Downsample2D' is the class
    by_class = {m for m in leaf_modules if isinstance(m, str) and m not in qualified and m in classes}
    leaf_types = tuple(m for m in leaf_modules if isinstance(m, type)) + tuple(classes[m] for m in sorted(by_class))
    leaf_names = frozenset(m for m in leaf_modules if isinstance(m, str)) - by_class
    unknown = sorted(leaf_names - qualified)
    if unknown:
        raise ValueError(f"leaf_modules names {unknown} that are not submodules of "
                         f"{type(model).__name__}, nor the class name of one; use names from model.named_modules() "
                         "or the classes of its submodules")
    _refuse_wrapped_forward(model)
    _refuse_tensor_defaults(model, concrete_args)
    versions = state_versions(model)
    gm, concrete_args = _fx_trace_fixing(model, leaf_types, leaf_names, concrete_args, example_inputs, example_kwargs)
    name = model.__class__.__name__
    if entries := unread_none_entries(model, gm, example_inputs, example_kwargs):
        warnings.warn(f"{', '.join(entries)} of {name}'s inputs {'is' if len(entries) == 1 else 'are'} None in the "
                      "example, and torch.fx traced it as a value that nothing in the graph reads: if forward checks it (`if batch['extra'] is not None:`), "
                      "the check held while traced and the pipe runs the code under it for every call, where eager "
                      "skips it. Use tracer='export', which traces the code the model runs on its example, or pass "
                      "it as an input of its own (fxpipe fixes an unread None input to None)",
                      stacklevel=user_stacklevel())
    _note_mode_branch(model, gm, lambda: _fx_trace(model, leaf_types, leaf_names, concrete_args))
    refuse_writes_while_tracing(model, versions)  # a loop over .parameters() ran once, on the real weights
    if detach_no_grad_blocks(gm):
        log.info("%s: the values leaving its torch.no_grad() blocks are detached", name)
    if fresh := fresh_constants(gm):
        log.info("%s: the constants it writes in place are made anew on each call: %s", name, ", ".join(fresh))
    if run_under_autocast(gm):
        log.info("%s: the calls inside its own torch.autocast blocks run under them", name)
    log.debug("traced %s: %d nodes", name, len(gm.graph.nodes))
    return gm


def _fx_trace_fixing(model: nn.Module, leaf_types: tuple[type, ...], leaf_names: frozenset[str],
                     concrete_args: dict[str, Any] | None, example_inputs: Any,
                     example_kwargs: dict[str, Any] | None) -> tuple[torch.fx.GraphModule, dict[str, Any] | None]:
    """Trace with fx; where that fails, again with the constant inputs fixed (:mod:`.constinputs`).

    A trace that passed is traced again with its ``None`` inputs fixed (:func:`none_inputs`), where
    that fails with the flags fixed too (:func:`_none_trace`).
    """
    try:
        gm = _fx_trace(model, leaf_types, leaf_names, concrete_args)
    except TraceError as exc:
        first = exc
    else:
        given = example_inputs not in (None, ()) or bool(example_kwargs)  # without examples a default may be a tensor
        nones = none_inputs(model, gm, example_inputs, example_kwargs, concrete_args, read_too=given)
        if not nones:
            return gm, concrete_args
        refuse_name_clash(model, nones)  # before _none_trace, which would tell it as eager's path not tracing
        try:  # a check `is not None` held for the traced value and kept code eager skips: trace eager's path
            gm, nones = _none_trace(model, leaf_types, leaf_names, concrete_args, nones,
                                    constant_inputs(model, example_inputs, example_kwargs, concrete_args))
        except TraceError as exc:  # the code eager runs for None does not trace; the first graph runs other code
            listed = ", ".join(f"{n}=None" for n in sorted(nones))
            raise TraceError(f"{exc}\n(Traced with {listed} fixed, the value in the example, as eager runs it: torch.fx "
                             "traces an input as a value, for which a check `is not None` holds, so the first trace "
                             "kept code eager skips for None. Use tracer='export', which traces the code the model "
                             "runs on its example, or give it an example tensor if the pipe will take one)",
                             module=exc.module, filename=exc.filename, lineno=exc.lineno) from None
        log.info("%s traced with its inputs %s fixed (a check `is not None` holds for a traced value)",
                 type(model).__name__, _listed(nones))
        gm.meta["fxpipe.fixed_by_example"] = _fixed_by_example(model, nones)
        return gm, {**(concrete_args or {}), **nones}
    fixed = constant_inputs(model, example_inputs, example_kwargs, concrete_args)
    if not fixed:
        raise first
    fixed.update(concrete_args or {})
    try:
        gm = _fx_trace(model, leaf_types, leaf_names, fixed)
    except TraceError as again:  # past the first failure, or not: say both, the later one first
        if (again.filename, again.lineno) == (first.filename, first.lineno):
            raise first from None
        raise TraceError(f"{again}\n(Traced with {_listed(fixed)} fixed as constants, since with them as inputs "
                         f"tracing failed earlier, at {first.filename}:{first.lineno}: {str(first).splitlines()[0]})",
                         module=again.module, filename=again.filename, lineno=again.lineno) from None
    log.info("%s traced with its inputs %s fixed as constants (concrete_args=)", type(model).__name__, _listed(fixed))
    gm.meta["fxpipe.fixed_by_example"] = _fixed_by_example(
        model, {k: v for k, v in fixed.items() if k not in (concrete_args or {})})
    return gm, fixed


def _fixed_by_example(model: nn.Module, fixed: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Return ``{input: (value fixed, forward's default)}``: a call leaving one out gets the default in eager, refused.

    An input without a default has ``inspect.Parameter.empty`` there: leaving it out is refused as missing.
    """
    params = inspect.signature(model.forward).parameters
    return {k: (v, params[k].default) for k, v in fixed.items() if k in params}


def _none_trace(model: nn.Module, leaf_types: tuple[type, ...], leaf_names: frozenset[str],
                concrete_args: dict[str, Any] | None, nones: dict[str, None],
                constants: dict[str, Any]) -> tuple[torch.fx.GraphModule, dict[str, Any]]:
    """Trace with ``nones`` fixed; where that fails, with every constant input fixed (``constants``: flags too).

    ``if mask is not None or is_causal:`` (timm's ViT) reads the flag only once ``mask`` is
    ``None``: traced as a value there, it fails, as a constant it traces. Returns the graph and
    what it fixed; raises the first failure where both fail.
    """
    try:
        return _fx_trace(model, leaf_types, leaf_names, {**(concrete_args or {}), **nones}), dict(nones)
    except TraceError as exc:
        if not set(constants) - set(nones):
            raise
        first = exc
    try:
        return _fx_trace(model, leaf_types, leaf_names, {**(concrete_args or {}), **nones, **constants}), \
            {**nones, **constants}
    except TraceError:
        raise first from None


def _listed(fixed: dict[str, Any]) -> str:
    """Write fixed inputs as ``name=value`` pairs."""
    return ", ".join(f"{k}={v!r}" for k, v in fixed.items())


def _fx_trace(model: nn.Module, leaf_types: tuple[type, ...], leaf_names: frozenset[str],
              concrete_args: dict[str, Any] | None) -> torch.fx.GraphModule:
    """Trace ``model`` with fxpipe's fx tracer; return the GraphModule."""
    refuse_name_clash(model, concrete_args)
    fx_tracer = _Tracer(leaf_types, leaf_names)
    drawn: list[str] = []
    flipped: list[str] = []
    try:
        # pipe_split() calls become marker nodes; assignments to buffers, in-place copies; nodes
        # made with grad mode off (a forward's torch.no_grad() blocks) or inside autocast blocks are marked
        with recording_markers(fx_tracer), recording_assignments(fx_tracer), torch.enable_grad(), \
                recording_autocast_blocks(), recording_python_random(drawn), no_proxies_left(model), \
                flags_kept(model, flipped), watching_functions() as functions, tracing_tensor_makers(), \
                warnings.catch_warnings():
            # a reentrant torch.utils.checkpoint sees Proxies, none requiring grad: its warning is the trace's
            warnings.filterwarnings("ignore", message="None of the inputs have requires_grad=True")
            graph = fx_tracer.trace(model, concrete_args=concrete_args)
    except Exception as exc:
        raise with_distributions_hint(_explain(model, fx_tracer, exc), exc) from exc
    check_functions(type(model).__name__, functions, "fx")
    warn_python_random(type(model).__name__, drawn, "fx")
    _name_variadic_inputs(graph)
    unmark_wrapped(graph)
    drop_guards(graph)  # concrete_args' guards: the binding checks the values
    _mark_keyword_only(model, graph)
    gm = torch.fx.GraphModule(fx_tracer.root, graph, model.__class__.__name__)
    if flipped and _writes_state(gm):  # a flag guarding no write of the model's state (a warn-once guard): quiet
        warnings.warn(
            f"tracing {type(model).__name__} ran a forward that flipped {', '.join(flipped)} (put back): fx keeps the "
            "path of that one call, so if the branch it took initialises the module from the data (an ActNorm, a "
            "codebook set from the first batch), every step runs it again on each micro-batch. Run one eager "
            "forward on a real batch before fxpipe.compile (the module initialises itself, and the trace takes the "
            "path of an initialised module)", stacklevel=user_stacklevel())
    register_graph_records(gm)  # a record the model builds is split, sent and joined field by field
    return gm


def _writes_state(gm: torch.fx.GraphModule) -> bool:
    """Tell whether ``gm`` writes a parameter or buffer of the model in place (through any alias of it)."""
    return any(n.op == "get_attr" or (n.op == "call_module" and written_args(n))
               for node in gm.graph.nodes
               for n in alias_closure(w for value in written_args(node)
                                      for w in (value if isinstance(value, (list, tuple)) else [value])
                                      if isinstance(w, torch.fx.Node)))


def _name_variadic_inputs(graph: torch.fx.Graph) -> None:
    """Name forward's ``*args`` and ``**kwargs`` placeholders plainly; mark them in ``node.meta["fxpipe.variadic"]``.

    An fx Interpreter gives a placeholder named ``*args`` (or ``**kwargs``) a list of every input
    left, where the graph reads a tuple (or a dict): each becomes one input, bound to what a call
    leaves for it (:func:`fxpipe.passes.bind_placeholders`).
    """
    for node in graph.nodes:
        if node.op == "placeholder" and str(node.target).startswith("*"):
            target = str(node.target)
            node.meta["fxpipe.variadic"] = target[:len(target) - len(target.lstrip("*"))]
            node.target = target.lstrip("*")


def _mark_keyword_only(model: nn.Module, graph: torch.fx.Graph) -> None:
    """Mark the placeholders of forward's keyword-only inputs (``node.meta["fxpipe.keyword_only"]``).

    A call binds them by keyword only, as eager does (:func:`fxpipe.passes.bind_placeholders`).
    """
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # a forward without a signature: bound by position, as before
        return
    for node in graph.nodes:
        name = str(node.target)
        if name not in params and name.endswith("_1"):  # torch.fx's placeholder of a fixed input: `flag_1`
            name = name[:-2]
        if node.op == "placeholder" and getattr(params.get(name), "kind", None) is inspect.Parameter.KEYWORD_ONLY:
            node.meta["fxpipe.keyword_only"] = True


def _user_trace(model: nn.Module, tracer: Callable[[nn.Module], torch.fx.GraphModule]) -> torch.fx.GraphModule:
    """Trace ``model`` with a user's tracer (Hugging Face's, timm's); refuse anything but a GraphModule."""
    gm = tracer(model)
    if not isinstance(gm, torch.fx.GraphModule):
        raise TypeError(f"tracer={getattr(tracer, '__name__', tracer)!r} returned "
                        f"{type(gm).__name__}; a tracer must return a torch.fx.GraphModule")
    return gm


def _note_mode_branch(model: nn.Module, gm: torch.fx.GraphModule, retrace: Callable[[], torch.fx.GraphModule]) -> None:
    """Merge the other mode's graph into ``gm``; where it cannot be, record in ``gm.meta`` what keeps them apart."""
    branch = _mode_branch(model, gm, retrace)
    if branch is not None:  # the graph holds the branch of this mode: the other mode is refused
        gm.meta["fxpipe.training"] = model.training
        gm.meta["fxpipe.mode_branch"] = branch


def _mode_branch(model: nn.Module, gm: torch.fx.GraphModule, retrace: Callable[[], torch.fx.GraphModule]) -> str | None:
    """Trace again in the other mode and merge that graph into ``gm``; return what keeps them apart, or None.

    A forward that branches on ``self.training`` in code the tracer traces through (a drop path,
    ``F.dropout(training=self.training)``) gets the branch of the mode it was traced in fixed
    in its graph; :func:`fxpipe.passes.modes.merge_modes` makes the graph read the mode when it
    runs. The leaf modules (dropout, batch norm) read the mode themselves, and leave no difference.
    """
    if not may_read_mode(model):
        return None
    try:
        with in_other_mode(model), quieted("fxpipe.frontend.assign", "fxpipe.frontend.pyrandom"):
            other = retrace()
    except Exception as exc:  # noqa: BLE001 - the other mode cannot be traced: it is refused
        log.debug("tracing %s in the other mode failed: %s", type(model).__name__, exc)
        return f"no graph: tracing it in the other mode failed ({type(exc).__name__})"
    return merge_modes(gm, other, model.training)


def _hugging_face(model: nn.Module) -> str:
    """Return a note on Hugging Face models for a model of the transformers package, else ''."""
    if not type(model).__module__.startswith("transformers."):
        return ""
    return ("\nHugging Face transformers 5 dropped its torch.fx tracer (transformers.utils.fx), and its models "
            "branch on shapes and wrap forward in decorators, which torch.fx cannot trace: use "
            "tracer='export' with example_inputs= (or example_kwargs=) holding the model's inputs.")


def _refuse_wrapped_forward(model: nn.Module) -> None:
    """Refuse a forward that a decorator wraps in ``(*args, **kwargs)``: torch.fx cannot see its arguments.

    torch.fx reads the arguments off the code of ``forward`` itself: it gets the wrapper's
    ``*args, **kwargs``, not the wrapped function's names, and either fails
    (``co_varnames is too small``) or traces every input as one tuple.
    """
    forward = type(model).forward
    inner = inspect.unwrap(forward)
    varargs = inspect.CO_VARARGS | inspect.CO_VARKEYWORDS
    code, inner_code = getattr(forward, "__code__", None), getattr(inner, "__code__", None)
    if inner is forward or code is None or inner_code is None:
        return
    if code.co_flags & varargs and not inner_code.co_flags & inspect.CO_VARARGS:
        name = type(model).__name__
        raise TraceError(
            f"cannot trace {name} with torch.fx: its forward is wrapped by a decorator taking "
            f"(*args, **kwargs) ({_qualname(forward)}), so torch.fx cannot see the arguments of "
            f"{name}.forward ({_arguments(inner)}). Use tracer='export' (torch.export runs the "
            "decorated forward on example_inputs=), or trace a submodule whose forward is not "
            f"wrapped.{_hugging_face(model)}")


def refuse_parallel_wrapper(model: nn.Module) -> None:
    """Refuse a model already wrapped in DDP, FSDP (1 or 2) or DataParallel, or tensor-parallelized, naming the fix."""
    wrappers: list[type] = [nn.DataParallel]
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.nn.parallel import DistributedDataParallel
        wrappers += [DistributedDataParallel, FullyShardedDataParallel]
    except ImportError:  # a torch built without distributed
        pass
    if isinstance(model, tuple(wrappers)):
        raise TypeError(f"the model is wrapped in {type(model).__name__}, which fxpipe cannot trace through (its "
                        "forward syncs and scatters across ranks): pass the wrapped model, model.module, and let "
                        "fxpipe add data parallel around each stage with data_parallel=N (data_parallel_shard=True "
                        "for FSDP2)")
    sharded = _fully_sharded(model)
    if sharded is not None:
        raise TypeError(f"fully_shard (FSDP2) was applied to the model ({sharded}), so its parameters are sharded "
                        "DTensors that fxpipe cannot split into stages: compile the model as built, before "
                        "fully_shard, and let fxpipe shard each stage over its replicas with data_parallel=N, "
                        "data_parallel_shard=True")
    distributed = next((name for name, p in model.named_parameters() if _is_dtensor(p)), None)
    if distributed is not None:
        raise TypeError(f"the model's parameter {distributed!r} is a DTensor (parallelize_module or distribute_tensor "
                        "was applied), which fxpipe cannot split into stages: compile the model as built and let "
                        "fxpipe shard each stage with tensor_parallel=N (see docs/guide/tensor-parallel.md)")


def _fully_sharded(model: nn.Module) -> str | None:
    """Return the name of the first module fully_shard (FSDP2) was applied to ('the model' for the root), or None."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        return None
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            return f"module {name!r}" if name else "the model itself"
    return None


def _is_dtensor(t: torch.Tensor) -> bool:
    """Tell whether ``t`` is a DTensor (a parameter sharded by tensor parallel or FSDP2)."""
    return hasattr(t, "placements") and hasattr(t, "to_local")


def _refuse_tensor_defaults(model: nn.Module, concrete_args: dict[str, Any] | None) -> None:
    """Refuse a forward argument whose default is a tensor: torch.fx writes it as a name its code cannot see.

    torch.fx keeps the default as a constant of the graph module, but the generated
    ``forward``'s signature names it before the module exists (``NameError:
    name '_tensor_constant0' is not defined``).
    """
    try:
        params = inspect.signature(type(model).forward).parameters
    except (TypeError, ValueError):
        return
    tensors = [n for n, p in params.items()
               if isinstance(p.default, torch.Tensor) and n not in (concrete_args or {})]
    if tensors:
        name = type(model).__name__
        raise TraceError(
            f"cannot trace {name} with torch.fx: {name}.forward's argument {tensors[0]!r} has a tensor default, "
            "which torch.fx cannot write into the traced code (its NameError: name '_tensor_constant0' is not "
            f"defined). Use tracer='export' (pass {tensors[0]}= in example_kwargs=, or leave it out to trace the "
            "default), or default it to None and make the tensor inside forward")


def _arguments(fn: Any, shown: int = 4) -> str:
    """List the first ``shown`` argument names of ``fn`` after ``self``."""
    names = list(inspect.signature(fn).parameters)[1:]
    return ", ".join(names[:shown]) + (", ..." if len(names) > shown else "")


def _qualname(fn: Any) -> str:
    """Name the function a decorator returned, with its module."""
    wrapper = getattr(fn, "__code__", None)
    return f"{wrapper.co_name} in {os.path.basename(wrapper.co_filename)}" if wrapper else repr(fn)


_DETECTOR = ("\nDetection models (torchvision's Faster R-CNN, RetinaNet, SSD) take lists of images of their own sizes "
             "and select boxes by their values, which neither tracer can pipeline as a whole: pipeline the backbone "
             "(pipe = fxpipe.compile(model.backbone, ...), then model.backbone = pipe) and run the heads after it.")


def detector_note(model: nn.Module) -> str:
    """Return the way to pipeline a detector (its backbone) where ``model`` looks like one, else ``""``."""
    return _DETECTOR if _detector(model) else ""


def _detector(model: nn.Module) -> bool:
    """Tell whether ``model`` looks like a detector: a backbone module plus box heads."""
    return isinstance(getattr(model, "backbone", None), nn.Module) and any(
        isinstance(getattr(model, name, None), nn.Module) for name in ("rpn", "roi_heads", "head", "anchor_generator"))


def _variadic(model: nn.Module) -> bool:
    """Tell whether ``model``'s forward takes ``*args`` or ``**kwargs``."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD) for p in params)


def _explain(model: nn.Module, tracer: _Tracer, exc: BaseException) -> TraceError:
    """Build a TraceError that names the failing module, its source line and the fix."""
    module_path, module_type = "", type(model)
    if tracer.module_stack:
        module_path, module_type = list(tracer.module_stack.values())[-1]
    frame = user_frame(exc)
    where = ""
    if frame is not None:
        line = linecache.getline(frame.filename, frame.lineno or 0).strip()  # no line number: no line
        where = f'\n  File "{frame.filename}", line {frame.lineno}, in {frame.name}\n    {line}'
    type_name = getattr(module_type, "__name__", str(module_type))
    if isinstance(exc, HookOnProxy):
        return refuse_tensor_hook(type(model).__name__, where, module=module_path or None,
                                  filename=frame.filename if frame else None, lineno=frame.lineno if frame else None)
    if "__cuda_array_interface__" in str(exc):  # torch.as_tensor(proxy) by a name fxpipe did not record
        fix = ("A traced value reached torch.as_tensor, torch.asarray or torch.tensor by a name imported from "
               "torch into a helper's module (fxpipe records them called as torch.as_tensor(...), or imported into "
               "the module of a forward): call it as torch.as_tensor(...) there, mark the module calling it as a "
               "leaf (leaf_modules=), or use tracer='export'.")
        what = f"module '{module_path}' ({type_name})" if module_path else f"the top-level module ({type_name})"
        return TraceError(f"cannot trace {type(model).__name__}: {exc}\nTracing failed in {what}:{where}\n{fix}",
                          module=module_path or None, filename=frame.filename if frame else None,
                          lineno=frame.lineno if frame else None)
    if module_path:
        fix = (f"Mark it as a leaf so it runs as one opaque call: "
               f"fxpipe.trace(model, leaf_modules=[{type_name}]) or leaf_modules=[{module_path!r}] "
               f"(fxpipe.compile takes the same leaf_modules=), or make its control flow "
               f"independent of tensor values, or use tracer='export'.")
        what = f"module '{module_path}' ({type_name})"
    else:
        fix = ("The failure is in the top-level forward, which cannot be a leaf: move the "
               "data-dependent part into a submodule and list it in leaf_modules=, fix the "
               "input to a constant (gm = fxpipe.trace(model, concrete_args={'<input>': value}), then "
               "fxpipe.compile(gm, ...)), or use tracer='export', which traces the code the model "
               "runs on example_inputs=.")
        if _detector(model):  # data-dependent heads on a backbone that traces: neither tracer takes the whole
            fix = _DETECTOR.strip()
        elif "cannot be iterated" in str(exc) and _variadic(model):  # `for r in rest`, `extra.items()`
            fix = ("forward takes *args or **kwargs, which torch.fx traces as one value each: reading an entry "
                   "(args[0], kwargs['w']) traces, a loop over them (or len, unpacking) does not. Use "
                   "tracer='export', which traces the entries the example inputs give, or name the inputs in "
                   "forward's signature.")
        what = f"the top-level module ({type_name})"
    return TraceError(f"cannot trace {type(model).__name__}: {exc}\n"
                      f"Tracing failed in {what}:{where}\n{fix}{_hugging_face(model)}",
                      module=module_path or None,
                      filename=frame.filename if frame else None,
                      lineno=frame.lineno if frame else None)


def _in_function_forward() -> bool:
    """Tell whether tracing is inside an autograd Function's forward, which autograd runs with grad off.

    ``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)`` (transformers' gradient
    checkpointing) runs its block so: eager differentiates it, by recomputing, so its values must
    not be detached as a user's ``torch.no_grad()`` block's are, unless the Function was called
    in one. The watched ``apply`` tells (a Function written with ``setup_context`` has no ``ctx``
    in its forward); the frames, where none is watched.
    """
    inside = applying()
    if inside is not None:
        return inside
    frame: Any = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "forward" and isinstance(frame.f_locals.get("ctx"), FunctionCtx):
            return True
        frame = frame.f_back
    return False
