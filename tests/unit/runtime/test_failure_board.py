"""The failure board: a death learned of once stops every later rejoin, store or no store."""

from __future__ import annotations

import threading

import pytest
import torch.distributed as dist

from fxpipe.errors import PeerFailure
from fxpipe.runtime.transport.failure import FailureBoard


class GoneStore:
    """A store whose host has exited: every call fails."""

    def __getattr__(self, name):
        def fail(*args, **kwargs):
            raise RuntimeError("Connection reset by peer")
        return fail


def test_a_death_posted_by_this_rank_is_named_on_rejoin_after_the_store_is_gone():
    board = FailureBoard(dist.HashStore(), rank=2, size=3, timeout=1)
    board.post("rank 1 died (rank 2 lost its connection while receiving)", fatal=True)
    board.store = GoneStore()  # rank 0 hosted it and has exited since
    with pytest.raises(PeerFailure, match=r"lost a rank in an earlier step \(rank 1 died"):
        board.rejoin()


def test_a_death_read_from_the_store_is_named_on_rejoin_after_the_store_is_gone():
    store = dist.HashStore()
    poster, board = _boards(store, 3, 0, 2)
    poster.post("rank 1 died (rank 0 lost its connection while receiving)", fatal=True)
    assert board.read("receiving")["fatal"]
    board.store = GoneStore()
    with pytest.raises(PeerFailure, match=r"lost a rank in an earlier step \(rank 1 died"):
        board.rejoin()


def test_a_later_death_does_not_override_the_first_reason_every_rank_reads():
    store = dist.HashStore()
    first, second = _boards(store, 2, 0, 1)
    first.post("rank 0 raised ValueError")
    second.post("rank 0 died (rank 1 lost its connection)", fatal=True)
    assert second.death is None  # the ranks agree on the first reason: not a death, they may rejoin


def test_without_a_death_a_lost_store_is_named_as_such():
    board = FailureBoard(GoneStore(), rank=1, size=2, timeout=1)
    with pytest.raises(PeerFailure, match="lost the rendezvous store while rejoining"):
        board.rejoin()


def test_a_rank_given_up_on_while_rejoining_is_refused_when_it_comes_back():
    store = dist.HashStore()
    waiting, late = _boards(store, 2, 0, 1)
    waiting.post("rank 0: nothing arrived for 1 s")  # the step both ranks failed
    with pytest.raises(PeerFailure, match=r"rank\(s\) \[1\] did not come back within 1 s.*refuses every later call"):
        waiting.rejoin()  # rank 1 stalls past the timeout
    with pytest.raises(PeerFailure, match=r"rank 0: this rank gave up waiting for rank\(s\) \[1\].*restart the job"):
        waiting.rejoin()  # its next call: refused, not paired with rank 1's late one
    with pytest.raises(PeerFailure, match=r"rank 1: rank 0 gave up waiting .*no longer pair"):
        late.rejoin()  # rank 1 back at last: refused at once instead of running its step with rank 0's next
    assert waiting.generation == late.generation == 0


def test_ranks_back_within_the_timeout_start_a_new_generation():
    store = dist.HashStore()
    first, second = _boards(store, 2, 0, 1)
    first.post("rank 1 raised ValueError")
    joined = threading.Thread(target=second.rejoin)
    joined.start()
    first.rejoin()
    joined.join()
    assert first.generation == second.generation == 1 and first.death is None and second.death is None


def _boards(store, size, *ranks):
    """Return one pipeline's boards for ``ranks`` (sharing its keys, as every rank's do)."""
    boards = [FailureBoard(store, rank=r, size=size, timeout=1) for r in ranks]
    for b in boards[1:]:
        b.prefix = boards[0].prefix
    return boards


def test_a_script_ended_early_is_named_by_its_global_rank_and_the_error_it_ended_on(monkeypatch):
    # the pipelines of a pipe (tensor-parallel indices, replicas) share the keys: they were by pipeline rank, so
    # rank 2 (pipeline rank 1 of pipeline [0, 2]) ending was named "rank 3" by pipeline [1, 3]; and a script
    # ending on an error outside the pipe's calls was told as a skipped call
    store = dist.HashStore()
    ended = FailureBoard(store, rank=1, size=2, timeout=1, global_ranks=[0, 2], world=4)
    other = FailureBoard(store, rank=0, size=2, timeout=1, global_ranks=[1, 3], world=4)
    other.prefix = ended.prefix
    ended.call, other.call = 2, 3
    monkeypatch.setattr("sys.last_value", RuntimeError("crash on rank 2"), raising=False)
    ended.end()
    told = other.ended_before()
    assert told.startswith("the script of rank 2 after 2 call(s) of this pipe ended while rank 1 is in its call 3: "
                           "it ended on an error raised outside the pipe's calls (rank 2 on RuntimeError: crash on "
                           "rank 2;"), told
    assert "restart the job and resume from the last complete checkpoint" in told
    monkeypatch.delattr("sys.last_value")
    ended.end()  # a script ending normally, one call short: a skipped call
    assert "a call skipped on one rank" in other.ended_before()
