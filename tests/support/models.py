"""Small models for the tests, each with a factory returning (model, args, kwargs)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformer import GPT  # examples/, put on sys.path by conftest
from unet import UNet

import fxpipe


class MLP(nn.Module):
    """Six linear layers with ReLU."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(d, d) for _ in range(6)])

    def forward(self, x):
        for layer in self.layers:
            x = F.relu(layer(x))
        return x


class CNN(nn.Module):
    """Three conv-BN-ReLU blocks, pooling and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.ModuleList([nn.Conv2d(c, 8, 3, padding=1) for c in (3, 8, 8)])
        self.bns = nn.ModuleList([nn.BatchNorm2d(8) for _ in range(3)])
        self.fc = nn.Linear(8 * 4 * 4, 5)

    def forward(self, x):
        for conv, bn in zip(self.convs, self.bns):
            x = F.relu(bn(conv(x)))
        x = F.adaptive_avg_pool2d(x, 4)
        return self.fc(torch.flatten(x, 1))


class BNAct(nn.BatchNorm2d):
    """A batch norm subclass with its own forward, as timm's BatchNormAct2d: the update spelled out, then an
    activation (fx traces through it unless it is a leaf)."""

    def forward(self, x):
        if self.training and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        x = F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, self.training,
                         self.momentum, self.eps)
        return F.relu(x) - 0.5


class NormLadder(nn.Module):
    """Conv-BN-ReLU blocks of widening channels: more batch norms of distinct widths than torch.compile's
    recompile limit (8), as in a real CNN's stage."""

    def __init__(self, widths: tuple[int, ...] = (4, 5, 6, 7, 8, 9, 10, 11, 12, 13)) -> None:
        super().__init__()
        pairs = zip((3, *widths[:-1]), widths)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Conv2d(a, b, 3, padding=1), nn.BatchNorm2d(b), nn.ReLU())
                                      for a, b in pairs])
        self.head = nn.Linear(widths[-1], 5)

    def forward(self, x):
        return self.head(self.blocks(x).mean((2, 3)))


class Inception(nn.Module):
    """Four parallel branches merged by concatenation."""

    def __init__(self, cin: int) -> None:
        super().__init__()
        self.b1 = nn.Conv2d(cin, 4, 1)
        self.b3 = nn.Sequential(nn.Conv2d(cin, 4, 1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1))
        self.b5 = nn.Sequential(nn.Conv2d(cin, 2, 1), nn.ReLU(), nn.Conv2d(2, 4, 5, padding=2))
        self.pool = nn.Conv2d(cin, 4, 1)

    def forward(self, x):
        pooled = self.pool(F.max_pool2d(x, 3, stride=1, padding=1))
        return F.relu(torch.cat([self.b1(x), self.b3(x), self.b5(x), pooled], dim=1))


class InceptionNet(nn.Module):
    """A stem, two inception blocks and a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.ModuleList([Inception(8), Inception(16)])
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        x = F.relu(self.stem(x))
        for block in self.blocks:
            x = block(x)
        return self.fc(x.mean(dim=(2, 3)))


class AdaLN(nn.Module):
    """PixArt's adaLN table added to a crossing value: ``table[None] + t.view(1, 6, -1)``.

    With one row per micro-batch the table's ``.grad`` and ``t``'s gradient share memory
    (cut at ``getitem``: ``t`` crosses, the table is on the later stage).
    """

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.embed = nn.Linear(8, 24)
        self.table = nn.Parameter(torch.randn(6, 4))
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = torch.tanh(self.embed(self.pre(x)))
        return self.proj(self.table[None] + t.reshape(-1, 6, 4)).sum(1)


def TiedTransformer() -> GPT:
    """Return a small decoder whose output projection shares the input embedding's weight."""
    return GPT(vocab=32, d=16, layers=3, heads=2, seq=8)


