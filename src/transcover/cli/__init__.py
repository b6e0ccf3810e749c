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
        # one line, as every other refusal (red team 189: `report --eps 1e400` printed the 14-line usage block first);
        # the usage is one --help away
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


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
        module.add_arguments(p)
        _add_debug(p)
        commands[module.NAME] = module
    return parser, commands


def _add_debug(p: argparse.ArgumentParser) -> None:
    """``--debug`` on ``p`` and on every sub-command below it: ``cover reference --debug`` was refused as an
    unrecognized argument while the README calls --debug general (red team 217).  The default is suppressed, so
    a level that is not given it keeps what an upper one parsed."""
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show the full traceback on errors")
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):  # aliases name one parser more than once
                _add_debug(child)


def main(argv: Sequence[str] | None = None) -> int:
    parser, commands = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    previous = _terminate_cleanly()
    stdout, sys.stdout = sys.stdout, _ClosedPipeTolerant(sys.stdout)
    try:
        return _run(args, commands)
    finally:
        sys.stdout = stdout
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
# every option naming a file a command writes (report's --output, approx construct's --save, a results --store: cover's
# --output is a choice, not a file), and the files a command writes into its --out folder
_FILE_OUTPUTS = {"report": (*_OUTPUT_OPTIONS, "output", "store"), "approx": (*_OUTPUT_OPTIONS, "save", "store")}
_RUN_FILES = {"history.jsonl", "history.csv", "history.png", "staged.json", "staged.png", "nonvacuous.json",
              "nonvacuous.png", "state.json", "model.safetensors", "optimizer.safetensors"}
# files a loader reads inside a model or run folder although they end in an output's suffix
_READ_NAMES = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "vocab.json",
               "special_tokens_map.json", "added_tokens.json", "preprocessor_config.json", "modules.json",
               "sentence_bert_config.json", "config_sentence_transformers.json", "transcover_roles.json",
               "state.json", "history.csv"}
_WRITTEN_SUFFIXES = (".json", ".csv", ".png", ".svg", ".pdf", ".html", ".htm")


def _check_outputs(args) -> None:  # noqa: ANN001  (an argparse Namespace)
    from ..report import check_output_path

    for dest in _OUTPUT_OPTIONS:
        value = getattr(args, dest, None)
        if isinstance(value, str) and value:
            check_output_path(value, f"--{dest}")
    _check_outputs_apart(args)


def _check_outputs_apart(args) -> None:  # noqa: ANN001
    """One line, before any work, where two output options name one file (the first output was lost: red team 169)
    or an output would overwrite a file the command reads: an input given by path, or a file a loader reads inside an
    input folder (``--json MODEL/model.safetensors`` replaced the weights with JSON)."""
    import os
    from pathlib import Path

    from .._errors import InputError
    from .._io import _descriptor

    dests = _FILE_OUTPUTS.get(getattr(args, "command", None), (*_OUTPUT_OPTIONS, "store"))
    # an open descriptor (/dev/stdout, /dev/stderr: one terminal or one redirect file for both) or a device is
    # written through, not replaced: no clash and nothing destroyed (red team 173)
    outs = [(f"--{d}", Path(v)) for d in dests if isinstance(v := getattr(args, d, None), str) and v
            and _descriptor(Path(v)) is None and not (Path(v).exists() and not Path(v).is_file())]
    seen: dict[Path, str] = {}
    for flag, p in outs:
        key = p.resolve()
        if key in seen:
            raise InputError(f"{seen[key]} and {flag} name the same file {p}; give each output its own file")
        seen[key] = flag
    out_dir = getattr(args, "out", None)
    if isinstance(out_dir, str) and out_dir:  # train/experiment --out: the run's own files, written or not yet
        run = Path(out_dir).resolve()
        for flag, p in outs:
            target = p.resolve()
            if run in target.parents and (target.name in _RUN_FILES or run / "checkpoint" in target.parents):
                raise InputError(f"{flag}={p} is a file the run writes into --out {out_dir}; give another output path")
    inputs = []
    for dest, value in vars(args).items():
        if dest in dests or dest == "out":
            continue
        for v in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(v, str) and v and os.path.exists(v):
                inputs.append(Path(v).resolve())
    for flag, p in outs:
        if not p.exists():
            continue
        target = p.resolve()
        for src in inputs:
            read = (src.is_file() and target == src) or (
                src.is_dir() and src in target.parents
                and (target.name in _READ_NAMES or target.name.endswith(".index.json")  # a sharded checkpoint's map
                     or not target.name.lower().endswith(_WRITTEN_SUFFIXES)))
            if read:
                where = "an input" if target == src else f"inside the input {src}"
                raise InputError(f"{flag}={p} is a file this command reads ({where}); writing it would destroy it: "
                                 "give another output path")


class _ClosedPipeTolerant:
    """``sys.stdout`` that survives a reader leaving early (``transcover bound ... --json b.json | head -1``): the
    table went to a closed pipe, BrokenPipeError ended the run without a word, and b.json was never written (red team
    169).  After the first broken write, what is printed goes to /dev/null and the command finishes its files."""

    def __init__(self, stream):  # noqa: ANN001
        self._stream, self._broken = stream, False

    def _gone(self) -> None:
        import os

        self._broken = True
        try:  # the interpreter's own flush at exit must not hit the closed pipe either
            fd = os.open(os.devnull, os.O_WRONLY)
            os.dup2(fd, self._stream.fileno())
            os.close(fd)
        except (OSError, ValueError, AttributeError):  # no real descriptor (a test's capture): nothing to redirect
            pass

    def write(self, text: str) -> int:
        if not self._broken:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._gone()
        return len(text)

    def flush(self) -> None:
        if not self._broken:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._gone()

    def __getattr__(self, name: str):  # noqa: ANN204  (isatty, fileno, encoding, ... as the stream has them)
        return getattr(self._stream, name)


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
