"""A forward's torch.no_grad() blocks survive the fx trace: no gradient flows through them."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.testing import assert_pipeline_equivalent


class Teacher(nn.Module):
    """A frozen branch computed under ``torch.no_grad()`` beside a trained one."""

    def __init__(self) -> None:
        super().__init__()
        self.teacher, self.student, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        with torch.no_grad():
            t = torch.tanh(self.teacher(x)) * 2
        return self.head(torch.relu(self.student(x) + t))


class Table(nn.Module):
    """Scale by a table made in a forward decorated with ``@torch.no_grad()`` (rotary embeddings' way)."""

    def __init__(self) -> None:
        super().__init__()
        self.freq = nn.Linear(8, 8)

    @torch.no_grad()
    def forward(self, x):
        return torch.cos(self.freq(x))


class WithTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.table, self.out = nn.Linear(8, 8), Table(), nn.Linear(8, 8)

    def forward(self, x):
        h = self.inp(x)
        return self.out(h * self.table(h))


@pytest.mark.parametrize("model", [Teacher, WithTable])
def test_no_grad_blocks_give_eager_s_gradients(model):
    torch.manual_seed(0)
    pipe = assert_pipeline_equivalent(model(), (torch.randn(6, 8),), n_stages=2, chunks=2, devices=["cpu"] * 2)
    frozen = dict(pipe.named_parameters())["teacher.weight" if model is Teacher else "table.freq.weight"]
    assert frozen.grad is None  # eager gives it none (an optimizer then skips it); the plain trace gave it one


def test_a_model_compiled_under_no_grad_still_trains():
    model, x = Teacher(), torch.randn(6, 8)
    eager = copy.deepcopy(model)
    with torch.no_grad():  # an inference script's habit: it must not mark the whole graph
        pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=2, devices=["cpu"] * 2)
    pipe.step(x, target=None, loss_fn=lambda out, _: out.pow(2).mean())
    eager(x).pow(2).mean().backward()
    torch.testing.assert_close(model.student.weight.grad, eager.student.weight.grad)
    assert model.teacher.weight.grad is None


class _Reentrant(nn.Module):
    """Checkpoints a block itself, as transformers' gradient checkpointing does (use_reentrant=True)."""

    def __init__(self, reentrant):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.reentrant = reentrant

    def forward(self, x):
        h = self.a(x)
        h = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.b(t)), h, use_reentrant=self.reentrant)
        return self.c(h)


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_model_checkpointing_a_block_itself_trains_every_parameter(reentrant):
    # autograd runs a reentrant checkpoint's block with grad off: it was detached as a no-grad block, and every
    # parameter before the block's end got no gradient
    # (and the trace passed torch's "None of the inputs have requires_grad=True" on, where every gradient is right)
    import warnings

    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_pipeline_equivalent(_Reentrant(reentrant), (torch.randn(8, 4),), n_stages=2, chunks=2,
                                   devices=["cpu"] * 2)
    assert not [w for w in caught if "None of the inputs have requires_grad" in str(w.message)]


class _DataInit(nn.Module):
    """An ActNorm set from the first batch it sees, branchless: a parameter written in place under no_grad."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.loc = nn.Parameter(torch.zeros(1, c))
        self.register_buffer("inited", torch.tensor(0.0))

    def forward(self, x):
        with torch.no_grad():
            self.loc.copy_(torch.where(self.inited > 0, self.loc, -x.mean(0, keepdim=True)))
            self.inited.fill_(1.0)
        return x + self.loc


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_a_parameter_written_in_place_in_a_no_grad_block_is_written_as_eager_writes_it(checkpoint):
    # before: "a leaf Variable that requires grad is being used in an in-place operation" at compile, explained as
    # a dropped branch; the block runs with autograd on, and its write now goes through a detached alias
    torch.manual_seed(0)
    model = nn.Sequential(_DataInit(4), nn.Linear(4, 4))
    eager = copy.deepcopy(model)
    x = torch.randn(8, 4) * 3 + 1
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), devices=["cpu"] * 2, chunks=2, checkpoint=checkpoint)
    for _ in range(2):
        pipe.step(x, target=x, loss_fn=F.mse_loss)
        for xs in x.chunk(2):  # eager on the micro-batches: the first one sets loc
            (F.mse_loss(eager(xs), xs) / 2).backward()
    for name, t in eager.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], t, msg=name)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


class _Masked(nn.Module):
    """Change an activation that carries a gradient in place inside ``torch.no_grad()`` (eager's gradient passes)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.a, self.head = how, nn.Linear(16, 16), nn.Linear(16, 3)

    def forward(self, x):
        g = self.a(x)
        with torch.no_grad():
            if self.how == "setitem":
                g[:, 0] = 0.0
            elif self.how == "clamp_":
                torch.clamp_(g, max=0.5)
            elif self.how == "view":
                g.view(-1)[::3] = 0.0
            elif self.how == "out":
                torch.clamp(g, max=0.2, out=g)
            else:  # pruning a weight
                self.head.weight[:, 0] = 0.0
        return self.head(g)


@pytest.mark.parametrize("how", ["setitem", "clamp_", "view", "weight", "out"])
def test_a_no_grad_write_by_a_function_or_through_a_view_leaves_the_gradient_as_eager(how):
    # only methods ending in _ were written through a detached alias: operator.setitem and torch.clamp_ were
    # recorded by autograd (masked gradients 47-79% off, silently), a weight's setitem refused at compile; out=
    # refused at compile (autograd takes no out= argument requiring grad)
    torch.manual_seed(0)
    model, x, y = _Masked(how), torch.randn(8, 16), torch.randint(0, 3, (8,))
    eager = copy.deepcopy(model)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=1, devices=["cpu"] * 2)
    loss = pipe.step(x, target=y, loss_fn=F.cross_entropy)
    expect = F.cross_entropy(eager(x), y)
    expect.backward()
    torch.testing.assert_close(loss, expect.detach())
    for a, b in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
