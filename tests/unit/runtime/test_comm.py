"""A failed send leaves nothing holding the pipeline's group, so closing it fails the waiting peers at once."""

import gc
import weakref

import pytest
import torch

from fxpipe.errors import PeerFailure
from fxpipe.runtime.transport.comm import Comm, forget_frames


class _ClosedGroup:
    """A process group whose peer has gone: every send fails at once, as gloo's does."""

    def send(self, tensors, rank, tag):
        """Fail as a send to a closed connection does."""
        raise RuntimeError("Connection closed by peer")

    def recv(self, tensors, rank, tag):
        """Never reached: the send before it fails."""
        raise AssertionError("not reached")


def _comm(group):
    """Make a Comm over ``group`` without a store or a board (the refusal is named plainly)."""
    comm = Comm.__new__(Comm)
    comm.group, comm.global_ranks, comm.pending = group, None, []
    comm._coalescing, comm._ranks = False, {0: 0, 1: 1}
    comm._explain = lambda exc, what, peer=None: PeerFailure(f"lost rank {peer} while {what}: {exc}")
    return comm


def test_a_failed_send_leaves_nothing_holding_the_group():
    # a comprehension's frame in the send's traceback held the group (and was the refusal's __context__),
    # so closing the group after a failed step left its connections open: a peer waited for the timeout
    group = _ClosedGroup()
    ref = weakref.ref(group)
    comm = _comm(group)
    del group
    gc.disable()  # the group must go by reference counting, at close, not at some later collection
    try:
        with pytest.raises(PeerFailure, match="lost rank 1 while sending: Connection closed by peer") as info:
            comm.send([(torch.zeros(2), 1, 0), (torch.zeros(2), 1, 1)], "sending")
        failure = info.value
        del info
        assert failure.__context__ is None and failure.__cause__ is None
        forget_frames(failure)
        comm.group = None  # what close() does, with destroy_process_group
        assert ref() is None, gc.get_referrers(ref())
    finally:
        gc.enable()
