"""Keep a stage's buffers through its recomputation: it starts from their values at the forward, and leaves them as it found them.

Reads:  the stage GraphModule: its batch norms that track running statistics (fx: the
        ``nn.BatchNorm*`` submodules; torch.export: the buffers ``aten.batch_norm`` reads,
        which it updates in place), the buffers its in-place ops write (``add_`` on
        ``num_batches_tracked``, a power iteration's ``copy_``), and, seen by their version
        counters or, where a kernel writes without bumping one, by their values, the buffers a
        leaf module writes inside its own forward (a spectral norm's ``_u`` and ``_v`` traced
        with fx; a QAT observer's ``min_val`` and ``scale``).
Writes: nothing in the graph; :func:`replayed` swaps buffers' storage for the block and back.

A whole-stage recomputation runs the stage's forward once more in training mode. Two things
then differ from eager unless the buffers the forward writes are handled::

    checkpointed forward of micro-batch i:   u_i -> u_i+1, weight from u_i+1     (as eager)
    ... later micro-batches' forwards:        u_i+1 -> ... -> u_k
    recomputation of i in backward:          must start from u_i (not u_k) to rebuild the
                                             same weight, and must leave u_k in place

So :meth:`~fxpipe.runtime.stage.stagecall.StageCall.replay_point` copies the buffers whose
values the forward reads (:func:`snapshot`), and the recomputation runs on those copies and
puts the buffers back after it. A batch norm's running statistics are not copied where only
the norm reads them (a training-mode output does not), so the recomputation only needs its
updates discarded (a scratch copy); where another node or a module around the norm reads
them, they are copied (:func:`private_statistics`). ``checkpoint="selective"`` keeps batch norms out of what it
recomputes; deferred batch norm skips recomputations itself.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.fx
from torch.nn.modules.batchnorm import _NormBase

from fxpipe.frontend.tracewrites import named_state
from fxpipe.passes.mutates import aliases, op_name, unwrapped, written_args
from fxpipe.runtime.observe.blame import add_note

__all__ = ["bumped", "changed", "norm_statistics", "note_written_weights", "private_statistics", "replayed", "snapshot",
           "state", "versions", "written_buffers"]


def norm_statistics(gm: torch.fx.GraphModule) -> set[str]:
    """Return the names of ``gm``'s batch norms' running statistics and counters (a training-mode output reads none)."""
    names: set[str] = set()
    for path, module in gm.named_modules():
        if isinstance(module, _NormBase) and module.track_running_stats:
            names |= {f"{path}.{k}" if path else k for k, b in module.named_buffers(recurse=False) if b is not None}
    buffers = dict(gm.named_buffers())
    for node in gm.graph.nodes:
        call = unwrapped(node)  # a mode-guarded batch norm too
        if call.op == "call_function" and "batch_norm" in op_name(call.target):  # exported: running mean, var
            names |= {str(a.target) for a in through_picks(node.all_input_nodes)
                      if a.op == "get_attr" and a.target in buffers}
    return names | {n for n in buffers if n.rsplit(".", 1)[-1] == "num_batches_tracked"}


def private_statistics(gm: torch.fx.GraphModule) -> set[str]:
    """Return the norms' statistics of ``gm`` that nothing but their own norm reads (their update is only discarded).

    A statistic another node reads (``w / sqrt(bn.running_var + eps)`` before the norm runs), or
    that a module called whole around the norm may read (torch.ao's fused QAT ``ConvBn2d``
    scales its weight by ``running_var``), is copied at the replay point like any buffer the
    forward reads: the recomputation would read the value later micro-batches left.
    """
    names = norm_statistics(gm)
    called = [str(n.target) for n in gm.graph.nodes if n.op == "call_module"]
    read: set[str] = set()
    for name in names:
        owner = name.rsplit(".", 1)[0] if "." in name else ""
        if any(owner.startswith(path + ".") for path in called):
            read.add(name)  # inside a module called whole that is not the norm itself
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target in names and any(not _norm_use(u) for u in node.users):
            read.add(str(node.target))
    return names - read


def _norm_use(node: torch.fx.Node) -> bool:
    """Tell whether ``node`` reads a statistic as a batch norm does: the norm itself, or a mode-merged choice it reads."""
    call = unwrapped(node)
    if call.op == "call_function" and "batch_norm" in op_name(call.target):
        return True
    positions = getattr(node.target, "returns_an_argument", None) if node.op == "call_function" else None
    return positions is not None and all(_norm_use(u) for u in node.users)


def through_picks(nodes: Sequence[torch.fx.Node]) -> list[torch.fx.Node]:
    """Return ``nodes`` with each mode-merged choice (``pick``) among them replaced by what it may return.

    Where torch.export's training and eval graphs merge out of step (ShuffleNet), a batch norm
    reads its running statistics through ``pick(training, buffer, other)``.
    """
    found: list[torch.fx.Node] = []
    for node in nodes:
        positions = getattr(node.target, "returns_an_argument", None) if node.op == "call_function" else None
        if positions is None:
            found.append(node)
            continue
        found += through_picks([a for i, a in enumerate(node.args) if i in positions and isinstance(a, torch.fx.Node)])
    return found


def state(gm: torch.fx.GraphModule) -> dict[str, torch.Tensor]:
    """Return ``gm``'s buffers and parameters by name (a frozen parameter a forward updates is kept as a buffer is)."""
    return named_state(gm)


