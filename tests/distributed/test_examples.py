"""The example scripts run as their docstrings say."""

import os
import subprocess
import sys

from launch import free_port as _free_port
from paths import ROOT


def test_train_distributed_resumes_equal_to_an_unbroken_run():
    # torchrun on 4 CPU processes: 2 pipeline ranks x 2 replicas, save after 4 steps, load, 2 more
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                           "--master-port", str(_free_port()), os.path.join(ROOT, "examples", "train_distributed.py")],
                          capture_output=True, text=True, timeout=240, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "4 ranks: 2 pipeline ranks x 2 replicas" in done.stdout
    assert "(equal)" in done.stdout, done.stdout


def _torchrun(*args: str, restarts: int = 0) -> subprocess.CompletedProcess:
    """Run an example under torchrun on 2 CPU processes."""
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--max-restarts", str(restarts), "--master-port", str(_free_port()), *args],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_resume_after_a_crash_under_torchrun_restarts_equal_to_an_unbroken_run(tmp_path):
    # rank 1 dies in step 4 after four saves; torchrun restarts both ranks, which load step-4 and go on
    script = os.path.join(ROOT, "examples", "resume.py")
    crashed = _torchrun(script, "--ckpt", str(tmp_path / "a"), "--die-at", "4", restarts=1)
    assert crashed.returncode == 0, crashed.stderr[-3000:]
    assert "round 1: resuming from step-4 (step 4)" in crashed.stdout
    unbroken = _torchrun(script, "--ckpt", str(tmp_path / "b"))
    assert unbroken.returncode == 0, unbroken.stderr[-3000:]
    steps = [line for line in unbroken.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 6
    assert [line for line in crashed.stdout.splitlines() if line.startswith("step ")] == steps
