"""Merge a model's training-mode and eval-mode graphs into one graph that reads the mode when it runs.

Reads:  two GraphModules traced from one model, ``gm`` in the mode ``training`` and
        ``other`` in the other mode (nodes, targets, arguments; ``other``'s attributes).
Writes: ``gm``'s graph and ``gm.training``, in place, when the two can be merged; nothing of
        ``node.meta``.

A tracer runs the model's Python once, so a forward reading ``self.training`` gets that mode
fixed in its graph: ``F.dropout(x, p, training=self.training)`` records ``training=True``,
an exported batch norm ``aten.batch_norm(..., True, ...)`` and an ``add_`` of its counter,
a drop path (``if not self.training: return x``) its extra nodes. Aligned node by node (by
op and target, in graph order), the two graphs differ in three ways, and each becomes a
node that reads the stage GraphModule's own ``training`` attribute (a ``get_attr``, copied
into every stage that reads it, so ``pipe.train()`` and ``pipe.eval()`` switch it)::

    dropout(x, 0.1, True)   | dropout(x, 0.1, False)   ->  dropout(x, 0.1, training)
    add_(counter, 1)        | (none)                    ->  add_ = training_only_add_(training, counter, 1)
    d = mul(x, keep)        | (none)                    ->  d = training_only_mul(training, x, keep)
    add(h, d)               | add(h, x)                 ->  add(h, pick(training, d, x))

:class:`When` runs a node of one mode only in that mode (``None`` in the other), a module call
too (an auxiliary head called only in training: the guard reads the module with a
``get_attr``); ``pick`` takes the argument of the mode running. Graphs whose placeholders or
outputs' structure differ between the modes are left as they are: :func:`merge_modes` returns
the first difference, and the caller refuses the other mode.
"""

from __future__ import annotations

import difflib
import operator
from typing import Any

import torch
import torch.fx
from fxpipe.passes.fingerprint import _target, call_name

__all__ = ["When", "merge_modes", "pick"]



class _Unmergeable(Exception):
    """The two graphs cannot be merged; the message names where."""


def pick(training: bool, in_training: Any, in_eval: Any) -> Any:
    """Return the value of the mode running."""
    return in_training if training else in_eval


pick.returns_an_argument = (1, 2)  # type: ignore[attr-defined]  # the positions its value may alias (mutates.aliases)


class When:
    """A node of one mode only: call ``fn`` (a function, a method of the first argument, or a module) in that mode, else give ``None``.

    A callable object rather than a function taking ``fn``: the graph's code names its target,
    but cannot write a builtin such as ``operator.getitem`` as an argument.
    """

    def __init__(self, fn: Any, expected: bool, kind: str = "call_function") -> None:
        self.fn, self.expected, self.kind = fn, expected, kind
        self.__name__ = f"{'training' if expected else 'eval'}_only_{call_name(fn, kind != 'call_function')}"

    def __call__(self, training: bool, /, *args: Any, **kwargs: Any) -> Any:
        """Run the node if the mode running is its own."""
        if training != self.expected:
            return None
        if self.kind == "call_function":
            return self.fn(*args, **kwargs)
        obj, *rest = args
        return getattr(obj, self.fn)(*rest, **kwargs) if self.kind == "call_method" else obj(*rest, **kwargs)

    def inner_call(self, node: torch.fx.Node) -> tuple[str, Any, tuple, dict]:
        """Return the op, target, args and kwargs of the call ``node`` (a call of this guard) makes."""
        if self.kind == "call_module":  # the module comes from a get_attr after the mode
            module = node.args[1]
            return "call_module", (module.target if isinstance(module, torch.fx.Node) else module), node.args[2:], \
                dict(node.kwargs)
        return self.kind, self.fn, node.args[1:], dict(node.kwargs)

    def __repr__(self) -> str:
        return self.__name__


def _shape(a: Any) -> Any:
    """Key an argument by its structure: nodes and literals by kind, not value (those may differ by mode).

    A parameter or buffer read (``get_attr``) is keyed by its name: the batch norms of two
    alike blocks are not paired across the modes (ShuffleNet's, whose training graph has more
    nodes, paired one block's with the next's, each mode reading the other's weights).
    """
    if isinstance(a, torch.fx.Node):
        return ("attr", str(a.target)) if a.op == "get_attr" else "node"
    if isinstance(a, (list, tuple)):
        return (type(a).__name__, tuple(_shape(v) for v in a))
    if isinstance(a, dict):
        return tuple((k, _shape(v)) for k, v in a.items())
    return type(a).__name__


def _structure(a: Any) -> str:
    """Write the structure of an output: its containers and their lengths, a leaf as ``*``."""
    if isinstance(a, (list, tuple)):
        return f"{type(a).__name__}({', '.join(_structure(v) for v in a)})"
    if isinstance(a, dict):
        return "{" + ", ".join(f"{k!r}: {_structure(v)}" for k, v in a.items()) + "}"
    return "*"


