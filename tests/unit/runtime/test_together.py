"""A call every rank makes together names itself and the fix when the others never join it."""

import pytest

from fxpipe import PeerFailure
from fxpipe.runtime.transport.sameoptions import summary
from fxpipe.runtime.transport.together import together
from fxpipe.options import CompileOptions


def test_a_timed_out_collective_becomes_a_peer_failure_naming_the_call_and_the_fix():
    with pytest.raises(PeerFailure, match=r"rank 0: fxpipe.save is called by every rank together, but the other "
                                          r"ranks did not join it \(\[gloo\] Timed out waiting 20000ms for send "
                                          r"operation to complete\): call it on every rank, not under `if rank == 0:`"):
        with together("fxpipe.save", 0):
            raise RuntimeError("[gloo] Timed out waiting 20000ms for send operation to complete")


def test_a_failed_collective_is_counted_by_the_runtime_as_a_failed_step():
    # so the rank's next call rejoins its peers instead of failing again on the closed connections
    told = []
    with pytest.raises(PeerFailure, match="skip this rank's next pipe.step too"):  # the others' failed meanwhile
        with together("fxpipe.save", 0, told.append):
            raise RuntimeError("Connection closed by peer")
    assert len(told) == 1 and "Connection closed" in str(told[0])


def test_gloos_source_line_and_crash_advice_are_left_out_of_the_message():
    # "[.../gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:35997. This is typically
    # caused by a remote worker crashing. Check the logs ... GLHF!" blamed a crash where the peer had only
    # skipped the call (fxpipe.save under `if rank == 0:`)
    gloo = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer "
            "[127.0.0.1]:35997. This is typically caused by a remote worker crashing. Check the logs of the remote "
            "worker before reporting an error. GLHF! \U0001f3d6\ufe0f")
    with pytest.raises(PeerFailure) as info:
        with together("fxpipe.save", 0):
            raise RuntimeError(gloo)
    message = str(info.value)
    assert "did not join it (Connection closed by peer [127.0.0.1]:35997.): call it on every rank" in message
    assert "pair.cc" not in message and "crashing" not in message and "GLHF" not in message


@pytest.mark.parametrize("exc", [ValueError("a refusal"), RuntimeError("a user's bug"), PeerFailure("rank 1 died")])
def test_other_failures_pass_through_as_they_are(exc):
    told = []
    with pytest.raises(type(exc)) as info:
        with together("fxpipe.clip_grad_norm_", 0, told.append):
            raise exc
    assert info.value is exc and not told


def test_the_compared_options_describe_equal_values_alike_and_action_lists_briefly():
    a = summary(CompileOptions(n_stages=2, schedule="1f1b", chunks=4))
    assert a == summary(CompileOptions(n_stages=2, schedule="1f1b", chunks=4))
    assert a["schedule"] == "'1f1b'" and a["chunks"] == "4"
    actions = [f"0F{i}" for i in range(40)]
    described = summary(CompileOptions(n_stages=2, schedule=actions))["schedule"]
    assert described.startswith("a list of 40 entries (digest ")
    assert summary(CompileOptions(n_stages=2, tracer=len))["tracer"] == "a callable len"
    backend = {"backend": lambda gm, inputs: gm}  # an address in its repr differs from process to process
    assert " at 0x" not in summary(CompileOptions(n_stages=2, torch_compile=backend))["torch_compile"]
