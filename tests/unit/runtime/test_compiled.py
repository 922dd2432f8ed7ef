"""torch_compile=: compiled stages under every schedule equal eager; zero bubble's W holds the weight GEMMs.

Most tests compile with ``aot_eager`` (AOT autograd's graphs run as eager ops: fast, and the
same forward/backward graphs and I/W split inductor gets); a few, marked slow, with inductor.
"""

import copy
import logging
import time

import pytest
import torch
import torch.nn.functional as F
from models import CNN, NormLadder, Stack, TiedTransformer, token_loss
from schedules import CUSTOM
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import fxpipe
from fxpipe.runtime.stage import aotsplit
from fxpipe.testing import max_relative_error

AOT = {"backend": "aot_eager"}


def _check_step(model, x, target, loss_fn, tol=1e-5, **kw):
    """Compile ``model`` with ``kw``, run one step; assert loss and gradients equal eager's; return the pipe."""
    eager = copy.deepcopy(model)
    expected = loss_fn(eager(x), target)
    expected.backward()
    pipe = fxpipe.compile(model, example_inputs=(x,), **kw)
    loss = pipe.step(x, target=target, loss_fn=loss_fn)
    assert max_relative_error(loss, expected) < tol
    grads = dict(eager.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert max_relative_error(p.grad, grads[name].grad) < tol, name
    return pipe


@pytest.mark.slow
def test_zero_bubble_compiled_equals_eager():
    x, y = torch.randn(8, 16), torch.randn(8, 8)
    pipe = _check_step(Stack(), x, y, F.mse_loss, n_stages=2, chunks=4, schedule="zb", devices=["cpu"] * 2,
                       torch_compile=AOT)
    stats = pipe.compile_stats
    assert sorted(stats) == [0, 1] and all(s["graphs"] >= 1 and s["split"] for s in stats.values())


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint", ["never", "except_last"])
@pytest.mark.parametrize("schedule,n,per_rank,chunks", [
    ("gpipe", 3, 1, 4), ("1f1b", 3, 1, 4), ("zb", 3, 1, 4), ("interleaved", 4, 2, 4), ("zbv", 4, 2, 4),
    (CUSTOM, 2, 1, 3)], ids=["gpipe", "1f1b", "zb", "interleaved", "zbv", "custom"])
def test_every_schedule_compiled_equals_eager(schedule, n, per_rank, chunks, checkpoint):
    tokens, target = torch.randint(0, 32, (8, 8)), torch.randint(0, 32, (8, 8))
    _check_step(TiedTransformer(), tokens, target, token_loss, n_stages=n, chunks=chunks, schedule=schedule,
                stages_per_rank=per_rank, devices=["cpu"] * n, checkpoint=checkpoint, torch_compile=AOT)


@pytest.mark.slow
def test_gpipe_program_compiled_equals_eager():
    model, x = Stack(), torch.randn(6, 16)
    eager = copy.deepcopy(model)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=3, devices=["cpu"] * 2, torch_compile=AOT)
    out = pipe(x)
    expected = eager(x)
    assert max_relative_error(out, expected) < 1e-5
    out.square().mean().backward()
    expected.square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert max_relative_error(p.grad, q.grad) < 1e-5, name


class _Recorder(TorchDispatchMode):
    """Record the time and output shape of every matrix product run under it."""

    def __init__(self, calls):
        super().__init__()
        self.calls = calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            self.calls.append((time.perf_counter_ns(), tuple(out.shape)))
        return out


