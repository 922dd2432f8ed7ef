"""Cut a sequence into contiguous groups minimizing the largest group cost, communication included.

Reads and writes no ``node.meta``: this module works on plain cost arrays. Items ``0..n-1``
are cut into ``k`` non-empty groups ``[a, b)``. Group ``j``'s cost is its compute plus a
communication term for the bytes crossing its two cuts::

    cost_j(a, b) = C[b] - C[a] + beta[j-1] * w[a] + beta[j] * w[b] + rho * w[a]
                   (no beta term into the first group, nor out of the last; ``rho`` prices
                   the bytes every group keeps of its inputs, for memory as the cost)

    C[p] = c[0] + ... + c[p-1]      prefix sums of the item costs
    w[p] = bytes crossing the cut before item p (w[0], w[n]: the sequence's inputs, outputs)

An optional cap bounds each group's memory, ``M[b] - M[a] + phi * w[a] <= cap`` (``M`` the
prefix sums of per-item memory, ``phi * w[a]`` the inputs a group keeps).

The search is exact: a bisection on the bottleneck ``T`` whose feasibility test is a dynamic
program over the groups. Since ``cost_j(a, b) <= T`` reads ``V_j[a] >= U_j[b] - T`` with
``U_j[b] = C[b] + beta[j] w[b]`` and ``V_j[a] = C[a] - (beta[j-1] + rho) w[a]``, whether ``[0, b)``
splits into ``j`` groups within ``T`` is one running maximum of ``V_j`` over the positions
where ``j - 1`` groups fit: O(k n) per probe, vectorized. With a memory cap, a start ``a``
only reaches the ends ``b <= R(a)``; the running maximum becomes a range maximum, done with a
sparse table in O(k n log n). The probes stop when the bracket is within 1e-12 of the
bottleneck, so the cut is optimal up to float rounding.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from itertools import pairwise

import torch

__all__ = ["NoFeasibleCut", "group_costs", "min_bottleneck_cut"]

_NEG = -math.inf


class NoFeasibleCut(ValueError):
    """No cut into the requested number of groups satisfies the memory cap."""

    def __init__(self, message: str, *, least: float) -> None:
        super().__init__(message)
        self.least = least


def _betas(beta: float | Sequence[float], k: int) -> list[float]:
    """Return one communication weight per boundary between consecutive groups."""
    if isinstance(beta, (int, float)):
        return [float(beta)] * max(k - 1, 0)
    betas = [float(b) for b in beta]
    if len(betas) != k - 1:
        raise ValueError(f"{len(betas)} communication weights for {k} groups; give k - 1 of them")
    return betas


def group_costs(c: Sequence[float], w: Sequence[float], starts: Sequence[int],
                beta: float | Sequence[float] = 0.0, rho: float = 0.0) -> list[float]:
    """Return each group's cost (compute plus communication) for the groups beginning at ``starts``."""
    k, n = len(starts), len(c)
    betas = _betas(beta, k)
    bounds = list(starts) + [n]
    out = []
    for j in range(k):
        a, b = bounds[j], bounds[j + 1]
        cost = float(sum(c[a:b])) + rho * w[a]
        if j > 0:
            cost += betas[j - 1] * w[a]
        if j < k - 1:
            cost += betas[j] * w[b]
        out.append(cost)
    return out


class _Problem:
    """Prefix arrays of one cut problem, as float64 tensors."""

    def __init__(self, c, w, k, beta, m, phi, cap, rho=0.0) -> None:
        n = len(c)
        self.n, self.k = n, k
        f64 = torch.float64
        self.C = torch.cat([torch.zeros(1, dtype=f64), torch.tensor(c, dtype=f64).clamp_min(0).cumsum(0)])
        self.w = torch.tensor(w, dtype=f64).clamp_min(0)
        betas = _betas(beta, k)
        self.U = [self.C + (betas[j] * self.w if j < k - 1 else 0.0) for j in range(k)]
        self.V = [self.C - ((betas[j - 1] if j > 0 else 0.0) + rho) * self.w for j in range(k)]
        self.reach = None  # R(a): the furthest end a group starting at a may have
        if cap is not None:
            M = torch.cat([torch.zeros(1, dtype=f64), torch.tensor(m, dtype=f64).clamp_min(0).cumsum(0)])
            slack = 1e-9 * (abs(cap) + float(M[-1]) + 1.0)  # the cap itself fits, whatever the rounding of sums
            limit = cap + M - phi * self.w + slack
            self.reach = torch.searchsorted(M, limit, right=True) - 1  # max b with M[b] <= limit[a]
            self.range_max = _RangeMax(self.reach, n)

    def layers(self, T: float) -> list[torch.Tensor]:
        """Return ``h[j][b]``: whether ``[0, b)`` splits into ``j`` groups of cost at most ``T``."""
        n = self.n
        h = torch.zeros(n + 1, dtype=torch.bool)
        h[0] = True
        out = [h]
        for j in range(self.k):
            masked = torch.where(h[:-1], self.V[j][:-1], _NEG)  # starts a = 0..n-1
            if self.reach is None:
                best = torch.cummax(masked, 0).values  # best[b-1] = max over a < b
                best = torch.cat([torch.full((1,), _NEG, dtype=torch.float64), best])
            else:
                best = self.range_max(masked)
            h = (best > _NEG) & (best >= self.U[j] - T)
            h[0] = False
            out.append(h)
        return out

    def feasible(self, T: float) -> bool:
        """Tell whether all ``k`` groups fit within ``T``."""
        return bool(self.layers(T)[-1][self.n])

    def starts(self, T: float) -> list[int]:
        """Backtrack a cut within ``T``, preferring at each step a group near the remaining mean."""
        hs = self.layers(T)
        b, starts = self.n, []
        positions = torch.arange(self.n + 1)
        for j in range(self.k, 0, -1):
            ok = hs[j - 1].clone()
            ok[b:] = False
            ok &= self.V[j - 1] >= self.U[j - 1][b] - T
            if self.reach is not None:
                ok &= self.reach >= b
            target = self.C[b] - self.C[b] / j  # a group of the mean remaining compute
            gap = torch.where(ok, (self.C - target).abs(), math.inf)
            gap = torch.where(positions < b, gap, math.inf)
            a = int(torch.argmin(gap))
            assert ok[a], "backtracking left the feasible set"
            starts.append(a)
            b = a
        assert b == 0
        return starts[::-1]


