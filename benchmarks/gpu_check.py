"""Check fxpipe on this machine's GPUs in about seven minutes: the CUDA tests, then what overlaps.

    python benchmarks/gpu_check.py OUT_DIR     # OUT_DIR gets the test log, the traces, the summary

1. tests    ``pytest -m cuda``: the CUDA tests in tests/ (log and JUnit XML in OUT_DIR).
2. copies   (one GPU or more) 4 stages alternating between cuda:0 and the CPU, so that every
            boundary is a copy: a training step with copy streams (fxpipe's way) against the
            same pipeline with every copy on the compute stream, under GPipe and 1F1B, median
            step times; from a timeline of each GPipe step (Chrome traces in OUT_DIR), the
            fraction of the forward copies' time during which some stage computes.
3. speedup  (two GPUs or more) 2, 3 and 4 stages, one GPU each, against one GPU at m = 8 and
            32, beside GPipe's bound k*m / (m + k - 1).
4. nccl     (two GPUs or more) fxpipe against torch.distributed.pipelining, 2 ranks under NCCL
            (:mod:`gpu_nccl`).  Parts 2 and 3 live in :mod:`gpu_measure`.
5. compiled (one GPU or more) compiled stages (``torch_compile=``, inductor) against eager, zero
            bubble, 2 stages on cuda:0: step times, compile time, gradients, W after I
            (:mod:`gpu_compiled`).
6. overhead (one GPU or more) every stage on cuda:0 (1, 2 and 4 stages, GPipe and 1F1B)
            against eager over the whole batch and over the same micro-batches (the limit):
            fxpipe's own cost on a GPU (:mod:`gpu_overhead`).
7. tp       (two GPUs or more) tensor parallelism: one decoder stage over 2 GPUs (tensor_parallel=2,
            tp_plan="auto") against the whole model on one: the loss, the collectives against the
            plan's count, the step times (:mod:`gpu_tp`).

Each part has a time budget and measures fewer repetitions rather than overrun it. One
summary table at the end, also in OUT_DIR/summary.md and summary.json; the exit status is 1
if a test or a part failed. Without CUDA it says so and exits 0. ``--standin`` runs parts
2-4 on CPU devices standing in for the GPUs, at toy sizes and with gloo: it checks the
script itself, and its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET

import torch

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path[:0] = [ROOT, BENCH]
from gpu_measure import measure_copies, measure_speedup, overlap

__all__ = ["main", "overlap"]

PARTS = ("tests", "copies", "overhead", "speedup", "nccl", "compiled", "tp")
BUDGET_S = {"tests": 120, "copies": 45, "overhead": 40, "speedup": 50, "nccl": 60, "compiled": 60,
            "tp": 45}  # 420 s; one GPU 265 s


class Clock:
    """Seconds left of the whole check, and of each part's share."""

    def __init__(self, total: float) -> None:
        self.end = time.monotonic() + total

    def share(self, part: str) -> float:
        """Return the seconds ``part`` may take: its budget, or what is left if less."""
        return max(0.0, min(BUDGET_S[part], self.end - time.monotonic()))

# -- 1. the CUDA tests ---------------------------------------------------------------------