def test_zero_bubble_runs_the_weight_gemms_in_w_spans_after_i(monkeypatch):
    """Time every GEMM the split backward runs: the weight-gradient ones land in W spans, after that I."""
    i_calls, w_calls = [], []
    split = aotsplit._split_backward

    def recording(stage, cut, run_i, run_w, *rest):
        def rec(run, calls):
            def inner(args):
                with _Recorder(calls):
                    return run(args)
            return inner
        return split(stage, cut, rec(run_i, i_calls), rec(run_w, w_calls), *rest)

    monkeypatch.setattr(aotsplit, "_split_backward", recording)
    model = Stack(d=16, hidden=48, layers=4)
    x, y = torch.randn(12, 16), torch.randn(12, 8)  # 3 rows per micro-batch: no activation is weight-shaped
    eager = copy.deepcopy(model)
    F.mse_loss(eager(x), y).backward()
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=4, schedule="zb", checkpoint="never",
                          devices=["cpu"] * 2, torch_compile=AOT)
    with fxpipe.timeline() as tl:
        pipe.step(x, target=y, loss_fn=F.mse_loss)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert max_relative_error(p.grad, q.grad) < 1e-5, name

    spans = {(e["cat"], e["args"]["stage"], e["args"]["micro_batch"]): (e["ts"], e["ts"] + e["dur"])
             for e in tl.events}
    for j in range(2):
        for i in range(4):  # W after its I, on every stage and micro-batch
            assert spans[("weight", j, i)][0] >= spans[("backward", j, i)][1], (j, i)

    def kind(stamp):
        us = (stamp - tl._origin) / 1e3
        return {k for (k, _, _), (a, b) in spans.items() if a <= us <= b}

    matrices = [tuple(p.shape) for p in model.parameters() if p.dim() == 2]
    weights = set(matrices)
    w_gemms = [shape for t, shape in w_calls if shape in weights]
    assert len(w_gemms) == len(matrices) * 4  # every weight matrix's gradient, once per micro-batch
    assert all(kind(t) == {"weight"} for t, shape in w_calls)
    assert i_calls and all(kind(t) == {"backward"} and shape not in weights for t, shape in i_calls)


