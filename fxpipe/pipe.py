"""The :class:`Pipe` module: a compiled model, called and trained like the model."""

from __future__ import annotations

import copy
import logging
import warnings
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.utils._pytree import keystr, tree_flatten_with_path

from fxpipe.errors import ModelChangedError, PipelineInputError
from fxpipe.plan.pipeline import PipelinePlan
from fxpipe.runtime.contract import Runtime
from fxpipe.runtime.drift import changes, describe, replaced, snapshot, untied
from fxpipe.runtime.microbatch import is_summed, summed
from fxpipe.runtime.stage.reshare import reshare

__all__ = ["Pipe"]

_REQUIRED: Any = object()  # pipe.step's target= or loss_fn= left out: refused naming what it takes

log = logging.getLogger(__name__)


class Pipe(nn.Module):
    """A model split into pipeline stages; call it like the model, train it like the model.

    Its parameters, buffers and submodules are the model's own, under the model's own names:
    ``pipe.state_dict().keys() == model.state_dict().keys()`` and gradients land in the
    model's ``Parameter`` objects. On a rank of the distributed runtime the model holds only
    this rank's tensors (the others are on ``meta``), and ``state_dict()`` has only their FQNs.
    """

    owned: frozenset[str] | None  # the FQNs this process holds; None: all of them
    _model: nn.Module
    _gm: torch.fx.GraphModule
    plan: PipelinePlan
    stages: list[torch.fx.GraphModule]
    devices: list[torch.device]

    def __init__(self, model: nn.Module, gm: torch.fx.GraphModule, plan: PipelinePlan,
                 stages: Sequence[torch.fx.GraphModule], devices: Sequence[torch.device],
                 runtime: Runtime, owned: Iterable[str] | None = None) -> None:
        super().__init__()
        # Share the model's registries, so names, state_dict and train() are the model's.
        self._parameters = model._parameters
        self._buffers = model._buffers
        self._modules = model._modules
        self._non_persistent_buffers_set = model._non_persistent_buffers_set
        self.training = model.training
        self.__dict__["_model"] = model
        self.__dict__["_gm"] = gm
        # Through __dict__: the model may own submodules of these names (timm's ``stages``).
        self.__dict__["plan"] = plan
        self.__dict__["stages"] = list(stages)
        for stage in self.stages:  # a graph reading the mode reads its stage's flag (not the model's modules')
            stage.training = model.training
        self.__dict__["devices"] = list(devices)
        self.__dict__["owned"] = None if owned is None else frozenset(owned)
        self._runtime = runtime
        self.__dict__["_snapshot"] = snapshot(model, gm, runtime.runs(), self.stages)  # what a change after compile is told from
        self.__dict__["_told"] = set()  # the attributes and modules found changed at the last call
        # after a load (assign=True replaces tensors), even one through a module holding the pipe
        self.register_load_state_dict_post_hook(_after_load)

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Refuse pickling (``torch.save(pipe)``): what loads it back could not rebuild the stages."""
        raise TypeError("a Pipe cannot be pickled (torch.save(pipe), pickle.dumps): its stages and runtime are "
                        "made by fxpipe.compile. Save its weights with fxpipe.save(pipe, path) or "
                        "torch.save(pipe.state_dict(), path), and compile the model again to load them")

    def __deepcopy__(self, memo: dict) -> Pipe:
        """Copy the pipe as deepcopy copies any module (pickling is refused, copying is not); refuse it across ranks."""
        if self.owned is not None:
            raise TypeError(
                "a distributed pipe cannot be copied (copy.deepcopy(pipe), AveragedModel(pipe)): its stages exchange "
                "values with the other ranks through process groups, which cannot be copied. Copy the model instead: "
                "AveragedModel(model) or copy.deepcopy(model) on each rank holds that rank's stages' parameters (the "
                "others' are on meta), and ema.update_parameters(model) follows the pipe's training")
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self.__dict__, memo))
        return new

    def __getattr__(self, name: str) -> Any:
        """Return a parameter, buffer or submodule, else the model's own attribute (``pipe.config``)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            model = self.__dict__.get("_model")
            if model is None or name.startswith("_"):
                raise
            if name not in vars(model):
                if hasattr(type(model), name):
                    raise _model_method(model, name) from None
                raise
            return vars(model)[name]

    def __setattr__(self, name: str, value: Any) -> None:
        """Set a model attribute on the model (``pipe.scale = 5.0``), where the next call warns of it."""
        model = self.__dict__.get("_model")
        modelled = model is not None and name in vars(model)
        owned = name in self.__dict__ or hasattr(type(self), name)  # pipe.schedule, pipe.devices: the pipe's own
        if name in _COMPILE_OPTIONS and "_runtime" in self.__dict__ and (not modelled or owned):
            aside = (f" The model's own attribute {name!r} is set on the model itself: "
                     f"model.{name} = {value!r}." if modelled else "")
            raise TypeError(f"pipe.{name} cannot be set: {name}= is fixed by fxpipe.compile, which built the "
                            f"stages and the schedule for it. Compile again with {name}={value!r} (the model keeps "
                            f"its weights; pass plan= to keep the split).{aside}")
        if name == "training" and model is not None and "_runtime" in self.__dict__:
            model.training = value  # as model.training = value: the model's flag and the stages' (which the
            for stage in self.stages:  # merged graph reads as self.training), not the modules inside
                stage.training = value
        elif modelled and owned and not name.startswith("_") and "_runtime" in self.__dict__:
            raise TypeError(f"pipe.{name} is the pipe's own, not the model's attribute {name!r}, which the pipe "
                            f"does not set: set it on the model itself (model.{name} = {value!r})")
        if modelled and not owned and not name.startswith("_"):
            setattr(model, name, value)
        else:
            super().__setattr__(name, value)

    @property
    def runtime(self) -> Runtime:
        """Return the runtime running the stages (one process, or this rank's share): its contract."""
        return self._runtime

    @property
    def schedule(self) -> Any:
        """Return the schedule :meth:`step` runs (:class:`~fxpipe.runtime.schedules.builtin.Schedule`)."""
        return self._runtime.schedule

    @property
    def code(self) -> str:
        """Return the generated executor's source for ``plan.chunks`` micro-batches."""
        return self._runtime.code()

    @property
    def compile_stats(self) -> dict[int, dict[str, Any]]:
        """Return ``torch_compile=``'s record per stage this process runs: graphs, compiles, recompiles, seconds,
        graph breaks (where and why), and each split backward's I and W sizes (empty when not compiled)."""
        return self._runtime.compile_stats()

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """Return the model's state dict; on a distributed rank, only the FQNs this rank holds."""
        state = super().state_dict(*args, **kwargs)
        if self.owned is None:
            return state
        prefix = kwargs.get("prefix", args[1] if len(args) > 1 else "")
        for key in [k for k in state if k.startswith(prefix) and k[len(prefix):] not in self.owned]:
            del state[key]
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Load the model's state; on a distributed rank only the FQNs it holds, sharded as it holds them."""
        held = self._model.state_dict(keep_vars=True)
        if strict:
            _refuse_wrapper_prefix(state_dict, held)
        if self.owned is None:
            return super().load_state_dict(state_dict, strict, assign)
        mine = type(state_dict)() if isinstance(state_dict, OrderedDict) else OrderedDict()
        for k, v in state_dict.items():
            if k in self.owned:
                mine[k] = _like_held(v, held.get(k))
        mine._metadata = self._versions(getattr(state_dict, "_metadata", None))  # type: ignore[attr-defined]
        result = super().load_state_dict(mine, strict=False, assign=assign)
        result.missing_keys[:] = [k for k in result.missing_keys if k in self.owned]
        known = set(held)  # every rank's FQNs (the others' on meta)
        result.unexpected_keys[:] = [k for k in state_dict if k not in known]  # the same on every rank
        if strict and (result.missing_keys or result.unexpected_keys):
            raise RuntimeError(f"Error(s) in loading state_dict for {type(self._model).__name__} on this rank: "
                               f"missing keys {result.missing_keys}, unexpected keys {result.unexpected_keys}")
        return result

    def _versions(self, metadata: Any) -> Any:
        """Return the state dict's module versions, the current one for each module another rank holds.

        A batch norm of an older version (or of none given) adds a ``num_batches_tracked`` of 0 to
        the state dict, which torch then copies onto this rank's meta copy of another rank's
        module, warning of a no-op: such a module is read as current instead.
        """
        versions = OrderedDict(metadata or {})
        owned: Collection[str] = self.owned or set()
        for name, module in self._model.named_modules():
            prefix = f"{name}." if name else ""
            own = (*module.named_parameters(recurse=False), *module.named_buffers(recurse=False))
            local = [prefix + k for k, _ in own]
            if local and not any(k in owned for k in local):
                versions[name] = {**versions.get(name, {}), "version": getattr(type(module), "_version", 1)}
        return versions

    def _apply(self, fn: Callable, recurse: bool = True) -> Pipe:
        """Cast (``double()``, ``to(dtype)``, ``to_empty``) in one process; refuse it on a distributed rank."""
        if self.owned is not None:
            raise TypeError(
                "a distributed pipe cannot be cast or moved after compile: its plan (the dtypes and devices of the "
                "values its ranks exchange, the parameters each rank holds) was built for the model as compiled. "
                "Cast or move the model before fxpipe.compile (or build it in that dtype)")
        gm = self.__dict__.get("_gm")
        if gm is not None and gm.meta.get("fxpipe.tracer") == "export":
            held = {t.dtype for t in (*self._model.parameters(), *self._model.buffers()) if t.is_floating_point()}
            cast = next((c for d in held if isinstance(c := fn(torch.zeros((), dtype=d)), torch.Tensor)
                         and c.dtype != d), None)  # a dtype the cast changes (a move keeps them)
            if cast is not None:
                raise TypeError(
                    f"an exported pipe cannot be cast to {cast.dtype} after compile: torch.export recorded the "
                    "dtypes of the model's inputs and values in its graph. Cast the model before fxpipe.compile "
                    f"(model.to({cast.dtype}), example inputs to match), or use tracer='fx', whose pipe casts")
        super()._apply(fn, recurse)
        self._reshare()
        return self

    def to(self, *args: Any, **kwargs: Any) -> Pipe:
        """Cast the pipe's tensors (``to(torch.bfloat16)``); refuse a move of its stages to another device."""
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        if device is not None and any(torch.device(device) != d for d in self.devices):
            raise TypeError(
                f"pipe.to({str(device)!r}) would move every stage onto one device, but the stages run on "
                f"{[str(d) for d in self.devices]}; pass devices= to fxpipe.compile instead (a dtype alone, "
                "pipe.to(torch.bfloat16), is fine)")
        return super().to(*args, **kwargs)

    def _reshare(self) -> None:
        """Point every stage this process runs at the model's current tensors (see :mod:`fxpipe.runtime.stage.reshare`)."""
        runtime = self.__dict__.get("_runtime")
        if runtime is not None:
            reshare(self._model, [*self.stages, *runtime.runs()])

    def train(self, mode: bool = True) -> Pipe:
        """Set training mode on the pipe, the model and every stage."""
        super().train(mode)
        self._model.train(mode)
        for stage in self.stages:
            stage.train(mode)
        return self

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model's forward over micro-batches; return the model's output structure."""
        self._follow_model()
        try:
            _refuse_meta(self._runtime, args, kwargs, None)
        except ValueError as exc:
            self._runtime.refuse(exc, stepping=False)  # across ranks the others are in their call, waiting
        return self._runtime.forward(args, kwargs, self.training)

    def _follow_model(self) -> None:
        """Take the model's mode where ``model.eval()``/``model.train()`` was called on the model, not the pipe.

        A change the pipe does not follow (a submodule replaced, an attribute the trace read) is
        warned of, once per change (:mod:`fxpipe.runtime.drift`).

        Its modules (batch norm, dropout modules) follow at once, as the pipe shares them; the
        flag a merged graph reads (``self.training`` in the model's code) is the stages' own.
        """
        snap = self.__dict__["_snapshot"]
        if snap.ties:  # a tie the graph reads as one tensor, undone on the model
            undone = untied(snap)
            if undone:
                name, of = undone[0]
                raise ModelChangedError(
                    f"{name} no longer shares its tensor with {of}, as it did at fxpipe.compile: the traced graph "
                    f"reads {of} for both (torch.export keeps one name for tied tensors), so {name} would get no "
                    f"gradient and {of} the uses of both. Compile the model again after undoing the tie, or keep it "
                    f"(load a state dict with assign=False, which copies into the tied tensor)")
        if replaced(snap):  # a Parameter replaced on the model (load_state_dict(assign=True), setattr)
            self._reshare()
            snap.retake()
        found = changes(snap)
        what = {f.split(" was ")[0] if ", is " in f else f for f in found}  # an attribute's name, not its values
        if not what <= self.__dict__["_told"]:  # told once per thing changed (a counter: once, not per step)
            warnings.warn(describe(found), stacklevel=3)
        self.__dict__["_told"] = what  # one undone and changed again is told again
        mode = self._model.training
        if mode != self.training:
            self.training = mode
            for stage in self.stages:
                stage.training = mode

    def step(self, *args: Any, target: Any = _REQUIRED, loss_fn: Callable[[Any, Any], torch.Tensor] = _REQUIRED,
             scaler: Any = None, loss_reduction: str = "mean", **kwargs: Any) -> torch.Tensor:
        """Run forward and backward of one mini-batch with a loss per micro-batch; return the loss.

        For a mean-reduced ``loss_fn`` the loss and the gradients equal those of
        ``loss_fn(model(*args, **kwargs), target).backward()``: each micro-batch's loss is
        weighted by its share of the rows. ``loss_reduction="sum"`` adds the micro-batches'
        losses as ``loss_fn`` returns them instead, for a loss normalised by a count of the whole
        batch (its tokens that are not ignored: ``F.cross_entropy(..., reduction="sum") / n``).
        With ``scaler`` (a ``torch.amp.GradScaler``, or :func:`fxpipe.grad_scaler`'s across
        ranks) the loss is scaled once, where it is computed, so every stage's gradients come
        out scaled; the loss returned is not. Across replicas (``data_parallel``) it is the
        global batch's (the replicas' mean).
        """
        self._follow_model()
        if target is _REQUIRED and not self._runtime.reads()[1]:
            target = None  # a rank without the loss's stage reads no target
        try:
            if not torch.is_grad_enabled():
                raise RuntimeError("pipe.step runs backward and needs autograd; call it outside torch.no_grad() and "
                                   "torch.inference_mode() (use pipe(x) to infer)")
            _check_step_arguments(self._runtime, target, loss_fn, scaler, loss_reduction)
            _refuse_meta(self._runtime, args, kwargs, target)
            self._runtime.check_stages()  # a parameter unfrozen since compile, a linear hooked since
        except (TypeError, ValueError, RuntimeError) as exc:
            self._runtime.refuse(exc)  # across ranks the others are in their step, waiting for this rank
        if loss_reduction == "sum":
            loss_fn = summed(loss_fn)
        if scaler is not None and scaler.is_enabled():
            base = loss_fn
            device = next((d for d in self.devices if d.type != "meta"), torch.device("cpu"))
            scaler.scale(torch.zeros((), device=device))  # start its scale on every rank, not just the loss's

            def scaled(out: Any, tgt: Any) -> torch.Tensor:
                return scaler.scale(base(out, tgt))
            loss_fn = summed(scaled) if is_summed(base) else scaled
            scale = float(scaler.get_scale())
            return self._runtime.step(args, kwargs, target, loss_fn, self.training) / scale
        return self._runtime.step(args, kwargs, target, loss_fn, self.training)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients over the steps inside without reducing them (replicas, tied ranks).

        The first step after the block reduces everything accumulated, once: run all but the
        last step of a gradient accumulation inside it. In one process it changes nothing.
        """
        previous = self._runtime.sync
        self._runtime.sync = False
        try:
            yield
        finally:
            self._runtime.sync = previous


