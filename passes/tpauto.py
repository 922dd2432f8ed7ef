"""Derive Megatron's tensor-parallel pairing from a traced graph: ``tp_plan="auto"``.

Reads:  the sites (:func:`fxpipe.passes.tpsites.find_sites`), ``node.meta["fxpipe.value"]``.
Writes: nothing; returns a role per site FQN and raises :class:`TensorParallelError` for a
        dimension the tensor-parallel size does not divide.

A linear becomes column-wise, then the layout of its shard is followed through the graph
(:func:`fxpipe.passes.tplayout.propagate`); each conflict says how the region grows::

    fc1 colwise ─▶ gelu ─▶ fc2 (reads a shard)          fc2 becomes rowwise: the region closes
    q colwise ─▶ view ─▶ sdpa(q, k, v) (k, v whole)    the linears k and v come from become colwise
    ... ─▶ o_proj (reads a shard of the heads)          rowwise

A region closes when every shard ends in a rowwise linear (one all-reduce forward, one
backward); a region that meets anything else (a norm over the shard, the model's output, an
op fxpipe cannot follow) is dropped, and its linears stay replicated. The token embedding (an
embedding reading a graph input) is vocabulary-parallel; a linear sharing its weight (a tied
output head) is column-wise with its logits gathered, so that both hold the same shard.
"""

from __future__ import annotations

import logging
import math
import re
import warnings
from collections.abc import Mapping, Sequence

import torch.fx
from fxpipe.passes.tplayout import Conflict, Rule, propagate, site_input
from fxpipe.passes.tpops import POINTWISE, divisors, ndim_of, op_name
from fxpipe.passes.tpsites import Site, find_sites

__all__ = ["ROLES", "TensorParallelError", "auto_roles", "indivisible", "role_rules"]

log = logging.getLogger(__name__)

ROLES = {  # role -> (what the site reads, what it gives, the PyTorch style it is)
    "colwise": Rule("R", "S-1", "ColwiseParallel()"),
    "rowwise": Rule("S-1", "R", "RowwiseParallel()"),
    "vocab": Rule("R", "R", "RowwiseParallel(input_layouts=Replicate())"),
    "gather": Rule("R", "R", "ColwiseParallel(output_layouts=Replicate())"),
}
_RESHAPES = {"view", "reshape", "_unsafe_view", "flatten", "contiguous", "clone"}
_WALK = POINTWISE | {"view", "reshape", "_unsafe_view", "transpose", "permute", "unsqueeze", "expand", "slice",
                     "cat", "getitem", "contiguous", "t", "flatten", "unflatten", "squeeze", "repeat_interleave"}


class TensorParallelError(ValueError):
    """A tensor-parallel plan or layout that cannot work; names the module, the cause and the fix."""

    cause: str | None = None  # a size tensor_parallel does not divide: what does not divide
    use: str | None = None  # and the sizes that would
    sizes: tuple[int, ...] = ()  # the sizes a tensor_parallel must divide


def role_rules(sites: Mapping[str, Site], roles: Mapping[str, str]) -> dict[str, Rule]:
    """Return the propagation rule of every node of every site given a role."""
    return {name: ROLES[role] for fqn, role in roles.items() for name in sites[fqn].nodes}


def indivisible(what: str, fqn: str | None, size: int, t: int, container: bool = False,
                others: Sequence[int] = ()) -> TensorParallelError:
    """Return the refusal of a dimension of ``size`` that ``t`` ranks do not divide (``container``: not a linear).

    ``others``: the sizes of the module's other dims ``t`` does not divide (grouped-query
    attention's key/value heads beside its query heads), which the sizes offered divide too.
    """
    more = sorted(set(others) - {size})
    fits = ", ".join(map(str, divisors(math.gcd(size, *more))))
    also = f" nor its other heads ({', '.join(map(str, more))}: grouped key/value heads?)" if more else ""
    leave = f"the linears in '{fqn}'" if container else f"'{fqn}'"
    cause = f"tensor_parallel={t} does not divide {what} of '{fqn}' ({size}){also}"
    use = f"use a tensor_parallel that divides {'them all' if more else 'it'} ({fits})"
    exc = TensorParallelError(f"{cause}; {use}, or leave {leave} out of the plan")
    exc.cause, exc.use, exc.sizes = cause, use, (size, *more)
    return exc


