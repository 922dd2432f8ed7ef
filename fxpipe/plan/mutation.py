"""Refuse in-place changes a pipeline cannot reproduce; give stages private copies of the rest.

See :mod:`fxpipe.passes.inplace` for the analysis: a stage that changes one of its inputs in place
works on a copy made on entry, so its recomputation and every other stage see the values
eager sees; a change that a later stage would have to see through the original value is
refused at compile time with :class:`~fxpipe.errors.MutationError`, before anything moves.
"""

from __future__ import annotations

import logging
import warnings

import torch.fx

from fxpipe import passes
from fxpipe.errors import MutationError, user_stacklevel

__all__ = ["conflict_message", "copy_mutated_inputs", "route_buffer_reads"]

log = logging.getLogger(__name__)


def copy_mutated_inputs(gm: torch.fx.GraphModule, modules: list) -> None:
    """Give stages that change an input in place a private copy; refuse what cannot work."""
    found = passes.plan_mutations(gm)
    if found.conflicts:
        raise MutationError(conflict_message(gm, found.conflicts[0]))
    for j, names in found.copies.items():
        passes.copy_on_write(modules[j], names)
        log.info("stage %d changes its input(s) %s in place; it works on a copy", j, names)
    if found.mutated_model_inputs:
        log.warning("the model changes its input(s) %s in place; fxpipe runs it on a copy, so "
                    "outputs and gradients equal eager but the caller's tensors are left "
                    "unchanged", found.mutated_model_inputs)


def route_buffer_reads(gm: torch.fx.GraphModule) -> None:
    """Send later stages the value of a buffer an earlier stage wrote; warn of buffer reads no route can fix."""
    found = passes.route_buffer_reads(gm)
    if found.routed:
        log.info("buffers written in place and read by later stages are sent to them as values: %s", found.routed)
    for buffer, writer, ws, reader, rs in found.unordered:
        when = "after" if ws > rs else "before and after"
        warnings.warn(
            f"buffer '{buffer}' is written in place in stage {ws} (node '{writer}') and read in stage {rs} "
            f"(node '{reader}'), {when} that read within one forward. A pipeline cannot give each micro-batch the value "
            f"eager gives it there: stages run micro-batches in the schedule's order, and a stage on another rank reads "
            f"its own copy of the buffer, which the writes of stage {ws} do not reach. Write it before every read in "
            f"the forward (each later read then gets the value as written: old = buf.clone(); update buf; read old), "
            f"keep the read and the write in one stage (split_points= that do not cut between nodes '{reader}' and "
            f"'{writer}'), or pass the value in as an input.",
            stacklevel=user_stacklevel())
    for buffer, stages in found.spread:
        warnings.warn(
            f"buffer '{buffer}' is written in place by stages {stages} (a module called in several stages, such as "
            f"a shared batch norm): each stage writes it for every micro-batch in the schedule's order, not in eager's, "
            f"and across ranks each rank writes its own copy, so its value after a step is not eager's. Keep its "
            f"writes in one stage (split_points=) for the value eager gives.", stacklevel=user_stacklevel())


def conflict_message(gm: torch.fx.GraphModule, c: passes.Conflict) -> str:
    """Explain an in-place change that a pipeline cannot reproduce, and the fix."""
    nodes = {n.name: n for n in gm.graph.nodes}
    value = nodes[c.value]
    made = "a model input" if value.op == "placeholder" else f"a value of stage {value.meta['fxpipe.stage']}"
    fix = (f"Write the op out of place (x = x.mul(2) rather than x.mul_(2), nn.ReLU() rather than "
           f"nn.ReLU(inplace=True)), or give split_points= that keep node '{c.node}' in one stage "
           f"with every use of {c.value!r}.")
    if c.reader is None:
        return (f"node '{c.node}' in stage {c.stage} changes in place storage shared by the stage "
                f"inputs {c.aliases} (views of one tensor); a stage that changes its input works "
                f"on a copy, and separate copies would no longer share the change. {fix}")
    return (f"node '{c.node}' in stage {c.stage} changes {c.value!r} ({made}) in place, and stage "
            f"{c.reader_stage} reads it afterwards (node '{c.reader}'). In a pipeline each stage "
            f"gets the value from the stage that made it (a reference, or a copy on another "
            f"device), and stage {c.stage} must not change its input, or its recomputation in "
            f"backward would see the changed value; so stage {c.reader_stage} would not see the "
            f"change that it sees in eager. {fix}")
