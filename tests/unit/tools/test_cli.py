"""The fxpipe command: the stage table, exit codes, errors without tracebacks, saved plans, pictures."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
from paths import ROOT

from fxpipe.tools import cli, dot

MODELS = textwrap.dedent('''
    import torch
    from torch import nn


    class DataDependent(nn.Module):
        def forward(self, x):
            if x.sum() > 0:
                return x * 2
            return x


    class Gated(nn.Module):
        def __init__(self):
            super().__init__()
            self.pre, self.gate, self.post = nn.Linear(4, 4), DataDependent(), nn.Linear(4, 4)

        def forward(self, x):
            return self.post(self.gate(self.pre(x)))


    def untraceable():
        return Gated(), torch.randn(4, 4)


    def broken():
        raise ValueError("no checkpoint at ./weights.pt")


    def only_model():
        return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


    def deeper():
        return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
''')


@pytest.fixture
def models(tmp_path):
    path = tmp_path / "cli_models.py"
    path.write_text(MODELS)
    return str(path)


def _run(*args, cwd=ROOT):
    """Run the command in a child Python that imports this checkout."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "fxpipe", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def _rows(stdout):
    """Return the stage numbers of the table's body rows."""
    lines = stdout.splitlines()
    top = next(k for k, line in enumerate(lines) if line.split()[:3] == ["stage", "device", "nodes"])
    body = []
    for line in lines[top + 2:]:
        if not line.split() or not line.split()[0].isdigit():
            break
        body.append(int(line.split()[0]))
    return body


def test_a_device_name_torch_does_not_know_exits_2_naming_the_valid_ones(capsys):
    # torch's "Invalid device string" came out with exit 1, naming no valid device
    with pytest.raises(SystemExit) as exit_:
        cli.main(["inspect", "examples/unet.py:factory", "--stages", "2", "--devices", "gpu0"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "'gpu0' is no torch device: use cpu, cuda or cuda:N" in err


def test_a_negative_warmup_exits_2(capsys):
    # --warmup -1 was taken (exit 0)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["inspect", "examples/unet.py:factory", "--stages", "2", "--warmup", "-1"])
    assert exit_.value.code == 2 and "'-1' is not a whole number (0 or more)" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["inspect", "examples/unet.py:factory", "--stages", "2", "--max-memory"],
                                     ["plan", "examples/unet.py:factory", "--ranks", "2", "--memory"]])
def test_a_negative_size_is_refused_as_a_size(capsys, command):
    # argparse took "-5GB" for an option and said only "expected one argument"
    code = cli.main([*command, "-5GB"])
    assert code == 2 and "'-5GB' is not a memory size" in capsys.readouterr().err


def test_an_output_file_in_a_missing_folder_exits_2_before_tracing(capsys, tmp_path):
    # the model was traced and the table printed first; then FileNotFoundError named x.dot, not the x.svg given
    missing = tmp_path / "nowhere" / "x.svg"
    code = cli.main(["inspect", "examples/unet.py:factory", "--stages", "2", "--dot", str(missing)])
    out, err = capsys.readouterr()
    assert code == 2 and f"--dot {missing}: the folder {missing.parent} does not exist" in err and not out


def test_a_device_count_that_fits_no_stage_count_exits_2(capsys):
    # the library's refusal came out with exit 1, which the docs keep for what the model does
    code = cli.main(["inspect", "examples/unet.py:factory", "--stages", "2", "--devices", "cpu,cpu,cpu"])
    err = capsys.readouterr().err
    assert code == 2 and "--devices has 3 names but --stages 2" in err


def test_plan_given_both_ranks_and_gpus_says_not_both(capsys):
    assert cli.main(["plan", "examples/unet.py:factory", "--ranks", "2", "--gpus", "2"]) == 2
    assert "or --gpus N (a whole cluster's layout), not both" in capsys.readouterr().err


@pytest.mark.slow  # about 2 s or more: left out of the fast loop
@pytest.mark.parametrize("spec, stages, skips", [("examples/unet.py:factory", 4, True),
                                                 ("examples/transformer.py:factory", 3, False)])
