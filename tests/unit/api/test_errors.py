"""Bad input fails early with a message naming the cause and the fix, leaving the model as it was."""

import copy

import pytest
import torch
from models import MLP, MultiIO
from torch import nn

import fxpipe


class DataDependent(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.gate = DataDependent()
        self.post = nn.Linear(4, 4)

    def forward(self, x):
        return self.post(self.gate(self.pre(x)))


def test_untraceable_model_names_module_line_and_fix():
    with pytest.raises(fxpipe.TraceError) as info:
        fxpipe.compile(Outer(), 2, example_inputs=(torch.randn(2, 4),))
    msg = str(info.value)
    assert "module 'gate' (DataDependent)" in msg
    assert "if x.sum() > 0:" in msg
    assert "test_errors.py" in msg
    assert "leaf_modules=[DataDependent]" in msg
    assert info.value.module == "gate" and info.value.lineno is not None
    assert isinstance(info.value, TypeError)


def test_leaf_modules_make_it_traceable():
    model = Outer()
    x = torch.randn(2, 4)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), leaf_modules=[DataDependent], devices=["cpu"] * 2)
    torch.testing.assert_close(pipe(x), model(x))
    gm = fxpipe.trace(model, leaf_modules=["gate"])
    assert any(n.op == "call_module" and n.target == "gate" for n in gm.graph.nodes)


def test_top_level_failure_suggests_submodule():
    with pytest.raises(fxpipe.TraceError, match="top-level forward"):
        fxpipe.trace(DataDependent())


@pytest.mark.parametrize("n_stages, message", [
    (0, r"n_stages=0; use an integer of at least 1"),
    (-2, r"n_stages=-2; use an integer of at least 1"),
    (99, r"n_stages=99 but the model has 12 compute nodes; use between 1 and 12 stages"),
])
def test_bad_n_stages(n_stages, message):
    with pytest.raises(ValueError, match=message):
        fxpipe.compile(MLP(), n_stages, example_inputs=(torch.randn(2, 16),))


def test_devices_of_wrong_length():
    with pytest.raises(ValueError, match=r"devices has 2 entries but n_stages=3; give one device per stage"):
        fxpipe.compile(MLP(), 3, devices=["cpu", "cpu"])


def test_device_that_does_not_exist():
    with pytest.raises(ValueError, match="not a device"):
        fxpipe.compile(MLP(), 2, devices=["cpu", "gpu7"])
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            fxpipe.compile(MLP(), 2, devices=["cpu", "cuda:0"])


@pytest.mark.parametrize("chunks", [0, -1, 1.5])
def test_bad_chunks(chunks):
    with pytest.raises(ValueError, match=r"chunks=.*use an integer of at least 1"):
        fxpipe.compile(MLP(), 2, chunks=chunks)


@pytest.mark.parametrize("timeout", [0, -1, "60", True])
def test_bad_timeout(timeout):
    # a negative timeout= was read as a rank that never joined ("call it on every rank, not under if rank == 0:")
    with pytest.raises(ValueError, match=r"timeout=.*use a number of seconds above 0"):
        fxpipe.compile(MLP(), 2, timeout=timeout)


def test_bad_checkpoint_and_balance():
    with pytest.raises(ValueError, match="checkpoint='sometimes'; use one of 'always', 'except_last', 'never'"):
        fxpipe.compile(MLP(), 2, checkpoint="sometimes")
    with pytest.raises(ValueError, match="balance_by='luck'"):
        fxpipe.compile(MLP(), 2, balance_by="luck")
    with pytest.raises(ValueError, match=r"balance_by=\[1, 2\].*split_points=.*GPipe\(module, balance="):
        fxpipe.compile(MLP(), 2, balance_by=[1, 2])


@pytest.mark.parametrize("keyword, meant", [("balance", r"split_points= .*GPipe\(module, balance"),
                                            ("n_microbatches", "chunks="), ("chunk", r"did you mean chunks=\?"),
                                            ("chekpoint", "did you mean checkpoint="), ("foo", "no such argument"),
                                            ("expert_parallel", "fxpipe has no expert parallelism")])
