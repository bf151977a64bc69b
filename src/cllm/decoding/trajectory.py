"""Recording Jacobi trajectories: the engine's `on_iteration` events gathered per block.

One recorder serves every consumer: `cllm collect` turns a block into a trajectory record
(`block_states`), the report and the demo colour its tokens. The engine knows nothing of it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from cllm.decoding.jacobi import IterationEvent


@dataclass
class BlockTrajectory:
    """Every state of one block, as the engine reported them, and its fixed point."""

    row: int
    block_index: int
    states: list[tuple[int, ...]] = field(default_factory=list)
    committed: list[int] = field(default_factory=list)  # per state: its leading final tokens
    fixed_point: tuple[int, ...] = ()
    sources: tuple[str, ...] = ()  # where each fixed-point token came from (`jacobi.rule.SOURCES`)


class TrajectoryRecorder:
    """An `on_iteration` hook: gathers each (row, block)'s states until it converges, then files
    the block under `blocks[row]` (in the order blocks converge: block index order)."""

    def __init__(self) -> None:
        self._open: dict[tuple[int, int], BlockTrajectory] = {}
        self.blocks: dict[int, list[BlockTrajectory]] = defaultdict(list)

    def __call__(self, event: IterationEvent) -> None:
        key = (event.row, event.block_index)
        block = self._open.setdefault(key, BlockTrajectory(event.row, event.block_index))
        block.states.append(tuple(event.state))
        block.committed.append(event.committed)
        if event.converged:
            block.fixed_point = tuple(event.state[: event.committed])
            block.sources = event.sources
            self.blocks[event.row].append(self._open.pop(key))


def block_states(block: BlockTrajectory) -> list[list[int]]:
    """The block's trajectory as a record holds it: every state cut to the fixed point's length
    (a block that ends with EOS is shorter than its states), consecutive repeats dropped (the
    engine may report the fixed point again on the iteration that confirms it)."""
    n = len(block.fixed_point)
    states: list[list[int]] = []
    for state in block.states:
        if not states or states[-1] != list(state[:n]):
            states.append(list(state[:n]))
    return states
