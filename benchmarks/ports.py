"""A free TCP port for the benchmarks' spawned ranks (the tests' own), spawned ranks run to the end, and two run to a deadline."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "support"))
from launch import free_port, start_and_join

__all__ = ["free_port", "run_ranks", "run_two_ranks"]


def run_ranks(rank: Callable, world: int, *args: Any) -> Any:
    """Spawn ``rank(r, port, *args, out)`` on ``world`` ranks and wait for them; return out's JSON (None if one failed)."""
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        procs = [ctx.Process(target=rank, args=(r, port, *args, out)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs) or not os.path.exists(out):
            return None
        with open(out) as f:
            return json.load(f)


def run_two_ranks(rank: Callable, seconds: float, share: float, standin: bool, name: str, what: str) -> Any:
    """Spawn ``rank(r, port, standin, deadline, out)`` on ranks 0 and 1, wait at most ``seconds``; return out's JSON.

    The ranks get ``share`` of ``seconds`` as their deadline to stop measuring; a rank still
    running after ``seconds``, or none writing ``out``, raises naming ``what`` did not finish.
    """
    ctx = mp.get_context("spawn")
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, name)
        deadline = time.time() + share * seconds
        port = free_port()
        procs = [ctx.Process(target=rank, args=(r, port, standin, deadline, out)) for r in range(2)]
        stuck = start_and_join(procs, seconds - (time.monotonic() - start))
        if stuck or not os.path.exists(out):
            why = f"ranks {stuck} still running after {seconds:.0f} s" if stuck else \
                f"exit codes {[p.exitcode for p in procs]}"
            raise RuntimeError(f"{what} did not finish: {why}")
        with open(out) as f:
            return json.load(f)
