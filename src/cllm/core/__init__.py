"""Shared plumbing every layer may use: errors, config <-> flags, seeds, the machine, progress, run folders."""

__version__ = "0.1.0"
