"""The fxpipe plan command: the ranked table, the saved plan, errors and exit codes."""

import os
import re
import subprocess
import sys
import textwrap

import pytest
from paths import ROOT

from fxpipe.tools import cli

MODELS = textwrap.dedent('''
    import functools

    import torch
    from torch import nn


    def mlp():
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)) for _ in range(4)])
        return model, torch.randn(32, 64)


    def no_inputs():
        return nn.Linear(4, 4)


    def passes_through(forward):
        @functools.wraps(forward)
        def wrapper(*args, **kwargs):
            return forward(*args, **kwargs)
        return wrapper


    class Wrapped(nn.Module):  # forward wrapped as Hugging Face transformers 5 does: fx cannot trace it
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(64, 64) for _ in range(4)])

        @passes_through
        def forward(self, x):
            for layer in self.layers:
                x = torch.relu(layer(x))
            return x


    def wrapped():
        torch.manual_seed(0)
        return Wrapped(), torch.randn(8, 64)


    def tied():
        model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 16))
        model[-1].weight = model[0].weight
        return model, torch.randint(0, 16, (16, 3))


    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(64, 64) for _ in range(4)])

        def forward(self, x, scale=2.0):
            for layer in self.layers:
                x = torch.relu(layer(x))
            return x * scale if scale is not None else x


    def scaled():
        torch.manual_seed(0)
        return Scaled(), (torch.randn(8, 64),), {"scale": None}
''')


@pytest.fixture
def models(tmp_path):
    path = tmp_path / "plan_models.py"
    path.write_text(MODELS)
    return str(path)


def test_plan_prints_the_ranking_and_saves_the_first_choice(models, tmp_path, capsys):
    out = tmp_path / "best.json"
    trace = tmp_path / "trace.json"
    status = cli.main(["plan", f"{models}:mlp", "--ranks", "4", "--device", "h100", "--memory", "80GB",
                       "--global-batch", "256", "--chunks", "1,4,16", "--json", str(out), "--trace", str(trace),
                       "--top", "5"])
    text = capsys.readouterr().out
    assert status == 0, text
    assert "on 4 x h100 (nominal)" in text and "global batch 256" in text
    lines = text.splitlines()
    top = next(k for k, line in enumerate(lines) if line.split()[:3] == ["#", "stages", "chunks"])
    assert [line.split()[0] for line in lines[top + 2:top + 7]] == ["1", "2", "3", "4", "5"]
    assert "first choice:" in text and "plan saved to" in text
    assert re.search(r"fxpipe\.compile\(model, \d+, example_inputs=\(x,\), plan=", text), text  # runs as printed
    assert out.exists() and trace.exists()
    # the saved plan is a plan `fxpipe inspect --plan` reuses
    assert cli.main(["inspect", f"{models}:mlp", "--plan", str(out)]) == 0
    assert "plan from" in capsys.readouterr().out


def test_the_printed_compile_call_gives_the_example_keywords(models, tmp_path, capsys):
    # it wrote example_inputs=(x,) only: followed with the plan, scale= was left at 2.0 where the plan fixed None
    # (PlanMismatchError: renamed (1): scale_1 -> scale)
    out = tmp_path / "best.json"
    assert cli.main(["plan", f"{models}:scaled", "--ranks", "2", "--chunks", "2", "--schedules", "1f1b",
                     "--json", str(out)]) == 0
    assert "example_inputs=(x,), example_kwargs={'scale': None}, plan=" in capsys.readouterr().out


def test_inputs_the_model_does_not_take_fail_in_one_paragraph(models, capsys):
    # it was "error: PropagationError: ..." with torch's "Original traceback: None" and "--traceback" advice
    status = cli.main(["plan", f"{models}:mlp", "--ranks", "2", "--device", "h100", "--input-shape", "8,16"])
    err = capsys.readouterr().err
    assert status == 1 and err.startswith("fxpipe plan: error: the model does not run on the example inputs: node "), err
    assert "Original traceback" not in err and "--traceback" not in err


def test_a_budget_nothing_fits_fails_naming_the_smallest(models, capsys):
    status = cli.main(["plan", f"{models}:mlp", "--ranks", "2", "--device", "a100", "--memory", "10kB",
                       "--chunks", "2"])
    err = capsys.readouterr().err
    assert status == 1
    assert "no configuration fits in 10.0kB per device; the smallest needs" in err


