"""How long ``fxpipe plan --gpus N`` takes to answer for a whole cluster (the target: under 60 s for 1024 GPUs).

    python benchmarks/plan_scale.py                  # Llama 3.1 8B and 70B on 1024 H100s (nominal model)
    python benchmarks/plan_scale.py --quick          # the example GPT on 64 GPUs

Each search runs in a fresh process (``python -m fxpipe plan ...``, tracing and annotating the
model on meta included), so the wall time is what a user waits; printed with the count of
layouts, simulations and pruned ones the command reports, and the time over the 60 s target.
Pin the cores to compare with the target: ``taskset -c 0,1 python benchmarks/plan_scale.py``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")

CASES = [
    ("benchmarks/llama.py:llama3_8b", 1024, 2048),
    ("benchmarks/llama.py:llama3_70b", 1024, 2048),
]
QUICK = [("examples/transformer.py:factory", 64, 512)]
TARGET = 60.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small model on 64 GPUs")
    parser.add_argument("--model", action="append", help="another MODEL spec to time (on 1024 GPUs)")
    args = parser.parse_args()
    cases = QUICK if args.quick else CASES + [(m, 1024, 2048) for m in args.model or []]
    for spec, gpus, batch in cases:
        seq = [] if "transformer" in spec else ["--seq", "8192"]
        cmd = [sys.executable, "-m", "fxpipe", "plan", spec, "--gpus", str(gpus), "--gpus-per-node", "8",
               "--device", "h100", "--memory", "80GB", "--global-batch", str(batch), "--dtype", "bf16", "--top", "3",
               *seq]
        start = time.perf_counter()
        done = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - start
        head = done.stdout.splitlines()[0] if done.stdout else done.stderr.strip().splitlines()[-1:]
        print(f"{spec} on {gpus} GPUs: {wall:.1f} s wall ({wall / TARGET:.2f}x the {TARGET:.0f} s target), "
              f"exit {done.returncode}\n  {head}", flush=True)
        if done.returncode:
            print(done.stderr[-2000:])


if __name__ == "__main__":
    main()
