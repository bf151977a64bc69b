"""Model cards (`cllm.training.cards`, the one writer): rendered from a shipped model's own files,
each card has the structure of the MODEL_CARD.md shipped beside it (same sections in the same
order, same tables; the shipped cards add hand-written sections), and both cards are put
together from the same pieces."""

import json
from pathlib import Path

from cllm.training.cards import card_section, cllm_card, facts_table, render_card, table, target_card
from cllm.training.pretrain import TARGET_ROLE

MODELS = Path(__file__).resolve().parents[2] / "models"


def read(model: str, name: str) -> dict:
    return json.loads((MODELS / model / name).read_text())


def headings(card: str) -> list[str]:
    return [line for line in card.splitlines() if line.startswith("#")]


def in_order(part: list[str], whole: list[str]) -> bool:
    rest = iter(whole)
    return all(line in rest for line in part)


def test_the_target_card_has_the_shipped_cards_structure():
    shipped = (MODELS / "stdlib-coder" / "MODEL_CARD.md").read_text()
    card = target_card(name="stdlib-coder", role=TARGET_ROLE, evaluation=read("stdlib-coder", "evaluation.json"),
                       architecture=read("stdlib-coder", "config.json"),
                       config=read("stdlib-coder", "pretrain_config.json"),
                       summary=read("stdlib-coder", "pretrain_summary.json"),
                       reproduce="cllm pretrain --config models/stdlib-coder/pretrain_config.json "
                                 "--out runs/stdlib-coder")
    assert in_order(headings(card), headings(shipped))
    # from the first section on, the shipped card is this one with hand-written sections after it
    lines, shipped_lines = card.splitlines(), shipped.splitlines()
    start = lines.index("## Architecture")
    assert shipped_lines[shipped_lines.index("## Architecture"):][: len(lines) - start] == lines[start:]


def test_the_cllm_card_has_the_shipped_cards_structure():
    shipped = (MODELS / "stdlib-coder-cllm" / "MODEL_CARD.md").read_text()
    card = cllm_card(read("stdlib-coder-cllm", "train_summary.json"))
    assert in_order(headings(card), headings(shipped))
    rows = [line for line in card.splitlines() if line.startswith("|")]
    assert rows and in_order(rows, shipped.splitlines())
    extra = cllm_card(read("stdlib-coder-cllm", "train_summary.json"), "\n## Extra\n\ntext\n")
    assert headings(extra) == ["# CLLM distilled from `stdlib-coder`", "## Evaluation", "## Extra", "## Config",
                               "## Trajectory meta"]


def test_cards_are_put_together_from_the_same_pieces():
    assert table(("", "a", "b"), [("x", "", "1")]) == ["| | a | b |", "|---|---|---|", "| x | | 1 |"]
    assert facts_table([("k", "v")]) == ["| | |", "|---|---|", "| k | v |"]
    assert card_section("S", ["one"], [], ["two"]) == ["## S", "", "one", "", "two"]
    assert render_card("T", ["about"], [card_section("S", ["x"]), []]) == "# T\n\nabout\n\n## S\n\nx\n"
    for card in ((MODELS / m / "MODEL_CARD.md").read_text() for m in ("stdlib-coder", "stdlib-coder-cllm")):
        lines = card.splitlines()
        assert lines[0].startswith("# ") and lines[1] == ""
        assert all(lines[i - 1] == lines[i + 1] == "" for i, line in enumerate(lines) if line.startswith("## "))