@pytest.mark.parametrize("args, message", [
    (["--device", "tpu"], "device='tpu'"),
    (["--memory", "lots"], "not a memory size"),
    (["--schedules", "gpipe,pipedream"], "'pipedream' is not a schedule"),
    (["--schedules", "zbv"], "'zbv' places several stages on a rank, which fxpipe plan --ranks does not search"),
    (["--device", "h100", "--measure"], "--measure times nodes on this machine"),
])
def test_bad_options_exit_2(models, capsys, args, message):
    assert cli.main(["plan", f"{models}:mlp", "--ranks", "2", *args]) == 2
    assert message in capsys.readouterr().err


def test_a_model_without_inputs_asks_for_them(models, capsys):
    assert cli.main(["plan", f"{models}:no_inputs", "--ranks", "2", "--device", "h100"]) == 2
    assert "planning needs example inputs" in capsys.readouterr().err


@pytest.mark.slow  # about 2 s or more: left out of the fast loop
def test_plan_runs_as_a_command():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-m", "fxpipe", "plan", "--help"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "--ranks" in done.stdout and "--memory" in done.stdout


def test_the_cluster_search_prints_the_call_and_launch_line_and_saves_a_plan(models, tmp_path, capsys):
    out = tmp_path / "plan.json"
    status = cli.main(["plan", f"{models}:mlp", "--gpus", "16", "--gpus-per-node", "8", "--device", "h100",
                       "--memory", "80GB", "--global-batch", "256", "--dtype", "bf16", "--top", "3", "--json", str(out)])
    text = capsys.readouterr().out
    assert status == 0
    assert "in 2 node(s) of 8" in text and "layouts," in text and "pruned by the compute bound" in text
    assert "pipe = fxpipe.compile(model, " in text and f"plan={str(out)!r}" in text
    assert "torchrun --nnodes 2 --nproc-per-node 8" in text
    import fxpipe
    plan = fxpipe.PipelinePlan.load(str(out))
    assert plan.layout["runtime"] == "distributed"
    s = plan.layout
    assert s["data_parallel"] * (plan.n_stages // s["stages_per_rank"]) * s["tensor_parallel"] == 16


def test_the_cluster_search_names_what_overflows(models, capsys):
    status = cli.main(["plan", f"{models}:mlp", "--gpus", "4", "--gpus-per-node", "4", "--device", "h100",
                       "--memory", "400kB", "--global-batch", "32"])
    err = capsys.readouterr().err
    assert status == 1
    assert "no layout fits in 400.0kB per device; the closest:" in err
    assert "parameters" in err and "> 400.0kB" in err


def test_layouts_compile_refuses_are_not_counted_over_the_memory_budget(models, capsys):
    # ZB-V on 2 ranks x 2 replicas puts the tied embedding and head on one rank: they read "8 over the memory budget"
    # and "raise --memory", on 80 GB devices
    status = cli.main(["plan", f"{models}:tied", "--gpus", "4", "--gpus-per-node", "4", "--device", "h100",
                       "--global-batch", "16", "--schedules", "zbv", "--stages", "4", "--tp", "1"])
    out, err = capsys.readouterr()
    assert status == 1
    assert "0 over the memory budget, 6 refused by fxpipe.compile (a tensor shared by stages 0 and 3" in out
    assert "no layout runs: each is one fxpipe.compile refuses" in err and "raise --memory" not in err


@pytest.mark.parametrize("args, message", [
    (["--ranks", "2", "--gpus", "4"], "give --ranks N (one pipeline, a stage per rank) or --gpus N"),
    (["--gpus", "12", "--gpus-per-node", "8"], "is not a whole number of 8-GPU nodes"),
    (["--ranks", "2", "--seq", "8"], "--seq, --tp and --inter-node-bandwidth go with --gpus"),
    # these exited 1 with "error: ValueError: ..." (or min() of an empty sequence), as if the model had failed
    (["--gpus", "4", "--gpus-per-node", "4", "--tp", "3"], "tensor_parallel=3: the automatic TP plan cannot split"),
    (["--gpus", "4", "--stages", "3"], "no layout of 4 GPUs with stages in [3] takes a global batch"),
    (["--gpus", "4", "--seq", "0"], "argument --seq: '0' is not a positive integer"),
    (["--ranks", "2", "--stages", "4"], "stages=4 on 2 ranks: this search places one stage per rank"),
    (["--ranks", "2", "--chunks", "64"], "chunks=64 with a global batch of 32 rows: a micro-batch holds at least"),
])
def test_bad_cluster_options_exit_2(models, capsys, args, message):
    try:
        status = cli.main(["plan", f"{models}:mlp", *args])
    except SystemExit as exc:  # argparse's own refusal
        status = exc.code
    assert status == 2
    assert message in capsys.readouterr().err


def test_link_speeds_read_bits_or_bytes():
    import argparse

    from fxpipe.tools.clustercmd import bandwidth
    assert bandwidth("400Gb/s") == bandwidth("400") == pytest.approx(50e9)
    assert bandwidth("25GB/s") == pytest.approx(25e9)
    with pytest.raises(argparse.ArgumentTypeError, match="is not a link speed"):
        bandwidth("fast")


def test_a_model_only_export_traces_is_planned_with_tracer_export_and_the_plan_records_it(models, tmp_path, capsys):
    import torch

    import fxpipe

    assert cli.main(["plan", f"{models}:wrapped", "--ranks", "2", "--stages", "2", "--device", "h100"]) == 1
    assert "On the command line: --tracer export" in capsys.readouterr().err
    out, out2 = tmp_path / "plan.json", tmp_path / "plan2.json"
    assert cli.main(["plan", f"{models}:wrapped", "--ranks", "2", "--stages", "2", "--device", "h100",
                     "--tracer", "export", "--json", str(out)]) == 0
    assert cli.main(["plan", f"{models}:wrapped", "--gpus", "2", "--gpus-per-node", "2", "--device", "h100",
                     "--tracer", "export", "--json", str(out2)]) == 0
    assert fxpipe.PipelinePlan.load(str(out)).layout["tracer"] == "export"
    assert fxpipe.PipelinePlan.load(str(out2)).layout["tracer"] == "export"
    capsys.readouterr()
    assert cli.main(["inspect", f"{models}:wrapped", "--plan", str(out)]) == 0  # the plan's tracer, not fx
    namespace: dict = {}
    exec(MODELS, namespace)
    model, x = namespace["wrapped"]()
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), devices=["cpu"] * 2, plan=str(out))
    torch.testing.assert_close(pipe(x), namespace["wrapped"]()[0](x))