class _Scale(nn.Module):
    """Scale by a learned vector, then dropout: the gradient is zero exactly where the mask dropped."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(d))
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(x * self.w)


def _masks_replayed(backend):
    model = nn.Sequential(_Scale(), _Scale())
    pipe = fxpipe.compile(model, 2, example_inputs=(torch.randn(6, 8),), chunks=1, checkpoint="always",
                          devices=["cpu"] * 2, split_points=["1"], torch_compile={"backend": backend})
    seen = []
    for _ in range(2):
        x = torch.randn(6, 8, requires_grad=True)
        out = pipe(x)
        out.sum().backward()
        # out is zero where either mask dropped; x.grad where the recomputation's masks dropped
        assert torch.equal(out != 0, x.grad != 0)
        seen.append(out != 0)
    assert not torch.equal(*seen)  # each step draws its own masks


def test_recompute_replays_dropout_masks():
    _masks_replayed("aot_eager")


@pytest.mark.slow
def test_recompute_replays_dropout_masks_with_inductor():
    _masks_replayed("inductor")


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint", ["except_last", "never"])
def test_recompilations_stay_bounded_over_three_batch_sizes(checkpoint):
    model = Stack()
    pipe = fxpipe.compile(model, 2, example_inputs=(torch.randn(8, 16),), chunks=2, schedule="zb",
                          devices=["cpu"] * 2, torch_compile=AOT, checkpoint=checkpoint)
    for rows in (8, 12, 6, 12, 8):  # micro-batches of 4, 6 and 3 rows; checkpointed ones without grad
        pipe.step(torch.randn(rows, 16), target=torch.randn(rows, 8), loss_fn=F.mse_loss)
    for j, s in pipe.compile_stats.items():
        # checkpointing: the no-grad forward compiles once more (dim 0 dynamic from the start);
        # never: static at 4 rows, once more with dim 0 dynamic at 6, then 3 rows reuse it
        assert s["recompiles"] == 1, (j, s)


def test_a_stage_that_never_recomputes_compiles_static_first():
    graphs = []  # per graph: whether a shape in it is symbolic

    def backend(gm, example_inputs):
        graphs.append(any(isinstance(v, torch.SymInt) or (isinstance(v, torch.Tensor) and any(
            isinstance(d, torch.SymInt) for d in v.shape)) for v in example_inputs))
        return gm

    pipe = fxpipe.compile(Stack(), 1, example_inputs=(torch.randn(8, 16),), chunks=1, devices=["cpu"],
                          torch_compile={"backend": backend}, checkpoint="never")
    for rows in (8, 8, 6, 5):
        pipe.step(torch.randn(rows, 16), target=torch.randn(rows, 8), loss_fn=F.mse_loss)
    assert graphs == [False, True]  # static at 8 rows (reused), dynamic from 6 (and reused at 5)


def test_state_dict_keys_stay_the_models_own(tmp_path):
    model = Stack()
    keys = list(model.state_dict())
    pipe = fxpipe.compile(model, 2, example_inputs=(torch.randn(8, 16),), chunks=2, schedule="1f1b",
                          devices=["cpu"] * 2, torch_compile=AOT)
    pipe.step(torch.randn(8, 16), target=torch.randn(8, 8), loss_fn=F.mse_loss)
    assert list(pipe.state_dict()) == keys and not any("_orig_mod" in k for k in pipe.state_dict())
    fxpipe.save(pipe, tmp_path / "ckpt")
    state = fxpipe.load_state_dict(tmp_path / "ckpt")
    assert list(state) == keys
    for k, v in model.state_dict().items():
        assert torch.equal(state[k], v), k


class _Doubled(nn.Module):
    """Doubles its input while recomputing: the gradients tell whether the recomputation saw the flag."""

    def forward(self, x):
        return x * 2.0 if fxpipe.is_recomputing() else x


def test_is_recomputing_is_read_per_pass_in_a_compiled_stage():
    def build(**kw):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), _Doubled(), nn.Linear(8, 8), nn.Linear(8, 4))
        pipe = fxpipe.compile(model, 2, example_inputs=(torch.randn(4, 8),), chunks=1, checkpoint="always",
                              devices=["cpu"] * 2, split_points=["2"], leaf_modules=[_Doubled], **kw)
        pipe.step(torch.ones(4, 8), target=torch.zeros(4, 4), loss_fn=F.mse_loss)
        return model, pipe

    eager, _ = build()
    compiled, pipe = build(torch_compile=AOT)
    for p, q in zip(compiled.parameters(), eager.parameters()):
        assert max_relative_error(p.grad, q.grad) < 1e-5
    assert any("is_recomputing" in b for b in pipe.compile_stats[0]["breaks"])


class _Gate(nn.Module):
    """Branches on a value: torch.compile breaks the graph here."""

    def forward(self, x):
        return x * 2 if x.sum().item() > 0 else x


def _gated():
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), _Gate(), nn.Linear(8, 4))


def test_a_graph_break_is_reported_naming_the_stage_and_node(caplog):
    model = _gated()
    eager = copy.deepcopy(model)
    pipe = fxpipe.compile(model, 2, example_inputs=(torch.randn(4, 8),), devices=["cpu"] * 2, split_points=["2"],
                          leaf_modules=[_Gate], torch_compile=AOT)
    x = torch.randn(4, 8)
    with caplog.at_level(logging.WARNING, logger="fxpipe"):
        assert max_relative_error(pipe(x), eager(x)) < 1e-5  # it still runs, as several graphs
    assert "stage 1: torch.compile breaks the graph at node '_2' (call_module 2: _Gate" in caplog.text
    assert pipe.compile_stats[1]["breaks"] and not pipe.compile_stats[0]["breaks"]


def test_fullgraph_refuses_a_graph_break_naming_the_stage_and_node():
    pipe = fxpipe.compile(_gated(), 2, example_inputs=(torch.randn(4, 8),), devices=["cpu"] * 2,
                          split_points=["2"], leaf_modules=[_Gate], torch_compile={**AOT, "fullgraph": True})
    with pytest.raises(fxpipe.CompileError, match=r"stage 1: torch.compile \(aot_eager\) cannot compile the stage "
                                                  r"at node '_2' \(call_module 2: _Gate.*drop fullgraph=True"):
        pipe(torch.randn(4, 8))


def test_a_backend_that_fails_is_named_with_the_stage():
    def failing(gm, example_inputs):
        raise RuntimeError("this backend cannot")

    pipe = fxpipe.compile(Stack(), 2, example_inputs=(torch.randn(4, 16),), devices=["cpu"] * 2,
                          torch_compile={"backend": failing})
    with pytest.raises(fxpipe.CompileError, match=r"stage 0: torch.compile \(failing\) cannot compile the stage.*"
                                                  r"this backend cannot.*try backend='aot_eager'"):
        pipe(torch.randn(4, 16))


def test_a_compile_failing_on_a_one_row_micro_batch_names_it():
    def no_single_rows(gm, example_inputs):
        if any(isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == 1 for t in example_inputs):
            raise RuntimeError("Expected X.is_contiguous(memory_format)")
        return gm

    pipe = fxpipe.compile(Stack(), 2, example_inputs=(torch.randn(4, 16),), devices=["cpu"] * 2, chunks=2,
                          torch_compile={"backend": no_single_rows})
    pipe(torch.randn(4, 16))  # 2-row micro-batches compile
    with pytest.raises(fxpipe.CompileError, match=r"stage 0: .*Expected X.is_contiguous.*This micro-batch has one "
                                                  r"row.*give every micro-batch 2 rows or more"):
        pipe(torch.randn(3, 16))  # 2 rows, then 1


class _Untraceable(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # torch.fx cannot trace this: compile would fail tracing
            return x
        return -x


@pytest.mark.parametrize("value,error,message", [
    ({"backend": "no_such_backend"}, fxpipe.CompileError, "backend='no_such_backend' cannot be loaded"),
    ({"backned": "inductor"}, TypeError, "torch_compile= got 'backned'; it takes backend, mode"),
    ("inductor", TypeError, "torch_compile= takes True, False or a dict"),
    ({"backend": "aot_eager", "mode": "max-autotune"}, fxpipe.CompileError, "mode= and options= configure inductor"),
    ({"mode": "reduce-overhead"}, fxpipe.CompileError, "captures CUDA graphs"),
    ({"options": {"no_such_option": 1}}, fxpipe.CompileError, "Unexpected optimization option no_such_option"),
    ({"options": {"triton.cudagraphs": True}}, fxpipe.CompileError,
     r"options=\{'triton.cudagraphs': True\} captures CUDA graphs"),
    ({"backend": "cudagraphs"}, fxpipe.CompileError, "backend='cudagraphs' captures CUDA graphs"),
    ({"mode": "max-autotune-no-cudagraphs", "options": {"max_autotune": True}}, fxpipe.CompileError,
     "got both mode= and options="),
    ({"backend": "tvm"}, fxpipe.CompileError, "backend='tvm' cannot be loaded .*needs the package 'tvm'"),
])
def test_bad_torch_compile_values_are_refused_before_tracing(value, error, message):
    with pytest.raises(error, match=message):
        fxpipe.compile(_Untraceable(), 2, example_inputs=(torch.randn(4, 8),), torch_compile=value)


def test_zero_bubble_with_a_backend_it_cannot_split_is_refused():
    with pytest.raises(fxpipe.CompileError, match="schedule='zb' splits each backward into I and W.*not 'eager'"):
        fxpipe.compile(Stack(), 2, example_inputs=(torch.randn(4, 16),), schedule="zb",
                       torch_compile={"backend": "eager"})
    with pytest.raises(fxpipe.CompileError, match="stage 0's schedule has W steps"):
        fxpipe.compile(Stack(), 2, example_inputs=(torch.randn(4, 16),), schedule=CUSTOM, chunks=3,
                       devices=["cpu"] * 2, torch_compile={"backend": "eager"})


@pytest.mark.parametrize("checkpoint", ["selective", ["always", "selective"]])
def test_selective_recomputation_is_refused_for_compiled_stages(checkpoint):
    """Selective marks break a compiled graph at every node: refused before tracing, naming what works."""
    with pytest.raises(fxpipe.CompileError, match="checkpoint='selective'.*'always' or 'except_last'"):
        fxpipe.compile(Stack(), 2, example_inputs=(torch.randn(4, 16),), checkpoint=checkpoint, torch_compile=AOT)


def test_tensor_parallel_compiled_stages_are_refused_before_tracing():
    """Compiled DTensor stages are not supported yet: refused naming both ways to run."""
    with pytest.raises(fxpipe.CompileError, match="tensor_parallel=2.*leave torch_compile= out"):
        fxpipe.compile(Stack(), 2, example_inputs=(torch.randn(4, 16),), runtime="distributed",
                       tensor_parallel=2, torch_compile=AOT)


def test_auto_policies_for_compiled_stages_recompute_whole_stages():
    """checkpoint='auto' with torch_compile= chooses among whole-stage policies, under a budget that needs some."""
    from fxpipe.options import CompileOptions
    from fxpipe.simulate.fit import candidates

    model, x = Stack(), torch.randn(512, 16)
    opts = CompileOptions(2, torch_compile=AOT)
    opts.check()
    assert "selective" not in candidates(opts) and candidates(opts)[0] == "never"
    free = fxpipe.compile(copy.deepcopy(model), 2, example_inputs=(x,), chunks=4, schedule="1f1b",
                          devices=["cpu"] * 2, checkpoint="never")
    budget = 0.9 * fxpipe.simulate(free, device="h100").devices[0].peak  # one CPU: the stages share its budget
    pipe = _check_step(model, x, torch.randn(512, 8), F.mse_loss, n_stages=2, chunks=4, schedule="1f1b",
                       devices=["cpu"] * 2, checkpoint="auto", max_memory=budget, torch_compile=AOT)
    assert "selective" not in pipe.plan.policies() and set(pipe.plan.policies()) != {"never"}


def test_other_backends_run_schedules_without_w():
    x, y = torch.randn(8, 16), torch.randn(8, 8)
    _check_step(Stack(), x, y, F.mse_loss, n_stages=2, chunks=2, schedule="1f1b", devices=["cpu"] * 2,
                torch_compile={"backend": "eager"})


@pytest.mark.slow
def test_deferred_batch_norm_and_autocast_compiled_match_uncompiled():
    torch.manual_seed(0)
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 5, (8,))
    plain, compiled = CNN(), CNN()
    compiled.load_state_dict(plain.state_dict())
    kw = dict(example_inputs=(x,), chunks=2, devices=["cpu"] * 2, deferred_batch_norm=True, schedule="zb")
    pipes = [fxpipe.compile(plain, 2, **kw), fxpipe.compile(compiled, 2, torch_compile=AOT, **kw)]
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses = [p.step(x, target=y, loss_fn=F.cross_entropy) for p in pipes]
    assert max_relative_error(losses[1], losses[0]) < 1e-5
    for (name, p), q in zip(compiled.named_parameters(), plain.parameters()):
        assert max_relative_error(p.grad, q.grad) < 1e-5, name
    for (name, b), c in zip(compiled.named_buffers(), plain.buffers()):  # running stats once per mini-batch
        assert max_relative_error(b.float(), c.float()) < 1e-5, name


@pytest.mark.parametrize("checkpoint", ["except_last", "never"])
def test_deferred_batch_norm_compiles_without_a_graph_break_per_norm(checkpoint):
    # a deferred batch norm once read is_recomputing() past a graph break: torch.compile then compiled
    # the code after the break once per batch norm, hit its recompile limit (8) and ran the rest eagerly
    torch.manual_seed(0)
    x, y = torch.randn(12, 3, 6, 6), torch.randint(0, 5, (12,))
    plain, compiled = NormLadder().train(), NormLadder().train()
    compiled.load_state_dict(plain.state_dict())
    kw = dict(example_inputs=(x[:8],), chunks=4, devices=["cpu"], deferred_batch_norm=True, checkpoint=checkpoint)
    pipes = [fxpipe.compile(plain, 1, **kw), fxpipe.compile(compiled, 1, torch_compile=AOT, **kw)]
    for rows in (8, 12):  # micro-batches of 2 rows, then 3
        losses = [p.step(x[:rows], target=y[:rows], loss_fn=F.cross_entropy) for p in pipes]
        assert max_relative_error(losses[1], losses[0]) < 1e-5
    stats = pipes[1].compile_stats[0]
    assert stats["breaks"] == [] and stats["compiles"] <= 2, stats
    for (name, b), c in zip(compiled.named_buffers(), plain.buffers()):  # each micro-batch counted once
        assert max_relative_error(b.float(), c.float()) < 1e-5, name
    assert int(compiled.blocks[0][1].num_batches_tracked) == 2


class _Broken(nn.Module):
    """Scale, a graph break, scale again: every instance runs the graph after the break torch.compile made once."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.rand(8) + 0.5)

    def forward(self, x):
        x = x * self.w
        torch._dynamo.graph_break()
        return torch.tanh(x * self.w)


