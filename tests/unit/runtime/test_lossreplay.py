"""A checkpointed last stage's loss_fn runs again in backward as it ran in forward."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe


class _Noisy(nn.Module):
    """Draws from a generator of its own."""

    def __init__(self):
        super().__init__()
        self.l, self.g = nn.Linear(16, 1), torch.Generator().manual_seed(3)

    def forward(self, h):
        return self.l(h + torch.randn(h.shape, generator=self.g))


class _Ema(nn.Module):
    """Reassigns its buffer (a running mean kept by assignment, not in place)."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(16, 1)
        self.register_buffer("mean", torch.zeros(16))

    def forward(self, h):
        self.mean = 0.5 * self.mean + 0.5 * h.detach().mean(0)
        return self.l(h - self.mean)


class _Scorer(nn.Module):
    """Scores in a method of its own, through F.batch_norm on its own buffers (no module call)."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(16, 1)
        self.register_buffer("rm", torch.zeros(16))
        self.register_buffer("rv", torch.ones(16))

    def score(self, h):
        return self.l(F.batch_norm(h, self.rm, self.rv, training=True, momentum=0.5))


def _discriminator(kind: str) -> nn.Module:
    """Return a GAN discriminator whose forward keeps state (or draws random numbers)."""
    torch.manual_seed(1)
    if kind == "spectral":
        return nn.Sequential(nn.utils.parametrizations.spectral_norm(nn.Linear(16, 32)), nn.LeakyReLU(0.2),
                             nn.Linear(32, 1))
    if kind in ("generator", "reassigned", "method"):
        return {"generator": _Noisy, "reassigned": _Ema, "method": _Scorer}[kind]()
    if kind == "batchnorm":
        return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
    return nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.5), nn.LeakyReLU(0.2), nn.Linear(32, 1))


@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
@pytest.mark.parametrize("kind", ["spectral", "batchnorm", "dropout", "generator", "reassigned", "method"])
def test_a_discriminator_in_loss_fn_runs_once_per_micro_batch_as_eager(kind, schedule):
    # the recomputed last stage ran loss_fn again: spectral norm's power iteration twice (gradients 18-25% off),
    # batch norm's statistics updated twice, dropout masks drawn anew; then its own generator drawn anew (gradients
    # 97% off), a reassigned buffer (110%) and buffers a method updates through F.batch_norm (statistics 0.1 off)
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        gen = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
        disc, eager_gen = _discriminator(kind), copy.deepcopy(gen)
        eager_disc = copy.deepcopy(disc)
        z, y = torch.randn(6, 8), torch.ones(6, 1)
        score = disc.score if kind == "method" else disc
        eager_score = eager_disc.score if kind == "method" else eager_disc
        pipe = fxpipe.compile(gen, 2, example_inputs=(z,), chunks=3, schedule=schedule, devices=["cpu"] * 2)
        torch.manual_seed(5)
        loss = pipe.step(z, target=y, loss_fn=lambda out, t: F.binary_cross_entropy_with_logits(score(out), t))
        torch.manual_seed(5)
        expect = sum(F.binary_cross_entropy_with_logits(eager_score(eager_gen(zc)), yc) / 3
                     for zc, yc in zip(z.chunk(3), y.chunk(3)))
        expect.backward()
        torch.testing.assert_close(loss, expect.detach())
        for a, b in zip([*gen.parameters(), *disc.parameters()], [*eager_gen.parameters(), *eager_disc.parameters()]):
            torch.testing.assert_close(a.grad, b.grad)
        for a, b in zip(disc.buffers(), eager_disc.buffers()):
            torch.testing.assert_close(a, b)
    finally:
        torch.set_default_dtype(torch.float32)


def test_the_loss_replay_watches_the_user_s_loss_fn_not_fxpipe_s_objects():
    # a micro-batch's loss closes over the pipe's binding, whose graph module was walked: every buffer of the
    # stages was copied and compared per checkpointed micro-batch (25% of a small model's step)
    from functools import partial

    from fxpipe.runtime.ignored import check_first_loss
    from fxpipe.runtime.microbatch import micro_losses
    from fxpipe.runtime.stage.lossreplay import watching

    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    x = torch.randn(4, 8)
    pipe = fxpipe.compile(model, 2, example_inputs=(x,), chunks=2, devices=["cpu"] * 2, schedule="1f1b")
    binding = pipe._runtime.binding
    scorer = nn.BatchNorm1d(2)
    losses = micro_losses(lambda out, t: F.mse_loss(scorer(out), t), torch.randn(4, 2), 4, 2, torch.device("cpu"),
                          binding.finish, partial(check_first_loss, binding))
    with watching(losses[0]) as state:
        pass
    watched = {id(b) for _, _, b, _ in state.buffers.values()}
    assert watched == {id(b) for b in scorer.buffers()}, len(watched)