def test_uneven_micro_batches_read_as_their_rows(models, capsys):
    # a global batch of 30 at chunks=4 read "rows 7.5"; the micro-batches hold 7 and 8
    assert cli.main(["plan", f"{models}:mlp", "--ranks", "2", "--global-batch", "30", "--chunks", "4",
                     "--schedules", "gpipe", "--checkpoint", "never"]) == 0
    table = capsys.readouterr().out
    rows = re.findall(r"^\s+\d+\s+\d+\s+\d+\s+(\S+)\s+gpipe", table, re.M)  # the ranking's rows column (a time
    assert rows and set(rows) == {"7-8"}, table                                # elsewhere may read 7.5 ms)


def test_plan_takes_export_dims_and_its_plan_records_it(tmp_path, capsys):
    # fxpipe plan had no --export-dims: a model whose export is slow with its other dims automatic could not be planned
    import fxpipe

    path = tmp_path / "pooled.py"
    path.write_text("import torch\nfrom torch import nn\n"
                    "def factory():\n"
                    "    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), (torch.randn(4, 8),)\n")
    out = tmp_path / "plan.json"
    assert cli.main(["plan", f"{path}:factory", "--ranks", "2", "--tracer", "export", "--export-dims", "batch",
                     "--json", str(out)]) == 0
    assert fxpipe.PipelinePlan.load(str(out)).layout["export_dims"] == "batch"
    capsys.readouterr()
    assert cli.main(["plan", f"{path}:factory", "--ranks", "2", "--export-dims", "batch"]) == 2
    assert "--export-dims batch sets which dims torch.export keeps dynamic" in capsys.readouterr().err