def test_w_adds_into_the_parameters_of_each_call_not_of_the_first_compile():
    model = nn.Sequential(nn.Linear(8, 8), _Broken(), _Broken(), nn.Linear(8, 8), _Broken(), _Broken())
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    _check_step(model, x, y, F.mse_loss, n_stages=2, chunks=2, schedule="zb", checkpoint="never",
                devices=["cpu"] * 2, split_points=["3"], leaf_modules=[_Broken], torch_compile=AOT)


def test_a_model_built_on_meta_compiles_after_materialization():
    with fxpipe.deferred_init():
        model = Stack()
    x, y = torch.randn(8, 16), torch.randn(8, 8)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=2, schedule="zb", devices=["cpu"] * 2,
                          torch_compile=AOT)
    assert torch.isfinite(pipe.step(x, target=y, loss_fn=F.mse_loss))
    assert all(not t.is_meta for t in model.state_dict().values())
    assert all(p.grad is not None for p in model.parameters())


def test_a_failed_step_leaves_no_queued_weight_work():
    model = Stack()
    x, y = torch.randn(8, 16), torch.randn(8, 8)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=4, schedule="zb", checkpoint="never",
                          devices=["cpu"] * 2, torch_compile=AOT)
    calls = []

    def failing(out, t):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("loss failed")
        return F.mse_loss(out, t)

    with pytest.raises(RuntimeError, match="loss failed"):
        pipe.step(x, target=y, loss_fn=failing)
    pipe.zero_grad(set_to_none=True)
    eager = copy.deepcopy(model)
    F.mse_loss(eager(x), y).backward()
    pipe.step(x, target=y, loss_fn=F.mse_loss)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert max_relative_error(p.grad, q.grad) < 1e-5, name


