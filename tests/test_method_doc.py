"""The code, the bench JSON and the model cards cite docs/method.md by section: every cited
section must exist (GitHub's heading anchors), and nothing cites documents outside the repo."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHOD = ROOT / "docs" / "method.md"


def anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a Markdown file's headings (lower case, punctuation dropped, spaces
    to hyphens)."""
    out = set()
    for line in markdown.splitlines():
        if m := re.match(r"#{1,6} (.+)", line):
            out.add(re.sub(r"[^\w\- ]", "", m[1].strip().lower()).replace(" ", "-"))
    return out


def cited_files() -> list[Path]:
    return [*sorted((ROOT / "src").rglob("*.py")), *sorted((ROOT / "models").glob("*/MODEL_CARD.md")),
            *sorted((ROOT / "docs").glob("*.md"))]


def test_every_cited_section_of_method_md_exists():
    known = anchors(METHOD.read_text())
    assert {"jacobi-decoding", "consistency-training", "counting", "quality-measures", "bench-methods",
            "bench-json", "trajectory-records"} <= known
    cited = {(path.name, a) for path in cited_files() for a in re.findall(r"method\.md#([\w-]+)", path.read_text())}
    assert cited, "nothing cites docs/method.md"
    assert not [(name, a) for name, a in cited if a not in known]


def test_no_citation_of_documents_outside_the_repository():
    offenders = [path for path in cited_files() if re.search(r"\b(REFERENCE|DESIGN)\.md", path.read_text())]
    assert not offenders