def auto_roles(gm: torch.fx.GraphModule, t: int) -> dict[str, str]:
    """Return the automatic plan: site FQN -> ``"colwise"``, ``"rowwise"``, ``"vocab"`` or ``"gather"``."""
    sites = find_sites(gm)
    of_node = {name: s for s in sites.values() for name in s.nodes}
    roles: dict[str, str] = {}
    refused: list[TensorParallelError] = []  # regions t does not divide: left whole if another one splits
    unclosed: list[str] = []  # regions of several linears that did not close: left whole, warned of
    alone: list[str] = []  # linears no region takes (a norm over the shard, a returned output): logged
    whole: dict[str, str] = {}  # their sites, which no other region takes
    for site in sites.values():
        if site.kind == "linear" and site.fqn not in roles and site.fqn not in whole:
            try:
                grown = _grow(gm, sites, of_node, {**roles, **whole}, site, t)
            except TensorParallelError as exc:
                refused.append(exc)
                whole.update(dict.fromkeys(getattr(exc, "region", (site.fqn,)), "whole"))
                continue
            if isinstance(grown, _Alone):
                alone.append(grown.message)
            elif isinstance(grown, _Unclosed):
                unclosed.append(grown.message)
                whole.update(dict.fromkeys(grown.region, "whole"))
            else:
                roles.update(grown)
    if refused and not roles:
        raise _none_split(refused)
    for message in _counted([str(exc).split("; use ")[0] for exc in refused] + unclosed):
        warnings.warn(f"tp_plan='auto' leaves a region whole: {message}; the regions it divides are split "
                      "(write tp_plan= yourself to choose otherwise)", stacklevel=2)
    for message in _counted(alone):
        log.info("tensor parallel (auto): %s", message)
    _embeddings(gm, sites, roles, t)
    _, left = propagate(gm, role_rules(sites, roles), t)
    assert not left, f"the automatic plan left conflicts: {left[:3]}"
    return roles


def _none_split(refused: list[TensorParallelError]) -> TensorParallelError:
    """Refuse an automatic plan that splits no region: the first refusal, the others counted, the fixes it has."""
    first = refused[0]
    if first.cause is None:
        return first
    more = f" (and {len(refused) - 1} more region(s) it does not divide)" if len(refused) > 1 else ""
    fits = divisors(math.gcd(*(n for exc in refused for n in exc.sizes))) if all(e.sizes for e in refused) else []
    use = first.use if not fits else "use tensor_parallel=1 (no larger size divides them all)" if fits == [1] else \
        f"use a tensor_parallel that divides them all ({', '.join(map(str, fits))})"
    return TensorParallelError(f"{first.cause}{more}; tp_plan='auto' then splits no region of the model: "
                               f"{use}, or write tp_plan= yourself naming the regions to split")


def _counted(messages: list[str]) -> list[str]:
    """Return one message per kind (names aside), counting the regions like it: one per layer of a deep model."""
    kinds: dict[str, list[str]] = {}
    regions = {re.sub(r"node '[^']*' ", "", m): m for m in reversed(messages)}  # one per region, its first node's
    for message in reversed(list(regions.values())):
        kinds.setdefault(re.sub(r"'[^']*'|\d+", "_", message), []).append(message)
    return [same[0] if len(same) == 1 else f"{same[0]}; and {len(same) - 1} more region(s) like it"
            for same in kinds.values()]


class _Alone:
    """A linear whose shard no region around it can close: it stays whole."""

    def __init__(self, message: str) -> None:
        self.message = message


class _Unclosed:
    """A region of several linears whose shards meet a whole value no linear makes: it stays whole."""

    def __init__(self, region: Mapping[str, str], message: str) -> None:
        self.region = list(region)
        names = ", ".join(f"'{fqn}'" for fqn in sorted(region))
        why = ("the value it names is whole over every head (a position bias made outside the region, as each "
               "T5 attention adds, or a mask per head), which attention over a shard of the heads cannot take"
               if message.startswith("attention reads a shard of the heads and the whole of") else
               "a head count tensor_parallel does not divide (multi-query attention's one key/value head) shards "
               "inside a head, which attention cannot take")
        self.message = (f"the linears {names} split together do not close into one column-wise/row-wise region "
                        f"({message}); {why}")


def _grow(gm: torch.fx.GraphModule, sites: Mapping[str, Site], of_node: Mapping[str, Site],
          taken: Mapping[str, str], start: Site, t: int) -> dict[str, str] | _Unclosed | _Alone:
    """Grow a column-wise/row-wise region from ``start``; return its roles, :class:`_Alone` if one linear's does not
    close, or :class:`_Unclosed` if several linears' does not."""
    region = {start.fqn: "colwise"}
    for _ in range(4 * len(sites) + 4):
        _, conflicts = propagate(gm, role_rules(sites, region), t)
        if not conflicts:
            for fqn, role in region.items():
                size = sites[fqn].out_features if role == "colwise" else sites[fqn].in_features
                if size % t:
                    exc = indivisible("the output features" if role == "colwise" else "the input features",
                                      fqn, size, t)
                    exc.region = list(region)  # type: ignore[attr-defined]
                    raise exc
            return region
        grown = _grown(gm, sites, of_node, taken, region, conflicts)
        if grown is None:
            for c in conflicts:
                if c.kind == "indivisible" and c.size:
                    what = (f"the heads (or another sharded dim) that node '{c.node}' reshapes" if c.module else
                            f"the sharded dim that node '{c.node}' reshapes outside any module, in the region")
                    exc = indivisible(what, c.module or min(region), c.size, t, container=bool(c.module),
                                      others=_module_sizes(gm, sites, c.module, t) if c.module else ())
                    exc.region = list(region)  # type: ignore[attr-defined]
                    raise exc
            return _Unclosed(region, conflicts[0].message) if len(region) > 1 else \
                _Alone(f"'{start.fqn}' stays whole ({conflicts[0].message})")
        region.update(grown)
    return {}


