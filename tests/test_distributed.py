"""The distributed runtime on CPU with gloo: 2 and 3 ranks, every schedule, failures."""

import json
import multiprocessing as mp
import socket
import time

import pytest

import dist_cases


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(case: str, world: int, schedule: str, tmp_path, limit: float = 120.0) -> list[dict]:
    """Run ``case`` on ``world`` spawned ranks; return each rank's result."""
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=dist_cases.run, args=(r, world, port, case, schedule, str(tmp_path)))
             for r in range(world)]
    start = time.monotonic()
    for p in procs:
        p.start()
    for p in procs:
        p.join(max(1.0, limit - (time.monotonic() - start)))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not hung, f"ranks {hung} still running after {limit} s"
    results = []
    for r in range(world):
        path = tmp_path / f"rank{r}.json"
        results.append(json.loads(path.read_text()) if path.exists() else {"exitcode": procs[r].exitcode})
    return results


def _assert_equal_to_eager(results):
    for r, res in enumerate(results):
        assert res["ok"], f"rank {r}: {res.get('traceback')}"
        assert res["loss_error"] < 1e-5, (r, res["loss_error"])
        assert res["grad_errors"], f"rank {r} holds no parameters"
        worst = max(res["grad_errors"].items(), key=lambda kv: kv[1])
        assert worst[1] < 1e-5, (r, worst)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb"])
def test_unet_skip_from_stage_0_to_2(schedule, tmp_path):
    results = _launch("unet", 3, schedule, tmp_path)
    _assert_equal_to_eager(results)
    assert any(src == 0 and dst == 2 for _, src, dst in results[0]["skips"])


def test_pipelining_markers_cut_across_ranks(tmp_path):
    results = _launch("marked", 3, "1f1b", tmp_path)
    _assert_equal_to_eager(results)
    assert results[0]["firsts"] == ["x", "layers_2", "tanh_3"]  # pipe_split(), then after layers.3


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb"])
def test_tied_embeddings_first_and_last_rank(schedule, world, tmp_path):
    results = _launch("tied", world, schedule, tmp_path)
    _assert_equal_to_eager(results)
    assert "embed.weight" in results[0]["grad_errors"] and "head.weight" in results[-1]["grad_errors"]


def test_shape_mismatch_fails_clearly_on_every_rank(tmp_path):
    results = _launch("shape", 2, "gpipe", tmp_path)
    for res in results:
        assert not res["ok"] and res["type"] == "PipelineInputError"
        assert "input 'x' has shape (4, 3, 16, 12)" in res["message"]
        assert "built for shape (batch, 3, 16, 16)" in res["message"]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb"])
def test_a_rank_that_raises_stops_the_others(schedule, tmp_path):
    start = time.monotonic()
    results = _launch("raises", 3, schedule, tmp_path, limit=90)
    assert time.monotonic() - start < 45  # well inside the 60 s timeout: failure propagates
    assert results[1]["type"] == "RuntimeError" and "boom in the bomb" in results[1]["message"]
    for r in (0, 2):
        assert results[r]["type"] == "PeerFailure", results[r]
        assert "rank 1 (stage 1) raised RuntimeError: boom in the bomb" in results[r]["message"]


def test_a_rank_that_dies_stops_the_others(tmp_path):
    start = time.monotonic()
    results = _launch("dies", 3, "1f1b", tmp_path, limit=90)
    assert time.monotonic() - start < 45
    assert results[1] == {"exitcode": 3}
    for r in (0, 2):
        assert results[r]["type"] == "PeerFailure", results[r]
        assert f"rank {r}: communication failed while" in results[r]["message"]
        assert "a peer probably died" in results[r]["message"]
