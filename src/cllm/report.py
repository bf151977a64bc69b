"""Showing what decoding did: trajectories as coloured terminal text (and, later, HTML/plots).

A trajectory is recorded with `TrajectoryRecorder` (an `on_iteration` hook). Each token of each
state is classed against the block's fixed point:

- "final": part of the committed prefix (input == output from the left),
- "correct": equal to the fixed point but after a still-wrong token (stationary, or about to be
  fast-forwarded),
- "wrong": not yet the fixed point's token.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from cllm.decoding import IterationEvent

STYLES = {"final": "bold green", "correct": "yellow", "wrong": "red"}


@dataclass
class BlockTrajectory:
    row: int
    block_index: int
    states: list[tuple[int, ...]] = field(default_factory=list)
    committed: list[int] = field(default_factory=list)
    fixed_point: tuple[int, ...] = ()


class TrajectoryRecorder:
    """An `on_iteration` hook that keeps every block's states (for pictures and the demo)."""

    def __init__(self) -> None:
        self._open: dict[tuple[int, int], BlockTrajectory] = {}
        self.blocks: dict[int, list[BlockTrajectory]] = defaultdict(list)

    def __call__(self, event: IterationEvent) -> None:
        key = (event.row, event.block_index)
        block = self._open.setdefault(key, BlockTrajectory(event.row, event.block_index))
        block.states.append(event.state)
        block.committed.append(event.committed)
        if event.converged:
            block.fixed_point = event.state[: event.committed]
            self.blocks[event.row].append(self._open.pop(key))


def classify(state: tuple[int, ...], committed: int, fixed_point: tuple[int, ...]) -> list[str]:
    """One class per token of `state` (only up to the fixed point's length)."""
    classes = []
    for i, token in enumerate(state[: len(fixed_point)]):
        if i < committed:
            classes.append("final")
        elif token == fixed_point[i]:
            classes.append("correct")
        else:
            classes.append("wrong")
    return classes


def show_token(text: str) -> str:
    """A token's text made visible in one cell: newlines and tabs escaped."""
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t") or "∅"


def render_block_terminal(block: BlockTrajectory, decode_token) -> list:
    """rich `Text` lines, one per state of the block: `decode_token(id) -> str`."""
    from rich.text import Text

    lines = []
    for j, (state, committed) in enumerate(zip(block.states, block.committed)):
        line = Text(f"  it {j:>2} │ ", style="dim")
        for token, cls in zip(state, classify(state, committed, block.fixed_point)):
            line.append(show_token(decode_token(token)), style=STYLES[cls])
            line.append("·", style="dim")
        lines.append(line)
    return lines
