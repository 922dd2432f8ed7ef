"""Skip connections for sequential models: ``@skippable`` layers that ``stash`` and ``pop``.

The names and behaviour of ``torchgpipe.skip``; in a :class:`~fxpipe.compat.torchgpipe.GPipe`
each skip that crosses partitions becomes an fxpipe skip route.
"""

from fxpipe.compat.torchgpipe.skip.namespace import Namespace
from fxpipe.compat.torchgpipe.skip.skippable import (
    Skippable,
    pop,
    skippable,
    stash,
    verify_skippables,
)

__all__ = ["Namespace", "Skippable", "pop", "skippable", "stash", "verify_skippables"]
