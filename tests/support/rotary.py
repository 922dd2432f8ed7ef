"""A small decoder with rotary embeddings as Hugging Face's Llama had them in transformers 4.4x.

The rotary table's inverse frequencies are a non-persistent buffer (no checkpoint holds them;
``reset_parameters`` computes them), and the rotary forward turns autocast off with
``torch.autocast(device_type=x.device.type, enabled=False)``: on a model built on meta and
traced on meta tensors, that is ``device_type="meta"``, which autocast refuses.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RotaryTable(nn.Module):
    """Cosines and sines of the positions' angles, from a non-persistent ``inv_freq`` buffer."""

    def __init__(self, dim: int, base: float = 10000.0) -> None:
        super().__init__()
        self.dim, self.base = dim, base
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self) -> torch.Tensor:
        """Return the inverse frequencies of the rotary angles."""
        return 1.0 / self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float32) / self.dim)

    def reset_parameters(self) -> None:
        """Compute the inverse frequencies into the buffer (it is in no checkpoint)."""
        with torch.no_grad():
            self.inv_freq.copy_(self._inv_freq())

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (cos, sin) of each position's angles, computed in float32 whatever autocast says."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        with torch.autocast(device_type=x.device.type, enabled=False):
            emb = torch.cat((freqs, freqs), dim=-1)
            return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the last dim of ``x`` by the angles whose cosines and sines are given."""
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin


class Block(nn.Module):
    """Causal self-attention with rotary queries and keys, then an MLP; both pre-norm."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Return ``x`` plus attention, plus the MLP."""
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(_rotate(q, cos, sin), _rotate(k, cos, sin), v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class RotaryDecoder(nn.Module):
    """Token embedding, rotary blocks, a final norm and a head tied to the embedding."""

    def __init__(self, vocab: int = 32, d: int = 16, layers: int = 3, heads: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.rotary = RotaryTable(d // heads)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.norm = nn.RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Return the logits of the next token at each position."""
        x = self.embed(ids)
        cos, sin = self.rotary(x, torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))
