"""The torch.compile backends of a compiled stage, and the one that splits backward into ``I`` and ``W``.

A stage without ``W`` steps compiles with the backend asked for (inductor with its mode and
options, or any registered or callable backend). A stage whose schedule has ``W`` steps
compiles with AOT autograd (``aot_eager``, or inductor's own AOT pipeline), and its backward
graph is cut in two (:func:`fxpipe.passes.gradsplit.split_weight_grads`)::

    dynamo graph ──▶ AOT autograd ──▶ forward graph                     (compiled as asked)
                                  └─▶ backward graph ──cut──▶ I graph   (compiled; runs in I)
                                                          └─▶ W graph   (compiled; queued for W)

Which backward outputs are weight gradients is read off AOT autograd's output descriptors:
``GradAOTOutput(grad_of=PlainAOTInput(k))`` where dynamo's graph input ``k`` is a parameter
that wants a gradient. The compiled backward runs ``I`` and then, when the stage is deferring
(its worker runs an ``I`` step), returns no gradient for those parameters and queues a closure
that runs ``W`` and adds its results to their ``.grad``; otherwise it runs ``W`` at once and
returns every gradient to autograd (``B``, and ``loss.backward()`` after ``pipe(x)``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol, cast

import torch
import torch.fx
from torch import nn
from torch.utils._pytree import tree_leaves

from fxpipe.errors import CompileError
from fxpipe.options import TorchCompile
from fxpipe.passes.gradsplit import GradSplit, split_weight_grads
from fxpipe.passes.linears import tensor_hooked

__all__ = ["Deferral", "stage_backend"]


class Deferral(Protocol):
    """What the backend asks of its compiled stage: its config, where ``W`` work goes, the time spent."""

    config: TorchCompile
    index: int  # the stage's index, which errors name
    store: list | None  # while set, the backward queues its W work here
    split: list[tuple[int, int]]  # per split backward: nodes in I, nodes in W

    def compiled_graph(self, gm: torch.fx.GraphModule) -> None:
        """Count one graph dynamo hands to the backend (and note why a graph ended at a break)."""

    def spent(self, seconds: float) -> None:
        """Add compile time spent outside the stage's call (a backward compiled when first run)."""


def stage_backend(stage: Deferral, split: bool) -> Callable[[torch.fx.GraphModule, list], Callable]:
    """Return the torch.compile backend of ``stage``: the asked one, or AOT with I/W split backward."""
    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        stage.compiled_graph(gm)
        params = {k: x for k, x in enumerate(example_inputs) if isinstance(x, nn.Parameter) and x.requires_grad}
        if split and params and not any(tensor_hooked(p) for p in params.values()):  # hooks see B's gradients
            return _handing_params(_split_backend(stage, params)(gm, example_inputs), params)
        return _plain(stage.config, gm, example_inputs)
    return backend


class _Handed(threading.local):
    """The parameters of the call whose backward is about to run on this thread."""

    params: dict[int, nn.Parameter] | None = None


_handed = _Handed()


def _handing_params(compiled: Callable, compiled_with: dict[int, nn.Parameter]) -> Callable:
    """Wrap a compiled graph so that its backward knows the parameters *this* call was given.

    Dynamo may run one compiled graph for several modules (a graph after a break in a method
    every instance shares gets each instance's parameters as inputs), so the parameters a W
    adds its gradients to are taken per call: a pre-hook on the call's autograd node hands
    them to the backward, on the thread that runs it, just before it runs::

        call(args) ─▶ outputs ─▶ grad_fn (the compiled graph's node) ◀── pre-hook: params of this call

    A call given the parameters the graph was compiled with (the common case) needs no hook:
    the backward falls back to those.
    """
    positions = sorted(compiled_with)

    def run(*args: Any) -> Any:  # dynamo calls a backend's result with the graph's inputs, unboxed
        params = {k: args[k] for k in positions}
        out = compiled(*args)
        if torch.is_grad_enabled() and any(params[k] is not compiled_with[k] for k in positions):
            node = _graph_node(out, {a.grad_fn for a in args if isinstance(a, torch.Tensor)})
            if node is not None:
                node.register_prehook(lambda grads: setattr(_handed, "params", params))
        return out

    return run


