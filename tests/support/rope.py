"""A Llama-style decoder that builds under ``torch.device("meta")``: rotary tables in
non-persistent buffers, RMSNorm, a tied head; on meta, ``rope_init`` sets what no checkpoint holds.

(``models.RopeDecoder`` is the one whose ``__init__`` makes every value, for ``fxpipe.deferred_init``;
it computes its rotary table on an explicit device, as Hugging Face's do, so it cannot build on meta.)
Any sequence length up to ``max_len`` runs: the rotary angles are sliced to the input's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models import RMSNorm


class Rotary(nn.Module):
    """Rotary position angles: ``inv_freq`` and the cos/sin tables, none of them saved."""

    def __init__(self, head_dim: int, max_len: int, base: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        angles = torch.outer(torch.arange(max_len).float(), inv_freq)
        self.register_buffer("cos", torch.cat([angles.cos()] * 2, -1), persistent=False)
        self.register_buffer("sin", torch.cat([angles.sin()] * 2, -1), persistent=False)

    def forward(self, q, k):
        t = q.shape[-2]
        cos, sin = self.cos[:t], self.sin[:t]
        return q * cos + _half_turn(q) * sin, k * cos + _half_turn(k) * sin


def _half_turn(x):
    """Rotate the two halves of the last dimension: (a, b) -> (-b, a)."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class Block(nn.Module):
    """Pre-norm causal attention with rotary positions, then a SiLU MLP."""

    def __init__(self, d: int, heads: int, max_len: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)
        self.rotary = Rotary(d // heads, max_len)
        self.up = nn.Linear(d, 2 * d, bias=False)
        self.down = nn.Linear(2 * d, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k = self.rotary(q, k)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(att.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.silu(self.up(self.norm2(x))))


class RopeLM(nn.Module):
    """Token embedding, rotary blocks, RMSNorm and an output head tied to the embedding."""

    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 2, layers: int = 4, max_len: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads, max_len) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def rope_init(module: nn.Module) -> None:
    """Set what a meta-built RopeLM's modules hold (an ``init=`` for fxpipe.compile)."""
    if isinstance(module, Rotary):
        fresh = Rotary(module.inv_freq.shape[0] * 2, module.cos.shape[0])
        for name in ("inv_freq", "cos", "sin"):
            getattr(module, name).copy_(getattr(fresh, name))
    elif isinstance(module, RMSNorm):
        with torch.no_grad():
            module.weight.fill_(1.0)
    elif hasattr(module, "reset_parameters"):
        module.reset_parameters()
