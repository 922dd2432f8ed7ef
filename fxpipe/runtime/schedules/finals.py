"""Each stage's last backward of a step made a full ``B``: where replicas reduce its gradients.

Read by the distributed runtime (:mod:`fxpipe.runtime.dataparallel`) and by the simulator, which
runs the same lists for a pipe with replicas.
"""

from __future__ import annotations

from collections.abc import Sequence

from fxpipe.runtime.schedules.actions import Action

__all__ = ["final_backwards"]


def final_backwards(actions: Sequence[Sequence[Action]]) -> tuple[list[list[Action]], dict[int, int]]:
    """Make each stage's last backward a full ``B`` after all its ``W``; return the lists and its micro-batch.

    Moves the ``W`` steps that come after a stage's last ``B``/``I`` to just before it, and
    turns that last ``I`` (and its ``W``) into one ``B``.
    """
    out, finals = [], {}
    for row in actions:
        row = list(row)
        for s in dict.fromkeys(a.stage for a in row):
            last = max(k for k, a in enumerate(row) if a.stage == s and a.is_backward)
            final = row[last]
            finals[s] = final.mb
            later_w = [a for a in row[last + 1:] if a.stage == s and a.kind == "W"]
            if final.kind == "B" and not later_w:
                continue
            moved = [a for a in later_w if a.mb != final.mb]  # the final one's W goes into its B
            rest = [a for a in row[last + 1:] if a not in later_w]
            row = row[:last] + moved + [Action(s, "B", final.mb)] + rest
        out.append(row)
    return out, finals