def test_inspect_examples_prints_one_row_per_stage(spec, stages, skips):
    done = _run("inspect", spec, "--stages", str(stages), "--chunks", "4")
    assert done.returncode == 0, done.stderr
    assert _rows(done.stdout) == list(range(stages))
    assert "bottleneck (max/mean FLOPs f+b)" in done.stdout and "estimated efficiency at chunks=4" in done.stdout
    assert ("skip routes:" in done.stdout) == skips
    if skips:
        assert "relu_1: stage 0 -> stage 3 (" in done.stdout
    assert done.stderr == ""


@pytest.mark.slow  # about 2 s or more: left out of the fast loop
def test_bad_model_spec_is_one_line_with_an_example_and_exit_2(capsys, monkeypatch):
    done = _run("inspect", "examples/unet.py", "--stages", "2")
    assert done.returncode == 2
    assert done.stderr == ("fxpipe inspect: error: MODEL 'examples/unet.py' is not FILE.py:FACTORY or "
                           "MODULE:FACTORY; for example: examples/unet.py:factory (a file, and the function in "
                           "it that returns the model)\n")
    assert done.stdout == ""
    monkeypatch.chdir(ROOT)
    for spec, why in [("examples/nothere.py:factory", "there is no file 'examples/nothere.py'"),
                      ("no_such_module:factory", "no module named 'no_such_module'"),
                      ("examples/unet.py:nothere", "'nothere' is not defined there"),
                      ("examples/unet.py:UNet.forward", "is not FILE.py:FACTORY")]:
        assert cli.main(["inspect", spec, "--stages", "2"]) == 2
        err = capsys.readouterr().err
        assert why in err and len(err.strip().splitlines()) == 1, err
        assert err.rstrip().endswith("for example: examples/unet.py:factory (a file, and the function in it that "
                                     "returns the model)")


