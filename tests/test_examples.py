"""The example scripts run as their docstrings say."""

import os
import subprocess
import sys

from launch import free_port as _free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_train_distributed_resumes_equal_to_an_unbroken_run():
    # torchrun on 4 CPU processes: 2 pipeline ranks x 2 replicas, save after 4 steps, load, 2 more
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                           "--master-port", str(_free_port()), os.path.join(ROOT, "examples", "train_distributed.py")],
                          capture_output=True, text=True, timeout=240, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "4 ranks: 2 pipeline ranks x 2 replicas" in done.stdout
    assert "(equal)" in done.stdout, done.stdout