def run_tests(out: str, seconds: float, rows: list) -> bool:
    """Run ``pytest -m cuda`` in a subprocess within ``seconds``; add a row; return whether all passed."""
    xml, log = os.path.join(out, "pytest.xml"), os.path.join(out, "pytest.log")
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-rfEs", "-p", "no:cacheprovider", "--durations=15",
           f"--junitxml={xml}", "tests"]
    if importlib.util.find_spec("pytest_timeout") is not None:  # one hanging test must not eat the others' time
        cmd.insert(-1, "--timeout=60")
    start = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=max(1.0, seconds))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # pytest and the ranks it spawned
            proc.wait()
            code = None
    took = time.monotonic() - start
    if code is None or not os.path.exists(xml):
        rows.append(["tests", "pytest -m cuda", f"stopped after {took:.0f} s" if code is None
                     else f"exit {code}, no report", "see pytest.log"])
        return False
    root = ET.parse(xml).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    assert suite is not None, "pytest's JUnit XML has no testsuite"
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    failed = [c.get("name", "?") for c in suite.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    rows.append(["tests", "pytest -m cuda", f"{passed} passed, {len(failed)} failed, {n['skipped']} skipped",
                 f"{took:.0f} s" + (f"; failed: {', '.join(failed[:4])}" if failed else "")])
    return code == 0


# -- the check -----------------------------------------------------------------------------

def header(standin: bool) -> str:
    """Describe torch and the devices."""
    if standin:
        return f"fxpipe GPU check on CPU stand-ins (numbers mean nothing): torch {torch.__version__}"
    names = [torch.cuda.get_device_name(k) for k in range(torch.cuda.device_count())]
    return (f"fxpipe GPU check: torch {torch.__version__}, CUDA {torch.version.cuda}, "
            f"{len(names)} GPU(s): {', '.join(sorted(set(names)))}")


def main(argv: list[str] | None = None) -> int:
    """Run the check; return the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", help="directory for the test log, the traces and the summary")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--standin", action="store_true", help="CPU devices stand in for GPUs (checks the script)")
    parser.add_argument("--total", type=float, default=430.0, help="seconds for the whole check")
    parser.add_argument("--compiled-batch", type=int, default=None,
                        help="the compiled part's batch (default 4096; 16384 makes it bound by the GPU)")
    parser.add_argument("--tf32", action="store_true", help="let float32 matrix products use TF32")
    args = parser.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    if not args.standin and not torch.cuda.is_available():
        build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        print(f"gpu_check: no CUDA device on this machine (torch {torch.__version__}, {build}); "
              "nothing to check. Run it where a GPU is present.")
        return 0
    if importlib.util.find_spec("fxpipe") is None or importlib.util.find_spec("fxpipe.passes") is None:
        print("gpu_check: fxpipe is not installed here (its passes/ folder installs as fxpipe.passes); "
              "run `pip install --no-deps -e .` in the repository first.")
        return 2
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown parts {unknown}; choose from {', '.join(PARTS)}")
    os.makedirs(args.out, exist_ok=True)
    clock = Clock(args.total)
    title = header(args.standin)
    print(title, flush=True)
    gpus = ["cpu:0", "cpu"] if args.standin else [f"cuda:{k}" for k in range(torch.cuda.device_count())]
    rows: list[list[str]] = []
    ok = True
    for part in parts:
        seconds, start = clock.share(part), time.monotonic()
        print(f"{part}: up to {seconds:.0f} s", flush=True)
        try:
            if part == "tests":
                ok &= run_tests(args.out, seconds, rows)
            elif part == "copies":
                measure_copies(args.out, seconds, rows, args.standin)
            elif part == "overhead":
                from gpu_overhead import measure_overhead

                measure_overhead(seconds, rows, args.standin)
            elif part == "compiled":
                from gpu_compiled import measure_compiled

                measure_compiled(args.out, seconds, rows, args.standin, args.compiled_batch)
            elif len(gpus) < 2:
                rows.append([part, "skipped", "needs 2 GPUs", f"{len(gpus)} here"])
            elif part == "speedup":
                measure_speedup(seconds, rows, gpus, args.standin)
            elif part == "tp":
                from gpu_tp import measure_tp

                measure_tp(seconds, rows, args.standin)
            else:
                from gpu_nccl import measure_nccl

                measure_nccl(seconds, rows, args.standin)
        except Exception as exc:  # noqa: BLE001 - a broken part is reported, the others still run
            ok = False
            with open(os.path.join(args.out, f"{part}.err"), "w") as f:
                f.write(traceback.format_exc())
            rows.append([part, "failed", f"{type(exc).__name__}: {exc}"[:120], f"{part}.err"])
        print(f"{part}: {time.monotonic() - start:.0f} s", flush=True)
    return summarize(args.out, title, rows, ok)


def summarize(out: str, title: str, rows: list[list[str]], ok: bool) -> int:
    """Print the summary table, write it to ``out``; return the exit status."""
    from tabulate import tabulate

    columns = ["part", "measurement", "value", "note"]
    print("\n" + title + "\n" + tabulate(rows, headers=columns))
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(title + "\n\n" + tabulate(rows, headers=columns, tablefmt="github") + "\n")
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump({"title": title, "ok": ok, "rows": [dict(zip(columns, r)) for r in rows]}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
