"""Read the ``ignore_index`` a ``loss_fn`` passes, where its labels mark entries that do not count.

torch's and transformers' losses skip -100 by default; a ``loss_fn`` may pass another (a loss
module's field, a ``functools.partial``'s keyword, ``ignore_index=0`` written in its code, a
global constant, a closure's variable or ``self.pad``, in a function, a loss module's
``forward`` or a callable object's ``__call__``). :mod:`.ignored` counts the entries that count per
micro-batch with it.
"""

from __future__ import annotations

import inspect
import io
import tokenize
import types
from collections.abc import Callable
from functools import partial
from typing import Any

from torch import nn

from fxpipe.runtime.stage.rng import filled_cell, held, user_functions

__all__ = ["IGNORE_INDEX", "code_of", "ignore_index_of", "passes_keyword"]

IGNORE_INDEX = -100  # torch's and transformers' ignore_index


def ignore_index_of(loss_fn: Callable) -> int:
    """Return the ``ignore_index`` ``loss_fn`` passes (a loss module's, a partial's, one written in its code), or -100.

    Read from the code that passes ``ignore_index=`` as a keyword (a number, a global constant or
    ``self.pad``; comments aside): one value found is taken, several leave torch's default.
    """
    for m in held(loss_fn, nn.Module):  # a loss module, or one holding it (a custom loss's submodule)
        for sub in m.modules():
            if isinstance(getattr(sub, "ignore_index", None), int):
                return int(sub.ignore_index)
    own = getattr(loss_fn, "ignore_index", None)  # an object with its own field (not a module)
    if isinstance(own, int):
        return own
    for f in held(loss_fn, partial):
        if isinstance(f.keywords.get("ignore_index"), int):
            return int(f.keywords["ignore_index"])
    for f, owner in code_of(loss_fn):
        if passes_keyword(f.__code__, "ignore_index"):
            found = _written_values(f, owner)
            if len(found) == 1:
                return found.pop()
    return IGNORE_INDEX


def code_of(loss_fn: Callable) -> list[tuple[types.FunctionType, Any]]:
    """Return the user's functions ``loss_fn`` runs, each with the object its ``self`` is (or None).

    Its functions and bound methods, and the ``forward`` of a loss module (or ``__call__`` of a
    callable object) it is or holds: torch's own modules are read by their ``ignore_index`` field.
    """
    owners = {id(m.__func__): m.__self__ for m in held(loss_fn, types.MethodType)}
    pairs = [(f, owners.get(id(f))) for f in user_functions(loss_fn)]
    objects = [*held(loss_fn, nn.Module)]
    if not isinstance(loss_fn, (types.FunctionType, types.MethodType, partial, nn.Module)):
        objects.append(loss_fn)  # a callable object: its __call__
    for obj in objects:
        method = getattr(type(obj), "forward" if isinstance(obj, nn.Module) else "__call__", None)
        if isinstance(method, types.FunctionType) and not method.__module__.startswith(("torch.", "fxpipe.")):
            pairs.append((method, obj))
    return pairs


def passes_keyword(code: types.CodeType, name: str) -> bool:
    """Tell whether ``code`` (or a function defined in it) calls with the keyword ``name``."""
    return any(isinstance(c, tuple) and name in c or isinstance(c, types.CodeType) and passes_keyword(c, name)
               for c in code.co_consts)


def _written_values(f: types.FunctionType, owner: Any) -> set[int]:
    """Return the values ``f``'s source passes as ``ignore_index=``: numbers, global names, its ``self``'s fields."""
    try:
        source = inspect.getsource(f)
    except (OSError, TypeError):  # no source: a REPL's function
        return set()
    tokens: list[tokenize.TokenInfo] = []
    try:
        tokens.extend(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass  # a lambda's line cut mid-expression: the tokens read so far
    words = [t.string for t in tokens if t.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE)]
    me = f.__code__.co_varnames[0] if f.__code__.co_argcount and owner is not None else None
    cells = {n: c.cell_contents for n, c in zip(f.__code__.co_freevars, f.__closure__ or ()) if filled_cell(c)}
    found: set[int] = set()
    for k in range(len(words) - 2):
        if words[k] != "ignore_index" or words[k + 1] != "=":
            continue
        value: Any = None
        rest = words[k + 2:k + 5]
        if rest[0] == "-" and len(rest) > 1 and rest[1].isdigit():
            value = -int(rest[1])
        elif rest[0].isdigit():
            value = int(rest[0])
        elif rest[0] == me and len(rest) > 2 and rest[1] == ".":  # self.pad, of a bound method's object
            value = getattr(owner, rest[2], None)
        elif rest[0] in cells and len(rest) > 2 and rest[1] == ".":  # self.pad in a lambda a method returned
            value = getattr(cells[rest[0]], rest[2], None)
        elif rest[0] in cells:  # a variable of the function that made it (a closure)
            value = cells[rest[0]]
        elif rest[0].isidentifier():
            value = f.__globals__.get(rest[0])
        if isinstance(value, int) and not isinstance(value, bool):
            found.add(value)
    return found
