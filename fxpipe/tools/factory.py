"""Load a model from a ``MODEL`` spec: ``path/to/file.py:factory`` or ``package.module:factory``.

``factory()`` returns a model, or ``(model, example_inputs)``, or ``(model, example_inputs,
example_kwargs)``. A spec that names nothing usable raises :class:`ModelSpecError`; user code
that raises (on import or in the factory), or a factory returning something else, raises
:class:`FactoryError` with the exception's type, message and innermost source line.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["EXAMPLE", "FactoryError", "ModelSpecError", "load_factory", "make_model"]

EXAMPLE = "fxpipe inspect examples/unet.py:factory --stages 4 --chunks 4"
MODEL = "examples/unet.py:factory (a file, and the function in it that returns the model)"


class ModelSpecError(ValueError):
    """A ``MODEL`` spec that names no importable factory."""


class FactoryError(ValueError):
    """The user's module or factory raised, or the factory returned no model."""


def load_factory(spec: str) -> Callable[[], Any]:
    """Import the factory named by ``path/to/file.py:name`` or ``package.module:name``."""
    where, _, name = spec.rpartition(":")
    if not where or not name.isidentifier():
        raise ModelSpecError(f"MODEL {spec!r} is not FILE.py:FACTORY or MODULE:FACTORY; for example: {MODEL}")
    if where.endswith(".py") or "/" in where or os.sep in where:
        if not os.path.isfile(where):
            raise ModelSpecError(f"MODEL {spec!r}: there is no file {where!r}; for example: {MODEL}")
        module = _run_user(f"importing {where}", _import_file, where)
    else:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())  # as `python -m` does
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as exc:
            if exc.name and (where == exc.name or where.startswith(exc.name + ".")):
                raise ModelSpecError(f"MODEL {spec!r}: no module named {exc.name!r}; for example: {MODEL}") from None
            raise FactoryError(f"importing {where} raised {_describe(exc)}") from None
        except Exception as exc:  # noqa: BLE001 - the user's module failed to import
            raise FactoryError(f"importing {where} raised {_describe(exc)}") from None
    factory = getattr(module, name, None)
    if not callable(factory):
        what = "is not callable" if factory is not None else "is not defined there"
        raise ModelSpecError(f"MODEL {spec!r}: {name!r} {what}; name a function returning a model, "
                         f"for example: {MODEL}")
    return factory


def _import_file(path: str) -> Any:
    """Import a Python file as a module, with its directory importable."""
    path = os.path.abspath(path)
    directory, stem = os.path.split(path)[0], os.path.splitext(os.path.basename(path))[0]
    if directory not in sys.path:
        sys.path.insert(0, directory)
    loaded = sys.modules.get(stem)
    if loaded is not None and os.path.abspath(getattr(loaded, "__file__", "") or "") == path:
        return loaded  # already imported from this very file
    name = stem if loaded is None else f"_fxpipe_model_{stem}"  # never replace another module
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _describe(exc: BaseException) -> str:
    """Describe an exception from user code: its type, message and innermost location."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f' (File "{frames[-1].filename}", line {frames[-1].lineno}, in {frames[-1].name})' if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def _run_user(what: str, fn: Callable, *args: Any) -> Any:
    """Call user code; turn its exceptions into a :class:`FactoryError` naming ``what``."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - anything the user's code raises
        raise FactoryError(f"{what} raised {_describe(exc)}") from None


def make_model(spec: str, shapes: list[tuple[int, ...]] | None,
               options: dict[str, Any] | None = None) -> tuple[Any, tuple | None, dict]:
    """Call the factory (with ``options`` as keywords, e.g. ``seq=``); return the model, its example inputs
    (or None) and keyword inputs."""
    import inspect

    import torch
    from torch import nn

    factory = load_factory(spec)
    options = dict(options or {})
    params: Any
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    required = [k for k, p in params.items() if p.default is inspect.Parameter.empty and k not in options and
                p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                           inspect.Parameter.KEYWORD_ONLY)]
    if required:
        raise ModelSpecError(f"MODEL {spec!r}: the factory needs {', '.join(repr(k) for k in required)}, which "
                             "the command cannot give: name a function called with no arguments that returns the "
                             "model, or (model, example_inputs) (def factory(): ...)")
    if options:
        missing = [k for k in options if k not in params and not any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())]
        if missing:
            raise ModelSpecError(f"MODEL {spec!r}: the factory takes no {', '.join(k + '=' for k in missing)} "
                                 f"argument; add one (def factory({missing[0]}=...)) to size the example inputs")
    made = _run_user(f"{spec}()", lambda: factory(**options))
    if isinstance(made, nn.Module):
        model, inputs, kwargs = made, None, {}
    elif isinstance(made, tuple) and len(made) in (2, 3) and isinstance(made[0], nn.Module):
        model, inputs = made[0], made[1]
        kwargs = dict(made[2]) if len(made) == 3 and made[2] else {}
        inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    else:
        raise FactoryError(f"{spec}() returned {type(made).__name__}; return an nn.Module, or "
                      "(model, example_inputs) with example_inputs a tensor or a tuple of them")
    if shapes:
        inputs, kwargs = tuple(torch.randn(s) for s in shapes), {}
    return model, inputs, kwargs
