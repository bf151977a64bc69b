"""What the training commands show of their library's log: `cllm.training` logs (the plan of a
run, the time left, each stage's summary inside `distill`); `log_to_terminal` puts those lines
on the terminal, above any progress bar, on the main process alone.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from tqdm.auto import tqdm


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
def log_to_terminal(name: str = "cllm") -> Iterator[None]:
    """While inside: the INFO lines of `name`'s loggers on stdout and its warnings on stderr,
    written above tqdm's bars (main process only: the others keep logging's default, warnings
    on stderr)."""
    if not is_main_process():
        yield
        return
    logger = logging.getLogger(name)
    info, warnings = _AboveBars(sys.stdout), _AboveBars(sys.stderr)
    info.addFilter(_Below(logging.WARNING))
    warnings.setLevel(logging.WARNING)
    handlers, level = [info, warnings], logger.level
    for handler in handlers:
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        for handler in handlers:
            logger.removeHandler(handler)
        logger.setLevel(level)
