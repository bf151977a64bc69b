"""The machine a timing depends on: what it is, its load, how many torch threads to take, when
timings can't be trusted, and the device sync before a clock read.

On a shared CPU, torch threads that wait on each other make every step many times slower, so
`bench`, `demo` and `serve` size their threads from the 1-minute load average, by one rule.
"""

from __future__ import annotations

import datetime
import os
import platform
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import transformers

from cllm.core.errors import UserError

T = TypeVar("T")


def load_average_1min() -> float | None:
    """The 1-minute load average, or None where the platform has none (Windows)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def threads_for_load(load_1min: float | None, cores: int | None, wanted: int = 2) -> int:
    """`wanted` torch threads, fewer when other processes leave fewer cores free: on a shared
    CPU, threads that wait on each other make every step many times slower."""
    if load_1min is None or not cores:
        return wanted
    return max(1, min(wanted, round(cores - load_1min)))


def load_warning(load_1min: float | None, cores: int | None, threads: int) -> str | None:
    """A warning when other processes already keep the CPU busy: the bench's `threads` then
    compete with them, and wall-clock figures (tokens/s, speedups) mean little; counts (tokens
    per forward, exactness) do not depend on it."""
    if load_1min is None or not cores or load_1min + threads <= cores + 0.5:
        return None
    advice = " (and try --threads 1: torch's threads wait on each other when the CPU is shared)" if threads > 1 else ""
    return (f"load average {load_1min:.1f} on {cores} cores before the bench's {threads} thread(s): other "
            "processes are using the CPU, so tokens/s and speedups are unreliable (tokens per forward "
            f"and exactness are not affected); rerun on a quiet machine for timings{advice}")


def in_passing_thread(fn: Callable[[], T], name: str = "cllm-load") -> T:
    """fn() in a thread of its own that ends with it; its result returned, or its exception
    raised, here. For work that must not leave the calling thread with torch CPU threads:
    torch's OpenMP (GNU libgomp) keeps a pool of worker threads for every thread that ran a
    parallel op, and while the pools together hold more threads than there are cores, every
    pool's workers sleep between ops instead of spinning. A server that loads its model on the
    main thread and decodes on another then pays a wake-up per op, several times a forward's
    cost on 2 cores (docs/serving.md, "How requests are served"). A passing thread's pool goes
    with it."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=run, name=name, daemon=True)  # a daemon: Ctrl-C during it still exits
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


def sync(device: torch.device) -> None:
    """Wait for the device's queued work: a clock read after it times what ran (gpt-fast's habit)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo where there is one)."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            return next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), name)
    except OSError:
        return name


def machine_info(device: torch.device | str = "cpu") -> dict[str, Any]:
    """What a timing depends on: versions, CPU, cores, torch threads, device, load, date. Read the
    load before starting one's own work."""
    device = torch.device(device)
    load = load_average_1min()
    return {
        "cpu": cpu_name(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(), "platform": platform.platform(),
        "device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "load_average_1min": round(load, 2) if load is not None else None,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def resolve_device(name: str) -> torch.device:
    """A `--device` value as a torch device: "auto" is CUDA when torch sees one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: torch sees no CUDA device here")
    return torch.device(name)
