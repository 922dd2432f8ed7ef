"""The ``torch.export`` front end: a flat graph over the model's own named parameters.

``torch.export`` traces the whole program (Python control flow on shapes included) down to
ATen ops. fxpipe exports with dim 0 of every batched input dynamic, since micro-batches change
the batch size, and its other dims automatic (``Dim.AUTO``: dynamic unless the model's code
ties them to the example's size, so a sequence length or an image size may change from step to
step), and takes ``ExportedProgram.module()``: one flat GraphModule whose parameters
and buffers sit under the model's own qualified names (``layer1.0.conv1.weight``) and are
the model's own tensor objects, and whose nodes keep the module they came from in
``nn_module_stack`` (so ``split_points=["layer3"]`` names modules as with the fx front end)::

    model ──torch.export──▶ ExportedProgram ──.module()──▶ GraphModule
      │                                                        │ get_attr "layer1.0.conv1.weight"
      └── Parameter objects ◀──────── the same objects ◀───────┘

So gradients land in the model's ``Parameter`` objects and ``pipe.state_dict()`` has the
model's keys. A model built on ``meta`` is exported with its meta tensors presented as fake
tensors on the example inputs' device (:mod:`fxpipe.frontend.exportmeta`); the graph still refers to
the model's own meta objects, which the stages fill. A model whose modules read
``self.training`` (dropout and batch norm among them) is exported in both modes and the two
graphs merged (:mod:`fxpipe.passes.modes`), so the pipe follows ``pipe.train()`` and
``pipe.eval()``. The graph is fixed to the autocast it was exported under (its casts are fixed
in the graph, and the dtype checks torch.export writes fail without them), and to the dims
torch.export specialised (a conv's channels; a size of 0 or 1): :mod:`fxpipe.runtime.validate`
refuses another autocast, other inputs and a mode that could not be merged, by name.

A model may branch on the batch size for speed only (``if x.shape[0] >= 64: x =
x.contiguous()``, as diffusers' ``Upsample2D`` does): torch.export then refuses an unbounded
batch dim with a ``ConstraintViolationError`` whose message suggests a bound (``max=63``).
fxpipe exports again with that bound (or with ``Dim.AUTO`` when the suggestion cannot be
read), logs a warning naming it, and refuses only when no bound admits the example batch
(the model fixes the batch to a constant). Micro-batches above the bound then fail torch's
guard in the first stage.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import logging
import os
import re
import sys
import tokenize
from collections.abc import Collection, Iterator
from functools import partial
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._pytree import SUPPORTED_NODES, tree_flatten, tree_map

from fxpipe.errors import TraceError, with_distributions_hint
from fxpipe.frontend.autogradfns import check_functions, watching_functions
from fxpipe.frontend.eagerfail import eager_failure
from fxpipe.frontend.exportmeta import fake_inputs, fake_state, meta_refusal, refuse_stand_ins, target_device
from fxpipe.frontend.inferencemode import warn_inference_mode, watching_inference_mode
from fxpipe.frontend.leftovers import no_proxies_left
from fxpipe.frontend.modes import in_other_mode, may_read_mode
from fxpipe.frontend.pyrandom import recording_python_random, warn_python_random
from fxpipe.frontend.quantized import quantized_modules
from fxpipe.frontend.slowexport import telling_if_slow
from fxpipe.frontend.specialised import recording_specialisations, specialising_line
from fxpipe.frontend.tensorhooks import warn_tensor_hooks, watching_tensor_hooks
from fxpipe.frontend.userframe import user_frame
from fxpipe.passes.annotate import same_constant
from fxpipe.passes.batchrows import sequence_first_modules
from fxpipe.passes.modes import merge_modes
from fxpipe.passes.records import register_record_type, register_records

__all__ = ["export_trace", "named_arguments"]

log = logging.getLogger(__name__)

_UNBOUNDED = 2 ** 63 - 2  # torch's own largest bound of a size
_RECORDS = 8  # exports tried while each names a dataclass to register (nested records name one each)
_UNKNOWN_TYPE = re.compile(r"Found <class '([\w.]+)'> in (output|input)")  # a type pytree cannot flatten


def _registered_record(exc: BaseException) -> bool:
    """Register the dataclass torch.export could not flatten (``exc`` names it); return whether one was."""
    unknown = _UNKNOWN_TYPE.search(str(exc))
    if unknown is None:
        return False
    parts = unknown.group(1).split(".")
    for cut in range(len(parts) - 1, 0, -1):  # the longest prefix that is an imported module
        found: Any = sys.modules.get(".".join(parts[:cut]))
        if found is None:
            continue
        for name in parts[cut:]:
            found = getattr(found, name, None)
        if isinstance(found, type) and dataclasses.is_dataclass(found) and found not in SUPPORTED_NODES:
            register_record_type(found)
            return True
        return False
    return False


def _batched(x: Any) -> bool:
    """Tell whether ``x`` is a tensor split into micro-batches on dim 0."""
    return isinstance(x, torch.Tensor) and x.dim() > 0


def _shapes_like(value: Any, leaf: Any) -> Any:
    """Map ``leaf`` over ``value``'s leaves into the ``dynamic_shapes`` structure torch.export matches it with.

    Python's containers (lists, tuples, named tuples, dicts) keep their type; another pytree
    node (a registered dataclass, a model's output record) is given as the list of its
    children, as torch.export asks (the dataclass itself is refused: ``Node type mismatch``).
    """
    kind = pytree._get_node_type(value)
    if kind not in SUPPORTED_NODES:
        return leaf(value)
    node = SUPPORTED_NODES[kind]
    children, context = node.flatten_fn(value)
    mapped = [_shapes_like(c, leaf) for c in children]
    return node.unflatten_fn(mapped, context) if kind in pytree.BUILTIN_TYPES else mapped


def named_arguments(signature: inspect.Signature, bound: inspect.BoundArguments) -> list[tuple[str, Any]]:
    """Return the bound arguments by name, a ``**kwargs`` parameter's entries by their own names."""
    return [(k, v) for name, value in bound.arguments.items()
            for k, v in (value.items() if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD
                         else [(name, value)])]


def constant_defaults(signature: inspect.Signature, bound: inspect.BoundArguments) -> dict[str, Any]:
    """Return the forward's parameters exported as their default, a constant (``None``, a number, a string), by name.

    An exported graph takes the inputs it was exported with only; a call may still leave out an
    input exported as its default, or pass its default for one left out, as eager allows
    (:func:`fxpipe.passes.bind_placeholders`).
    """
    found = {name: p.default for name, p in signature.parameters.items()
             if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
             and (p.default is None or type(p.default) in (bool, int, float, str))
             and (name not in bound.arguments or same_constant(bound.arguments[name], p.default))}
    var = next((name for name, p in signature.parameters.items() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    if var is not None:  # a **kwargs entry passed as None: as absent to kwargs.get(name), the way such forwards read
        found.update({k: None for k, v in bound.arguments.get(var, {}).items() if v is None})
    return found


def export_trace(model: nn.Module, args: tuple, kwargs: dict, device: Any = None,
                 unbatched: Collection[str] = (), export_dims: str = "auto") -> torch.fx.GraphModule:
    """Export ``model`` with a dynamic batch dim; return the flat GraphModule over its own state.

    The other dims are ``Dim.AUTO`` (``export_dims="auto"``) or the example's (``"batch"``); the
    inputs named in ``unbatched`` have no batch dim (every dim ``Dim.AUTO``, or static). Meta tensors
    of the model (and meta example inputs) are exported as fake tensors on the example inputs'
    device, else on ``device`` (the stages'), else on CPU; see :mod:`fxpipe.frontend.exportmeta`.
    """
    needs = ("tracer='export' needs example_inputs= (or example_kwargs=) holding at least one tensor with a "
             "batch dimension: torch.export traces with them")
    register_records((args, kwargs))  # a dataclass input's tensors are its fields, not one opaque leaf
    if not any(_batched(t) for t in tree_flatten((args, kwargs))[0]):
        raise ValueError(needs)
    scripted: list[str] = []  # the outermost scripted modules
    for name, m in model.named_modules():
        if isinstance(m, torch.jit.ScriptModule) and not any(name.startswith(f"{o}.") for o in scripted):
            scripted.append(name or "the model")
    if scripted:  # torch.export calls its forward with the wrong arguments, blamed on the batch
        raise TraceError(f"torch.export cannot trace {type(model).__name__}: {', '.join(map(repr, scripted[:3]))} "
                         f"{'is a' if len(scripted) == 1 else 'are'} torch.jit.ScriptModule, which it cannot "
                         "export; use tracer='fx' (which calls a scripted module as one call), or build the model "
                         "without torch.jit.script", module=type(model).__name__)
    packed = [name or "the model" for name in quantized_modules(model)]
    if packed:  # packed parameters torch.export cannot flatten, blamed on the batch
        raise TraceError(f"torch.export cannot trace {type(model).__name__}: {', '.join(map(repr, packed[:3]))} "
                         f"{'is a' if len(packed) == 1 else 'are'} quantized module(s) (torch.ao.quantization's "
                         "convert or quantize_dynamic), whose packed parameters it cannot export; use tracer='fx', "
                         "or quantize after training", module=type(model).__name__)
    if any(isinstance(v, torch.Generator) for v in tree_flatten((args, kwargs))[0]):
        raise TraceError(f"torch.export cannot trace {type(model).__name__} with a torch.Generator among its inputs; "
                         "hold it in the module that draws from it (self.gen = torch.Generator() in __init__: "
                         "exported and replayed in recomputation), or use tracer='fx', which takes it as an input",
                         module=type(model).__name__)
    signature = inspect.signature(model.forward)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"the example inputs do not match {type(model).__name__}.forward: {exc}") from None
    whole = {id(t) for name, value in named_arguments(signature, bound) if name in unbatched for t in tree_flatten(value)[0]}

    def split(t: Any) -> bool:  # a tensor split into micro-batches (not an unbatched= input's)
        return _batched(t) and id(t) not in whole

    if not any(split(t) for t in tree_flatten((args, kwargs))[0]):
        raise ValueError(needs + f", besides the unbatched= inputs {sorted(unbatched)}")
    # A batch of one would be specialised to the constant 1; export with two rows instead.
    if any(split(t) and t.shape[0] == 1 for t in tree_flatten((args, kwargs))[0]):
        args, kwargs = tree_map(lambda t: torch.cat([t, t]) if split(t) else t, (args, kwargs))
    rows = next(t.shape[0] for t in tree_flatten((args, kwargs))[0] if split(t))
    # A view (``ids[:, :8]``) would be guarded on its base's sizes, which real inputs do not have; a tensor given
    # twice (example_kwargs={"input_ids": ids, "labels": ids}) would be exported as one input read in both places,
    # so later calls' labels were never read (the input_ids stood in for them, silently): each gets its own copy.
    seen: set[int] = set()

    def own(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        again = id(t) in seen
        seen.add(id(t))
        return t.clone() if again or t._base is not None else t

    args, kwargs = tree_map(own, (args, kwargs))
    bound = signature.bind(*args, **kwargs)
    target = target_device(args, kwargs, device)
    args, kwargs = fake_inputs(args, kwargs, target)

    def dims(name: str, t: Any, *, batch: Any) -> Any:
        """Return the dynamic dims of one input tensor: the batch's, and ``Dim.AUTO`` for the rest under "auto"."""
        free = export_dims == "auto"
        if name in unbatched and isinstance(t, torch.Tensor):
            return {d: torch.export.Dim.AUTO for d in range(t.dim())} if free else None
        if not _batched(t):
            return None
        return {0: batch, **{d: torch.export.Dim.AUTO for d in range(1, t.dim()) if free}}

    def export(batch: Any) -> torch.export.ExportedProgram:
        named = inspect.signature(model.forward).bind(*args, **kwargs)  # **kwargs' entries by name while exported
        dynamic = {name: _shapes_like(value, partial(dims, name, batch=batch)) for name, value in named.arguments.items()}
        with no_proxies_left(model):  # a cache the forward filled holds fake tensors
            return torch.export.export(model, tuple(args), dict(kwargs), dynamic_shapes=dynamic)

    told: set[str] = set()  # the bounds warned of: the other mode's export meets the same
    used: list[Any] = []  # the batch dim a bounded export took: the other mode's export starts from it

    def exported(faked: Any) -> torch.fx.GraphModule:
        for _ in range(_RECORDS):  # each dataclass the model takes or returns unregistered costs one more try
            fixed: list[Any] = []  # the sizes the model's code fixed to a constant, with its line
            try:
                with recording_specialisations(fixed):
                    program = export(used[0] if used else torch.export.Dim("batch", min=1))
                break
            except Exception as exc:  # retried with a bound, or re-raised with the fix
                if _registered_record(exc):
                    continue
                refusal = meta_refusal(model, exc, target, faked) or eager_failure(model, args, kwargs, exc)
                if refusal is not None:
                    raise refusal from exc
                try:
                    program = _bounded(model, export, exc, rows, fixed, told, used)
                except TraceError as refused:
                    listed = _listed_inputs(bound)
                    if not listed:
                        raise
                    raise TraceError(f"input(s) {listed} of {type(model).__name__} are lists of tensors, the likely "
                                     "cause: fxpipe splits every tensor of an input on its own dim 0 into "
                                     "micro-batches, not a list along its length, so if the list is the batch (images "
                                     "the forward stacks), pass it as one stacked tensor instead. What torch.export "
                                     f"met: {refused}", module=refused.module) from exc
                break
        return program.module()

    drawn: list[str] = []
    inference: list[str] = []
    try:
        with fake_state(model, target) as faked, _keywords_by_name(model, signature, bound), \
                telling_if_slow(type(model).__name__, export_dims):
            with recording_python_random(drawn), watching_functions() as functions, watching_tensor_hooks() as hooks, \
                    watching_inference_mode(inference):
                try:
                    gm = exported(faked)
                except TraceError as exc:
                    if drawn:  # random numbers sized by the batch (SpecAugment's NumPy masks) fail on a symbolic batch
                        exc.args = (f"{exc.args[0]}\nThe forward drew Python or NumPy random numbers while traced, at "
                                    f"{', '.join(dict.fromkeys(drawn))}, which no graph keeps (every step would reuse "
                                    "them): draw them with torch, turn them off for training through the pipe (a "
                                    "Hugging Face audio model's mask_time_prob=0, mask_feature_prob=0), or apply them "
                                    "outside it"),
                    raise
            check_functions(type(model).__name__, functions, "export")
            warn_tensor_hooks(type(model).__name__, hooks)
            warn_python_random(type(model).__name__, drawn, "export")
            warn_inference_mode(type(model).__name__, inference)
            difference = _other_mode(model, gm, partial(exported, faked))
    except TraceError:
        _refuse_built_while_tracing(model)  # the likelier cause, and the model is left holding them
        raise
    _refuse_built_while_tracing(model)
    _share_state(gm, model)
    refuse_stand_ins(gm, model)
    gm.meta["fxpipe.tracer"] = "export"
    gm.meta["fxpipe.export_dims"] = export_dims  # "batch": the other dims are the example's, by request
    gm.meta["fxpipe.model_module"] = type(model).__module__  # what a refusal may suggest (no fx for transformers)
    gm.meta["fxpipe.example_device"] = target  # the device the trace ran on, held by the graph's device checks
    if difference is not None:  # the graph keeps this mode's: the other is refused
        gm.meta["fxpipe.training"] = model.training
        gm.meta["fxpipe.mode_branch"] = difference
    gm.meta["fxpipe.autocast"] = enabled_autocast()
    gm.meta["fxpipe.sequence_first"] = sequence_first_modules(model)  # its modules are inlined: their flags kept
    gm.meta["fxpipe.defaults"] = constant_defaults(signature, bound)
    gm.meta["fxpipe.keywords"] = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
    gm.meta["fxpipe.positional"] = [name for name, p in signature.parameters.items() if p.kind in (
        inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]  # a call's positions
    log.debug("exported %s: %d nodes", type(model).__name__, len(gm.graph.nodes))
    return gm


def _other_mode(model: nn.Module, gm: torch.fx.GraphModule, exported: Any) -> str | None:
    """Export ``model`` in its other mode and merge that graph into ``gm``; return what keeps them apart, or None.

    An exported graph holds the mode it was traced in (``aten.dropout(x, p, True)``, a batch
    norm's ``training`` flag and counter, the branches of the model's own code): merged, it
    reads the stage's mode when it runs. Costs a second export, only where a module's source
    mentions ``training``.
    """
    if not may_read_mode(model, torch_nn=True):
        return None
    try:
        with in_other_mode(model):
            other = exported()
    except Exception as exc:  # noqa: BLE001 - the other mode cannot be exported: it stays refused
        log.debug("exporting %s in the other mode failed: %s", type(model).__name__, exc)
        return f"no graph: exporting it in the other mode failed ({type(exc).__name__})"
    return merge_modes(gm, other, model.training)


@contextlib.contextmanager
def _keywords_by_name(model: nn.Module, signature: inspect.Signature, bound: inspect.BoundArguments) -> Iterator[None]:
    """Give ``model.forward`` a signature naming each ``**kwargs`` entry passed, while it is exported.

    torch.export matches ``dynamic_shapes`` against the forward's arguments in one place by the
    signature (``kwargs: {"mask": ...}``) and in another by the names passed (``mask``), and
    fails on a forward taking ``**kwargs``. With the entries named as keyword-only parameters,
    both agree; the model's own forward runs unchanged.
    """
    params = list(signature.parameters.values())
    var = [p.name for p in params if p.kind is inspect.Parameter.VAR_KEYWORD]
    entries = list(bound.arguments.get(var[0], {})) if var else []
    if not entries:
        yield
        return
    forward = model.forward
    named = [p for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD]
    named += [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY) for k in entries]

    def flat(*args: Any, **kwargs: Any) -> Any:
        return forward(*args, **kwargs)

    flat.__signature__ = signature.replace(parameters=named)  # type: ignore[attr-defined]
    own = model.__dict__.get("forward")
    model.__dict__["forward"] = flat
    try:
        yield
    finally:
        if own is None:
            del model.__dict__["forward"]
        else:
            model.__dict__["forward"] = own


def enabled_autocast() -> tuple[tuple[str, torch.dtype], ...]:
    """Return the device types autocast is enabled for in this thread, each with its dtype.

    What an exported graph was traced under, to compare with a step's (only what is enabled
    counts; :func:`fxpipe.runtime.stage.rng.autocast_state` keeps the disabled ones too, to replay).
    """
    return tuple((d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d))


def _bounded(model: nn.Module, export: Any, exc: Exception, rows: int, fixed: list[Any], told: set[str],
             used: list[Any]) -> torch.export.ExportedProgram:
    """Export again with the batch bound torch suggests (or ``Dim.AUTO``) if it admits 1 to ``rows`` rows.

    ``fixed`` holds the sizes the first export fixed to constants, with the model's lines;
    ``told`` the warnings given already (once per compile, not once per mode exported); ``used``
    is set to the batch dim exported with.
    """
    if "Constraints violated" not in str(exc):
        raise _refusal(model, exc) from exc
    suggested = _suggested_batch(str(exc))
    if isinstance(suggested, int):  # specialised to a constant: no bound keeps the batch dynamic
        raise _refusal(model, exc, where=specialising_line(fixed, suggested)) from exc
    lo: int
    hi: int | None
    try:
        if suggested is not None:
            lo, hi = suggested
            _admit(model, exc, lo, hi, rows)
            dim = torch.export.Dim("batch", min=1, max=hi)
            program = export(dim)
        else:
            dim = torch.export.Dim.AUTO
            program = export(dim)
            lo, hi = _batch_range(program)
    except TraceError:
        raise
    except Exception as again:
        raise _refusal(model, again) from again
    _admit(model, exc, lo, hi, rows)
    used[:] = [dim]
    if hi is not None and hi < _UNBOUNDED:
        said = (f"torch.export refused an unbounded batch dimension for {type(model).__name__} (the model branches "
                f"on the batch size); exported with the batch bounded to [1, {hi}] as torch suggests: micro-batches "
                "of more rows fail torch's guard in the first stage")
    else:  # no upper bound: the constraint is elsewhere (a size it must not take)
        said = (f"torch.export refused a batch dimension free of constraints for {type(model).__name__} (the model's "
                "code constrains the batch size); exported with it automatic: the graph's guards check each "
                "micro-batch's size at the step, and refuse a size they do not admit, naming it")
    if said not in told:
        told.add(said)
        log.warning("%s", said)
    return program


def _admit(model: nn.Module, exc: Exception, lo: int, hi: int | None, rows: int) -> None:
    """Refuse a bound that leaves out the example batch or smaller micro-batches (None: a constant)."""
    if hi is None:
        raise _refusal(model, exc) from exc
    if lo > 2 or rows > hi:  # torch bounds sizes below 2 apart (0/1 specialisation); 1 row still runs
        upper = "inf" if hi >= _UNBOUNDED else str(hi)
        raise _refusal(model, exc, f"torch.export admits only a batch in [{lo}, {upper}] for this example, "
                                   f"but fxpipe runs micro-batches of 1 to {rows} rows. Export with "
                                   "a smaller example batch (the bound follows the example), or ") from exc


def _suggested_batch(message: str) -> tuple[int, int] | int | None:
    """Read torch's suggested fix for the batch dim: a (min, max) range, a constant, or None."""
    from torch.export.dynamic_shapes import refine_dynamic_shapes_from_suggested_fixes

    head = message.split("\n\n")[0]  # the fixes, without the advice that follows them
    batch = torch.export.Dim("batch", min=1)
    try:
        refined = refine_dynamic_shapes_from_suggested_fixes(head, {"x": {0: batch}})
    except Exception:  # noqa: BLE001 - a message this version cannot read: try Dim.AUTO
        return None
    dim: Any = refined["x"][0]  # type: ignore[call-overload, index]
    if isinstance(dim, int):
        return dim
    if dim is batch or getattr(dim, "__name__", None) != "batch":
        return None  # no suggestion about the batch
    return _size(dim.min), _size(dim.max)


def _listed_inputs(bound: inspect.BoundArguments) -> list[str]:
    """Return the names of the inputs that are lists or tuples of two or more tensors."""
    return [name for name, value in bound.arguments.items() if isinstance(value, (list, tuple)) and len(value) > 1
            and all(isinstance(t, torch.Tensor) for t in value)]


def _batch_range(program: torch.export.ExportedProgram) -> tuple[int, int | None]:
    """Return the range of the first batched input's dim 0 in ``program`` (no max: a constant)."""
    for node in program.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder" and isinstance(val, torch.Tensor) and val.dim() > 0 \
                and node.name not in program.graph_signature.inputs_to_parameters \
                and node.name not in program.graph_signature.inputs_to_buffers:
            size = val.shape[0]
            if isinstance(size, int):
                return size, None
            vr = program.range_constraints[size.node.expr]
            return _size(vr.lower), _size(vr.upper)
    return 1, None


def _size(bound: Any) -> int:
    """Return a bound of a size as an int (torch's and sympy's infinities as ``_UNBOUNDED``)."""
    try:
        return min(int(bound), _UNBOUNDED)
    except (TypeError, ValueError, AttributeError, OverflowError):
        return _UNBOUNDED


_UNEQUAL_ROWS = re.compile(r"L\['(\w+)'\]\.size\(\)\[0\] = (\d+) is not equal to L\['(\w+)'\]\.size\(\)\[0\] = (\d+)")
_FACTORY = re.compile(r"\btorch\.(randn|rand|randint|empty|zeros|ones|full|normal)\(")


def _refusal(model: nn.Module, exc: BaseException, fix: str = "", where: str = "") -> TraceError:
    """Explain that torch.export cannot keep the batch dim dynamic for ``model`` (or flatten what it returns)."""
    return with_distributions_hint(_refused(model, exc, fix, where), exc)


def _prefix_tuned(model: nn.Module) -> bool:
    """Tell whether ``model`` is a PEFT model with a prefix-tuning adapter (its prefixes go in as a cache)."""
    configs = getattr(model, "peft_config", None)
    return isinstance(configs, dict) and any(
        str(getattr(c, "peft_type", "")).endswith("PREFIX_TUNING") for c in configs.values())


def _refused(model: nn.Module, exc: BaseException, fix: str, where: str) -> TraceError:
    """Explain that torch.export cannot keep the batch dim dynamic for ``model`` (the text of :func:`_refusal`)."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    unknown = _UNKNOWN_TYPE.search(first)
    if unknown is not None and not fix and _prefix_tuned(model):
        return TraceError(
            f"torch.export could not trace {type(model).__name__}: PEFT's prefix tuning hands the model its prefixes "
            f"as a key/value cache ({unknown.group(1)}) at every call, use_cache=False or not, and torch.export "
            "cannot flatten it into tensors. Prefix tuning cannot be pipelined; prompt tuning (PromptTuningConfig) "
            "or LoRA can. The full torch.export error is chained below.")
    if unknown is not None and not fix:
        cls, where = unknown.group(1), unknown.group(2)
        return TraceError(
            f"torch.export could not trace {type(model).__name__}: its {where} holds a {cls}, which torch.export "
            f"cannot flatten into tensors. Make the model take and return tensors only: a Hugging Face model "
            f"returns its key/value cache unless asked not to, so pass example_kwargs={{'use_cache': False}} and the same "
            f"use_cache=False to pipe.step and pipe(...) (a config's use_cache=False does not reach every "
            f"encoder-decoder's decoder); or register {cls} with "
            "torch.utils._pytree.register_pytree_node. The full torch.export error is chained below.")
    if not fix and ("data-dependent" in first or type(exc).__name__ == "GuardOnDataDependentSymNode"):
        return _value_branch(model, exc, first)
    if not fix and "fake tensor in the exported program constant" in first:  # a write through .data, typically
        return TraceError(
            f"torch.export could not trace {type(model).__name__}: {first} This is what a write through a "
            "tensor's .data makes (self.ema.data.mul_(0.9), older EMA and codebook code): write the tensor itself "
            "inside torch.no_grad() (self.ema.mul_(0.9)), which is the same in eager, or use tracer='fx'. The full "
            "torch.export error is chained below.")
    frame = user_frame(exc) if type(exc).__module__ == "builtins" else None
    if not fix and "Couldn't swap" in first:  # Module.to() / .float() in the forward: it swaps the parameters
        at = f" at {frame.filename}:{frame.lineno} ({(frame.line or '').strip()})" if frame is not None else ""
        return TraceError(
            f"torch.export could not trace {type(model).__name__}: its forward moves or casts a submodule{at} "
            f"({first}), which swaps the submodule's parameters while torch.export holds them. Cast or move the "
            "model once before fxpipe.compile and take the call out of the forward, or use tracer='fx' where the "
            "model is not a transformers 5 model. The full torch.export error is chained below.")
    line = f"The model's code fixes the batch size to a constant{where}. " if where else ""
    made = frame is not None and "concrete integers" in str(exc) and _FACTORY.search(frame.line or "")
    if frame is not None and not fix and re.search(r"\b(np|numpy)\.", frame.line or ""):  # host code on sizes
        return _numpy_line(model, exc, frame, first)
    if frame is not None and not fix and "unhashable type" in str(exc) and "SymInt" in str(exc):  # set(sizes)
        return TraceError(
            f"torch.export could not trace {type(model).__name__}: its forward puts sizes or values read from "
            f"tensors in a set or a dict's keys at {frame.filename}:{frame.lineno} ({(frame.line or '').strip()}; "
            f"{first}). torch.export traces them as symbols, which cannot be hashed (eager holds numbers). Rewrite "
            "the line without hashing them (compare with min() and max(), say), or compute it outside the pipe and "
            "pass its result in as an input. The full torch.export error is chained below.")
    if frame is not None and not fix and "'dict' object has no attribute" in str(exc):  # a mapping read by name
        return TraceError(
            f"torch.export could not trace {type(model).__name__}: its forward raised AttributeError: {first} at "
            f"{frame.filename}:{frame.lineno} ({(frame.line or '').strip()}). Under tracer='export' fxpipe gives "
            "a mapping input (a tokenizer's BatchEncoding, an OrderedDict) to the forward as a plain dict, which "
            "the exported graph reads by key: read its entries by key (enc['input_ids']), or use tracer='fx', "
            "which passes it as it is. The full torch.export error is chained below.")
    if frame is not None and not fix:  # the model's own code raised: say where, and that eager should run
        first = (f"its forward raised {type(exc).__name__}: {first} at {frame.filename}:{frame.lineno} "
                 f"({(frame.line or '').strip()})" + ("" if made else ". Check that the model runs eagerly on the "
                                                      "example inputs; if it does, that line may depend on the "
                                                      "batch size"))
    if made and not fix:  # torch.randn(shape, layout=...): a tensor sized by a tuple, not a batch-dependent model
        fix = ("a tensor made from a shape tuple with a symbolic batch size cannot be traced there (the model "
               "does not depend on the batch size): make it from a tensor of the batch instead (torch.randn_like(t), "
               "t.new_zeros(...)), or draw it outside the pipe and pass it in; otherwise ")
    if not fix and "Constraints violated" in str(exc) and any(isinstance(m, nn.RNNBase) for m in model.modules()):
        # an input's dim 0 the batch's, which an RNN reads as its layers: h0 of (layers, batch, hidden)
        fix = ("fxpipe splits dim 0 of every input into micro-batches: an input given to an RNN as its initial "
               "state (h0, c0), of shape (layers * directions, batch, hidden), must be passed batch-first, the dim "
               "moved inside the forward (h0.transpose(0, 1).contiguous()); otherwise ")
    unequal = _UNEQUAL_ROWS.search(str(exc))
    if not fix and unequal is not None:  # an input of other rows than the batch: an edge_index [2, E], a table
        name, rows, other, batch = unequal.groups()
        fix = (f"input '{name}' has {rows} rows on dim 0 where '{other}' has {batch}, and fxpipe splits dim 0 of "
               f"every input into micro-batches: an input that is not one row per sample (an edge_index [2, E], "
               f"a lookup table) goes whole to every micro-batch when named in unbatched=['{name}']; otherwise ")
    fix = fix or ("fxpipe splits dim 0 of every input into micro-batches, so the model must not "
                  "depend on the batch size; otherwise ")
    if type(model).__module__.startswith("diffusers."):  # whose models fx rarely traces
        other = ("pipeline a submodule without that line (an autoencoder's encoder and decoder, with the sampling "
                 "between them in your code); tracer='fx' cannot trace most diffusers models")
    elif type(model).__module__.startswith("transformers."):  # whose models fx cannot trace
        lossy = ("; the line computes a loss over the whole batch's rows (CLIP's contrastive loss, "
                 "return_loss=True): leave the loss out of the model and compute it from the logits in loss_fn "
                 "(with chunks=1 it sees the whole batch)") if "loss" in where.lower() else ""
        other = ("pipeline a submodule without that code (a vision-language model's language model, fed "
                 f"inputs_embeds), or rewrite the line so it does not depend on the batch size{lossy}; tracer='fx' "
                 "cannot trace transformers 5 models")
    else:
        other = "use the fx front end (tracer='fx'), whose graph is shape-generic"
    return TraceError(
        f"torch.export could not trace {type(model).__name__} with a dynamic batch dimension: "
        f"{first}\n{line}{fix}{other}. The full torch.export error is chained below.")


def _numpy_line(model: nn.Module, exc: BaseException, frame: Any, first: str) -> TraceError:
    """Explain that the model's forward runs NumPy on traced values, which torch.export cannot trace."""
    spec = (" (Wav2Vec2-style SpecAugment draws its masks with NumPy in training mode: set the config's "
            "mask_time_prob=0 and mask_feature_prob=0, or apply_spec_augment=False, and mask the inputs in your own "
            "code before the pipe)" if "mask" in frame.name.lower() else "")
    return TraceError(
        f"torch.export could not trace {type(model).__name__}: its forward runs NumPy at {frame.filename}:"
        f"{frame.lineno} ({(frame.line or '').strip()}; {type(exc).__name__}: {first}). Eager runs NumPy on real "
        "numbers; torch.export traces with symbolic sizes, which NumPy cannot take. Compute that part outside the "
        f"pipe and pass its result in as an input, or write it with torch ops{spec}. The full torch.export error "
        "is chained below.")


def _value_branch(model: nn.Module, exc: BaseException, first: str) -> TraceError:
    """Explain that the model branches on a tensor's value, which no export keeps (batch size aside)."""
    frame = user_frame(exc)
    where = f" at {frame.filename}:{frame.lineno} ({(frame.line or '').strip()})" if frame else ""
    in_transformers = type(model).__module__.startswith("transformers.") or (
        frame is not None and f"{os.sep}transformers{os.sep}" in frame.filename)  # a wrapper's transformers model
    fx = ("; a transformers 5 model cannot use tracer='fx': pipeline a submodule without the branch, or give "
          "inputs or a config for which the model does not take it" if in_transformers
          else f", or move it into a submodule of its own and use the fx front end (tracer='fx') with that submodule in "
          f"leaf_modules= (the branch is in {type(model).__name__}.forward itself, which cannot be a leaf)"
          if frame and _in_forward(model, frame)
          else ", or use the fx front end (tracer='fx') with the module holding the branch in leaf_modules=")
    labels = (" The branch reads labels=: a model checking its labels in forward (Wav2Vec2ForCTC's "
              "`labels.max() >= vocab_size`) traces without them; leave labels= out and compute the loss from the "
              "output in loss_fn=, with the labels as target=." if frame and _reads_labels(
                  model, frame.line or "", made_from=_in_forward(model, frame)) else "")
    line = (frame.line or "").strip() if frame else ""
    if line and not re.match(r"(if|elif|while|assert)\b", line) and " if " not in line and ".item()" not in line \
            and "int(" not in line and "bool(" not in line:  # a size computed as a tensor (Longformer's torch.div)
        return TraceError(
            f"torch.export could not trace {type(model).__name__}: its forward uses a tensor's value as a size or "
            f"index{where} ({first}). torch.export records one path with symbolic sizes and cannot take a size read "
            "from a tensor's value, such as one computed with tensor ops on sizes (torch.div(x.size(1), w)). Compute "
            f"it from sizes with Python integers (x.size(1) // w){fx}.{labels} The full torch.export error is chained "
            "below.")
    return TraceError(
        f"torch.export could not trace {type(model).__name__}: its forward branches on a tensor's value{where} "
        f"({first}). torch.export records one path and cannot keep a branch on values (an `if x.any():` or "
        f"`.item()`), with any batch size. Rewrite the branch without Python control flow (torch.where, "
        f"torch.cond){fx}.{labels} The full torch.export error is chained below.")


def _in_forward(model: nn.Module, frame: Any) -> bool:
    """Tell whether ``frame`` (a traceback's summary) is in the model's own ``forward``, not a submodule's."""
    try:
        lines, start = inspect.getsourcelines(type(model).forward)
        source = inspect.getsourcefile(type(model).forward)
    except (OSError, TypeError):
        return False
    return (source is not None and os.path.realpath(source) == os.path.realpath(frame.filename)
            and start <= (frame.lineno or 0) < start + len(lines))


def _reads_labels(model: nn.Module, line: str, made_from: bool = False) -> bool:
    """Tell whether a source line reads the forward's ``labels`` input (as code: not a comment's or string's word).

    ``made_from``: the line is in the model's own forward, where a name holding ``label``
    (DeBERTa's ``label_index``, made from ``labels`` in its loss code) counts too.
    """
    try:
        if "labels" not in inspect.signature(model.forward).parameters:
            return False
    except (TypeError, ValueError):
        return False
    try:
        for token in tokenize.generate_tokens(io.StringIO(line.strip()).readline):
            if token.type == tokenize.NAME and (token.string == "labels" or made_from and "label" in token.string):
                return True
    except (tokenize.TokenError, SyntaxError):  # a line cut off mid-statement: the names before it counted
        pass
    return False


def _share_state(gm: torch.fx.GraphModule, model: nn.Module) -> None:
    """Make every parameter and buffer of ``gm`` the model's own object of the same name."""
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    for registry, own in (("_parameters", params), ("_buffers", buffers)):
        for name, t in list(getattr(gm, "named_" + registry[1:])(remove_duplicate=False)):
            if name in own and own[name] is not t:
                prefix, _, leaf = name.rpartition(".")
                getattr(gm.get_submodule(prefix), registry)[leaf] = own[name]


def _refuse_built_while_tracing(model: nn.Module) -> None:
    """Refuse a model whose forward built parameters or buffers while traced: they hold no data (fake tensors)."""
    from torch._subclasses.fake_tensor import is_fake

    built = [name for name, t in (*model.named_parameters(), *model.named_buffers()) if is_fake(t)]
    if built:
        raise TraceError(
            f"{type(model).__name__}'s forward built {', '.join(built[:4])}{' ...' if len(built) > 4 else ''} while "
            "torch.export traced it (a submodule made on the first call, self.extra = nn.Linear(...), or a lazy "
            "module's parameters): made inside the trace, they hold no data. Run one forward on a real batch "
            "before fxpipe.compile, so the model builds them itself, then compile; build the model again first, "
            "as this one now holds them without data")
