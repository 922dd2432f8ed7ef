"""The layouts a cluster search tries: ``dp x pp x tp`` of the GPUs, stages per rank, schedules and chunks.

    gpus N, gpus per node G ─▶ tp: powers of two up to G that divide N (a tp group inside a node)
                            ─▶ pp: divisors of N / tp, at most the model's blocks; dp = N / (pp tp)
                               dividing the global batch
                            ─▶ stages per rank v: 1 (gpipe, 1f1b, zb), 2 (interleaved, zbv), 4 (interleaved)
                            ─▶ chunks: powers of two from the schedule's least (pp for interleaved and
                               ZB-V), the first ``CHUNK_STEPS`` of them that divide the replica's rows
                            ─▶ replicate (DDP) or shard (FSDP2) when dp > 1

The counts stay small by construction: a 1024-GPU cluster of 8-GPU nodes has 4 tp sizes, at
most 11 pp sizes each, 3 ways to place stages and 4 chunk counts: a few hundred layouts before
schedules and recomputation. :mod:`fxpipe.simulate.cluster` then prunes by bounds before
simulating any of them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

__all__ = ["CHUNK_STEPS", "Shape", "shapes"]

CHUNK_STEPS = 4  # chunk counts tried per layout: the least the schedule takes, and 3 doublings
_PER_RANK = {1: ("gpipe", "1f1b", "zb"), 2: ("interleaved", "zbv"), 4: ("interleaved",)}


@dataclass(frozen=True)
class Shape:
    """A layout before recomputation is chosen: how the GPUs are split, how stages sit on them, the schedule."""

    dp: int
    pp: int
    tp: int
    v: int  # stages per rank
    schedule: str
    chunks: int
    shard: bool

    @property
    def n_stages(self) -> int:
        """Return the pipeline's stages: ranks per pipeline x stages per rank."""
        return self.pp * self.v

    def name(self) -> str:
        """Name the layout in one phrase: ``dp8 x pp4 x tp8, 2 stages/rank, fsdp``."""
        extra = f", {self.v} stages/rank" if self.v > 1 else ""
        return f"dp{self.dp} x pp{self.pp} x tp{self.tp}{extra}, {'fsdp' if self.shard else 'ddp'}" \
            if self.dp > 1 else f"pp{self.pp} x tp{self.tp}{extra}"


def _powers(limit: int) -> list[int]:
    """Return 1, 2, 4, ... up to ``limit``."""
    out, k = [], 1
    while k <= limit:
        out.append(k)
        k *= 2
    return out


def shapes(gpus: int, gpus_per_node: int, batch: int, blocks: int, *, tps: Sequence[int] | None = None,
           schedules: Sequence[str] | None = None, max_chunks: int = 512,
           stages: Sequence[int] | None = None, chunk_counts: Sequence[int] | None = None) -> Iterator[Shape]:
    """Yield every layout of ``gpus`` for a global batch of ``batch`` rows and a model of ``blocks`` cuttable blocks.

    ``tps`` are the tensor-parallel sizes the model takes (default: powers of two up to a node);
    ``schedules`` the schedules to try (default: all); ``stages`` the stage counts (``pp x v``)
    and ``chunk_counts`` the micro-batch counts to keep (default: any).
    """
    tp_sizes = [t for t in (tps or _powers(gpus_per_node)) if t <= gpus_per_node and gpus % t == 0]
    for tp in tp_sizes:
        rest = gpus // tp
        for pp in [p for p in range(1, rest + 1) if rest % p == 0]:
            dp = rest // pp
            if batch % dp:
                continue
            rows = batch // dp
            for v, names in _PER_RANK.items():
                if pp * v > blocks or (v > 1 and pp == 1):
                    continue
                if pp == 1:  # one stage: 1F1B is gradient accumulation, one micro-batch's activations at a time
                    names = ("1f1b",)
                for schedule in names:
                    if schedules is not None and schedule not in schedules:  # one stage runs 1F1B: kept with it
                        continue
                    least = pp if v > 1 else 1
                    if stages is not None and pp * v not in stages:
                        continue
                    counts = [m for m in _powers(min(rows, max_chunks)) if m >= max(least, pp) and rows % m == 0]
                    counts = counts[:CHUNK_STEPS] if chunk_counts is None else \
                        [m for m in chunk_counts if m >= max(least, pp) and rows % m == 0]
                    for chunks in counts:
                        for shard in ((False, True) if dp > 1 else (False,)):
                            yield Shape(dp, pp, tp, v, schedule, chunks, shard)
