"""What a rank's step runs under (training mode, autocast, loss reduction), compared with the first rank's.

Every rank of a pipeline must step under the same state: the values crossing ranks have the
autocast dtype, the first rank's mode decides dropout and batch norm, and only the loss's rank
weighs the micro-batches. The other ranks compare theirs with the layout the first rank sends;
the loss's rank also sends its state with its word on the target before each later step
(:func:`fxpipe.runtime.transport.steplayout.tell_target_given`), so that a mismatch there is
refused by the first rank, on every rank, before anything runs::

    loss rank ──(has target, mode, autocast, reduction)──▶ first rank: refuses a mismatch in the layout
"""

from __future__ import annotations

from fxpipe.frontend.export import enabled_autocast
from fxpipe.runtime.validate import describe_autocast

__all__ = ["mismatch", "state"]

State = tuple[bool, tuple, str]  # training, enabled autocast, loss reduction ("" for pipe(x))


def state(training: bool, reduction: str) -> State:
    """Return this rank's state for a call in ``training`` mode with ``reduction`` (``""``: not a step)."""
    return training, tuple(enabled_autocast()), reduction


def mismatch(me: int, mine: State, first: int, theirs: State, role: str = " (the first stage's)") -> str | None:
    """Say how rank ``me``'s state differs from rank ``first``'s (``role``), naming the fix; None if alike."""
    (training, autocast, reduction), (their_training, their_autocast, their_reduction) = mine, theirs
    if reduction and their_reduction and reduction != their_reduction:
        return (f"rank {me} called pipe.step with loss_reduction={reduction!r} but rank {first}{role} "
                f"with {their_reduction!r}: only the rank computing the loss (the last stage's) weighs the "
                "micro-batches, by its own, so another rank's would be ignored. Pass the same loss_reduction= (and "
                "loss_fn=) on every rank")
    if training != their_training:
        mode, other = ("training", "eval") if training else ("eval", "training")
        return (f"rank {me}'s pipe is in {mode} mode but rank {first}'s{role} is in {other} mode: "
                "call pipe.train() or pipe.eval() on every rank, as every rank calls pipe.step and pipe(x)")
    if tuple(autocast) != tuple(their_autocast):
        return (f"rank {me} runs {describe_autocast(tuple(autocast))} but rank {first}{role} runs "
                f"{describe_autocast(tuple(their_autocast))}: the ranks exchange values in the autocast dtype, so "
                "enter the same torch.autocast on every rank")
    return None
