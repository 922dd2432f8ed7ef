"""Let go of every distributed pipe's process groups when the interpreter exits, while Python is whole.

A process group's threads are joined when the group is freed. A pipe holds its groups (the
pipeline's, DDP's reducer, the ties') inside reference cycles (a traced graph is one), so
without help they are freed only by the interpreter's last collection, while it tears itself
down; a gloo thread that then drops the last reference to a tensor needs the GIL, which a
finalizing interpreter no longer hands out, and the process aborts
("terminate called without an active exception") after the script has finished. Seen on
pp1 x dp4: the device mesh's ``dp`` dimension spans every rank, so it reuses the world group,
which the pipe then keeps past ``destroy_process_group()``; the worker finishing the script's
last ``all_gather_object`` freed its tensors during finalization (a core dump's stacks)::

    script ends ──▶ finalization frees the pipe ──▶ gloo thread frees a tensor ──▶ abort (exit -6)
    script ends ──▶ atexit: pipes drop their groups, gc ──▶ threads joined ──▶ clean exit

Every :class:`~fxpipe.runtime.distributed.DistributedRuntime` registers here; one ``atexit``
handler releases them all and collects, so the groups are freed while the interpreter still
runs. Call ``torch.distributed.destroy_process_group()`` at the end of the script as PyTorch
asks: the groups torch itself still registers are its to free, and so are those that DTensor
parameters (FSDP2, tensor parallel) keep through their device mesh, which PyTorch's own
caches hold past the pipe.
"""

from __future__ import annotations

import atexit
import gc
import logging
import weakref
from typing import Any

__all__ = ["release_all", "track"]

log = logging.getLogger(__name__)

_LIVE: weakref.WeakSet = weakref.WeakSet()
_REGISTERED = False


def track(runtime: Any) -> None:
    """Release ``runtime`` (it has a ``release()`` method) at interpreter exit, unless freed before."""
    global _REGISTERED
    _LIVE.add(runtime)
    if not _REGISTERED:
        atexit.register(release_all)
        _REGISTERED = True


def release_all() -> None:
    """Release every live runtime's process groups, then collect the cycles that held them."""
    for runtime in list(_LIVE):
        try:
            runtime.release()
        except Exception as exc:  # noqa: BLE001 - exiting: free what can be freed
            log.debug("releasing a pipe at exit: %s", exc)
    gc.collect()
