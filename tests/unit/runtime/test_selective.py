"""Selective recomputation: equal to eager under every schedule, random numbers replayed, the pass
flags, the save= predicate, and what a forward really keeps for its backward."""

import copy
import gc

import pytest
import torch
import torch.nn.functional as F
from models import FACTORIES, DecoderBlock, TableDecoderBlock
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import fxpipe
from fxpipe.simulate.devices import device_model
from fxpipe.simulate.stagecost import graph_costs
from fxpipe.testing import assert_pipeline_equivalent


class Block(nn.Module):
    """Pre-norm attention and MLP, dropout on both residual branches and inside attention."""

    def __init__(self, d: int = 16, p: float = 0.0) -> None:
        super().__init__()
        self.p = p
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.n1(x)).chunk(3, -1)
        q, k, v = (z.reshape(b, t, 4, d // 4).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.p if self.training else 0.0)
        x = x + F.dropout(self.proj(a.transpose(1, 2).reshape(b, t, d)), self.p, self.training)
        return x + F.dropout(self.fc2(F.gelu(self.fc1(self.n2(x)))), self.p, self.training)


def stack(p: float = 0.0, blocks: int = 4) -> nn.Module:
    """Return ``blocks`` blocks in sequence."""
    return nn.Sequential(*[Block(p=p) for _ in range(blocks)])


SETTINGS = ["selective", ["selective", "never"], ["always", "selective"], ["selective", "except_last"]]


@pytest.mark.parametrize("checkpoint", SETTINGS, ids=str)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb"])
def test_equal_to_eager(schedule, checkpoint):
    x = torch.randn(6, 8, 16)
    pipe = assert_pipeline_equivalent(stack(), (x,), n_stages=2, chunks=3, checkpoint=checkpoint,
                                      devices=["cpu"] * 2, schedules=[schedule])
    assert pipe.plan.policies() == (checkpoint if isinstance(checkpoint, list) else [checkpoint] * 2)


@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_equal_to_eager_with_two_stages_per_rank(schedule):
    assert_pipeline_equivalent(stack(), (torch.randn(8, 8, 16),), n_stages=4, chunks=4, stages_per_rank=2,
                               checkpoint=["selective", "always", "selective", "never"], devices=["cpu"] * 4,
                               schedule=schedule)


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_every_test_model_equal_to_eager(name):
    model, args, kwargs = FACTORIES[name]()
    assert_pipeline_equivalent(model, args, example_kwargs=kwargs, n_stages=3, chunks=3, checkpoint="selective",
                               devices=["cpu"] * 3)


@pytest.mark.parametrize("checkpoint", SETTINGS, ids=str)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb"])
def test_dropout_replayed_at_one_chunk(schedule, checkpoint):
    # eager and the pipe draw from one seed in the same order at chunks=1; gradients are equal only
    # if the recomputation in backward draws the masks of the first forward again
    assert_pipeline_equivalent(stack(p=0.3), (torch.randn(4, 8, 16),), n_stages=2, chunks=1,
                               checkpoint=checkpoint, devices=["cpu"] * 2, schedules=[schedule])


def test_a_wrong_replay_would_be_seen(monkeypatch):
    # without the replay the recomputed dropout draws new masks: the gradients differ from eager
    from fxpipe.runtime.stage import tape

    monkeypatch.setattr(tape, "restore_rng", lambda device, state: torch.random.fork_rng([]))
    with pytest.raises(AssertionError):
        assert_pipeline_equivalent(stack(p=0.3), (torch.randn(4, 8, 16),), n_stages=2, chunks=1,
                                   checkpoint="selective", devices=["cpu"] * 2, schedules=())


class Spy(nn.Module):
    """Record (is_checkpointing, is_recomputing) on every call; its backward saves tanh's result, made inside."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = []

    def forward(self, x):
        self.calls.append((fxpipe.is_checkpointing(), fxpipe.is_recomputing()))
        return torch.tanh(self.lin(x)) * 2


class SpyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.spy = Spy()

    def forward(self, x):
        return self.b(self.spy(self.a(x)))


@pytest.mark.parametrize("schedule", ["gpipe", "zb"])
def test_flags_in_the_forward_and_the_recomputation(schedule):
    model = SpyNet()
    pipe = fxpipe.compile(model, 2, example_inputs=(torch.randn(4, 4),), chunks=2, checkpoint="selective",
                          devices=["cpu"] * 2, leaf_modules=[Spy], schedule=schedule)
    model.spy.calls.clear()
    if schedule == "gpipe":
        pipe(torch.randn(4, 4)).sum().backward()
    else:
        pipe.step(torch.randn(4, 4), target=torch.randn(4, 4), loss_fn=F.mse_loss)
    # each micro-batch's forward, then the recomputation its backward asked for
    assert sorted(model.spy.calls) == [(False, True)] * 2 + [(True, False)] * 2
    assert not fxpipe.is_checkpointing() and not fxpipe.is_recomputing()


def test_save_predicate_chooses_what_is_kept():
    everything = lambda node: False  # keep nothing: the linears are recomputed too
    pipe = assert_pipeline_equivalent(stack(), (torch.randn(6, 8, 16),), n_stages=2, chunks=3, devices=["cpu"] * 2,
                                      checkpoint="selective", save=everything, schedules=["zb"])
    # zero bubble's W still finds the inputs of the recomputed linears it defers
    plan = pipe._runtime.calls[0].saver.plan
    assert not any(plan.saved)
    fc = lambda node: node.op == "call_module" and "fc" in str(node.target)
    pipe = fxpipe.compile(stack(), 2, example_inputs=(torch.randn(6, 8, 16),), checkpoint="selective", save=fc,
                          devices=["cpu"] * 2)
    plan = pipe._runtime.calls[0].saver.plan
    assert {n for n, s in zip(plan.names, plan.saved) if s} == {"_0_fc1", "_0_fc2", "_1_fc1", "_1_fc2"}


class _Allocations(TorchDispatchMode):
    """Note the storage of every tensor an op makes."""

    def __init__(self):
        super().__init__()
        self.made = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type == "cpu":
                self.made.setdefault(StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes())
        return out


def _decoder() -> nn.Module:
    """Return a Llama-style stack: RMSNorm, rotary attention, SwiGLU."""
    torch.manual_seed(0)
    return nn.Sequential(*[DecoderBlock(32, 4, 96, 16) for _ in range(3)])


def _alive_after(run) -> tuple[int, torch.Tensor]:
    """Run ``run()``; return the bytes of the storages its ops made that are still alive, and its output."""
    record = _Allocations()
    with record:
        out = run()
    gc.collect()
    mine = StorageWeakRef(out.untyped_storage())
    return sum(n for ref, n in record.made.items() if not ref.expired() and ref != mine), out


def _beside_autograd(x: torch.Tensor) -> int:
    """Return what an eager forward leaves alive that autograd does not save (copies of weights made for matmuls)."""
    model = _decoder()
    state = {StorageWeakRef(t.untyped_storage()) for t in (*model.parameters(), *model.buffers())}
    saved = {}

    def pack(t):
        ref = StorageWeakRef(t.untyped_storage())
        if ref not in state:
            saved[ref] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        alive, _out = _alive_after(lambda: model(x.clone().requires_grad_()))
    return alive - sum(saved.values())


def _kept_from_forward(mode: str, x: torch.Tensor) -> tuple[float, float]:
    """Return the bytes a one-stage forward of a decoder stack keeps for its backward, and what the simulator predicts."""
    pipe = fxpipe.compile(_decoder(), 1, example_inputs=(x,), checkpoint=mode, devices=["cpu"])
    held, out = _alive_after(lambda: pipe(x))
    cost = graph_costs(pipe._gm, pipe.plan, device_model("h100"), x.shape[0])[0]
    out.sum().backward()
    return held, cost.sel_kept if mode == "selective" else cost.kept


def test_selective_keeps_half_and_the_simulator_says_so():
    x = torch.randn(4, 16, 32)
    beside = _beside_autograd(x)
    never, never_predicted = _kept_from_forward("never", x)
    selective, selective_predicted = _kept_from_forward("selective", x)
    never, selective = never - beside, selective - beside
    assert selective < 0.6 * never, (selective, never)
    # the simulator's bytes are what the forward keeps (its micro-batch's input against the loss's share)
    assert abs(never_predicted - never) <= 0.05 * never, (never_predicted, never)
    assert abs(selective_predicted - selective) <= 0.1 * selective, (selective_predicted, selective)


class _Peak(TorchDispatchMode):
    """Note the most bytes alive at once among the storages ops make."""

    def __init__(self):
        super().__init__()
        self.made, self.peak = {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                self.made.setdefault(StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes())
        self.peak = max(self.peak, sum(n for ref, n in self.made.items() if not ref.expired()))
        return out


def _forward_peak(monkeypatch, release: bool) -> int:
    """Return the forward peak of a one-stage selective pipe over rotary blocks with table buffers."""
    from fxpipe.runtime.stage import selective

    if not release:
        monkeypatch.setattr(selective, "_releases", lambda program: {})
    torch.manual_seed(0)
    x = torch.randn(4, 16, 32)
    pipe = fxpipe.compile(nn.Sequential(*[TableDecoderBlock(32, 4, 96, 16) for _ in range(3)]), 1,
                          example_inputs=(x,), checkpoint="selective", devices=["cpu"])
    monkeypatch.undo()
    record = _Peak()
    with record:
        out = pipe(x)
    out.sum().backward()
    return record.peak


def test_kept_values_no_recomputation_reads_are_let_go_during_the_forward(monkeypatch):
    # rope's outputs are kept in place of q and k (selectswap): q and k go as soon as rope has run,
    # not at the end of the forward beside what replaced them -- 2 x 8 KiB less per block at the peak
    assert _forward_peak(monkeypatch, False) - _forward_peak(monkeypatch, True) >= 3 * 2 * 4 * 16 * 32 * 4


@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_kept_rotary_outputs_equal_to_eager(schedule):
    torch.manual_seed(0)
    model = nn.Sequential(*[TableDecoderBlock(32, 4, 96, 16) for _ in range(4)])
    assert_pipeline_equivalent(model, (torch.randn(8, 16, 32),), n_stages=2, chunks=4, checkpoint="selective",
                               devices=["cpu"] * 2, schedules=[schedule])


def test_offload_is_refused_on_cpu():
    model = stack()
    before = [p.device for p in model.parameters()]
    with pytest.raises(ValueError, match="needs a CUDA device"):
        fxpipe.compile(model, 2, example_inputs=(torch.randn(4, 8, 16),), checkpoint=["offload", "never"],
                       devices=["cpu"] * 2)
    assert [p.device for p in model.parameters()] == before


def test_gpipe_program_checkpoints_per_stage():
    pipe = fxpipe.compile(copy.deepcopy(stack()), 2, example_inputs=(torch.randn(4, 8, 16),), chunks=2,
                          checkpoint=["always", "selective"], devices=["cpu"] * 2)
    assert "compute(0, 0, in0, True)" in pipe.code and "compute(1, 0, in1, False)" in pipe.code


class Fickle(nn.Module):
    """Saves tanh's result on its first call only: its recomputation saves something else."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return torch.tanh(x) * 2 if self.calls % 2 else x * 2


def test_a_node_that_saves_otherwise_when_recomputed_is_named():
    model = nn.Sequential(nn.Linear(4, 4), Fickle())  # its output is the stage's: kept; tanh's is not
    pipe = fxpipe.compile(model, 1, example_inputs=(torch.randn(4, 4),), checkpoint="selective", devices=["cpu"],
                          leaf_modules=[Fickle])
    model[1].calls = 0
    out = pipe(torch.randn(4, 4))
    with pytest.raises(RuntimeError, match="node '_1' did not save what its first forward saved.*save="):
        out.sum().backward()
