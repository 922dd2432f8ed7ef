"""Compile a U-Net into 4 pipeline stages on CPU, print the plan, train one step against eager.

    python examples/unet.py

The U-Net is a plain ``nn.Module``: no ``nn.Sequential``, no ``@skippable``, no ``balance``.
fxpipe finds its skip connections and routes each one straight from the stage that makes
it to the stage that uses it.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import fxpipe


class Block(nn.Module):
    """Two 3x3 convolutions with batch norm and ReLU."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(x)))


class UNet(nn.Module):
    """A U-Net of ``depth`` levels; level k's encoder output skips to level k's decoder."""

    def __init__(self, depth: int = 3, base: int = 8, cin: int = 3, cout: int = 2) -> None:
        super().__init__()
        widths = [base * 2 ** k for k in range(depth + 1)]
        self.down = nn.ModuleList([Block(cin if k == 0 else widths[k - 1], widths[k]) for k in range(depth)])
        self.middle = Block(widths[depth - 1], widths[depth])
        self.up = nn.ModuleList([nn.ConvTranspose2d(widths[k + 1], widths[k], 2, stride=2)
                                 for k in reversed(range(depth))])
        self.dec = nn.ModuleList([Block(2 * widths[k], widths[k]) for k in reversed(range(depth))])
        self.head = nn.Conv2d(widths[0], cout, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)
            x = F.max_pool2d(x, 2)
        x = self.middle(x)
        for up, dec in zip(self.up, self.dec):
            x = up(x)
            x = dec(torch.cat([x, skips.pop()], dim=1))
        return self.head(x)


def factory() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """Return a small U-Net and an example input (for ``fxpipe inspect examples/unet.py:factory``)."""
    torch.manual_seed(0)
    return UNet(), (torch.randn(8, 3, 32, 32),)


def main() -> None:
    """Compile, print the plan, run one training step and compare with eager."""
    model, (x,) = factory()
    target = torch.randn(8, 2, 32, 32)
    eager = copy.deepcopy(model).eval()
    model.eval()  # batch norm statistics over the whole batch; see deferred_batch_norm for training
    pipe = fxpipe.compile(model, 4, example_inputs=(x,), devices=["cpu"] * 4, chunks=4)
    print(pipe.plan)

    loss = pipe.step(x, target=target, loss_fn=F.mse_loss)
    eager_loss = F.mse_loss(eager(x), target)
    eager_loss.backward()
    diffs = [(p.grad - q.grad).abs().max().item()
             for p, q in zip(model.parameters(), eager.parameters())]
    print(f"loss: pipeline {loss.item():.6f}  eager {eager_loss.item():.6f}")
    print(f"largest gradient difference to eager: {max(diffs):.3g}")
    print(f"largest loss difference to eager: {abs(loss.item() - eager_loss.item()):.3g}")


if __name__ == "__main__":
    main()