class _RangeMax:
    """For each end ``b``, the max of ``values[a]`` over starts with ``a < b <= reach[a]``.

    Each start covers the ends ``a+1 .. reach[a]``: two overlapping power-of-two blocks of a
    sparse table, filled by one scatter-max and pushed down level by level. The blocks depend
    only on ``reach``, so they are computed once per problem.
    """

    def __init__(self, reach: torch.Tensor, n: int) -> None:
        lo = torch.arange(n) + 1
        hi = reach[:n]
        self.starts = torch.nonzero(hi >= lo).flatten()
        lo, hi = lo[self.starts], hi[self.starts]
        level = torch.floor(torch.log2((hi - lo + 1).to(torch.float64))).to(torch.long)
        self.levels = max(int(n).bit_length(), 1)
        self.width = n + 2
        left = level * self.width + lo
        right = level * self.width + hi - (1 << level) + 1
        self.index = torch.cat([left, right])
        self.n = n

    def __call__(self, values: torch.Tensor) -> torch.Tensor:
        """Return the range maxima for one vector of start values (``-inf`` where unusable)."""
        table = torch.full(((self.levels + 1) * self.width,), _NEG, dtype=torch.float64)
        vals = values[self.starts]
        table.scatter_reduce_(0, self.index, torch.cat([vals, vals]), "amax")
        table = table.view(self.levels + 1, self.width)
        for L in range(self.levels, 0, -1):
            half = 1 << (L - 1)
            below = table[L - 1]
            torch.maximum(below, table[L], out=below)
            below[half:] = torch.maximum(below[half:], table[L][:-half])
        return table[0][: self.n + 1]


def min_bottleneck_cut(c: Sequence[float], w: Sequence[float], k: int, *,
                       beta: float | Sequence[float] = 0.0, rho: float = 0.0,
                       m: Sequence[float] | None = None, phi: float = 0.0,
                       cap: float | None = None, joined: Collection[int] = ()) -> list[int]:
    """Return the start of each of ``k`` groups minimizing the largest group cost (module docstring).

    ``c`` holds ``n`` item costs, ``w`` the ``n + 1`` cut widths, ``beta`` the cost per
    crossing byte (one number, or one per boundary), ``rho`` the cost per byte a group
    receives. With ``cap``, every group's memory ``M[b] - M[a] + phi * w[a]`` (``m`` per item)
    stays within it, or :class:`NoFeasibleCut` says the smallest cap that fits. No group
    starts at a position in ``joined`` (item ``p`` stays with item ``p - 1``): the runs of
    joined items are cut as single items, which raises ValueError if fewer than ``k`` remain.
    """
    if joined:
        firsts = [p for p in range(len(c)) if p == 0 or p not in joined]
        if len(firsts) < k:
            raise ValueError(f"only {len(firsts)} places to start a group, for {k} groups")
        bounds = firsts + [len(c)]

        def fuse(values: Sequence[float]) -> list[float]:
            return [float(sum(values[a:b])) for a, b in pairwise(bounds)]

        fused = min_bottleneck_cut(fuse(c), [w[p] for p in bounds], k, beta=beta, rho=rho,
                                   m=None if m is None else fuse(m), phi=phi, cap=cap)
        return [firsts[i] for i in fused]
    n = len(c)
    if not 1 <= k <= n:
        raise ValueError(f"cannot cut {n} items into {k} non-empty groups")
    if len(w) != n + 1:
        raise ValueError(f"{len(w)} cut widths for {n} items; give n + 1 of them")
    if cap is not None and m is None:
        raise ValueError("a memory cap needs the per-item memory m=")
    problem = _Problem(c, w, k, beta, m, phi, cap, rho)
    if cap is not None and not problem.feasible(math.inf):
        assert m is not None  # a cap comes with m (checked above)
        least = least_memory(m, w, k, phi)
        raise NoFeasibleCut(f"no cut into {k} groups keeps every group within {cap:.6g}; "
                            f"the least possible largest group needs {least:.6g}", least=least)
    hi = max(group_costs(c, w, problem.starts(math.inf), beta, rho))
    slack = 1e-12
    while not problem.feasible(hi):  # prefix-sum rounding may put that cut a hair above its sum
        hi, slack = hi + slack * max(abs(hi), 1e-300), slack * 2
    lo = min(max(max(float(x) for x in c), float(problem.C[-1]) / k, 0.0), hi)
    while hi - lo > 1e-12 * max(abs(hi), 1e-300):
        mid = (lo + hi) / 2
        if mid <= lo or mid >= hi:
            break
        if problem.feasible(mid):
            hi = mid
        else:
            lo = mid
    return problem.starts(hi)


def least_memory(m: Sequence[float], w: Sequence[float], k: int, phi: float) -> float:
    """Return the smallest possible largest group memory ``M[b] - M[a] + phi * w[a]``."""
    starts = min_bottleneck_cut(m, w, k, rho=phi)
    return max(group_costs(m, w, starts, 0.0, phi))
