"""Showing what Jacobi decoding did: one block's trajectory in the terminal (`cllm generate
--show-trajectory`, `cllm demo`) and a whole prompt's as one HTML page (`cllm bench`).

A trajectory is recorded with `TrajectoryRecorder` (an `on_iteration` hook). Each token of each
state is classed against the block's fixed point:

- "final": part of the committed prefix (input == output from the left),
- "correct": equal to the fixed point but after a still-wrong token (stationary, or about to be
  fast-forwarded),
- "wrong": not yet the fixed point's token;

and marked (docs/method.md#counting) as

- fast-forwarded: this update newly made it correct, in the contiguous correct run from the left;
- stationary: already correct, unchanged in every later state, while a token before it is wrong.

The page is one self-contained HTML file (inline CSS, every token's text escaped). Nothing here
runs a model.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.text import Text

from cllm.decoding.stats import correct_prefix_length, fast_forwarded_per_update, stationary_count
from cllm.decoding.trajectory import BlockTrajectory

STYLES = {"final": "bold green", "correct": "yellow", "wrong": "red"}


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


@dataclass(frozen=True)
class Mark:
    cls: str  # final / correct / wrong
    fast_forwarded: bool  # newly correct from the left in the update that produced this state
    stationary: bool  # correct and settled for good while a token before it is still wrong


def token_marks(block: BlockTrajectory) -> list[list[Mark]]:
    """Per state, per token (up to the fixed point's length): its class and marks."""
    fp, states = block.fixed_point, block.states
    prefix = [correct_prefix_length(s, fp) for s in states]
    # settled[i]: the first state from which position i equals the fixed point for good
    settled = []
    for i, target in enumerate(fp):
        j = len(states)
        while j > 0 and states[j - 1][i] == target:
            j -= 1
        settled.append(j)
    marks = []
    for j, (state, committed) in enumerate(zip(states, block.committed)):
        classes = classify(state, committed, fp)
        marks.append([
            Mark(cls, fast_forwarded=j > 0 and prefix[j - 1] <= i < prefix[j],
                 stationary=j >= settled[i] and prefix[j] < i)
            for i, cls in enumerate(classes)
        ])
    return marks


# how a source is named for people, and its colour (terminal, HTML)
SOURCE_NAMES = {"ar": "one per forward (as AR)", "jacobi": "Jacobi (verified earlier output)",
                "pool": "recycled n-gram", "table": "draft table", "guess": "initial guess"}
SOURCE_STYLES = {"ar": "green", "jacobi": "cyan", "pool": "magenta", "table": "blue", "guess": "yellow"}


def sources_summary(sources: Sequence[str] | dict[str, int]) -> str:
    """'5 tokens: 3 draft table, 2 one per forward (as AR)': where a block's (or a run's) tokens came from."""
    counts = dict(sources) if isinstance(sources, dict) else {s: list(sources).count(s) for s in dict.fromkeys(sources)}
    total = sum(counts.values())
    parts = [f"{counts[s]} {SOURCE_NAMES.get(s, s)}" for s in SOURCE_NAMES if counts.get(s)]
    return f"{total} tokens: " + ", ".join(parts) if parts else f"{total} tokens"


def sources_legend() -> str:
    """The colours of the sources, as rich markup."""
    return " · ".join(f"[{SOURCE_STYLES[s]}]{name}[/]" for s, name in SOURCE_NAMES.items())


def show_token(text: str) -> str:
    """A token's text made visible in one cell: newlines and tabs escaped."""
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t") or "∅"


def render_block_terminal(block: BlockTrajectory, decode_token) -> list:
    """rich `Text` lines, one per state of the block: `decode_token(id) -> str`.
    Fast-forwarded tokens are underlined, stationary ones overlined."""
    lines = []
    for j, (state, marks) in enumerate(zip(block.states, token_marks(block))):
        line = Text(f"  it {j:>2} │ ", style="dim")
        for token, mark in zip(state, marks):
            style = (STYLES[mark.cls] + (" underline" if mark.fast_forwarded else "")
                     + (" overline" if mark.stationary else ""))
            line.append(show_token(decode_token(token)), style=style)
            line.append("·", style="dim")
        lines.append(line)
    if block.sources:  # the fixed point, each token coloured by where it came from
        line = Text("  from │ ", style="dim")
        for token, source in zip(block.fixed_point, block.sources):
            line.append(show_token(decode_token(token)), style=SOURCE_STYLES.get(source, ""))
            line.append("·", style="dim")
        lines.append(line)
    return lines


def trajectory_legend() -> str:
    """What the colours and marks of `render_block_terminal` mean, as rich markup."""
    return ("[bold green]final[/] · [yellow]correct, not yet final[/] · [red]wrong[/] · [underline]fast-forwarded[/] · "
            f"[overline]stationary[/]; from: {sources_legend()}")


# ------------------------------------------------------------------------------------------
# HTML trajectory picture (the paper's figure: one row per iteration, target beside CLLM)

CSS = """
body { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 13px; margin: 1.5em; color: #222; }
h1 { font-size: 18px; } h2 { font-size: 15px; margin: 1.2em 0 .3em; } h3 { font-size: 13px; margin: .4em 0; }
.legend span.t { margin-right: .8em; }
.row { display: flex; gap: 2em; align-items: flex-start; border-top: 1px solid #ddd; padding-top: .4em; }
.panel { flex: 1; min-width: 0; }
table.traj { border-collapse: collapse; }
td.it { color: #888; padding-right: .6em; white-space: nowrap; vertical-align: top; }
span.t { display: inline-block; padding: 0 2px; margin: 1px; border-radius: 3px; white-space: pre; }
.final { background: #b7e4c7; } .correct { background: #fff3b0; } .wrong { background: #f4c2c2; }
.src-ar { background: #d8f3dc; } .src-jacobi { background: #caf0f8; } .src-pool { background: #f3d5f7; }
.src-table { background: #cfe0fc; } .src-guess { background: #fff3b0; }
.ff { outline: 2px solid #2d6a4f; } .stationary { border-bottom: 3px solid #1d4ed8; }
pre.prompt { background: #f6f6f6; padding: .6em; white-space: pre-wrap; }
.meta { color: #666; }
"""


def _html_block(block: BlockTrajectory | None, decode_token: Callable[[int], str]) -> str:
    if block is None:
        return '<div class="panel meta">(no such block)</div>'
    fp = block.fixed_point
    ff = fast_forwarded_per_update(block.states, fp)
    head = (f"<h3>block {block.block_index} · {len(block.states) - 1} updates · fast-forwarded per "
            f"update {ff} · stationary {stationary_count(block.states, fp)}</h3>")
    if block.sources:
        spans = "".join(f'<span class="t src-{s}" title="{html.escape(SOURCE_NAMES.get(s, s))}">'
                        f"{html.escape(show_token(decode_token(t)))}</span>" for t, s in zip(fp, block.sources))
        head += (f'<p class="meta">fixed point by source ({html.escape(sources_summary(block.sources))}): '
                 f"{spans}</p>")
    rows = []
    for j, (state, marks) in enumerate(zip(block.states, token_marks(block))):
        spans = []
        for token, mark in zip(state, marks):
            cls = " ".join(["t", mark.cls] + ["ff"] * mark.fast_forwarded + ["stationary"] * mark.stationary)
            text = html.escape(show_token(decode_token(token)))
            spans.append(f'<span class="{cls}" title="id {token}: {mark.cls}">{text}</span>')
        rows.append(f'<tr><td class="it">it {j}</td><td>{"".join(spans)}</td></tr>')
    return f'<div class="panel">{head}<table class="traj">{"".join(rows)}</table></div>'


def trajectory_html(panels: Sequence[tuple[str, Sequence[BlockTrajectory]]], decode_token: Callable[[int], str],
                    *, prompt: str = "", title: str = "Jacobi trajectories") -> str:
    """One page: per block, one row; per model (panel), one column; one line per iteration."""
    legend = ('<p class="legend">each state: <span class="t final">final</span><span class="t correct">correct, not '
              'yet final</span>'
              '<span class="t wrong">wrong</span><span class="t correct ff">fast-forwarded by this update</span>'
              '<span class="t correct stationary">stationary</span></p>'
              '<p class="legend">where each final token came from: '
              + "".join(f'<span class="t src-{s}">{html.escape(n)}</span>' for s, n in SOURCE_NAMES.items())
              + "</p>")
    names = "".join(f'<div class="panel"><h2>{html.escape(name)}</h2></div>' for name, _ in panels)
    body = [f"<h1>{html.escape(title)}</h1>", legend, "<h2>prompt</h2>",
            f'<pre class="prompt">{html.escape(prompt)}</pre>', f'<div class="row">{names}</div>']
    for b in range(max((len(blocks) for _, blocks in panels), default=0)):
        cells = [_html_block(blocks[b] if b < len(blocks) else None, decode_token) for _, blocks in panels]
        body.append(f'<div class="row">{"".join(cells)}</div>')
    return (f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")


def write_trajectory_html(path: str | Path, panels, decode_token, *, prompt: str = "",
                          title: str = "Jacobi trajectories") -> Path:
    path = Path(path)
    path.write_text(trajectory_html(panels, decode_token, prompt=prompt, title=title), encoding="utf-8")
    return path
