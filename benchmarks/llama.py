"""Llama 3.1-style decoders (8B, 70B, 405B and tiny ones) written out here, built on meta for planning.

The shapes are Llama 3.1's published configurations (hidden size, layers, heads, key-value heads,
feed-forward size, vocabulary); the blocks are the usual pre-norm decoder: RMSNorm, grouped-query
attention with rotary embeddings and causal SDPA, a SwiGLU feed-forward. No weights are downloaded:
the factories build the model under ``torch.device("meta")``, which is all ``fxpipe plan`` reads.

    fxpipe plan benchmarks/llama.py:llama3_8b --gpus 8 --device h100 --global-batch 8 --seq 8192 --dtype bf16
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Config:
    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int = 128256
    seq: int = 8192


CONFIGS = {
    "8b": Config(4096, 32, 32, 8, 14336),
    "70b": Config(8192, 80, 64, 8, 28672),
    "405b": Config(16384, 126, 128, 8, 53248),
    "tiny": Config(64, 4, 4, 2, 128, vocab=256, seq=32),
    "small": Config(96, 6, 6, 2, 192, vocab=256, seq=32),
    "medium": Config(128, 8, 8, 4, 256, vocab=512, seq=32),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate(x, cos, sin):
    """Apply rotary embeddings to ``x`` of shape (b, heads, s, d) with tables of shape (s, d)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.heads, c.kv_heads, c.dim // c.heads
        self.wq = nn.Linear(c.dim, c.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(c.dim, c.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(c.dim, c.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(c.heads * self.head_dim, c.dim, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        rep = self.heads // self.kv_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class FeedForward(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.w1 = nn.Linear(c.dim, c.ffn, bias=False)
        self.w3 = nn.Linear(c.dim, c.ffn, bias=False)
        self.w2 = nn.Linear(c.ffn, c.dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(c.dim), Attention(c)
        self.ffn_norm, self.feed_forward = RMSNorm(c.dim), FeedForward(c)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """Embedding, ``layers`` blocks, a final norm and the output projection (untied, as Llama 3.1's)."""

    def __init__(self, c: Config):
        super().__init__()
        self.tok_embeddings = nn.Embedding(c.vocab, c.dim)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.dim)
        self.output = nn.Linear(c.dim, c.vocab, bias=False)
        d = c.dim // c.heads
        freqs = 1.0 / (500000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        angles = torch.outer(torch.arange(c.seq, dtype=torch.float32), freqs)
        self.register_buffer("cos", torch.cat([angles.cos(), angles.cos()], -1), persistent=False)
        self.register_buffer("sin", torch.cat([angles.sin(), angles.sin()], -1), persistent=False)

    def forward(self, tokens):
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin)
        return self.output(self.norm(x))


def build(name: str, seq: int | None = None, batch: int = 1, meta: bool = True):
    """Return a Llama of config ``name`` (on meta unless ``meta=False``) and example tokens of ``batch`` x ``seq``."""
    c = CONFIGS[name]
    if seq is not None:
        c = Config(c.dim, c.layers, c.heads, c.kv_heads, c.ffn, c.vocab, seq)
    if meta:
        with torch.device("meta"):
            model = Llama(c)
    else:
        model = Llama(c)
    return model, (torch.randint(0, c.vocab, (batch, c.seq)),)


def llama3_8b(seq: int = 8192):
    return build("8b", seq)


def llama3_70b(seq: int = 8192):
    return build("70b", seq)


def llama3_405b(seq: int = 8192):
    return build("405b", seq)


def tiny(seq: int = 32):
    return build("tiny", seq, batch=8, meta=False)