def token_loss(logits: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    """Return the mean cross-entropy over every token (TiedTransformer's loss)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))


class MultiIO(nn.Module):
    """Two positional tensors, a keyword tensor, a float argument; returns a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(4, 8)
        self.c = nn.Linear(8, 8)
        self.d = nn.Linear(8, 3)
        self.e = nn.Linear(8, 2)

    def forward(self, x, y, *, mask, scale: float = 1.0):
        h = torch.tanh(self.a(x)) + torch.tanh(self.b(y))
        h = torch.relu(self.c(h)) * mask
        main = self.d(h) * scale
        return {"main": main, "aux": (self.e(h), x.sum(dim=1) * scale)}


class Mixed(nn.Module):
    """Return a value of every kind; as a leaf module its output is one node of the fx graph."""

    def forward(self, h):
        return {"out": h, "none": None, "scale": 2.0, "shift": 1, "approx": "tanh",
                "nested": (None, {"idx": h.argmax(-1), "mask": (h > 0).detach(), "const": h.detach() * 2}),
                "pair": (h * 2, 0.5)}


class Carrier(nn.Module):
    """Unpack every value of :class:`Mixed` before ``b`` and use it after: each may cross a cut.

    Cut right after ``mixed`` (fx), the whole dict crosses; cut at ``b``, each value crosses on
    its own: ``None``, a float, an int, a string, nested tuples and dicts, an integer tensor, a
    bool and a float tensor without grad, the micro-batch's row count.
    """

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.mixed = Mixed()

    def forward(self, x):
        v = self.mixed(torch.tanh(self.a(x)))
        out, none, scale, shift, approx = v["out"], v["none"], v["scale"], v["shift"], v["approx"]
        nested, pair = v["nested"], v["pair"]
        idx, mask, const = nested[1]["idx"], nested[1]["mask"], nested[1]["const"]
        rows, width = x.shape[0], x.shape[-1]
        h = F.gelu(self.b(out) * scale, approximate=approx)
        h = torch.roll(torch.clamp(h, min=none, max=width), shifts=shift, dims=-1)
        h = h + F.one_hot(idx, width).to(h.dtype) + torch.where(mask, const, -const)
        h = h.reshape(rows, -1) + pair[0] * pair[1]
        return self.c(h), nested[0], approx


class Spectral(nn.Module):
    """A complex tensor (``fft_fft``) crosses a cut right after it and carries a gradient back to ``a``."""

    def __init__(self, d: int = 8, conj: bool = False) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)
        self.conj = conj  # a lazy conjugate crosses (its conj bit set, no copy made)

    def forward(self, x):
        z = torch.fft.fft(torch.tanh(self.a(x)))
        z = z.conj() if self.conj else z
        return self.b(z.real * z.imag + z.abs())


