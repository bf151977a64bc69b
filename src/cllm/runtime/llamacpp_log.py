"""llama.cpp's own log, taken in by the llama.cpp adapter (`llamacpp.checked_api` installs it):
each line goes to the Python logger "llama-cpp-python" at debug level (llama-cpp-python's own
callback prints llama.cpp's warnings to stderr as they come, and fails on a line cut inside a
UTF-8 character), and the error lines logged inside `errors()` are kept, so that a failed load
can say llama.cpp's reason in one line (`LoadErrors.reason`).
"""

from __future__ import annotations

import ctypes
import logging
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger("llama-cpp-python")

ERROR, CONT = 4, 5  # ggml.h's ggml_log_level: GGML_LOG_LEVEL_ERROR, GGML_LOG_LEVEL_CONT (continues a line)
_PREFIX = re.compile(r"^(\w+: )+")  # llama.cpp starts a line with the function that logs it

_lock = threading.Lock()
_pending = {"level": 0, "text": ""}  # the line being logged, until its newline
_listeners: list[list[str]] = []  # the error lines of each open `errors()` block
_installed: list = []  # the ctypes callback, kept alive while llama.cpp may call it


class LoadErrors(list):
    """The error lines llama.cpp logged during an `errors()` block."""

    def reason(self) -> str | None:
        """llama.cpp's reason, in one line: its first error (the cause; later lines say that
        the load failed), without the names of the functions that logged it."""
        for line in self:
            text = _PREFIX.sub("", line.strip()).removeprefix("error loading model: ")
            text = " ".join(_PREFIX.sub("", text).split())
            if text and text != "failed to load model":
                return text
        return None


def install(llama_cpp) -> None:
    """Send llama.cpp's log here (once per process)."""
    if _installed:
        return

    @llama_cpp.llama_log_callback
    def callback(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        _take(level, text.decode("utf-8", errors="replace") if text else "")

    _installed.append(callback)
    llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))


def _take(level: int, text: str) -> None:
    with _lock:
        if level != CONT:
            _pending["level"] = level
        _pending["text"] += text
        if not _pending["text"].endswith("\n"):
            return
        lines, _pending["text"] = _pending["text"].splitlines(), ""
        level = _pending["level"]
        if level == ERROR:
            for errors in _listeners:
                errors.extend(lines)
    for line in lines:
        log.debug("%s", line)


@contextmanager
def errors() -> Iterator[LoadErrors]:
    """The error lines llama.cpp logs while the block runs."""
    caught = LoadErrors()
    with _lock:
        _listeners.append(caught)
    try:
        yield caught
    finally:
        with _lock:
            _listeners.remove(caught)