@pytest.mark.slow
def test_a_tied_weight_read_from_another_device_and_an_exported_graph_compile():
    """"cpu" and "cpu:0" are two devices: the head reads the embedding's weight through a per-call copy."""
    tokens, target = torch.randint(0, 32, (8, 8)), torch.randint(0, 32, (8, 8))
    _check_step(TiedTransformer(), tokens, target, token_loss, n_stages=2, chunks=4, schedule="zb",
                devices=["cpu", "cpu:0"], torch_compile=AOT)
    x, y = torch.randn(8, 16), torch.randn(8, 8)
    _check_step(Stack(), x, y, F.mse_loss, n_stages=2, chunks=4, schedule="zb", devices=["cpu"] * 2,
                tracer="export", torch_compile=AOT)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_inductor_compiled_stages_equal_eager(schedule):
    x, y = torch.randn(8, 16), torch.randn(8, 8)
    pipe = _check_step(Stack(), x, y, F.mse_loss, tol=1e-4, n_stages=2, chunks=4, schedule=schedule,
                       devices=["cpu"] * 2, torch_compile=True)
    assert all(s["backend"] == "inductor" for s in pipe.compile_stats.values())


@pytest.mark.slow
def test_inductor_zero_bubble_splits_a_cnn_s_backward():
    # a batch norm's backward returns a tuple, which I handed W whole (inductor returns tensors only); and
    # inductor lays convolutions out channels-last, so W was compiled for strides its inputs did not have
    torch.manual_seed(0)
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 5, (8,))
    pipe = _check_step(CNN().eval(), x, y, F.cross_entropy, tol=1e-4, n_stages=2, chunks=2, schedule="zb",
                       devices=["cpu"] * 2, split_points=["convs.1"], torch_compile=True)
    assert all(s["split"] for s in pipe.compile_stats.values())


