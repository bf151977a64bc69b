"""The CPU we share: its load, how many torch threads to take, and when timings can't be trusted.

On a shared CPU, torch threads that wait on each other make every step many times slower, so
`bench`, `demo` and `serve` size their threads from the 1-minute load average, by one rule.
"""

from __future__ import annotations

import os


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
