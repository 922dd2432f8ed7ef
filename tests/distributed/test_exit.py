"""A distributed pipe at interpreter exit: its process groups are freed while Python still runs."""

import json
import multiprocessing as mp
import sys

import pytest
from launch import free_port, run, start_and_join


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc/self/task")
def test_groups_freed_before_finalization(tmp_path):
    # a pipe in a module global lives until the interpreter tears down; were its groups freed then,
    # a gloo thread dropping a tensor could not take the GIL and the process would abort (exit -6)
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=run, args=(r, 2, port, "exit_cases:global_pipe", "1f1b", str(tmp_path)))
             for r in range(2)]
    assert not start_and_join(procs, 120.0)
    assert [p.exitcode for p in procs] == [0, 0]
    for r in range(2):
        assert json.loads((tmp_path / f"rank{r}.json").read_text())["ok"]
        seen = json.loads((tmp_path / f"exit{r}.json").read_text())
        assert seen["released"] and seen["groups"] == [False] * 4 and seen["wrapped"] == 0
        # gloo's threads of the pipeline's and the replicas' groups are joined: fewer than while training
        assert seen["exit_threads"] < seen["running_threads"] - 2, seen
