"""A free TCP port for the benchmarks' spawned ranks, and two spawned ranks run to a deadline."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import tempfile
import time
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    """Return a TCP port free on this machine now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        for p in procs:
            p.start()
        for p in procs:
            p.join(max(1.0, seconds - (time.monotonic() - start)))
        stuck = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        if stuck or not os.path.exists(out):
            why = f"ranks {stuck} still running after {seconds:.0f} s" if stuck else \
                f"exit codes {[p.exitcode for p in procs]}"
            raise RuntimeError(f"{what} did not finish: {why}")
        with open(out) as f:
            return json.load(f)