def _graph_node(out: Any, earlier: set) -> Any:
    """Return the autograd node of the compiled call that made ``out``: an output's own ``grad_fn``, or
    one reached through the views AOT autograd regenerates outside the graph, never an input's (``earlier``)."""
    leaves = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    for depth in range(4):  # the nearest first: an output the graph computed names its node directly
        for t in leaves:
            node = t.grad_fn
            for _ in range(depth):
                node = next((n for n, _ in node.next_functions if n is not None), None) if node else None
            if node is not None and node not in earlier and "CompiledFunction" in node.name():
                return node
    return None


def _plain(config: TorchCompile, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
    """Compile with the backend asked for, as torch.compile itself would."""
    if config.backend == "inductor":
        from torch._inductor.compile_fx import compile_fx

        return cast(Callable, compile_fx(gm, example_inputs, config_patches=config.inductor_config()))
    if isinstance(config.backend, str):
        return torch._dynamo.lookup_backend(config.backend)(gm, example_inputs)
    return config.backend(gm, example_inputs)


def _split_backend(stage: Deferral, params: dict[int, nn.Parameter]) -> Callable:
    """Return an AOT backend whose backward compiler splits each backward graph into I and W."""
    config = stage.config

    def split_compiler(compile_part: Callable[[torch.fx.GraphModule, list, dict, bool], Callable]) -> Callable:
        def bw_compiler(bw: torch.fx.GraphModule, example_inputs: Sequence, **kwargs: Any) -> Callable:
            try:
                return split(bw, example_inputs, **kwargs)
            except Exception as exc:  # named with the stage, the original chained
                first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
                raise CompileError(f"stage {stage.index}: torch.compile ({config.name}) cannot compile the stage's "
                                   f"backward split into I and W for zero bubble: {type(exc).__name__}: {first[:300]}; "
                                   "try backend='aot_eager' to tell the graph from the backend, or a schedule "
                                   "without W (1f1b)") from exc

        def split(bw: torch.fx.GraphModule, example_inputs: Sequence, **kwargs: Any) -> Callable:
            start = time.perf_counter()
            weight_of = _weight_outputs(bw, params)
            cut = split_weight_grads(bw, weight_of)
            stage.split.append((len(cut.inputs.graph.nodes), len(cut.weights.graph.nodes)))
            with _donating(lambda idxs: [k for k in idxs if k not in cut.taken]):
                run_i = compile_part(cut.inputs, list(example_inputs), kwargs, False)
            # W reads the backward's own inputs at their runtime layout (a tangent may come channels-last,
            # unlike its traced value), and what I hands it as I's graph last saw it
            out = next(n for n in reversed(cut.inputs.graph.nodes) if n.op == "output")
            w_examples = [example_inputs[k] for k in cut.taken] + \
                [n.meta.get("val") for n in out.args[0][len(cut.input_positions):]]
            with _donating(lambda idxs: []):
                run_w = compile_part(cut.weights, w_examples, kwargs, True)
            stage.spent(time.perf_counter() - start)
            return _split_backward(stage, cut, run_i, run_w, [weight_of[k] for k in cut.weight_positions], params)
        return bw_compiler

    if config.backend == "aot_eager":
        from torch._dynamo.backends.debugging import aot_eager, boxed_nop

        def eager_part(gm: torch.fx.GraphModule, examples: list, kwargs: dict, weights: bool) -> Callable:
            return boxed_nop(gm, examples)

        def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
            with torch._functorch.config.patch(enable_autograd_cache=False):
                return aot_eager(gm, example_inputs, bw_compiler=split_compiler(eager_part))
        return backend

    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner, fake_tensor_prop
    from torch._inductor.utils import BoxedBool

    def inductor_part(gm: torch.fx.GraphModule, examples: list, kwargs: dict, weights: bool) -> Callable:
        out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
        # outputs keep the strides the graph traced (inductor's "user visible"): W is compiled for the
        # strides of the values I carries to it; gradients keep eager's, as inductor's backward does
        visible = not weights or inductor_config.bw_outputs_user_visible
        out.meta["user_visible_output_idxs"] = [k for k, v in enumerate(out.args[0])
                                                if visible and isinstance(v, torch.fx.Node)]
        if weights:  # W's inputs are I's results, never the parameters: nothing static, no CUDA graph
            kwargs = {**kwargs, "static_input_idxs": [], "cudagraphs": BoxedBool(False)}
        else:  # I's values at the layouts of the runtime's inputs (inductor keeps them for visible outputs)
            fake_tensor_prop(gm, examples)
        # not through inductor's graph cache: an entry of the whole backward (a batch norm's, with its size
        # guards naming the forward's inputs) was matched against W's inputs on a later run: KeyError 'x'
        with inductor_config.patch(fx_graph_cache=False):
            return compile_fx_inner(gm, examples, **kwargs)

    def inner_compile(gm: torch.fx.GraphModule, example_inputs: Sequence, **kwargs: Any) -> Any:
        if not kwargs.get("is_backward"):
            return compile_fx_inner(gm, example_inputs, **kwargs)
        return split_compiler(inductor_part)(gm, example_inputs, **kwargs)

    def inductor_backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        with torch._functorch.config.patch(enable_autograd_cache=False):
            return cast(Callable, compile_fx(gm, example_inputs, inner_compile=inner_compile,
                                             config_patches=config.inductor_config()))
    return inductor_backend


@contextmanager
def _donating(keep: Callable[[list[int]], list[int]]) -> Iterator[None]:
    """Compile a part with only some of the backward's donated inputs (inductor may write over those).

    AOT autograd lets the backward reuse the memory of saved values nothing reads after it;
    ``W`` reads some of them after ``I``, so ``I`` must not take them, and ``W``'s inputs (a
    different list, where the backward's indices mean nothing) are never donated.
    """
    context = torch._guards.TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None)
    before = getattr(meta, "bw_donated_idxs", None)
    if meta is None or not before:
        yield
        return
    meta.bw_donated_idxs = keep(list(before))
    try:
        yield
    finally:
        meta.bw_donated_idxs = before


