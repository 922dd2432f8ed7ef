"""Check runtime inputs against what the traced graph was fixed to, before anything runs.

An fx graph is generic in shapes: inputs of other non-batch shapes than the example run
correctly (the plan's costs were only estimated on the example). A ``torch.export`` graph is
not: its non-batch dims and its autocast are fixed when it is exported, so a mismatch is
refused here with the input's name, rather than failing deep inside a stage. A graph follows
``pipe.train()``/``pipe.eval()`` where the model's two modes could be merged into one graph
(:mod:`fxpipe.passes.modes`); where they could not, the other mode is refused here.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Collection, Sequence
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path

from fxpipe.errors import PipelineInputError
from fxpipe.frontend.export import enabled_autocast
from fxpipe.passes.annotate import TensorSpec, spec_of
from fxpipe.passes.structure import difference, in_order_of

__all__ = ["check_inputs", "check_micro_batches", "check_micro_guards", "check_signature", "describe_autocast"]

log = logging.getLogger(__name__)


def check_inputs(gm: torch.fx.GraphModule, values: Sequence[Any], names: Sequence[str],
                 training: bool, unbatched: Collection[str] = ()) -> None:
    """Raise :class:`PipelineInputError` if the inputs, the mode or the autocast differ from what the graph fixed."""
    meta = getattr(gm, "meta", {})
    fixed_mode = meta.get("fxpipe.training")  # the mode the graph was fixed in (export; fx with a branch on it)
    if fixed_mode is not None and fixed_mode != training:
        mode, other = ("training", "eval") if training else ("eval", "training")
        tracer = "torch.export" if meta.get("fxpipe.tracer") == "export" else "torch.fx"
        fixes = ("; or list the module that branches in leaf_modules=, or use tracer='export'" if tracer == "torch.fx"
                 else "")
        raise PipelineInputError(
            f"the pipe is in {mode} mode but it was compiled in {other} mode, and the model's forward differs "
            f"between the modes in a way one graph cannot follow ({meta.get('fxpipe.mode_branch', 'unknown')}), "
            f"so {tracer} fixed {other} mode's. Compile the pipe in the mode it runs in (model."
            f"{'train' if training else 'eval'}() before fxpipe.compile); to evaluate while training, "
            "fxpipe.save(pipe, path), build the model again under fxpipe.deferred_init() (or on meta), call "
            f"model.{'train' if training else 'eval'}() and fxpipe.compile(model, ..., weights=path){fixes}")
    traced = meta.get("fxpipe.autocast")
    if traced is not None and tuple(traced) != enabled_autocast():
        raise PipelineInputError(
            f"torch.export traced the model {describe_autocast(tuple(traced))} but the pipe runs {describe_autocast(enabled_autocast())}: "
            "an exported graph keeps the dtypes it was traced with (an autocast's casts are fixed in it, and its "
            "checks of the dtypes fail without them); call fxpipe.compile(..., tracer='export') under the same "
            "torch.autocast as the steps, or use tracer='fx'")
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    known = [(name, value, node.meta["fxpipe.value"]) for node, value, name in zip(placeholders, values, names)
             if "fxpipe.value" in node.meta]  # the example's, where compile had example inputs
    for name, value, example in known:
        _refuse_missing_batch_dim(name, value, example, name in unbatched)
    check_signature([k[0] for k in known], [spec_of(k[1]) for k in known], [k[2] for k in known],
                    kinds=False)  # in one process a pipe may be cast after compile
    for node, value, name in zip(placeholders, values, names):
        expected = node.meta.get("val")  # a fake tensor where torch.export or dynamo traced
        if isinstance(expected, FakeTensor) and isinstance(value, torch.Tensor):
            _check_static_dims(name, value, expected, first=0 if name in unbatched else 1, fx_traces=_fx_traces(meta),
                               static=meta.get("fxpipe.export_dims") == "batch")
        elif meta.get("fxpipe.tracer") == "export":
            _check_constant(name, value, expected)
    _check_guards(gm, dict(zip(placeholders, values)), unbatched)


def _refuse_missing_batch_dim(name: str, value: Any, example: Any, whole: bool) -> None:
    """Refuse one sample given without its batch dim (``x[0]``: the example's shape but for dim 0)."""
    if whole or not isinstance(value, torch.Tensor) or not isinstance(example, TensorSpec):
        return
    shape = tuple(example.shape)
    if len(shape) == value.dim() + 1 and shape[1:] == tuple(value.shape) and len(shape) > 1:
        raise PipelineInputError(
            f"input {name!r} has shape {tuple(value.shape)}, the example's {shape} without its first dim: fxpipe "
            f"splits dim 0 of each input into micro-batches, so one sample needs its batch dim "
            f"({name}.unsqueeze(0); x[0:1] rather than x[0])")


def _fx_traces(meta: dict) -> bool:
    """Tell whether tracer='fx' is a way past an exported graph's fixed sizes (not for transformers 5 models)."""
    return not str(meta.get("fxpipe.model_module", "")).startswith("transformers.")


_NO_FX = ("tracer='fx' cannot trace transformers 5 models: pad the input to a size in the range (its attention "
          "mask marking the padding), or export with an example of that size")


_PAIRED = re.compile(r"(\w+)\.size\(\)\[(\d+)\] == (\w+)\.size\(\)\[(\d+)\]")
_DIM_READ = re.compile(r"(\w+)\.size\(\)\[(\d+)\]")


def check_micro_guards(gm: torch.fx.GraphModule, mbs: Sequence[Sequence[Any]], chunks: int) -> None:
    """Run an exported graph's guards on each size of micro-batch; refuse one they fail, naming the fix.

    :func:`check_inputs` runs them with the example's rows; a guard on the batch dim itself
    (SigLIP's patch arithmetic refusing one row) failed inside stage 0 as a bare ``AssertionError``.
    """
    if getattr(gm, "_guards_fn", None) is None:
        return
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    sizes: dict[int, Sequence[Any]] = {}
    for mb in mbs:
        rows = next((v.shape[0] for v in mb if isinstance(v, torch.Tensor) and v.dim() > 0), None)
        if rows is not None:
            sizes.setdefault(int(rows), mb)
    for rows, mb in sizes.items():
        _check_guards(gm, dict(zip(placeholders, mb)), (), micro=(rows, chunks if len(mbs) > 1 else 0))


def _check_guards(gm: torch.fx.GraphModule, values: dict[torch.fx.Node, Any], unbatched: Collection[str],
                  micro: tuple[int, int] | None = None) -> None:
    """Run an exported graph's guards (``_guards_fn``) on stand-ins of the inputs' sizes; refuse those they fail.

    torch.export guards what it assumed of the sizes beyond each input's range: a divisibility
    (a patch size), a feature map not of size 1. Failing inside stage 0, they raised a bare
    ``AssertionError``. The batch dim keeps the example's rows here unless ``micro`` gives a
    micro-batch's ``(rows, chunks)`` (chunks 0: the batch is one; :func:`check_micro_guards`);
    the stand-ins are on meta, so no kernel runs.
    """
    guards = getattr(gm, "_guards_fn", None)
    if guards is None:  # an fx graph: nothing to scan for
        return
    call = next((n for n in gm.graph.nodes if n.op == "call_module" and n.target == "_guards_fn"), None)
    if call is None or not all(a in values for a in call.args if isinstance(a, torch.fx.Node)):
        return

    def stand_in(node: Any) -> Any:
        value = values[node] if isinstance(node, torch.fx.Node) else node
        expected = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
        if not isinstance(value, torch.Tensor):
            return value
        shape = list(value.shape)
        hint = getattr(getattr(expected.shape[0], "node", None), "hint", None) \
            if isinstance(expected, torch.Tensor) and expected.dim() == len(shape) > 0 else None
        if hint is not None and node.target not in unbatched and micro is None:
            shape[0] = int(hint)  # the example's rows: the micro-batches' are check_micro_guards'
        return torch.empty(shape, dtype=value.dtype, device="meta")

    try:
        guards(*[stand_in(a) for a in call.args])
    except AssertionError as exc:  # anything else (a guard reading a value: .item() on meta) is for the stage
        sizes = ", ".join(f"'{n.target}' {tuple(v.shape)}" for n, v in values.items() if isinstance(v, torch.Tensor))
        if micro is not None and micro[1]:
            raise PipelineInputError(
                f"a micro-batch of {micro[0]} row(s) (chunks={micro[1]}; its sizes {sizes}) fails a check "
                f"torch.export put in the graph: {exc}. The exported code admits some batch sizes only (the "
                f"example's passed): use a chunks= whose micro-batches it admits (fewer chunks, larger "
                f"micro-batches), or export with an example of that many rows"
                f"{_by_chance(exc, values, micro[0])}") from None
        if micro is not None:  # the whole batch is one micro-batch
            raise PipelineInputError(
                f"a batch of {micro[0]} row(s) (its sizes {sizes}) fails a check torch.export put in the graph: "
                f"{exc}. The exported code admits some batch sizes only (the example's passed): pass batches of "
                "more rows, or export with an example of that many rows") from None
        paired = _PAIRED.search(str(exc))
        if paired is not None and paired.group(1) != paired.group(3):  # two inputs' sizes that must agree
            a, i, b, j = paired.groups()
            raise PipelineInputError(
                f"the inputs' sizes ({sizes}) fail a check torch.export put in the graph: {exc}. The graph needs "
                f"'{a}' dim {i} to equal '{b}' dim {j}: pass inputs that agree with one another (a mask of the "
                "inputs' length). If eager runs on them, the model's code branched on these sizes being equal for "
                "the example, which torch.export kept: export with an example where they differ") from None
        fix = ("Use tracer='fx', whose graph is shape-generic (several image sizes in one run), or export with an "
               "example of this size" if _fx_traces(gm.meta) else _NO_FX[0].upper() + _NO_FX[1:])
        if paired is not None:  # two dims of one input the example had equal (a square image)
            a, i, _, j = paired.groups()
            fix = (f"The graph needs '{a}' dim {i} to equal its dim {j}, as the example's were: export with an "
                   "example where they differ (the model's code may branch on their being equal, which fx cannot "
                   "trace either)")
        raise PipelineInputError(
            f"the inputs' sizes ({sizes}) fail a check torch.export put in the graph: {exc}. torch.export "
            "specialised the model's code to sizes like the example's (a size a layer divides by, a feature map "
            f"of size 1), so these cannot run through this graph. {fix}") from None
    except Exception as exc:  # noqa: BLE001 - not a size the guards refuse: the later checks and the stage say
        log.debug("the exported graph's guards could not run on stand-ins of the sizes: %s", exc)


def _by_chance(exc: BaseException, values: dict[torch.fx.Node, Any], rows: int) -> str:
    """Name the split inputs (``rows`` in dim 0) whose dim 0 a failed guard reads beside other inputs' later dims.

    Such an input likely has no batch dim, and was split because its dim 0 had the batch's size
    in the example (FLUX's ``img_ids`` of 2 image tokens beside a batch of 2).
    """
    reads = _DIM_READ.findall(str(exc))
    split = {str(n.target) for n, v in values.items() if isinstance(v, torch.Tensor) and v.dim() > 0 and
             v.shape[0] == rows}
    firsts = sorted({name for name, dim in reads if dim == "0" and name in split})
    if not firsts or all(dim == "0" for _, dim in reads):
        return ""
    names = ", ".join(repr(n) for n in firsts)
    return (f". If {names} ha{'s' if len(firsts) == 1 else 've'} no batch dim (the check reads its dim 0 beside "
            "other inputs' later dims), its dim 0 had the batch's size in the example by chance and fxpipe split "
            f"it: pass fxpipe.compile(..., unbatched=[{names}]), or an example whose sizes differ from its batch size")


def _check_constant(name: str, value: Any, expected: Any) -> None:
    """Refuse a number where an exported graph takes a tensor, or another value of a number it fixed."""
    if isinstance(expected, FakeTensor) and value is not None and not isinstance(value, torch.Tensor):
        raise PipelineInputError(
            f"input '{name}' is {value!r} (a {type(value).__name__}) but the exported graph takes a tensor there "
            f"(the example was a {expected.dim()}-dim {expected.dtype} tensor): pass torch.tensor({value!r}), "
            "as at compile")
    if type(expected) in (bool, int, float) and isinstance(value, torch.Tensor) and not (
            value.numel() == 1 and float(value) == expected):
        raise PipelineInputError(
            f"input '{name}' is a tensor of shape {tuple(value.shape)} but torch.export fixed it to the example's "
            f"{expected!r}: a Python number is a constant in an exported graph. Give a tensor at compile too "
            f"(torch.tensor({expected!r})) so each call's value is used, or use tracer='fx' where it traces the model "
            "(it does not trace transformers 5 or most diffusers models)")
    if type(expected) is bool and isinstance(value, bool) and value != expected:
        fix = (f"or compile another pipe with example_kwargs={{'{name}': {value!r}}}" if name != "use_cache" else
               "since a key/value cache kept between calls cannot be pipelined: feed the whole sequence each call "
               "(a generation loop included; docs/guide/using-it.md)")
        raise PipelineInputError(
            f"input '{name}' is {value!r} but torch.export fixed it to the example's {expected!r}: a flag chooses the "
            f"model's code while it is traced, so a pipe runs the one its example chose. Call it with {name}="
            f"{expected!r}, {fix}")
    if type(expected) in (bool, int, float) and isinstance(value, (bool, int, float)) and value != expected:
        raise PipelineInputError(
            f"input '{name}' is {value!r} but torch.export fixed it to the example's {expected!r}: a Python number "
            f"is a constant in an exported graph. Pass it as a tensor (torch.tensor({value!r}), at compile too) so "
            "each call's value is used (a diffusion timestep), or use tracer='fx' where it traces the model (it does "
            "not trace transformers 5 or most diffusers models)")


def check_micro_batches(gm: torch.fx.GraphModule, rows: int, batch: int, chunks: int, names: Sequence[str],
                        unbatched: Collection[str] = ()) -> None:
    """Refuse micro-batches of ``rows`` rows where torch.export bounded the batch dim below them."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, name in zip(placeholders, names):
        expected = node.meta.get("val")
        if name in unbatched or not isinstance(expected, FakeTensor) or expected.dim() == 0:
            continue
        bounds = None if _fixed(expected.shape[0]) is not None else _range(expected.shape[0])
        if bounds is not None and bounds[1] is not None and rows > bounds[1]:
            raise PipelineInputError(
                f"a batch of {batch} rows makes micro-batches of up to {rows} rows (chunks={chunks}), but "
                f"torch.export bounded input '{name}''s batch dim to at most {bounds[1]} rows (the model "
                f"branches on the batch size): compile with chunks >= {-(-batch // bounds[1])}, or pass "
                f"batches of at most {bounds[1] * chunks} rows")


def describe_autocast(state: tuple) -> str:
    """Describe an autocast state of :func:`~fxpipe.frontend.export.enabled_autocast`."""
    if not state:
        return "without autocast"
    return "under " + " and ".join(f"torch.autocast({d!r}, dtype={dtype})" for d, dtype in state)


def _fixed(d: Any) -> int | None:
    """Return the size an exported dim is fixed to (an int, or a symbol torch.export specialised), else None."""
    if isinstance(d, int):
        return d
    expr = getattr(getattr(d, "node", None), "expr", None)
    return int(expr) if expr is not None and getattr(expr, "is_number", False) else None


def _range(d: Any) -> tuple[int, int | None] | None:
    """Return the sizes a dynamic exported dim admits (torch.export's range of its symbol), if known."""
    node = getattr(d, "node", None)
    ranges = getattr(getattr(node, "shape_env", None), "var_to_range", {})
    bounds = ranges.get(getattr(node, "expr", None))
    if bounds is None:
        return None
    try:
        upper: int | None = int(bounds.upper)
    except (TypeError, ValueError, AttributeError, OverflowError):  # unbounded (torch's int_oo)
        upper = None
    return int(bounds.lower), upper


def _check_static_dims(where: str, actual: torch.Tensor, expected: torch.Tensor, first: int = 1,
                       fx_traces: bool = True, static: bool = False) -> None:
    """Compare the dims an exported placeholder fixed from dim ``first`` on (1: not the batch's), and their ranges."""
    if actual.dim() != expected.dim():
        raise PipelineInputError(f"input '{where}' has {actual.dim()} dims but the exported graph "
                                 f"takes {expected.dim()}; give it the example's shape")
    for k, d in list(enumerate(expected.shape))[first:]:
        bounds = None if _fixed(d) is not None else _range(d)
        if bounds is not None and not (bounds[0] <= actual.shape[k] and (bounds[1] is None or actual.shape[k] <= bounds[1])):
            raise PipelineInputError(
                f"input '{where}' has {actual.shape[k]} in dim {k}, but torch.export traced the model for "
                f"sizes {bounds[0]} to {bounds[1] if bounds[1] is not None else 'any'} there: it specialises "
                "sizes 0 and 1, of this input or of a value made from it (a feature map reaching size 1), and "
                "keeps the branch the model's own code took on the size (a cache used as is up to the length it "
                "holds, grown past it: only sizes up to it run). " + (
                    "Use tracer='fx', whose graph is shape-generic (several image sizes in one run; a module "
                    "branching on the size kept whole with leaf_modules=), or export with an example of that size "
                    "(which moves the range)" if fx_traces else _NO_FX))
    fixed = [(k, _fixed(d)) for k, d in enumerate(expected.shape) if _fixed(d) is not None]
    wrong = [(k, d) for k, d in fixed if actual.shape[k] != d]
    if wrong:
        shape = tuple("*" if _fixed(d) is None else _fixed(d) for d in expected.shape)
        if static:  # export_dims="batch" fixed them, not the model's code
            raise PipelineInputError(
                f"input '{where}' has shape {tuple(actual.shape)} but the exported graph is fixed to {shape} (* = "
                "dynamic): export_dims='batch' keeps every dim but the batch the example's. Export with an example "
                "of this shape, or with export_dims='auto' (dims as free as the model allows; a longer export)")
        raise PipelineInputError(
            f"input '{where}' has shape {tuple(actual.shape)} but the exported graph is fixed to "
            f"{shape} (* = dynamic): torch.export fixed the dims the model's code ties to the example. "
            "Export with an example of this shape" + (", or use tracer='fx', whose graph is shape-generic"
                                                      if fx_traces else f"; {_NO_FX}"))
    if actual.dtype != expected.dtype:
        raise PipelineInputError(f"input '{where}' has dtype {actual.dtype} but the exported graph "
                                 f"takes {expected.dtype} (torch.export fixed the example's dtype): cast it "
                                 f"({where}.to({expected.dtype})), or compile with an example of dtype {actual.dtype}")


def check_signature(names: list[str], spec: list[Any], example: list[Any], kinds: bool = True) -> None:
    """Refuse inputs the plan cannot serve: another structure, number of dimensions or dtype (``kinds``) than the example's.

    Other sizes are served: the values crossing the stages are propagated anew for each new
    micro-batch layout (:func:`specs_for`).
    """
    for name, got, want in zip(names, spec, example):
        got = in_order_of(got, want)  # a dict's keys in another order: the graph reads them by key
        got_leaves, got_tree = tree_flatten(got)
        want_leaves, want_tree = tree_flatten(want)
        found = difference(got_tree, want_tree, name)
        if found is not None:
            raise PipelineInputError(
                f"input '{name}' is not of the structure the plan was built for: {found}; the stages were traced "
                "for the example's structure, so pass the same kind of value (or compile with example inputs of "
                "the kind you run)")
        for k, (g, w) in enumerate(zip(got_leaves, want_leaves)):
            if (g is None) != (w is None) and isinstance(g if w is None else w, TensorSpec):
                path = keystr(tree_flatten_with_path(want)[0][k][0])  # where in the input (d['z'])
                raise PipelineInputError(
                    f"input '{name}{path}' is {_describe(g)}, but the plan was built for {_describe(w)}: the stages "
                    f"were traced {'with' if g is None else 'without'} it, so "
                    f"{'they would read a tensor that is not there' if g is None else 'it would be ignored'}. "
                    + ("Across ranks every input of the model (labels= too, where the model computes its own loss) "
                       "goes to the first stage's rank, pipe.plan.stages[0].on_rank; only target= goes to the "
                       "loss's rank. " if g is None else "")
                    + "Compile with example inputs of the kind you run (a model called both ways needs a pipe "
                    "for each)")
            if kinds and isinstance(g, TensorSpec) and _other_kind(g, w):
                got_kind, want_kind = _kinds(g, w)
                raise PipelineInputError(
                    f"input '{name}' has {got_kind}, but the plan was built for {want_kind}; sizes may change "
                    "from step to step, the number of dimensions and the dtype may not: cast the input, or "
                    "compile with example inputs of that kind"
                    + (" (a model cast after compile, model.to(dtype), keeps its inputs' dtype across ranks: cast "
                       "the model before fxpipe.compile and give example inputs of its dtype, or keep its dtype "
                       "and use torch.autocast)" if g.dtype.is_floating_point and w.dtype.is_floating_point else ""))


def _other_kind(got: TensorSpec | torch.Tensor, want: Any) -> bool:
    """Tell whether a tensor (or its spec) has another dtype or number of dimensions than the example's spec."""
    return isinstance(want, TensorSpec) and (got.dtype != want.dtype or len(got.shape) != len(want.shape))


def unlike_example(names: Sequence[str], values: Sequence[Any], example: Sequence[Any]) -> str | None:
    """Name the first tensor input whose number of dimensions or dtype differs from the example's; None if none."""
    for name, got, want in zip(names, values, example):
        for g, (path, w) in zip(tree_flatten(in_order_of(got, want))[0], tree_flatten_with_path(want)[0]):
            if isinstance(g, torch.Tensor) and _other_kind(g, w):
                got_kind, want_kind = _kinds(g, w)
                return f"input '{name}{keystr(path)}' has {got_kind}, where the example it was traced with had {want_kind}"
    return None


def _kinds(got: TensorSpec | torch.Tensor, want: TensorSpec) -> tuple[str, str]:
    """Describe what differs between a tensor input and the example's: its number of dimensions, its dtype, or both."""
    dims, dtype = len(got.shape) != len(want.shape), got.dtype != want.dtype
    got_kind = " and ".join(([f"shape {tuple(got.shape)}"] if dims else []) + ([f"dtype {got.dtype}"] if dtype else []))
    want_kind = " and ".join(([f"{len(want.shape)} dimension(s) ({', '.join(map(str, want.shape))})"]
                              if dims else []) + ([f"dtype {want.dtype}"] if dtype else []))
    return got_kind, want_kind


def _describe(value: Any) -> str:
    """Describe a value's kind briefly, for a refusal."""
    if isinstance(value, TensorSpec):
        return f"a tensor of {len(value.shape)} dimension(s)"
    if isinstance(value, (tuple, list, dict)):
        return f"a {type(value).__name__} of {len(value)} item(s)"
    return "None" if value is None else f"a {type(value).__name__}"
