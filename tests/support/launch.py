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
import random
import socket
import time
import traceback

import torch

__all__ = ["free_port", "launch", "run", "start_and_join"]


def _ephemeral() -> tuple[int, int]:
    """Return the kernel's range of ports for outgoing connections (Linux's default elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """Return a TCP port free on this machine now, below the range of outgoing connections' ports.

    Port 0's answer is an ephemeral port: any connection made meanwhile (gloo's pairs and store
    clients of ranks that other test workers run) can take it before rank 0's store binds it,
    and the case fails with EADDRINUSE. A random port below that range is taken only by a listener.
    """
    low, _ = _ephemeral()
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(15000, low) if low > 16000 else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError("no free TCP port found for the test's ranks")


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


def start_and_join(procs: list, limit: float, give_up=None) -> list[int]:
    """Start ``procs``, wait for them at most ``limit`` seconds in all; kill those still running and return their ranks.

    ``give_up()``, polled while they run, ends the wait early when it says true (nothing is stuck then).
    """
    start = time.monotonic()
    for p in procs:
        p.start()
    for p in procs:
        if give_up is None:
            p.join(max(1.0, limit - (time.monotonic() - start)))
        while give_up is not None and p.is_alive() and time.monotonic() - start < limit:
            p.join(0.1)
            if give_up():
                for q in procs:
                    q.kill()
                    q.join()
                return []
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


def _port_taken(results: list[dict]) -> bool:
    """Say whether a rank failed because the store's port was taken before it bound it."""
    return any("EADDRINUSE" in r.get("message", "") for r in results)


def _rank_0_port_taken(tmp_path) -> bool:
    """Say whether rank 0 has reported that its store's port was taken (the others would wait for it in vain)."""
    try:
        return _port_taken([json.loads((tmp_path / "rank0.json").read_text())])
    except (OSError, ValueError):
        return False


def launch(case: str, world: int, schedule: str, tmp_path, limit: float = 120.0) -> list[dict]:
    """Run ``case`` on ``world`` fresh ranks; return each rank's result (on a new port if another process took it)."""
    ctx = context()
    for attempt in range(3):
        for stale in tmp_path.glob("rank*.json"):
            stale.unlink()
        port = free_port()
        procs = [ctx.Process(target=run, args=(r, world, port, case, schedule, str(tmp_path), dict(os.environ)))
                 for r in range(world)]
        hung = start_and_join(procs, limit, give_up=lambda: _rank_0_port_taken(tmp_path))
        assert not hung, f"ranks {hung} still running after {limit} s"
        results = []
        for r in range(world):
            path = tmp_path / f"rank{r}.json"
            results.append(json.loads(path.read_text()) if path.exists() else {"exitcode": procs[r].exitcode})
        if not _port_taken(results) or attempt == 2:
            return results
    return results