def _weight_outputs(bw: torch.fx.GraphModule, params: dict[int, nn.Parameter]) -> dict[int, int]:
    """Return the backward outputs that are gradients of parameters: output position -> graph input."""
    from torch._functorch._aot_autograd.descriptors import GradAOTOutput, PlainAOTInput

    out = next(n for n in reversed(bw.graph.nodes) if n.op == "output")
    found = {}
    for k, desc in enumerate(out.meta.get("desc") or ()):
        if isinstance(desc, GradAOTOutput) and isinstance(desc.grad_of, PlainAOTInput) and desc.grad_of.idx in params:
            found[k] = desc.grad_of.idx
    return found


def _split_backward(stage: Deferral, cut: GradSplit, run_i: Callable, run_w: Callable,
                    inputs: list[int], compiled_with: dict[int, nn.Parameter]) -> Callable:
    """Return the boxed backward: I now; W now, or queued in the stage's store while it defers."""
    n_inputs = len(cut.input_positions)

    def backward(args: list) -> list:
        taken = [args[k] for k in cut.taken]
        results = list(run_i(list(args)))
        args.clear()  # the boxed calling convention: the saved values may go once I has run
        grads: list = [None] * cut.n_outputs
        for k, value in zip(cut.input_positions, results[:n_inputs]):
            grads[k] = value
        carried = taken + results[n_inputs:]
        del results
        handed, _handed.params = _handed.params, None
        store = stage.store
        if store is None:
            for k, value in zip(cut.weight_positions, run_w(carried)):
                grads[k] = value
        else:
            params = handed if handed is not None else compiled_with
            store.append(_WeightStep(run_w, carried, [params[k] for k in inputs]))
        return grads

    backward._boxed_call = True  # type: ignore[attr-defined]
    return backward


class _WeightStep:
    """One micro-batch's W of one compiled graph: run the W graph, add its results to ``.grad``."""

    __slots__ = ("carried", "params", "run")

    def __init__(self, run: Callable, carried: list, params: list[nn.Parameter]) -> None:
        self.run, self.carried, self.params = run, carried, params

    def __call__(self) -> None:
        """Compute the weight gradients and accumulate them as autograd would."""
        carried, self.carried = self.carried, []
        with torch.no_grad():
            for p, grad in zip(self.params, self.run(carried)):
                if grad is None:
                    continue
                if p.grad is None:
                    p.grad = grad if grad.is_contiguous() else grad.contiguous()
                else:
                    p.grad.add_(grad)