def test_a_keyword_from_elsewhere_names_the_argument_meant(keyword, meant):
    with pytest.raises(TypeError, match=rf"fxpipe.compile\(\) got unexpected keyword arguments: {keyword}= \(.*{meant}"):
        fxpipe.compile(MLP(), 2, **{keyword: 1})


def test_num_stages_in_place_of_n_stages_is_named_and_a_missing_n_stages_said_so():
    # Python's bare "compile() missing 1 required positional argument: 'n_stages'" came first
    with pytest.raises(TypeError, match=r"num_stages= \(use n_stages \(the second argument\)\)"):
        fxpipe.compile(MLP(), num_stages=2, example_inputs=(torch.randn(4, 16),))
    with pytest.raises(TypeError, match=r"fxpipe.compile\(\) is missing n_stages, the number of pipeline stages"):
        fxpipe.compile(MLP(), example_inputs=(torch.randn(4, 16),))


def test_a_schedule_file_that_is_missing_is_named(tmp_path):
    with pytest.raises(fxpipe.ScheduleError, match="looks like the path of a schedule file, and no such file exists"):
        fxpipe.compile(MLP(), 2, example_inputs=(torch.randn(4, 16),), schedule=str(tmp_path / "mine.txt"))


def test_batch_sizes_disagree_names_the_argument():
    model = MultiIO()
    x, y, mask = torch.randn(6, 6), torch.randn(5, 4), torch.rand(6, 8)
    with pytest.raises(fxpipe.PipelineInputError, match=r"'x' has 6 rows on dim 0 but 'y' has 5"):
        fxpipe.compile(model, 2, example_inputs=(x, y), example_kwargs={"mask": mask})
    pipe = fxpipe.compile(model, 2, example_inputs=(x, torch.randn(6, 4)), example_kwargs={"mask": mask},
                          chunks=2, devices=["cpu"] * 2)
    with pytest.raises(fxpipe.PipelineInputError, match=r"'x' has 6 rows on dim 0 but 'mask' has 3"):
        pipe(x, torch.randn(6, 4), mask=torch.rand(3, 8))
    assert isinstance(fxpipe.PipelineInputError("x"), ValueError)


def test_failing_compile_leaves_model_unmoved_and_unmodified():
    model = MLP()
    before = copy.deepcopy(model.state_dict())
    params = [id(p) for p in model.parameters()]
    attrs = set(vars(model))
    with pytest.raises(ValueError, match="unknown split point 'nope'"):
        fxpipe.compile(model, 2, example_inputs=(torch.randn(2, 16),), split_points=["nope"])
    with pytest.raises(ValueError, match="n_stages=99"):
        fxpipe.compile(model, 99, example_inputs=(torch.randn(2, 16),))
    assert [id(p) for p in model.parameters()] == params
    assert set(vars(model)) == attrs
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]) and v.device == before[k].device


def test_compile_rejects_non_modules():
    with pytest.raises(TypeError, match="expects an nn.Module"):
        fxpipe.compile(lambda x: x, 2)


def test_sync_batch_norm_across_ranks_is_refused_naming_the_fix():
    # on CPU it failed in tracing with a hint about dropped branches and tracer='export'; on GPUs it would wait on
    # ranks that never run its stage
    model = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(),
                                                                  nn.Conv2d(4, 4, 3)))
    with pytest.raises(fxpipe.CompileError, match=r"holds 1 SyncBatchNorm module\(s\) \('1'\).*Build the model with "
                                                  r"plain BatchNorm.*deferred_batch_norm=True"):
        fxpipe.compile(model, 2, example_inputs=(torch.randn(4, 3, 8, 8),), runtime="distributed")


def test_a_step_under_no_grad_is_refused_naming_pipe_x():
    model = MLP()
    pipe = fxpipe.compile(model, 2, example_inputs=(torch.randn(4, 16),), chunks=2)
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"pipe.step runs backward and needs autograd; call it "
                                                             r"outside torch.no_grad\(\).*use pipe\(x\) to infer"):
        pipe.step(torch.randn(4, 16), target=torch.randn(4, 16), loss_fn=torch.nn.functional.mse_loss)
