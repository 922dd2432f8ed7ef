"""The ``fxpipe`` command: ``fxpipe inspect MODEL --stages N`` shows what the compiler did;
``fxpipe plan MODEL --ranks N`` chooses a configuration; one module per command
(:mod:`fxpipe.tools.inspectcmd`, :mod:`fxpipe.tools.plancmd`).

    fxpipe inspect examples/unet.py:factory --stages 4 --chunks 4 --dot unet.svg --timeline t.json
    fxpipe plan examples/transformer.py:factory --ranks 4 --device h100 --memory 80GB

``MODEL`` is ``path/to/file.py:factory`` or ``package.module:factory``; ``factory()`` returns
a model or ``(model, example_inputs)``. Exit status: 0 on success, 1 when the model cannot be
pipelined as asked (it does not trace, its factory raises, a saved plan no longer matches),
2 for a command line that cannot be used (a bad MODEL, a malformed option).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import logging
import os
import sys
import warnings
from collections.abc import Iterator, Sequence

from fxpipe.errors import SearchSpaceError, TraceError
from fxpipe.tools import inspectcmd, plancmd
from fxpipe.tools.cliargs import Failure, UsageError, join_negative_values, option_hint, trace_hint
from fxpipe.tools.factory import FactoryError, ModelSpecError

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``fxpipe`` command line; return the exit status."""
    parser = _parser()
    args, extra = parser.parse_known_args(join_negative_values(sys.argv[1:] if argv is None else argv))
    if extra:  # name the option meant, with the subcommand's usage (the top-level one lists no options)
        _refuse_unknown(parser, args.command, extra)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="fxpipe: %(levelname)s: %(message)s")
    if not args.verbose:  # torch logs a traceback when a fake kernel rejects the shapes; we explain
        logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)
    try:
        with _warnings_as_lines(args.command):
            return args.run(args)
    except (UsageError, ModelSpecError, SearchSpaceError) as exc:
        print(f"fxpipe {args.command}: error: {exc}{_hint(args.command, exc)}", file=sys.stderr)
        return 2
    except (Failure, FactoryError) as exc:
        print(f"fxpipe {args.command}: error: {exc}{_hint(args.command, exc)}", file=sys.stderr)
        return 1
    except TraceError as exc:  # the model cannot be traced as asked: say which options fix it
        print(f"fxpipe {args.command}: error: TraceError: {exc}{trace_hint(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (| head): stop quietly, as Unix tools do
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 141
    except Exception as exc:
        if args.traceback:
            raise
        print(f"fxpipe {args.command}: error: {type(exc).__name__}: {exc}\n"
              "(run again with --traceback to see where)", file=sys.stderr)
        return 1


@contextlib.contextmanager
def _warnings_as_lines(command: str) -> Iterator[None]:
    """Print each ``UserWarning`` as one line, ``fxpipe COMMAND: warning: ...``, not Python's file:line format."""
    default = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):  # type: ignore[no-untyped-def]
        if not issubclass(category, UserWarning):
            return default(message, category, filename, lineno, file, line)
        print(f"fxpipe {command}: warning: {message}", file=sys.stderr if file is None else file)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = default


def _refuse_unknown(parser: argparse.ArgumentParser, command: str, extra: Sequence[str]) -> None:
    """Exit with the subcommand's usage, naming for each unknown option the closest one it has."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    known = list(sub._option_string_actions)
    named = []
    for word in extra:
        close = difflib.get_close_matches(word.split("=")[0], known, n=1) if word.startswith("-") else []
        named.append(f"{word} (did you mean {close[0]}?)" if close else word)
    sub.error(f"unrecognized arguments: {' '.join(named)}")


def _parser() -> argparse.ArgumentParser:
    """Build the argument parser: one subcommand per module."""
    parser = argparse.ArgumentParser(prog="fxpipe", description="Pipeline parallelism for any PyTorch model.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    inspectcmd.register(commands)
    plancmd.register(commands)
    return parser


def _hint(command: str, exc: Exception) -> str:
    """Name the options of ``fxpipe inspect`` that set a library message's keywords (``fxpipe plan`` names its own)."""
    return option_hint(str(exc)) if command == "inspect" else ""
