"""Models and hand-written plans for the tensor-parallel tests (what ``tp_plan="auto"`` must find too)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel


class Block(nn.Module):
    """A pre-norm residual MLP block: x + fc2(gelu(fc1(norm(x))))."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class ResidualMLP(nn.Module):
    """An input projection, residual MLP blocks, a head."""

    def __init__(self, d: int = 16, hidden: int = 32, blocks: int = 4, out: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList([Block(d, hidden) for _ in range(blocks)])
        self.head = nn.Linear(d, out)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


MLP_PLAN = {"blocks.*.fc1": ColwiseParallel(), "blocks.*.fc2": RowwiseParallel()}


class Attention(nn.Module):
    """Causal self-attention whose views hard-code the head count (4 heads of 8), matmul-softmax-matmul.

    The key projection has no bias: softmax ignores it (its gradient is zero but for rounding).
    """

    def __init__(self) -> None:
        super().__init__()
        self.q, self.v, self.o = (nn.Linear(32, 32) for _ in range(3))
        self.k = nn.Linear(32, 32, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, 4, 8).transpose(1, 2)
        k = self.k(x).view(b, s, 4, 8).transpose(1, 2)
        v = self.v(x).view(b, s, 4, 8).transpose(1, 2)
        mask = torch.triu(torch.full((s, s), float("-inf"), device=x.device), 1)
        att = torch.softmax(q @ k.transpose(-2, -1) * 8 ** -0.5 + mask, dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, s, 32)
        return self.o(y)


class HeadNorm(nn.Module):
    """Qwen3's per-head RMS norm, written out (traced through: its weight is a get_attr beside a shard)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d) + 0.1 * torch.randn(d))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class QKNormAttention(Attention):
    """Attention with Qwen3's q_norm and k_norm over each head: weights left whole beside the heads' shard.

    Each rank computes their gradient over its own heads only; the runtime sums the group's parts.
    ``q_norm`` is traced through, ``k_norm`` is ``nn.RMSNorm`` (a leaf module call on the shard).
    """

    def __init__(self) -> None:
        super().__init__()
        self.q_norm = HeadNorm(8)
        self.k_norm = nn.RMSNorm(8, eps=1e-6)
        with torch.no_grad():
            self.k_norm.weight.add_(0.1 * torch.randn(8))

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q_norm(self.q(x).view(b, s, 4, 8)).transpose(1, 2)
        k = self.k_norm(self.k(x).view(b, s, 4, 8)).transpose(1, 2)
        v = self.v(x).view(b, s, 4, 8).transpose(1, 2)
        mask = torch.triu(torch.full((s, s), float("-inf"), device=x.device), 1)
        att = torch.softmax(q @ k.transpose(-2, -1) * 8 ** -0.5 + mask, dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, s, 32)
        return self.o(y)


class MLP2(nn.Module):
    """The decoder block's MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 32)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class DecoderBlock(nn.Module):
    """Pre-norm attention and MLP with residuals."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(32), nn.LayerNorm(32)
        self.attn = Attention()
        self.mlp = MLP2()

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TiedDecoder(nn.Module):
    """A decoder (vocabulary 64, width 32, 4 heads) whose output head shares the token embedding."""

    def __init__(self, layers: int = 2, positions: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.pos = nn.Embedding(16, 32) if positions else None
        self.blocks = nn.ModuleList([DecoderBlock() for _ in range(layers)])
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 64, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        h = self.embed(ids)
        if self.pos is not None:
            h = h + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


DECODER_PLAN = {
    "embed": RowwiseParallel(input_layouts=Replicate()),
    "blocks.*.attn.q": ColwiseParallel(), "blocks.*.attn.k": ColwiseParallel(), "blocks.*.attn.v": ColwiseParallel(),
    "blocks.*.attn.o": RowwiseParallel(),
    "blocks.*.mlp.fc1": ColwiseParallel(), "blocks.*.mlp.fc2": RowwiseParallel(),
    "head": ColwiseParallel(output_layouts=Replicate()),
}

# torchtitan's sequence-parallel plan, for a graph: the residual stream a local shard of the sequence dim,
# the norms on DTensors, the linears reading them gather what they need
SP_PLAN = {
    "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
    "blocks.*.ln1": SequenceParallel(), "blocks.*.ln2": SequenceParallel(), "norm": SequenceParallel(),
    "blocks.*.attn.q": ColwiseParallel(), "blocks.*.attn.k": ColwiseParallel(), "blocks.*.attn.v": ColwiseParallel(),
    "blocks.*.attn.o": RowwiseParallel(output_layouts=Shard(1)),
    "blocks.*.mlp.fc1": ColwiseParallel(), "blocks.*.mlp.fc2": RowwiseParallel(output_layouts=Shard(1)),
    "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
}

LLAMA_PLAN = {
    "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
    "model.layers.*.self_attn.q_proj": ColwiseParallel(), "model.layers.*.self_attn.k_proj": ColwiseParallel(),
    "model.layers.*.self_attn.v_proj": ColwiseParallel(), "model.layers.*.self_attn.o_proj": RowwiseParallel(),
    "model.layers.*.mlp.gate_proj": ColwiseParallel(), "model.layers.*.mlp.up_proj": ColwiseParallel(),
    "model.layers.*.mlp.down_proj": RowwiseParallel(),
}


def llama(layers: int = 2):
    """Return a small Hugging Face Llama (4 heads, 2 key/value heads, untied head) from a config."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
    return LlamaForCausalLM(cfg)


def token_loss(logits, target):
    """Cross-entropy over a vocabulary, per token."""
    logits = getattr(logits, "logits", logits)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