class _SizeAcross(nn.Module):
    """Passes the batch size to the next stage as a Python int (every exported Hugging Face model does)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x):
        b = x.size(0)
        h = torch.relu(self.b(torch.relu(self.a(x)).reshape(-1, 32)))
        return self.c(h.view(b, -1, 32))


def test_an_int_crossing_stages_does_not_compile_a_recomputing_stage_again_per_batch_size():
    # dynamo specialized the int: the second batch size compiled both graphs of the stage again (4, not 2)
    torch.manual_seed(0)
    pipe = fxpipe.compile(_SizeAcross(), 2, example_inputs=(torch.randn(4, 3, 16),), chunks=2, schedule="1f1b",
                          checkpoint="always", devices=["cpu"] * 2, torch_compile={"backend": "aot_eager"},
                          split_points=["b"])
    for rows in (4, 6, 8):
        pipe.step(torch.randn(rows, 3, 16), target=torch.randn(rows, 3, 4), loss_fn=F.mse_loss)
    assert all(v["compiles"] <= 2 for v in pipe.compile_stats.values()), pipe.compile_stats


class _BreakingGate(nn.Module):
    """A leaf whose forward breaks the graph (.item()): its code after the break is shared by every stage."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        if bool((h > -1e9).all()):
            h = torch.relu(h)
        return self.b(h) + x


