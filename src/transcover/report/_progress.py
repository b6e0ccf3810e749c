"""Progress on long work: a rich bar on a terminal, nothing when output is piped or ``--quiet``."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["progress", "start_progress", "close_all", "Tracker"]

_OPEN: list = []  # bars started by start_progress and not yet closed (main() closes them on errors)


class Tracker:
    """What a command calls while it works: ``step(label)`` starts a named phase, ``update(done,
    total)`` moves the bar within it.  A silent tracker's methods do nothing."""

    def __init__(self, bar=None):
        self._bar = bar
        self._task = None

    def step(self, label: str, total: int | None = None) -> None:
        if self._bar is None:
            return
        if self._task is not None:
            self._bar.remove_task(self._task)
        self._task = self._bar.add_task(label, total=total)

    def update(self, done: int, total: int | None = None) -> None:
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, completed=done, total=total)

    def close(self) -> None:
        """Remove the bar from the terminal (idempotent)."""
        if self._bar is not None:
            self._bar.stop()
            if self._bar in _OPEN:
                _OPEN.remove(self._bar)
            self._bar = None

    def callback(self) -> Callable[[int, int], None] | None:
        """``progress(done, total)`` for APIs that take one, or ``None`` when silent."""
        return None if self._bar is None else self.update


def _is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def count_text(completed: float, total: float | None) -> str:
    """``done/total`` for a phase whose size is known, nothing for one that is not (its bar pulses): an open
    phase drew ``0/None`` (stop 43's note)."""
    return "" if total is None else f"{int(completed)}/{int(total)}"


def _bar(stream):
    from rich.console import Console
    from rich.progress import BarColumn, Progress, ProgressColumn, SpinnerColumn, TextColumn, TimeElapsedColumn
    from rich.text import Text

    class _Count(ProgressColumn):
        def render(self, task) -> Text:  # noqa: ANN001
            return Text(count_text(task.completed, task.total))

    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), _Count(), TimeElapsedColumn(),
                    console=Console(file=stream), transient=True)


def start_progress(*, quiet: bool = False, stream=None) -> Tracker:
    """A started :class:`Tracker` (call ``close()``; the CLI's ``main`` closes any left open)."""
    stream = sys.stderr if stream is None else stream
    if quiet or not _is_terminal(stream):
        return Tracker()
    bar = _bar(stream)
    bar.start()
    _OPEN.append(bar)
    return Tracker(bar)


def close_all() -> None:
    while _OPEN:
        _OPEN.pop().stop()


@contextmanager
def progress(*, quiet: bool = False, stream=None) -> Iterator[Tracker]:
    """A :class:`Tracker` that draws on ``stream`` (stderr) only if it is a terminal and not quiet."""
    stream = sys.stderr if stream is None else stream
    if quiet or not _is_terminal(stream):
        yield Tracker()
        return
    with _bar(stream) as bar:
        yield Tracker(bar)
