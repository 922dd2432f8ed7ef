"""The :class:`Pipe` module: a compiled model, called and trained like the model."""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch
import torch.fx
from torch import nn
from torch.utils._pytree import tree_map

import passes
from fxpipe.errors import PipelineInputError
from fxpipe.local import LocalRuntime
from fxpipe.microbatch import batch_size, gather, micro_sizes, scatter
from fxpipe.plan import PipelinePlan
from fxpipe.validate import check_inputs

__all__ = ["Pipe"]

log = logging.getLogger(__name__)

class Pipe(nn.Module):
    """A model split into pipeline stages; call it like the model, train it like the model.

    Its parameters, buffers and submodules are the model's own, under the model's own names:
    ``pipe.state_dict().keys() == model.state_dict().keys()`` and gradients land in the
    model's ``Parameter`` objects.
    """

    def __init__(self, model: nn.Module, gm: torch.fx.GraphModule, plan: PipelinePlan,
                 stages: Sequence[torch.fx.GraphModule], devices: Sequence[torch.device],
                 runtime: LocalRuntime) -> None:
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
        self.__dict__["devices"] = list(devices)
        self._runtime = runtime
        self._input_names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
        info = getattr(gm.graph._codegen, "pytree_info", None)
        self._out_spec = info.out_spec if info is not None else None

    @property
    def code(self) -> str:
        """Return the generated executor's source for ``plan.chunks`` micro-batches."""
        return self._runtime.program(self.plan.chunks)[0]

    def train(self, mode: bool = True) -> "Pipe":
        """Set training mode on the pipe, the model and every stage."""
        super().train(mode)
        self._model.train(mode)
        for stage in self.stages:
            stage.train(mode)
        return self

    def _micro_batches(self, args: tuple, kwargs: dict) -> tuple[list[list[Any]], int | None]:
        """Bind the inputs to the graph's placeholders and split them into micro-batches."""
        values = passes.bind_placeholders(self._gm, args, kwargs)
        batch = batch_size(values, self._input_names)
        check_inputs(self._gm, values, self._input_names, self.training)
        mbs = scatter(values, self._input_names, self.plan.chunks)
        first = self.devices[0]
        mbs = [tree_map(lambda t: t.to(first, non_blocking=True)
                        if isinstance(t, torch.Tensor) and t.device != first else t, mb) for mb in mbs]
        return mbs, batch

    def _finish(self, output: Any) -> Any:
        """Rebuild the output structure for GraphModules whose codegen flattens outputs."""
        if self._out_spec is not None:
            return self._gm.graph._codegen.process_outputs(output)
        return output

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model's forward over micro-batches; return the model's output structure."""
        mbs, _ = self._micro_batches(args, kwargs)
        outputs = self._runtime.run(mbs, self.training)
        return self._finish(gather(outputs))

    def step(self, *args: Any, target: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
             **kwargs: Any) -> torch.Tensor:
        """Run forward and backward of one mini-batch with a loss per micro-batch; return the loss.

        For a mean-reduced ``loss_fn`` the loss and the gradients equal those of
        ``loss_fn(model(*args, **kwargs), target).backward()``.
        """
        if not torch.is_grad_enabled():
            raise RuntimeError("pipe.step runs backward and needs autograd; call it outside "
                               "torch.no_grad()")
        mbs, batch = self._micro_batches(args, kwargs)
        sizes = micro_sizes(batch, self.plan.chunks)
        target_batch = batch_size([target], ["target"])
        if batch is not None and target_batch is not None and target_batch != batch:
            raise PipelineInputError(f"target has {target_batch} rows on dim 0 but the inputs have "
                                     f"{batch}; give the target the inputs' batch size")
        targets = scatter([target], ["target"], len(mbs))
        last = self.devices[-1]
        outputs = self._runtime.run(mbs, self.training)
        total = None
        for out, tgt, rows in zip(outputs, targets, sizes):
            tgt = tree_map(lambda t: t.to(last) if isinstance(t, torch.Tensor) else t, tgt[0])
            loss = loss_fn(self._finish(out), tgt)
            weighted = loss * (rows / batch) if batch else loss
            total = weighted if total is None else total + weighted
        assert total is not None
        total.backward()
        return total.detach()