def _model_method(model: nn.Module, name: str) -> AttributeError:
    """Say that ``pipe.<name>`` is the model's class's method or property, which the pipe does not run."""
    kind = "property" if isinstance(getattr(type(model), name, None), property) else "method"
    return AttributeError(
        f"'Pipe' object has no attribute '{name}': {type(model).__name__}.{name} is a {kind} of the model's class, "
        "and the pipe runs the traced forward only (pipe(x), pipe.step). Call it on the model itself: in one process "
        "the pipe shares the model's parameters; across ranks each rank holds only its stages' (the others are on "
        "meta). To generate, loop over pipe(ids) with the whole sequence each call (the traced graph keeps no "
        "key/value cache; across ranks, broadcast each new token from pipe.plan.stages[-1].on_rank: "
        "docs/guide/using-it.md, 'Generating with a pipe'), or in one process call model.generate itself; to save "
        "(save_pretrained), fxpipe.save(pipe, path), then fxpipe.load(model, path) into a model built whole")


def _after_load(pipe: Pipe, incompatible: Any) -> None:
    """After a load reaching the pipe (itself, or a module holding it): point the stages at the loaded tensors,
    and on a distributed rank drop from the missing keys those of the other ranks' stages."""
    pipe._reshare()
    if pipe.owned is None or not incompatible.missing_keys:
        return
    names = [n for n, _ in pipe._model.named_parameters(remove_duplicate=False)] + \
            [n for n, _ in pipe._model.named_buffers(remove_duplicate=False)]
    others = {n for n in names if n not in pipe.owned}
    incompatible.missing_keys[:] = [k for k in incompatible.missing_keys
                                    if not any(k == f or k.endswith("." + f) for f in others)]


