"""The ``transcover`` command line: one thin module per sub-command.

Each command lives in ``transcover/cli/_<name>.py`` and exposes::

    NAME: str                      # the sub-command, e.g. "analyze"
    HELP: str                      # one line for ``transcover --help``
    def add_arguments(parser): ... # argparse arguments
    def run(args) -> int: ...      # does the work through the Python API; returns the exit code

Command modules import nothing heavy at module level (the CLI must start fast); they import the
API inside ``run``.  Every :class:`~transcover.TranscoverError` (and ``OSError``) becomes one line
``transcover: error: ...`` on stderr and exit code 2; ``--debug`` re-raises with the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings
from collections.abc import Sequence

from .._errors import TranscoverWarning, clean_line

__all__ = ["main", "build_parser"]

# The order is the order of ``transcover --help``; a module that does not exist is not listed.
_COMMAND_MODULES = (
    "_analyze",
    "_lipschitz",
    "_perturb",
    "_bound",
    "_cover",
    "_approx",
    "_advise",
    "_train",
    "_experiment",
    "_report",
)


def _command_modules():
    for name in _COMMAND_MODULES:
        try:
            yield importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.{name}":
                raise


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every option's help ends with its default, unless the text already states one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("default" in text.lower() or any(default is v for v in (None, False, argparse.SUPPRESS))
                or (isinstance(default, (list, tuple)) and not default) or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)"


def _float(text: str) -> float:
    """``float(text)``, refusing a literal that float64 rounds to 0 or to infinity: ``--eps 1e-400`` was refused as
    "got --eps=0.0", a value the user never typed (red team 162), and ``1e400`` read as inf."""
    from ._conventions import literal_problem

    value = float(text)
    problem = literal_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return value


_float.__name__ = "float"  # argparse's "invalid float value: 'abc'" keeps its wording


class _Parser(argparse.ArgumentParser):
    """argparse with defaults in the help and "did you mean" for a mistyped command or choice; every ``type=float``
    option reads its value through ``_float``."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)
        self.register("type", float, _float)

    def error(self, message: str):
        import difflib
        import re

        m = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if m:
            choices = re.findall(r"'([^']*)'", m.group(2))
            close = difflib.get_close_matches(m.group(1), choices, n=1, cutoff=0.6)
            if close:
                message += f"; did you mean '{close[0]}'?"
        super().error(message)


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, object]]:
    from .._version import __version__

    parser = _Parser(
        prog="transcover",
        description="Certified norms, Lipschitz constants and covering-number bounds of Transformers.",
    )
    parser.add_argument("--version", action="version", version=f"transcover {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the full traceback on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands: dict[str, object] = {}
    for module in _command_modules():
        p = sub.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show the full traceback on errors")
        module.add_arguments(p)
        commands[module.NAME] = module
    return parser, commands


def main(argv: Sequence[str] | None = None) -> int:
    parser, commands = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    previous = _terminate_cleanly()
    try:
        return _run(args, commands)
    finally:
        if previous is not None:
            import signal

            signal.signal(signal.SIGTERM, previous)


def _run(args, commands) -> int:  # noqa: ANN001
    from .._errors import TranscoverError

    try:
        with warnings.catch_warnings():
            # every TranscoverWarning is shown (one line each), however often the same text recurs
            warnings.simplefilter("always", TranscoverWarning)
            warnings.showwarning = _show_warning
            try:
                _check_outputs(args)
                return int(commands[args.command].run(args) or 0)
            finally:
                from ..report import close_progress_bars

                close_progress_bars()  # a bar left open by an error must not draw over the message
    except KeyboardInterrupt:
        print("transcover: interrupted", file=sys.stderr)
        return 130
    except _Terminated:
        print("transcover: terminated", file=sys.stderr)
        return 143
    except (TranscoverError, OSError) as err:
        if args.debug:
            raise
        print(f"transcover: error: {_one_line(err)}", file=sys.stderr)
        return 2
    except Exception as err:  # an internal bug: still one line, but say how to see more
        if args.debug:
            raise
        print(f"transcover: internal error: {type(err).__name__}: {_one_line(err)} "
              "(rerun with --debug for the traceback)", file=sys.stderr)
        return 1


# Every file option of every command, checked before any work: a missing or unwritable folder used to stop
# perturb, bound, cover, sweeps, train and lipschitz only after the computation, with the other outputs
# (a PNG, a JSON, a trained checkpoint) already written (red team 37h).  Suffixes stay with each command.
_OUTPUT_OPTIONS = ("json", "csv", "plot", "figure")


def _check_outputs(args) -> None:  # noqa: ANN001  (an argparse Namespace)
    from ..report import check_output_path

    for dest in _OUTPUT_OPTIONS:
        value = getattr(args, dest, None)
        if isinstance(value, str) and value:
            check_output_path(value, f"--{dest}")


class _Terminated(BaseException):
    """SIGTERM (timeout, kill, a batch scheduler) raised in the main thread, so every ``finally`` runs: an atomic
    write in progress removes its temporary file, which SIGTERM's default action left behind (red team 37h)."""


def _terminate_cleanly():  # noqa: ANN202
    import signal
    import threading

    def handler(signum, frame):  # noqa: ANN001
        raise _Terminated

    if threading.current_thread() is not threading.main_thread():
        return None
    try:
        return signal.signal(signal.SIGTERM, handler)
    except (ValueError, OSError):  # not settable here (an embedding interpreter)
        return None


_SHOW_OTHER = warnings.showwarning


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """``transcover: warning: <one line>`` on stderr for transcover's own warnings; others as Python shows them."""
    if issubclass(category, TranscoverWarning):
        print(f"transcover: warning: {_one_line(message)}", file=sys.stderr)
    else:
        _SHOW_OTHER(message, category, filename, lineno, file, line)


def _one_line(err: BaseException | Warning | str) -> str:
    """The message on one line: escape sequences and control characters removed, whitespace collapsed."""
    return clean_line(str(err)) or type(err).__name__


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
