"""Run a test case on several fresh ranks (gloo on CPU) and collect each rank's result.

A case is a function ``case(rank, world, schedule) -> dict`` in a module on the tests' path,
named ``"module:function"`` (or a bare function name of ``dist_cases``). Each rank writes its
result (or its exception) as JSON; :func:`launch` returns them in rank order.
"""

from __future__ import annotations

import importlib
import json
import multiprocessing as mp
import os
import socket
import time
import traceback

import torch

__all__ = ["free_port", "launch", "run", "start_and_join"]


def free_port() -> int:
    """Return a TCP port free on this machine now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _case(name: str):
    """Return the case function ``module:function`` (default module: dist_cases)."""
    module, _, func = name.rpartition(":")
    mod = importlib.import_module(module or "dist_cases")
    cases = getattr(mod, "CASES", {})
    return cases[func] if func in cases else getattr(mod, func)


def run(rank: int, world: int, port: int, case: str, schedule: str, outdir: str,
        environ: dict[str, str] | None = None) -> None:
    """Entry point of one spawned rank: run a case, write the result as JSON."""
    if environ is not None:  # the launching test's environment, as a spawned process would inherit it
        os.environ.clear()
        os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), FXPIPE_TEST_DIR=outdir)
    torch.set_num_threads(1)
    if torch.cuda.is_available() and not case.endswith("_nccl"):
        # these cases run on the CPU: with CUDA present fxpipe would pick NCCL and a GPU per rank
        import torch.distributed as dist

        dist.init_process_group("gloo")
    try:
        result = {"ok": True, **_case(case)(rank, world, schedule)}
    except Exception as exc:  # noqa: BLE001 - reported to the test
        result = {"ok": False, "type": type(exc).__name__, "message": str(exc),
                  "traceback": traceback.format_exc()}
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if not result["ok"] and case.rpartition(":")[2] == "raises":
        if rank == 0:  # rank 0 hosts the store the others read the failure from (torchrun's agent outlives them)
            _outlive(outdir, world)
        raise SystemExit(1)  # a failing rank exits like a script with an uncaught exception


def _outlive(outdir: str, world: int, limit: float = 30.0) -> None:
    """Wait until every rank has written its result (at most ``limit`` seconds)."""
    end = time.monotonic() + limit
    while time.monotonic() < end and not all(os.path.exists(os.path.join(outdir, f"rank{r}.json"))
                                             for r in range(world)):
        time.sleep(0.05)


def start_and_join(procs: list, limit: float) -> list[int]:
    """Start ``procs``, wait for them at most ``limit`` seconds in all; kill those still running and return their ranks."""
    start = time.monotonic()
    for p in procs:
        p.start()
    for p in procs:
        p.join(max(1.0, limit - (time.monotonic() - start)))
    stuck = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return stuck


def context() -> mp.context.BaseContext:
    """Return the context ranks start in: forked from a server that imported torch and fxpipe once.

    Each rank is a fresh process, as with ``spawn``, but it skips importing torch, fxpipe and
    the cases (about 4 s of CPU per rank on a 2-core machine, most of a small case's time).
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "fxpipe", "launch", "dist_cases"])
    return ctx


def launch(case: str, world: int, schedule: str, tmp_path, limit: float = 120.0) -> list[dict]:
    """Run ``case`` on ``world`` fresh ranks; return each rank's result."""
    ctx = context()
    port = free_port()
    procs = [ctx.Process(target=run, args=(r, world, port, case, schedule, str(tmp_path), dict(os.environ)))
             for r in range(world)]
    hung = start_and_join(procs, limit)
    assert not hung, f"ranks {hung} still running after {limit} s"
    results = []
    for r in range(world):
        path = tmp_path / f"rank{r}.json"
        results.append(json.loads(path.read_text()) if path.exists() else {"exitcode": procs[r].exitcode})
    return results