def _check_step_arguments(runtime: Runtime, target: Any, loss_fn: Any, scaler: Any, loss_reduction: str) -> None:
    """Refuse ``pipe.step``'s own arguments: one left out, a ``loss_fn`` that is no function, a lone scaler."""
    needs = []
    if target is _REQUIRED:
        needs.append("target=: the batch's target, or target=None for a model that computes its own loss (its "
                     "labels among the inputs, loss_fn=lambda out, _: out.loss); across ranks only the loss's rank, "
                     "pipe.plan.stages[-1].on_rank, reads it")
    if loss_fn is _REQUIRED:
        needs.append("loss_fn=: a function (output, target) -> loss, e.g. loss_fn=torch.nn.functional.cross_entropy, "
                     "or loss_fn=lambda out, _: out.loss for a model that computes its own loss")
    if needs:
        raise TypeError(f"pipe.step() needs {'; and '.join(needs)}")
    if isinstance(loss_fn, type) and issubclass(loss_fn, nn.Module):
        raise TypeError(f"loss_fn= is the class {loss_fn.__name__}, not a loss: pass an instance, "
                        f"loss_fn={loss_fn.__name__}() (or the function, e.g. torch.nn.functional.cross_entropy)")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be a function (output, target) -> loss, got {type(loss_fn).__name__}: "
                        "pass e.g. loss_fn=torch.nn.functional.cross_entropy, or for a model that computes its own "
                        "loss (Hugging Face's labels=) loss_fn=lambda out, _: out.loss (on every rank, also those "
                        "without the loss's stage)")
    if loss_reduction not in ("mean", "sum"):
        raise ValueError(f"loss_reduction={loss_reduction!r} is not 'mean' (loss_fn returns each micro-batch's "
                         "mean over its rows) or 'sum' (loss_fn returns each micro-batch's share of the batch's "
                         "loss, and the shares are added)")
    if scaler is not None and scaler.is_enabled():
        _refuse_lone_scaler(runtime, scaler)