def _key(n: torch.fx.Node) -> tuple:
    """Key a node for the alignment: what it calls and the shape of its arguments."""
    if n.op in ("placeholder", "get_attr", "call_module"):
        return n.op, str(n.target)
    if n.op == "output":  # paired whatever it returns: a structure of another shape is named there
        return (n.op,)
    return n.op, _target(n.target), _shape(n.args), _shape(n.kwargs)


def merge_modes(gm: torch.fx.GraphModule, other: torch.fx.GraphModule, training: bool) -> str | None:
    """Rewrite ``gm`` (traced in mode ``training``) to also compute ``other``'s graph in the other mode.

    Returns ``None`` when merged (or when the graphs are the same), else the first difference
    that keeps them apart, leaving ``gm`` untouched.
    """
    mine, theirs = list(gm.graph.nodes), list(other.graph.nodes)
    matcher = difflib.SequenceMatcher(None, [_key(n) for n in mine], [_key(n) for n in theirs], autojunk=False)
    pairs: dict[torch.fx.Node, torch.fx.Node] = {}  # other's node -> gm's
    only_mine: list[torch.fx.Node] = []
    only_theirs: list[tuple[torch.fx.Node, torch.fx.Node | None]] = []  # with gm's node it follows
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            pairs.update(zip(theirs[j1:j2], mine[i1:i2]))
            continue
        only_mine += mine[i1:i2]
        only_theirs += [(n, mine[i1 - 1] if i1 else None) for n in theirs[j1:j2]]
    for n in [*only_mine, *(n for n, _ in only_theirs)]:
        if n.op not in ("call_function", "call_method", "call_module", "get_attr"):
            return f"{_line(n)} in {'training' if (n in only_mine) == training else 'eval'} mode only"
    if not only_mine and not only_theirs and all(_same(a, b, pairs) for b, a in pairs.items()):
        return None
    try:
        _rewrite(gm, other, training, pairs, only_mine, only_theirs)
    except _Unmergeable as exc:
        return str(exc)
    return None


def _same(a: torch.fx.Node, b: torch.fx.Node, pairs: dict[torch.fx.Node, torch.fx.Node]) -> bool:
    """Tell whether the paired nodes ``a`` (gm) and ``b`` (other) take the same arguments."""
    mapped = torch.fx.node.map_arg((b.args, b.kwargs), lambda v: pairs.get(v, v))
    return _equal((a.args, a.kwargs), mapped)


def _equal(x: Any, y: Any) -> bool:
    """Compare two arguments: nodes by identity, literals by type and value."""
    if isinstance(x, torch.fx.Node) or isinstance(y, torch.fx.Node):
        return x is y
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(_equal(a, b) for a, b in zip(x, y))
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(_equal(x[k], y[k]) for k in x)
    return type(x) is type(y) and x == y


def _rewrite(gm: torch.fx.GraphModule, other: torch.fx.GraphModule, training: bool,
             pairs: dict[torch.fx.Node, torch.fx.Node], only_mine: list[torch.fx.Node],
             only_theirs: list[tuple[torch.fx.Node, torch.fx.Node | None]]) -> None:
    """Insert ``other``'s own nodes into ``gm``, guard each mode's own nodes and pick differing arguments."""
    # built beside gm's graph: a graph that cannot be merged leaves gm as it was
    graph = gm.graph.__class__(owning_module=gm, tracer_cls=gm.graph._tracer_cls)
    graph._codegen = gm.graph._codegen
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    first = next((n for n in gm.graph.nodes if n.op != "placeholder"), None)
    after: dict[torch.fx.Node | None, list[torch.fx.Node]] = {}
    for n, anchor in only_theirs:
        after.setdefault(anchor, []).append(n)
    mine_only, mode = set(only_mine), None
    missing: list[str] = []  # state only the other mode's graph reads, given to gm once merged

    def the_mode() -> torch.fx.Node:
        """Return the node reading the stage's mode (made at its first use)."""
        nonlocal mode
        if mode is None:
            mode = graph.create_node("get_attr", "training")  # a bool, not state: get_attr would warn
        return mode

    def theirs_to_mine(v: torch.fx.Node) -> torch.fx.Node:
        """Return the new node standing for ``other``'s node ``v``."""
        if v in pairs:
            return env[pairs[v]]
        if v not in env:
            raise _Unmergeable(f"{v.name} of the other mode is read before it is made")
        return env[v]

    def copy_theirs(n: torch.fx.Node) -> None:
        """Copy a node of the other mode only into the new graph, guarded (an attribute as it is)."""
        if n.op == "get_attr":
            if not _has_attr(gm, str(n.target)):
                missing.append(str(n.target))
            env[n] = graph.create_node("get_attr", str(n.target))  # the state is given to gm below
            return
        if n.op == "call_module" and not _has_attr(gm, str(n.target)):
            missing.append(str(n.target))  # a module only the other mode calls: given to gm below
        args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), theirs_to_mine)
        env[n] = _guarded(graph, the_mode, n, args, kwargs, not training)

    for n in after.get(None, []):
        copy_theirs(n)
    for a in gm.graph.nodes:
        if a is first:
            the_mode()
        if a in mine_only and a.op != "get_attr":
            args, kwargs = torch.fx.node.map_arg((a.args, a.kwargs), env.__getitem__)
            env[a] = _guarded(graph, the_mode, a, args, kwargs, training)
        else:
            env[a] = graph.node_copy(a, env.__getitem__)
        for n in after.get(a, []):
            copy_theirs(n)
    # the paired nodes' arguments: where the modes differ, the running mode's
    for b, a in pairs.items():
        if _same(a, b, pairs):
            continue
        new = env[a]
        if a.op == "output" and _structure(a.args) != _structure(b.args):  # the pipe joins one structure
            raise _Unmergeable(f"the model's outputs {_structure(a.args[0])} in {'training' if training else 'eval'} "
                               f"mode where the other mode returns {_structure(b.args[0])}")
        theirs_args = torch.fx.node.map_arg((b.args, b.kwargs), theirs_to_mine)
        with graph.inserting_before(new):
            args, kwargs = _picked(graph, the_mode(), (new.args, new.kwargs), theirs_args, training)
        new.args, new.kwargs = args, kwargs
    for target in missing:  # nothing above can refuse now
        _set_attr(gm, other, target)
    graph.lint()
    gm.graph = graph
    gm.recompile()
    gm.training = training  # what the graph reads (a GraphModule starts in training mode)


