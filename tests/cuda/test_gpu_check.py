"""benchmarks/gpu_check.py, on the CPU: without CUDA it exits 0 at once; its overlap measure;
its copy-stream comparison run end to end on CPU devices standing in for a GPU."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from paths import ROOT

SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.py")


@pytest.fixture
def gpu_check(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts benchmarks/ first; undo it after
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_without_cuda_it_says_so_and_exits_0(tmp_path):
    # nothing ran (no output folder); no time bound: importing torch alone took 50 s with other jobs on 2 cores
    done = subprocess.run([sys.executable, SCRIPT, str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert "no CUDA device on this machine" in done.stdout and "nothing to check" in done.stdout
    assert not (tmp_path / "out").exists()


def _event(cat, ts, dur):
    return {"cat": cat, "ts": ts, "dur": dur}


def test_overlap_is_the_share_of_copy_time_under_some_compute(gpu_check):
    events = [_event("forward", 0, 10), _event("backward", 5, 10),  # busy 0-15 (overlapping spans merge)
              _event("recompute", 30, 5),  # busy 30-35
              _event("copy", 10, 10),  # 10-20: half under compute
              _event("copy", 28, 4)]  # 28-32: half under compute
    total_ms, fraction = gpu_check.overlap(events)
    assert total_ms == pytest.approx(14e-3)
    assert fraction == pytest.approx(7 / 14)
    assert gpu_check.overlap([_event("forward", 0, 1)]) == (0.0, 0.0)


@pytest.mark.slow  # about 2 s or more: left out of the fast loop
def test_the_copy_comparison_runs_on_cpu_standins(gpu_check, tmp_path):
    code = gpu_check.main(["--standin", "--parts", "copies,speedup", "--total", "60", str(tmp_path)])
    assert code == 0
    rows = json.loads((tmp_path / "summary.json").read_text())["rows"]
    measured = [r["measurement"] for r in rows if r["part"] == "copies"]
    assert "gpipe step, copies on the compute stream" in measured
    assert "forward copy time overlapped by compute, streams on" in measured
    assert any(r["part"] == "speedup" and r["measurement"].startswith("2 stages") for r in rows)
    trace = json.loads((tmp_path / "copies_streams_off.json").read_text())
    copies = [e for e in trace["traceEvents"] if e.get("cat") == "copy"]
    assert len(copies) == 3 * 4  # three boundaries, four micro-batches
    assert "copies on the compute stream" in (tmp_path / "summary.md").read_text()


@pytest.mark.slow
def test_the_compiled_part_runs_on_cpu_standins(gpu_check, tmp_path):
    assert gpu_check.main(["--standin", "--parts", "compiled", "--total", "60", str(tmp_path)]) == 0
    rows = {r["measurement"]: r for r in json.loads((tmp_path / "summary.json").read_text())["rows"]
            if r["part"] == "compiled"}
    assert "zb step, aot_eager / eager" in rows and rows["W after its I; W's share of backward time"]["value"] \
        .startswith("yes")
    assert float(rows["gradients against eager (max relative error)"]["value"]) < 1e-4
    assert (tmp_path / "compiled_zb.json").exists()


@pytest.mark.slow  # about 20 s: two spawned gloo ranks
def test_the_tensor_parallel_part_runs_on_cpu_standins(gpu_check, tmp_path):
    code = gpu_check.main(["--standin", "--parts", "tp", "--total", "90", str(tmp_path)])
    assert code == 0
    rows = {r["measurement"]: r["value"] for r in json.loads((tmp_path / "summary.json").read_text())["rows"]}
    assert float(rows["tp=2 loss against one GPU's, relative"]) < 1e-5
    counted, planned = rows["collectives counted / planned"].split(" / ")
    assert counted == planned and int(counted) > 0


@pytest.mark.slow
def test_the_overhead_part_runs_on_cpu_standins(gpu_check, tmp_path):
    assert gpu_check.main(["--standin", "--parts", "overhead", "--total", "30", str(tmp_path)]) == 0
    rows = {r["measurement"]: r["value"] for r in json.loads((tmp_path / "summary.json").read_text())["rows"]
            if r["part"] == "overhead"}
    assert "eager step over the m micro-batches (the limit)" in rows
    ratios = [float(v) for k, v in rows.items() if k.startswith("fxpipe")]
    assert len(ratios) == 5 and all(r > 0 for r in ratios)