@pytest.mark.parametrize("command, wrong, meant", [("inspect", "--stagse", "--stages"), ("plan", "--devise", "--device")])
def test_a_misspelled_option_names_the_one_meant_with_the_command_s_usage(capsys, command, wrong, meant):
    with pytest.raises(SystemExit) as exit_:
        cli.main([command, "examples/unet.py:factory", wrong, "2"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"usage: fxpipe {command} " in err
    assert f"fxpipe {command}: error: unrecognized arguments: {wrong} (did you mean {meant}?) 2" in err


@pytest.mark.slow  # about 2 s or more: left out of the fast loop
def test_untraceable_model_prints_the_trace_error_and_exits_1(models):
    done = _run("inspect", f"{models}:untraceable", "--stages", "2")
    assert done.returncode == 1
    assert "cannot trace Gated" in done.stderr and "if x.sum() > 0:" in done.stderr
    assert "--leaf-modules gate" in done.stderr
    assert "Traceback" not in done.stderr


def test_leaf_modules_make_it_traceable(models, capsys):
    assert cli.main(["inspect", f"{models}:untraceable", "--stages", "2", "--leaf-modules", "gate",
                     "--devices", "cpu"]) == 0
    assert _rows(capsys.readouterr().out) == [0, 1]


@pytest.mark.slow  # about 2 s or more: left out of the fast loop
def test_factory_that_raises_prints_its_message_and_exits_1(models):
    done = _run("inspect", f"{models}:broken", "--stages", "2")
    assert done.returncode == 1
    assert "raised ValueError: no checkpoint at ./weights.pt" in done.stderr
    assert "Traceback" not in done.stderr


def test_in_process_errors(models, capsys):
    assert cli.main(["inspect", "nocolon", "--stages", "2"]) == 2
    assert cli.main(["inspect", f"{models}:only_model", "--stages", "2", "--timeline", "t.json"]) == 2
    assert "needs example inputs" in capsys.readouterr().err
    assert cli.main(["inspect", f"{models}:only_model", "--stages", "2", "--input-shape", "3,5"]) == 1
    err = capsys.readouterr().err
    assert "the model does not run on the example inputs" in err and "Traceback" not in err
    assert cli.main(["inspect", f"{models}:only_model", "--stages", "9"]) == 1
    assert "use between 1 and 5 stages" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        cli.main(["inspect", f"{models}:only_model", "--stages", "2", "--input-shape", "3,x"])
    assert info.value.code == 2


@pytest.mark.parametrize("options, says", [
    (["--schedule", "foo"], "schedule='foo'; use one of"),
    (["--stages-per-rank", "2", "--schedule", "1f1b"], "with stages_per_rank=2 use 'interleaved' or 'zbv'"),
    (["--checkpoint", "auto"], "pass max_memory="),
    (["--torch-compile", "nosuchbackend"], "backend='nosuchbackend' cannot be loaded"),
])
def test_an_option_value_compile_refuses_exits_2_as_plan_does(models, capsys, options, says):
    assert cli.main(["inspect", f"{models}:only_model", "--stages", "2", *options]) == 2
    assert says in capsys.readouterr().err


def test_input_shape_makes_inputs_and_code_prints_the_executor(models, capsys):
    assert cli.main(["inspect", f"{models}:only_model", "--stages", "2", "--chunks", "3",
                     "--input-shape", "6,4", "--code"]) == 0
    out = capsys.readouterr().out
    assert "example batch 6" in out and "balance_by=flops" in out
    assert "def gpipe_2x3(rt, mb):" in out and "# clock 3" in out


def test_chunks_past_the_example_batch_are_noted_above_the_efficiency(models, capsys):
    # the table said "estimated efficiency at chunks=16" for an example of 8 rows, which runs 8 micro-batches
    assert cli.main(["inspect", f"{models}:only_model", "--stages", "2", "--chunks", "16",
                     "--input-shape", "8,4"]) == 0
    out = capsys.readouterr().out
    assert "note: the example batch of 8 rows runs as 8 micro-batches of one row, fewer than chunks=16" in out
    assert cli.main(["inspect", f"{models}:only_model", "--stages", "2", "--chunks", "4", "--input-shape", "8,4"]) == 0
    assert "note:" not in capsys.readouterr().out


def test_plan_saved_and_reused_and_a_changed_model_refused(models, tmp_path, capsys):
    path = str(tmp_path / "plan.json")
    assert cli.main(["inspect", f"{models}:only_model", "--stages", "3", "--split-points", "_2,_4",
                     "--json", path]) == 0
    first = capsys.readouterr().out
    saved = json.load(open(path))
    assert saved["format"] == "fxpipe.plan.pipeline/1" and len(saved["stages"]) == 3
    assert cli.main(["inspect", f"{models}:only_model", "--plan", path]) == 0
    again = capsys.readouterr().out
    table = lambda text: text.split("\n", 1)[1]  # noqa: E731 - all but the header line
    assert table(again) == table(first).replace(f"plan saved to {path}\n", "")
    assert cli.main(["inspect", f"{models}:deeper", "--plan", path]) == 1
    err = capsys.readouterr().err
    assert "no longer matches the saved plan" in err
    assert "changed (1): _3: call_module 3 (ReLU) -> _3: call_module 3 (Tanh)" in err


def test_a_reused_plan_keeps_its_chunks_and_refuses_other_stages(models, tmp_path, capsys):
    path = str(tmp_path / "plan.json")
    assert cli.main(["inspect", f"{models}:only_model", "--stages", "3", "--chunks", "4", "--json", path]) == 0
    capsys.readouterr()
    assert cli.main(["inspect", f"{models}:only_model", "--plan", path]) == 0
    assert "3 stages, chunks=4" in capsys.readouterr().out
    assert cli.main(["inspect", f"{models}:only_model", "--plan", path, "--chunks", "2"]) == 0
    assert "3 stages, chunks=2" in capsys.readouterr().out
    assert cli.main(["inspect", f"{models}:only_model", "--plan", path, "--stages", "2"]) == 2
    err = capsys.readouterr().err
    assert "has 3 stages but --stages 2; drop --stages (or give --stages 3)" in err and "n_stages" not in err


def test_timeline_writes_a_chrome_trace(tmp_path, capsys):
    path = tmp_path / "trace.json"
    assert cli.main(["inspect", os.path.join(ROOT, "examples", "unet.py:factory"), "--stages", "2",
                     "--chunks", "2", "--warmup", "0", "--timeline", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"timeline saved to {path}" in out and "4 forward, 2 recompute, 4 backward, 0 copy events" in out
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    for kind in ("forward", "backward"):
        got = sorted((e["tid"], e["args"]["stage"], e["args"]["micro_batch"]) for e in events if e["cat"] == kind)
        assert got == [(j, j, i) for j in range(2) for i in range(2)]


def test_timeline_of_the_zero_bubble_schedule_shows_weight_steps(tmp_path, capsys):
    path = tmp_path / "trace.json"
    assert cli.main(["inspect", os.path.join(ROOT, "examples", "transformer.py:factory"), "--stages", "2",
                     "--chunks", "2", "--warmup", "0", "--schedule", "zb",
                     "--timeline", str(path), "--code"]) == 0
    out = capsys.readouterr().out
    assert "one training step (zb)" in out and "4 forward, 2 recompute, 4 backward, 4 weight, 0 copy events" in out
    assert "weight ms" in out and "1W1" in out.split()
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert sorted((e["args"]["stage"], e["args"]["micro_batch"]) for e in events if e["cat"] == "weight") == \
        [(j, i) for j in range(2) for i in range(2)]


@pytest.mark.slow
def test_timeline_of_compiled_stages(tmp_path, capsys):
    path = tmp_path / "trace.json"
    assert cli.main(["inspect", os.path.join(ROOT, "examples", "transformer.py:factory"), "--stages", "2",
                     "--chunks", "2", "--schedule", "zb", "--torch-compile", "aot_eager",
                     "--timeline", str(path)]) == 0
    out = capsys.readouterr().out
    assert "one training step (zb)" in out and "4 forward, 2 recompute, 4 backward, 4 weight, 0 copy events" in out
    assert "torch.compile (aot_eager) stage 0:" in out and "torch.compile (aot_eager) stage 1:" in out
    assert "backward split I " in out


def test_compiled_stages_without_a_step_say_that_nothing_compiled_yet(capsys):
    # "torch.compile (aot_eager) stage 0: 0 graph(s), 0 compile(s), 0.0 s" read as if compiling did nothing
    assert cli.main(["inspect", "examples/unet.py:factory", "--stages", "2", "--torch-compile", "aot_eager"]) == 0
    out = capsys.readouterr().out
    assert "no stage ran, so none compiled yet" in out and "0 compile(s)" not in out


def test_dot_file_and_picture(tmp_path, capsys, monkeypatch):
    spec = os.path.join(ROOT, "examples", "unet.py:factory")
    assert cli.main(["inspect", spec, "--stages", "2", "--dot", str(tmp_path / "g.dot")]) == 0
    source = (tmp_path / "g.dot").read_text()
    assert source.startswith("digraph fxpipe {") and "subgraph cluster_1" in source
    capsys.readouterr()
    monkeypatch.setattr(dot, "graphviz_available", lambda: False)
    assert cli.main(["inspect", spec, "--stages", "2", "--dot", str(tmp_path / "g.svg")]) == 1
    assert "Graphviz's `dot` is not installed" in capsys.readouterr().err
    assert (tmp_path / "g.dot").exists() and not (tmp_path / "g.svg").exists()


@pytest.mark.skipif(not dot.graphviz_available(), reason="Graphviz's dot is not installed")
def test_dot_renders_svg_with_graphviz(tmp_path, capsys):
    spec = os.path.join(ROOT, "examples", "unet.py:factory")
    assert cli.main(["inspect", spec, "--stages", "4", "--dot", str(tmp_path / "u.svg")]) == 0
    assert f"graph rendered to {tmp_path / 'u.svg'}" in capsys.readouterr().out
    svg = (tmp_path / "u.svg").read_text()
    assert "<svg" in svg and svg.count('class="cluster"') == 4


def test_console_script_points_at_main():
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    module, _, name = scripts["fxpipe"].partition(":")
    assert (module, name) == ("fxpipe.tools.cli", "main") and callable(cli.main)


def test_inspect_shows_each_stages_policy_and_predicted_peak(models, capsys):
    assert cli.main(["inspect", f"{models}:only_model", "--stages", "2", "--chunks", "2", "--input-shape", "8,4",
                     "--checkpoint", "selective,always", "--schedule", "1f1b"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.split()[:2] == ["stage", "device"])
    assert "checkpoint" in header.split() and "peak" in header.split()
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["0"], ["1"])]
    assert "selective" in rows[0] and "always" in rows[1]
    assert cli.main(["inspect", f"{models}:only_model", "--stages", "2", "--input-shape", "8,4",
                     "--checkpoint", "auto", "--max-memory", "1kB"]) == 1
    assert "nothing tried fits" in capsys.readouterr().err  # at 1kB nothing does: not "what would fit"


def test_inspect_tp_prints_the_automatic_plan_and_its_collectives(tmp_path, capsys):
    """``--tp 2``: each module's style, what stays whole, the collectives per micro-batch; nothing launched."""
    path = tmp_path / "tp_models.py"
    path.write_text("import torch, tpmodels\n"
                    "def decoder():\n"
                    "    return tpmodels.TiedDecoder(), (torch.randint(0, 64, (4, 8)),)\n")
    assert cli.main(["inspect", f"{path}:decoder", "--stages", "2", "--chunks", "2", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "tensor parallel over 2 ranks per stage (auto):" in out
    assert "blocks.0.attn.q: ColwiseParallel()   [all_reduce in backward" in out
    assert "blocks.0.attn.o: RowwiseParallel()   [all_reduce in forward" in out
    assert "embed: RowwiseParallel(input_layouts=Replicate())" in out and "whole on every rank: pos" in out
    assert "per micro-batch, forward: 6 collective(s)" in out
    # the stage table is the whole stage's; each rank holds half of every split layer (the position embedding whole)
    assert "per rank (each of the 2 holds 1/2 of every split layer" in out
    assert "stage 0: params 25.9kB of 48.8kB, FLOPs f+b 1.0M of 1.9M" in out
    assert "stage 1: params 19.4kB of 38.0kB, FLOPs f+b 1.0M of 1.9M" in out
    assert cli.main(["inspect", f"{path}:decoder", "--stages", "2", "--tp", "3"]) == 1
    assert "tensor_parallel=3 does not divide" in capsys.readouterr().err


def test_leaf_modules_take_a_class_name_as_well_as_a_qualified_name(models, capsys):
    # a class name (as fxpipe.compile's leaf_modules=[DataDependent] takes the class) was refused as "not a
    # submodule"; it keeps every module of that class as one call
    assert cli.main(["inspect", f"{models}:untraceable", "--stages", "2", "--leaf-modules", "DataDependent"]) == 0
    by_class = capsys.readouterr().out
    assert cli.main(["inspect", f"{models}:untraceable", "--stages", "2", "--leaf-modules", "gate"]) == 0
    assert capsys.readouterr().out == by_class
    assert cli.main(["inspect", f"{models}:untraceable", "--stages", "2", "--leaf-modules", "Nothing"]) == 1
    assert "leaf_modules names ['Nothing'] that are not submodules of Gated" in capsys.readouterr().err


def test_warnings_print_as_one_line_naming_the_command(models, capsys):
    # a UserWarning came out in Python's format: "fxpipe/plan/assign.py:64: UserWarning: ..." and its source line
    assert cli.main(["inspect", f"{models}:only_model", "--stages", "2", "--input-shape", "4,4",
                     "--tracer", "export", "--leaf-modules", "0"]) == 0
    err = capsys.readouterr().err
    assert "fxpipe inspect: warning: leaf_modules" in err and "UserWarning" not in err, err


def test_inspect_export_dims_batch_exports_the_other_dims_fixed_and_needs_the_export_tracer(models, capsys):
    assert cli.main(["inspect", f"{models}:only_model", "--stages", "2", "--input-shape", "4,4",
                     "--tracer", "export", "--export-dims", "batch"]) == 0
    assert "2 stages" in capsys.readouterr().out
    # a usage mistake: exit 2 before anything is traced
    assert cli.main(["inspect", f"{models}:only_model", "--stages", "2", "--input-shape", "4,4",
                     "--export-dims", "batch"]) == 2
    assert "--export-dims batch sets which dims torch.export keeps dynamic, but the tracer is fx: pass --tracer " \
           "export with it" in capsys.readouterr().err
