"""Name the fxpipe argument a keyword from torchgpipe, ``torch.distributed.pipelining`` or a typo means."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["BY_HAND", "ELSEWHERE", "refuse_unknown"]

BY_HAND = ("split_points= (the module or node names where stages begin); for an nn.Sequential, torchgpipe's layer "
           "counts through fxpipe.compat.torchgpipe.GPipe(module, balance=...)")
_CHUNKS = "chunks= (the number of micro-batches)"
_CHECKPOINT = "checkpoint= ('always', 'except_last', 'never', 'selective', 'auto' or one per stage)"
_COMPILE = "torch_compile= (True, or a dict of torch.compile's arguments)"
_EXAMPLE = "example_inputs= (a tuple of the forward's positional inputs)"

# keywords other pipeline libraries (or habit) use, and what fxpipe calls them
ELSEWHERE = {
    "balance": f"{BY_HAND}, or balance_by= (what stages balance)",
    **dict.fromkeys(("micro_batches", "n_microbatches", "num_microbatches", "microbatches"), _CHUNKS),
    **dict.fromkeys(("num_stages", "stages"), "n_stages (the second argument)"),
    "device": "devices= (one device per stage, e.g. [\"cuda:0\", \"cuda:1\"])",
    **dict.fromkeys(("checkpoint_stop", "activation_checkpointing"), _CHECKPOINT),
    **dict.fromkeys(("compiled", "use_compile"), _COMPILE),
    "split_policy": "split_points= (the module or node names where stages begin) or balance_by=",
    **dict.fromkeys(("example_args", "example_input", "sample_input"), _EXAMPLE),
    "loss_fn": "pipe.step(..., target=, loss_fn=): the loss is given at each step, not at compile",
    "optimizer": "an optimizer built from pipe.parameters() after compile, stepped after pipe.step",
    "world_size": "data_parallel=, tensor_parallel= and n_stages / stages_per_rank (their product is the world)",
    **dict.fromkeys(("expert_parallel", "ep", "ep_size", "moe_parallel"),
                    "nothing: fxpipe has no expert parallelism; a mixture of experts' experts stay in their stage, "
                    "tensor_parallel= shards their linears and data_parallel= replicates them"),
}


def refuse_unknown(function: Callable[..., Any], unknown: Mapping[str, Any]) -> None:
    """Raise a TypeError naming the argument each unknown keyword of ``function`` stands for."""
    if not unknown:
        return
    known = [p for p in inspect.signature(function).parameters if p not in ("unknown", "kwargs")]
    lines = []
    for key in unknown:
        if key in ELSEWHERE:
            lines.append(f"{key}= (use {ELSEWHERE[key]})")
        else:
            close = difflib.get_close_matches(key, known, n=2, cutoff=0.6)
            lines.append(f"{key}= (did you mean {' or '.join(c + '=' for c in close)}?)" if close
                         else f"{key}= (no such argument)")
    raise TypeError(f"fxpipe.{function.__qualname__}() got unexpected keyword arguments: " + "; ".join(lines)
                    + f". Its arguments: {', '.join(known)}")