def written_buffers(gm: torch.fx.GraphModule) -> list[str]:
    """Return the names of the buffers (and parameters) the graph of ``gm`` updates: running statistics, in-place writes.

    A parameter written in place under ``torch.no_grad()`` (a momentum encoder's target network,
    BYOL's and MoCo's ``pt.mul_(m).add_(po, alpha=1 - m)``) is one too: a recomputation applied
    the update a second time.
    """
    names = sorted(norm_statistics(gm))
    buffers = state(gm)
    for node in gm.graph.nodes:
        for arg in written_args(node):
            while isinstance(arg, torch.fx.Node) and arg.op != "get_attr" and len(aliases(arg)) == 1:
                arg = aliases(arg)[0]  # a write through an alias (a no_grad block's detach of the buffer) writes it
            if isinstance(arg, torch.fx.Node) and arg.op == "get_attr" and arg.target in buffers:
                names.append(str(arg.target))
    return list(dict.fromkeys(names))


def versions(gm: torch.fx.GraphModule) -> dict[str, tuple[int, int]]:
    """Return the identity and version counter of each real buffer and parameter of ``gm`` (bumped by in-place writes).

    The identity tells a write from a swap: FSDP2 registers the sharded parameters before a
    forward and the unsharded ones after it (``reshard_after_forward=False``), whose counters
    are another tensor's. Taken as a write, every parameter was copied per micro-batch and put
    back by the recomputation, the sharded copy into the unsharded parameter ("its data is not
    allocated yet").
    """
    return {n: (id(t), t._version) for n, t in state(gm).items() if not t.is_meta}


def bumped(gm: torch.fx.GraphModule, before: dict[str, tuple[int, int]]) -> list[str]:
    """Return the buffers of ``gm`` written in place since ``before`` was taken (the same tensor, another version)."""
    return [n for n, (who, v) in versions(gm).items() if n in before and before[n][0] == who and before[n][1] != v]


def changed(gm: torch.fx.GraphModule, before: dict[str, torch.Tensor]) -> list[str]:
    """Return the buffers of ``gm`` whose values differ from ``before`` (written without bumping a version counter).

    A fused kernel may write a buffer behind autograd's back: torch's ``FusedMovingAvgObsFakeQuantize``
    (every ``get_default_qat_qconfig`` model's observer) updates ``min_val``, ``scale``... at version 0.
    """
    buffers = dict(gm.named_buffers())
    return [n for n, was in before.items() if n in buffers and not torch.equal(buffers[n], was)]


def snapshot(gm: torch.fx.GraphModule, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """Copy the buffers (or parameters) ``names`` of ``gm`` as they are now."""
    if not names:
        return {}  # most stages write none: no walk over the module tree per micro-batch
    buffers = state(gm)
    with torch.no_grad():  # a sparse buffer (a graph's adjacency) is not written in place: no copy, no compare
        return {n: buffers[n].detach().clone() for n in names
                if n in buffers and not buffers[n].is_meta and buffers[n].layout == torch.strided}


@contextmanager
def replayed(gm: torch.fx.GraphModule, names: Sequence[str], before: dict[str, torch.Tensor]) -> Iterator[None]:
    """Run the block with the buffers ``names`` as copied in ``before`` (scratch copies where not); put them back after."""
    buffers = state(gm) if names else {}
    tensors = {n: buffers[n] for n in names if n in buffers and not buffers[n].is_meta}
    if not tensors:
        yield
        return
    # swapped, not copied: autograd may have saved these tensors for the backward being
    # computed, and an in-place copy would fail its version check
    current = {n: t.data for n, t in tensors.items()}
    with torch.no_grad():
        for n, t in tensors.items():
            t.data = before[n] if n in before else t.data.clone()
    try:
        yield
    finally:
        for n, t in tensors.items():
            t.data = current[n]


def note_written_weights(exc: BaseException, gms: Sequence[torch.fx.GraphModule]) -> None:
    """Note on autograd's in-place error the trainable parameters a stage's forward writes in place, with the fix.

    Each micro-batch's forward writes them again before an earlier micro-batch's backward reads
    what it saved (``self.head.weight[:, 0] = 0`` under ``torch.no_grad()``, pruning by hand).
    """
    if not isinstance(exc, RuntimeError) or "modified by an inplace operation" not in str(exc):
        return
    weights = [name for gm in gms for name in written_buffers(gm)
               if (p := dict(gm.named_parameters()).get(name)) is not None and p.requires_grad]
    if weights:
        add_note(
            exc, f"fxpipe: the forward writes {', '.join(weights[:3])} in place, a parameter that trains: each micro-batch's "
            "forward writes it again before an earlier micro-batch's backward reads the value it saved. Write it "
            "outside the forward (after optimizer.step()), or compute the weight used as a new tensor each forward "
            "(torch.nn.utils.prune or parametrize: weight * mask), or use chunks=1")
