"""Progress of a long command, readable in a terminal and in a log.

In a terminal: one live bar (rich) for the stage under way, and one line per finished stage.
When the output is not a terminal (a pipe, a log file): no bar, but a line per stage and per
step the stage calls worth a line, each with the elapsed time, so a log shows what is being
done and how fast. Library code takes a `Progress` and calls it; `Progress.off()` says nothing.
A library that only logs its steps is shown by its command with `echo_log`.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.progress import Progress as Bar
from tqdm.auto import tqdm


class Stage:
    """One stage's counter: `advance()` after each unit of work."""

    def __init__(self, progress: Progress, title: str, total: int) -> None:
        self.progress, self.title, self.total, self.done = progress, title, total, 0
        self._task = None
        if progress._bar is not None:
            self._task = progress._bar.add_task(title, total=total)

    def advance(self, n: int = 1) -> None:
        """`n` more units done."""
        self.done += n
        if self._task is not None:
            self.progress._bar.update(self._task, advance=n)

    def note(self, text: str) -> None:
        """What was just finished: a line in a log (a terminal has the bar)."""
        if self._task is None:
            self.progress.line(f"  {self.title} {self.done}/{self.total}: {text}")


class Progress:
    def __init__(self, console: Any = None, *, enabled: bool = True) -> None:
        self.console, self.enabled = console, enabled and console is not None
        self.start = time.perf_counter()
        self._bar = None

    @classmethod
    def off(cls) -> Progress:
        return cls(None, enabled=False)

    @property
    def live(self) -> bool:
        """A terminal: one live bar, redrawn in place."""
        return self.enabled and self.console.is_terminal

    def elapsed(self) -> str:
        return f"{time.perf_counter() - self.start:7.1f} s"

    def line(self, text: str) -> None:
        """One line, stamped with the time since the command started."""
        if self.enabled:
            self.console.print(f"[{self.elapsed()}] {text}", markup=False, highlight=False, soft_wrap=True)

    def warn(self, text: str) -> None:
        if self.enabled:
            self.console.print(f"[bold yellow]warning:[/] {escape(text)}", highlight=False, soft_wrap=True)

    @contextmanager
    def stage(self, title: str, total: int, *, detail: str = ""):
        """A stage of `total` units: a live bar in a terminal, start and end lines in a log."""
        if not self.enabled:
            yield Stage(self, title, total)
            return
        if self.live:
            self._bar = Bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn(), console=self.console,
                            transient=True)
            self._bar.start()
        else:
            self.line(f"{title}: {detail or f'{total} steps'} ...")
        began = time.perf_counter()
        try:
            yield Stage(self, title, total)
        finally:
            if self._bar is not None:
                self._bar.stop()
                self._bar = None
            self.line(f"{title} done in {time.perf_counter() - began:.1f} s" + (f" ({detail})" if detail else ""))


def progress_bar(**kwargs: Any) -> tqdm:
    """A tqdm bar (its keywords) that redraws at most every second on a terminal and every 30
    seconds elsewhere: a log file gets a line per half minute, not one per step."""
    kwargs.setdefault("mininterval", 1.0 if sys.stderr.isatty() else 30.0)
    kwargs.setdefault("dynamic_ncols", True)
    return tqdm(**kwargs)


def is_main_process() -> bool:
    """Rank 0 of a launched run (`accelerate launch`, `torchrun`), or a plain process."""
    return os.environ.get("RANK", "0") == "0"


class _AboveBars(logging.StreamHandler):
    """Writes through `tqdm.write`: a progress bar on the terminal is cleared, then redrawn."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # noqa: BLE001 - logging's own convention
            self.handleError(record)


class _Below(logging.Filter):
    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < self.level


@contextmanager
def echo_log(logger: str = "cllm", prefix: str = "") -> Iterator[None]:
    """While a command runs, show what its library logs under `logger` (e.g. "cllm.profiling"):
    INFO lines on stdout and warnings on stderr, each after `prefix`, written above tqdm's bars;
    on the main process of a launched run alone (the others keep logging's default). The
    library logs its steps, the command shows them."""
    if not is_main_process():
        yield
        return
    log = logging.getLogger(logger)
    info, warnings = _AboveBars(sys.stdout), _AboveBars(sys.stderr)
    info.addFilter(_Below(logging.WARNING))
    warnings.setLevel(logging.WARNING)
    handlers, level = [info, warnings], log.level
    for handler in handlers:
        handler.setFormatter(logging.Formatter(prefix.replace("%", "%%") + "%(message)s"))
        log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield
    finally:
        for handler in handlers:
            log.removeHandler(handler)
        log.setLevel(level)