class AttnBlock(nn.Module):
    """``nn.MultiheadAttention(need_weights=False)`` returns ``(out, None)``: a tuple with a None."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(d, d), nn.Linear(d, d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)

    def forward(self, x):
        h = self.inp(x)
        a = self.attn(h, h, h, need_weights=False)
        return self.out(a[0] + h)


class RMSNorm(nn.Module):
    """Root-mean-square norm whose weight starts at ones, made in ``__init__`` (no reset_parameters)."""

    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class RotaryTable(nn.Module):
    """Rotary embedding: ``inv_freq`` computed in ``__init__`` (float64, then cast), a non-persistent buffer."""

    def __init__(self, head_dim: int, base: float = 10000.0) -> None:
        super().__init__()
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(device="cpu", dtype=torch.float64) / head_dim
        self.register_buffer("inv_freq", (1.0 / base ** exponents).to(torch.float32), persistent=False)

    def forward(self, x):  # (batch, heads, tokens, head_dim)
        freqs = torch.outer(torch.arange(x.shape[-2], dtype=torch.float32), self.inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class DecoderBlock(nn.Module):
    """Pre-norm attention with rotary positions and a causal mask buffer, then a SwiGLU MLP."""

    def __init__(self, d: int, heads: int, hidden: int, seq: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm, self.mlp_norm = RMSNorm(d), RMSNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.rope = RotaryTable(d // heads)
        self.register_buffer("mask", torch.ones(seq, seq, dtype=torch.bool).tril(), persistent=False)
        self.gate, self.up = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d)

    def forward(self, x):
        b, t, d = x.shape
        h = self.attn_norm(x)
        q, k, v = (m(h).view(b, t, self.heads, d // self.heads).transpose(1, 2) for m in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(self.rope(q), self.rope(k), v, attn_mask=self.mask[:t, :t])
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class RotaryBuffers(nn.Module):
    """Rotary embedding from cos/sin tables made once in ``__init__`` (buffers), sliced per call."""

    def __init__(self, head_dim: int, seq: int, base: float = 10000.0) -> None:
        super().__init__()
        freqs = torch.outer(torch.arange(seq, dtype=torch.float32),
                            1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, x):  # (batch, heads, tokens, head_dim)
        cos, sin = self.cos[: x.shape[-2]], self.sin[: x.shape[-2]]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class TableDecoderBlock(DecoderBlock):
    """:class:`DecoderBlock` with rotary tables kept as buffers (recomputing rope then needs only q and k)."""

    def __init__(self, d: int, heads: int, hidden: int, seq: int) -> None:
        super().__init__(d, heads, hidden, seq)
        self.rope = RotaryBuffers(d // heads, seq)


class RopeDecoder(nn.Module):
    """A Llama-style decoder whose ``__init__`` makes every value: an embedding with ``padding_idx``,
    RMSNorms (ones), rotary tables and masks (non-persistent buffers), a post-init like Hugging
    Face's ``_init_weights`` (normal(0, std), zero biases and padding row), then a tied head."""

    def __init__(self, vocab: int = 96, d: int = 32, heads: int = 4, hidden: int = 64, layers: int = 3,
                 seq: int = 16, std: float = 0.02) -> None:
        super().__init__()
        self.std = std
        self.embed = nn.Embedding(vocab, d, padding_idx=0)
        self.blocks = nn.ModuleList([DecoderBlock(d, heads, hidden, seq) for _ in range(layers)])
        self.norm = RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.apply(self._init_weights)
        self.head.weight = self.embed.weight  # tied after the init, as post_init() ties

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=self.std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            module.weight.data.normal_(std=self.std)
            module.weight.data[module.padding_idx].zero_()
        elif isinstance(module, RMSNorm):
            module.weight.data.fill_(1.0)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class FusedBlock(nn.Module):
    """Pre-norm GELU MLP with a residual add (and optional dropout): the kernels torch.compile fuses."""

    def __init__(self, d: int, hidden: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up, self.down = nn.Linear(d, hidden), nn.Linear(hidden, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return x + self.drop(self.down(F.gelu(self.up(self.norm(x)))))


class Stack(nn.Module):
    """A transformer-like stack without attention: an input projection, FusedBlocks, a norm and a head."""

    def __init__(self, d: int = 16, hidden: int = 48, layers: int = 4, out: int = 8, dropout: float = 0.0) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.blocks = nn.Sequential(*[FusedBlock(d, hidden, dropout) for _ in range(layers)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, out)

    def forward(self, x):
        return self.head(self.norm(self.blocks(self.inp(x))))


def mlp():
    """Return an MLP and its inputs."""
    return MLP(), (torch.randn(7, 16),), {}


def cnn():
    """Return a CNN with batch norm (eval mode) and its inputs."""
    return CNN().eval(), (torch.randn(7, 3, 8, 8),), {}


def unet():
    """Return a U-Net (eval mode for batch norm) and its inputs."""
    return UNet(depth=3, base=4).eval(), (torch.randn(7, 3, 16, 16),), {}


def inception():
    """Return an Inception-style model and its inputs."""
    return InceptionNet(), (torch.randn(7, 3, 8, 8),), {}


def transformer():
    """Return a transformer with tied embeddings and its inputs."""
    return TiedTransformer(), (torch.randint(0, 32, (7, 8)),), {}


def multi_io():
    """Return a several-input, dict-output model and its inputs."""
    return MultiIO(), (torch.randn(7, 6), torch.randn(7, 4)), {"mask": torch.rand(7, 8), "scale": 0.5}


FACTORIES = {"mlp": mlp, "cnn": cnn, "unet": unet, "inception": inception,
             "transformer": transformer, "multi_io": multi_io}


# -- models built under fxpipe.deferred_init --------------------------------------------------
def deferred(factory=None, *args, **kwargs) -> nn.Module:
    """Build ``factory(*args, **kwargs)`` (default: RopeDecoder) under fxpipe.deferred_init."""
    factory = factory or RopeDecoder
    with fxpipe.deferred_init():
        return factory(*args, **kwargs)


def tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by FQN, non-persistent buffers and tied names included."""
    return {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}


def assert_same(a: nn.Module, b: nn.Module) -> None:
    """Assert two models hold the same tensors under the same FQNs."""
    ta, tb = tensors(a), tensors(b)
    assert list(ta) == list(tb)
    for name in ta:
        assert torch.equal(ta[name], tb[name]), name


class Pack(nn.Module):
    """Pack padded rows by their lengths (a leaf: fx cannot trace the packing)."""

    def forward(self, h, lengths):
        return nn.utils.rnn.pack_padded_sequence(h, lengths, batch_first=True, enforce_sorted=False)


class Unpack(nn.Module):
    """Pad a packed sequence back to five steps (a leaf)."""

    def forward(self, p):
        return nn.utils.rnn.pad_packed_sequence(p, batch_first=True, total_length=5)[0]


class PackedLSTM(nn.Module):
    """Two LSTMs over a packed sequence, between a projection and a head."""

    def __init__(self):
        super().__init__()
        self.inp, self.pack = nn.Linear(8, 16), Pack()
        self.rnn1, self.rnn2 = nn.LSTM(16, 16, batch_first=True), nn.LSTM(16, 16, batch_first=True)
        self.unpack, self.head = Unpack(), nn.Linear(16, 4)

    def forward(self, x, lengths):
        p, _ = self.rnn1(self.pack(self.inp(x), lengths))
        p, _ = self.rnn2(p)
        return self.head(self.unpack(p))