def _refuse_meta(runtime: Runtime, args: tuple, kwargs: dict, target: Any) -> None:
    """Refuse inputs or a target on the meta device (shapes without data) where this rank reads them.

    A rank that does not read them (the inputs past the first stage's rank) may pass placeholders.
    """
    inputs, loss = runtime.reads()
    for where, value in (("input", (args, kwargs) if inputs else ((), {})), ("target", target if loss else None)):
        for path, leaf in tree_flatten_with_path(value)[0]:
            if isinstance(leaf, torch.Tensor) and leaf.is_meta:
                name = where if where == "target" else f"input {_argument(path)}"
                raise PipelineInputError(
                    f"{name}{keystr(path) if where == 'target' else ''} is on the meta device (a shape without "
                    "data): a call runs on real values. Meta tensors are for example_inputs= at fxpipe.compile; "
                    "give the batch itself here (moved with .to(device))")


def _argument(path: tuple) -> str:
    """Name the input at ``path`` in ``(args, kwargs)``: its position or its keyword, and where inside it."""
    where, rest = path[0].idx, path[1:]
    head = f"{path[1].key!r}" if where == 1 else f"{path[1].idx}"
    return head + keystr(rest[1:])


def _refuse_lone_scaler(runtime: Runtime, scaler: Any) -> None:
    """Refuse, across ranks, a gradient scaler whose inf/NaN check each rank makes alone."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    if runtime.place().distributed and not isinstance(scaler, ShardedGradScaler):
        raise TypeError(
            f"scaler= is a {type(scaler).__name__}, whose inf/NaN check each rank makes alone: a step skipped on one "
            "rank only would leave the ranks' weights and scales apart. Across ranks use scaler = "
            "fxpipe.grad_scaler(pipe), which agrees on every rank (FSDP's ShardedGradScaler)")


_COMPILE_OPTIONS = frozenset({"chunks", "schedule", "checkpoint", "n_stages", "stages_per_rank", "balance",
                              "data_parallel", "data_parallel_shard", "tensor_parallel", "tracer", "export_dims",
                              "devices"})


def _refuse_wrapper_prefix(state_dict: Mapping[str, Any], held: Mapping[str, Any]) -> None:
    """Refuse a state dict whose keys carry a wrapper's prefix (DDP's ``module.``, torch.compile's ``_orig_mod.``)."""
    for prefix, wrapper in (("module.", "DistributedDataParallel or DataParallel"), ("_orig_mod.", "torch.compile")):
        wrapped = [k for k in state_dict if k.startswith(prefix) and k not in held and k[len(prefix):] in held]
        if wrapped:
            raise RuntimeError(f"the state dict's keys start with {prefix!r} ({wrapped[0]!r}: saved from a model "
                               f"wrapped in {wrapper}), where the pipe's are the model's own ({wrapped[0][len(prefix):]!r}): "
                               f"strip the prefix, {{k.removeprefix({prefix!r}): v for k, v in state_dict.items()}}")


def _like_held(value: Any, held: Any) -> Any:
    """Return a full tensor of a state dict as the rank holds it: this rank's shard where data parallel shards it."""
    if isinstance(value, torch.Tensor) and not hasattr(value, "placements") and hasattr(held, "placements"):
        from torch.distributed.tensor import distribute_tensor  # sharded by FSDP2: each rank cuts its own

        return distribute_tensor(value.to(held.device), held.device_mesh, held.placements, src_data_rank=None)
    return value