def _picked(graph: torch.fx.Graph, mode: torch.fx.Node, mine: Any, theirs: Any, training: bool) -> Any:
    """Return ``mine`` with each part that differs from ``theirs`` read by the running mode."""
    if _equal(mine, theirs):
        return mine
    if isinstance(mine, (list, tuple)) and isinstance(theirs, (list, tuple)) and type(mine) is type(theirs) \
            and len(mine) == len(theirs) and not isinstance(mine, torch.Size):
        return type(mine)(_picked(graph, mode, x, y, training) for x, y in zip(mine, theirs))
    if isinstance(mine, dict) and isinstance(theirs, dict) and mine.keys() == theirs.keys():
        return {k: _picked(graph, mode, mine[k], theirs[k], training) for k in mine}
    in_training, in_eval = (mine, theirs) if training else (theirs, mine)
    if in_training is True and in_eval is False:  # the mode itself: F.dropout(training=self.training)
        return mode
    if in_training is False and in_eval is True:
        return graph.call_function(operator.not_, (mode,))
    return graph.call_function(pick, (mode, in_training, in_eval))


def _guarded(graph: torch.fx.Graph, the_mode: Any, n: torch.fx.Node, args: Any, kwargs: Any,
             expected: bool) -> torch.fx.Node:
    """Make ``n`` (a node of the mode ``expected`` only) in ``graph``, run only in that mode."""
    mode = the_mode()
    if n.op == "call_module":  # the guard calls the module it reads, as passes/amp.py's wrapper does
        args = (graph.create_node("get_attr", n.target, name=f"{n.name}_module"), *args)
    new = graph.create_node("call_function", When(n.target, expected, kind=n.op), (mode, *args), kwargs, name=n.name)
    new.meta = {k: v for k, v in n.meta.items() if k not in ("val", "tensor_meta")}
    return new


def _line(n: torch.fx.Node) -> str:
    """Write a node as a line of the graph's listing: ``name = op target(args)``."""
    return f"{n.name} = {n.op} {_target(n.target)}{tuple(n.args)!r}"


def _get_attr(gm: torch.nn.Module, target: str) -> Any:
    """Return the attribute at the dotted path ``target``."""
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _has_attr(gm: torch.nn.Module, target: str) -> bool:
    """Tell whether ``gm`` has the dotted attribute ``target``."""
    try:
        _get_attr(gm, target)
    except AttributeError:
        return False
    return True


def _set_attr(gm: torch.nn.Module, other: torch.nn.Module, target: str) -> None:
    """Give ``gm`` the state ``other`` holds at the dotted path ``target`` (read only in the other mode).

    A tensor is registered as a buffer, as a GraphModule does with the state its graph reads; a
    module (called in the other mode only) as a submodule.
    """
    *path, name = target.split(".")
    owner: torch.nn.Module = gm
    for part in path:
        if not hasattr(owner, part):
            owner.add_module(part, torch.nn.Module())
        owner = getattr(owner, part)
    value = _get_attr(other, target)
    if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
        owner.register_buffer(name, value)
    else:
        setattr(owner, name, value)