def test_stages_sharing_code_after_a_graph_break_all_stay_compiled(caplog):
    # eight stages' cache entries on the shared code passed dynamo's recompile limit (8): the rest ran eagerly
    torch.manual_seed(0)
    model = nn.Sequential(*[_BreakingGate() for _ in range(8)])
    x = torch.randn(8, 8)
    pipe = fxpipe.compile(model, 8, example_inputs=(x,), chunks=8, schedule="1f1b", devices=["cpu"] * 8,
                          torch_compile={"backend": "aot_eager"}, leaf_modules=[_BreakingGate])
    with caplog.at_level(logging.WARNING, logger="torch._dynamo"):
        pipe.step(x, target=x, loss_fn=F.mse_loss)
        pipe.eval()
        with torch.no_grad():
            pipe(x)
    assert not [r for r in caplog.records if "recompile_limit" in r.getMessage()]
    assert torch._dynamo.config.recompile_limit >= 64


@pytest.mark.slow
def test_inductor_zero_bubble_compiles_a_batch_norm_stage_again_from_a_filled_graph_cache(tmp_path, monkeypatch):
    # a second compile (a restarted job, a second pipe) met inductor's cached entry of the whole backward, whose size
    # guards name the forward's inputs, for W's graph: KeyError 'x', raised as a CompileError naming aot_eager
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    x, y = torch.randn(10, 16), torch.randn(10, 8)
    grads = []
    for _ in range(2):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16),
                              nn.GELU(), nn.Linear(16, 8))
        pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=3, schedule="zb", checkpoint="never",
                              devices=["cpu"] * 2, split_points=["3"], torch_compile=True)
        pipe.step(x, target=y, loss_fn=F.mse_loss)  # uneven micro-batches (4, 3, 3): sizes W is compiled for
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
