"""The call signature of a traced model: bind inputs to placeholders, rebuild outputs."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from fxpipe import passes
from fxpipe.errors import PipelineInputError, user_stacklevel
from fxpipe.passes.annotate import input_difference
from fxpipe.passes.structure import as_containers
from fxpipe.runtime.microbatch import batch_size, gather, scatter, to_device
from fxpipe.runtime.observe.blame import add_note, raised_in_stage
from fxpipe.runtime.validate import check_inputs, check_micro_batches, check_micro_guards, unlike_example

__all__ = ["Binding"]


class Binding:
    """Bind ``model(*args, **kwargs)`` to a GraphModule's placeholders and split it into micro-batches."""

    def __init__(self, gm: torch.fx.GraphModule, fixed: bool = False) -> None:
        self.gm = gm
        self.fixed = fixed  # a user's schedule: its micro-batch count is fixed, fewer are refused, not warned of
        self.names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
        info = getattr(gm.graph._codegen, "pytree_info", None)
        self.flattens_outputs = info is not None and info.out_spec is not None
        self.warned = False  # that a batch smaller than chunks runs fewer micro-batches (said once)
        self.example = [n.meta.get("fxpipe.value") for n in gm.graph.nodes if n.op == "placeholder"]
        self.targets_checked = False  # for ignored entries shared unequally by the micro-batches (once)
        self.summed_checked = False  # for 0-dim sums under a mean loss_fn, means under a summed one (once)
        self.summed_pending: tuple[int, Any] | None = None  # (micro-batches, loss_fn) for the first loss's check
        self.coupled: list[str] = gm.meta.get("fxpipe.coupled", [])  # outputs that couple a batch's rows
        reduced = gm.meta.get("fxpipe.summed", {})  # 0-dim outputs that sum, and that average, over the rows
        self.summed: list[str] = reduced.get("sum", [])
        self.means: list[str] = reduced.get("mean", [])
        self.coupled_scalars: list[str] = reduced.get("coupled", [])  # 0-dim outputs neither sums nor means
        # 0-dim outputs per mode (known where compile had example inputs)
        independent = gm.meta.get("fxpipe.independent", [])  # outputs every micro-batch computes alike
        self.independent = frozenset(k for k, _ in independent)
        alike = {name for _, name in independent}
        self.scalars = {mode: [s for s in passes.scalar_outputs(gm, mode) if s not in alike] for mode in (True, False)}
        self.unbatched = frozenset(gm.meta.get("fxpipe.unbatched", ()))  # inputs every micro-batch gets whole
        self.rows: Callable[[int, int], list[int]] | None = None  # (batch, chunks) -> sizes; None: even (scatter)

    def bind(self, args: tuple, kwargs: dict) -> list[Any]:
        """Return one value per placeholder for a call with ``args`` and ``kwargs``."""
        if self.gm.meta.get("fxpipe.tracer") == "export":  # mappings as the plain dicts the example was made
            args, kwargs = as_containers(args), as_containers(kwargs)
        found = input_difference(self.gm, args, kwargs)
        if found is not None:
            raise PipelineInputError(
                f"the inputs are not of the structure the model was exported for: {found}; torch.export made each "
                "tensor of the example's containers an input of its own (a list of 3 tensors is 3 inputs, a dict's "
                "entries are read by key), so pass inputs of that structure, or compile a pipe with example inputs "
                "of each structure you run")
        return passes.bind_placeholders(self.gm, args, kwargs)

    def split(self, args: tuple, kwargs: dict, chunks: int, training: bool,
              device: torch.device | None = None) -> tuple[list[list[Any]], int | None]:
        """Bind, check and split the inputs; return the micro-batches (on ``device``) and the batch size."""
        values = self.bind(args, kwargs)
        batch = batch_size(values, self.names, self.unbatched, agree=chunks > 1)
        check_inputs(self.gm, values, self.names, training, self.unbatched)
        mbs = scatter(values, self.names, chunks, self.unbatched, self.rows)
        if batch is not None:
            check_micro_batches(self.gm, -(-batch // len(mbs)), batch, chunks, self.names, self.unbatched)
            check_micro_guards(self.gm, mbs, chunks)
        if batch is not None and batch < chunks and not self.warned and not self.fixed:
            self.warned = True
            warnings.warn(f"a batch of {batch} row(s) runs as {len(mbs)} micro-batch(es), fewer than chunks={chunks}: "
                          "a micro-batch holds at least one row (said once per pipe)", stacklevel=user_stacklevel())
        if device is not None:
            mbs = [[to_device(v, device) for v in mb] for mb in mbs]
        return mbs, batch

    def note_unlike(self, exc: BaseException, args: tuple, kwargs: dict) -> None:
        """Note on a call's exception raised inside a stage an input of another ndim or dtype than the example's."""
        if not raised_in_stage(exc) or isinstance(exc, PipelineInputError):  # only then are the inputs bound again
            return
        unlike = unlike_example(self.names, self.bind(args, kwargs), self.example)
        if unlike is not None:
            add_note(exc, f"fxpipe: {unlike}: pass inputs of the example's kind, or compile with example inputs "
                          "of this kind")

    def check_joinable(self, m: int, training: bool) -> None:
        """Refuse, before anything runs, a forward of ``m`` micro-batches whose outputs cannot be joined.

        Across ranks only the last rank joins the outputs; found there after the forwards, the
        refusal would reach the other ranks a call late. The first rank asks this instead.
        """
        if m <= 1:
            return
        if self.coupled:
            raise PipelineInputError(
                f"the model's output couples the rows of a batch, so the micro-batches' outputs cannot be "
                f"joined into it: {'; '.join(self.coupled)}. Run this forward on a pipe compiled with "
                "chunks=1, or return per-row values (embeddings) and couple them after the pipeline")
        if self.scalars[training]:
            raise PipelineInputError(
                f"the model returns a 0-dim tensor ({', '.join(self.scalars[training])}), which cannot be joined across "
                f"{m} micro-batches: each computes it over its own rows. Return per-sample values (reduce after "
                "the pipeline), or use chunks=1; a loss the model computes (Hugging Face's labels=) is what "
                "pipe.step(..., loss_fn=lambda out, _: out.loss) trains on; a Hugging Face mixture of experts "
                "returns its router's aux_loss only under output_router_logits=True (leave it False to infer)")

    def gather(self, outputs: list[Any], training: bool) -> Any:
        """Join the micro-batches' outputs on dim 0; refuse outputs that couple a batch's rows."""
        self.check_joinable(len(outputs), training)
        return gather(outputs, self.independent)

    def finish(self, output: Any) -> Any:
        """Rebuild the model's output structure where the graph returns flat outputs."""
        if self.flattens_outputs:
            return self.gm.graph._codegen.process_outputs(output)
        return output