def _module_sizes(gm: torch.fx.GraphModule, sites: Mapping[str, Site], module: str, t: int) -> list[int]:
    """Return the sizes ``t`` does not divide that the module's linears, all split column-wise, would reshape.

    Grouped-query attention reshapes its key/value heads apart from its query heads: the sizes
    a refusal offers must divide both.
    """
    linears = {fqn: "colwise" for fqn, site in sites.items() if site.kind == "linear" and fqn.startswith(module + ".")}
    _, conflicts = propagate(gm, role_rules(sites, linears), t)
    return [c.size for c in conflicts if c.kind == "indivisible" and c.size and c.module == module]


def _grown(gm: torch.fx.GraphModule, sites: Mapping[str, Site], of_node: Mapping[str, Site],
           taken: Mapping[str, str], region: Mapping[str, str], conflicts: list[Conflict]) -> dict[str, str] | None:
    """Return the sites the conflicts ask to add (a reader of a shard: rowwise; a whole operand's: colwise)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    grown: dict[str, str] = {}
    for c in conflicts:
        site = of_node.get(c.node)
        if c.kind == "input" and site is not None and site.kind == "linear" and site.fqn not in region \
                and site.fqn not in taken:
            grown[site.fqn] = "rowwise"
        elif c.kind == "mixed" and c.replicated:
            found = set()
            for name in c.replicated:
                found |= _linears_behind(nodes[name], of_node)
            if not found or any(f in taken or f in region or sites[f].kind != "linear" for f in found):
                return None
            grown.update({f: "colwise" for f in found})
        else:
            return None
    return grown or None


def _linears_behind(node: torch.fx.Node, of_node: Mapping[str, Site]) -> set[str]:
    """Return the sites a value comes from through elementwise ops and reshapes (an embedding's too)."""
    found: set[str] = set()
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.name in of_node:
            found.add(of_node[n.name].fqn)
        elif n.op in ("call_function", "call_method") and op_name(n) in _WALK:
            todo += [a for a in n.all_input_nodes if ndim_of(a) is not None]
    return found


def _read_directly(gm: torch.fx.GraphModule, site: Site, sites: Mapping[str, Site]) -> bool:
    """Tell whether a site's weight is read by a node that is no site's own use of it (it would see a DTensor)."""
    site_nodes = {name for s in sites.values() if s.weight is site.weight for name in s.nodes}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and _fetch(gm, str(node.target)) is site.weight \
                and any(user.name not in site_nodes for user in node.users):
            return True
    return False


def _fetch(gm: torch.fx.GraphModule, target: str) -> object:
    """Return the attribute a ``get_attr`` target names."""
    obj: object = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def _through_reshapes(node: object) -> object:
    """Return the value a node reshapes (GPT-2's ``input_ids.view(-1, n)``), through every reshape, else the node."""
    while isinstance(node, torch.fx.Node) and op_name(node) in _RESHAPES and node.args \
            and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node


def _embeddings(gm: torch.fx.GraphModule, sites: Mapping[str, Site], roles: dict[str, str], t: int) -> None:
    """Make the token embedding vocabulary-parallel, and a linear tied to it column-wise with its logits gathered."""
    nodes = {n.name: n for n in gm.graph.nodes}
    for site in sites.values():
        reads = [_through_reshapes(site_input(nodes[name])) for name in site.nodes]
        if site.kind != "embedding" or not all(isinstance(r, torch.fx.Node) and r.op == "placeholder" for r in reads):
            continue
        tied = [s for s in sites.values() if s is not site and s.weight is site.weight]
        if any(s.kind != "linear" or s.fqn in roles for s in tied) or _read_directly(gm, site, sites):
            log.debug("tensor parallel: embedding '%s' stays replicated (its weight is tied to %s)", site.fqn,
                      [s.fqn for s in tied])
            continue
        if site.out_features % t:  # GPT-2's 50257: the blocks are still split, the embedding stays whole
            log.info("tensor parallel: embedding '%s' stays replicated (%d ranks do not divide its vocabulary of %d)",
                     site.fqn, t, site.out_features)
            continue
        roles[site.fqn] = "vocab"
        roles.update({s.fqn: "gather" for s in tied})
