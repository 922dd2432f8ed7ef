"""Compile a small GPT-style decoder with tied embeddings into 4 stages on CPU; train one step.

    python examples/transformer.py
    fxpipe inspect examples/transformer.py:factory --stages 4 --chunks 4

The output projection shares the token embedding's weight. fxpipe gives the weight to the
first stage that reads it; the last stage reads a copy whose gradient flows back into the
one ``Parameter``, so the tied weight's gradient equals eager's.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import fxpipe


class Block(nn.Module):
    """Pre-norm causal self-attention and an MLP, each with a residual connection."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """Token and position embeddings, ``layers`` blocks, and a head tied to the embedding."""

    def __init__(self, vocab: int = 256, d: int = 64, layers: int = 4, heads: int = 4, seq: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def factory() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """Return a small GPT and example tokens (for ``fxpipe inspect examples/transformer.py:factory``)."""
    torch.manual_seed(0)
    return GPT(), (torch.randint(0, 256, (8, 32)),)


def gpt_medium() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """Return a GPT-2-medium-sized model (24 layers, d=1024, 350M parameters) and 8 sequences of 1024
    tokens, for planning (``fxpipe plan examples/transformer.py:gpt_medium ...``)."""
    torch.manual_seed(0)
    return GPT(vocab=50304, d=1024, layers=24, heads=16, seq=1024), (torch.randint(0, 50304, (8, 1024)),)


def main() -> None:
    """Compile, print the plan, run one training step and compare with eager."""
    model, (tokens,) = factory()
    target = torch.randint(0, 256, tokens.shape)
    eager = copy.deepcopy(model)

    def loss_fn(logits: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))

    pipe = fxpipe.compile(model, 4, example_inputs=(tokens,), devices=["cpu"] * 4, chunks=4)
    print(pipe.plan)
    loss = pipe.step(tokens, target=target, loss_fn=loss_fn)
    eager_loss = loss_fn(eager(tokens), target)
    eager_loss.backward()
    tied = (model.embed.weight.grad - eager.embed.weight.grad).abs().max().item()
    print(f"loss: pipeline {loss.item():.6f}  eager {eager_loss.item():.6f}")
    print(f"tied embedding gradient, largest difference to eager: {tied:.3g}")


if __name__ == "__main__":
    main()
