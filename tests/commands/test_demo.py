"""`cllm demo` end to end: on tiny models, without a CLLM, and on a bare checkout (fallback)."""

from __future__ import annotations

import json
import re

import pytest

from cllm.cli import main
from cllm.commands.demo import DemoConfig, run
from cllm.models import SHIPPED
from tests.bench.test_bench import make_tiny_setup

SMALL = dict(max_prompts=2, max_new_tokens=12, block_size=4, sweep_block_sizes=[2, 4], repeats=1,
             val_prompts=0, threads=1, live_delay=0.0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_setup(tmp_path_factory.mktemp("demo"))


def report_files(out) -> set[str]:
    return {p.name for p in out.iterdir()}


def test_demo_runs_end_to_end_on_tiny_models_and_writes_its_report_folder(tiny, tmp_path, capsys):
    out = tmp_path / "demo"
    config = DemoConfig(target=str(tiny["target"]), cllm=str(tiny["cllm"]), prompts=str(tiny["prompts"]),
                        out=str(out), **dict(SMALL, val_prompts=2))
    assert run(config) == 0
    printed = capsys.readouterr().out
    assert "report folder" in printed and str(out) in printed and "live" in printed
    assert {"bench.json", "report.md", "config.json", "demo_config.json", "trajectory.html", "speedup.png",
            "accepted_histogram.png", "tpf_vs_block_size.png"} <= report_files(out)
    data = json.loads((out / "bench.json").read_text())
    assert {"cllm_ar", "cllm_jacobi", "target_jacobi"} <= set(data["methods"])
    assert all(e["ok"] for e in data["exactness"].values())


def test_demo_tells_the_target_only_story_without_a_cllm(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(SHIPPED, "stdlib-coder-cllm", tmp_path / "absent")
    out = tmp_path / "demo"
    config = DemoConfig(target=str(tiny["target"]), prompts=str(tiny["prompts"]), out=str(out), **SMALL)
    assert run(config) == 0
    assert "No CLLM" in capsys.readouterr().out
    methods = json.loads((out / "bench.json").read_text())["methods"]
    assert "target_jacobi" in methods and not any(m.startswith("cllm") for m in methods)


def test_demo_falls_back_to_a_tiny_random_model_on_a_bare_checkout(tmp_path, monkeypatch, capsys):
    for name in ("stdlib-coder", "stdlib-coder-cllm"):
        monkeypatch.setitem(SHIPPED, name, tmp_path / "absent" / name)
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--max-prompts", "2", "--max-new-tokens", "12", "--block-size", "4",
                 "--sweep-block-sizes", "4", "--repeats", "1", "--val-prompts", "0", "--threads", "1",
                 "--live-delay", "0"]) == 0
    assert "tiny random Llama" in capsys.readouterr().out
    data = json.loads((out / "bench.json").read_text())
    assert data["models"]["target"]["name"] == "tiny random Llama (fallback)"
    assert "trajectory.html" in report_files(out)


def test_demo_output_in_a_log_shows_progress_the_engine_and_a_whole_table(tiny, tmp_path, capsys):
    """Piped to a file (capsys is no terminal): a stamped line per stage and per prompt, no bar,
    a table that fits 80 columns with no cell cut, and the live decode on the headline's engine
    with where its tokens came from."""
    out = tmp_path / "demo"
    config = DemoConfig(target=str(tiny["target"]), cllm=str(tiny["cllm"]), prompts=str(tiny["prompts"]),
                        out=str(out), **SMALL)
    assert run(config) == 0
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    stamped = [line for line in lines if re.match(r"\[\s*\d+\.\d s\] ", line)]
    assert any("bench done in" in line for line in stamped) and any("sweep done in" in line for line in stamped)
    per_prompt = [line for line in stamped if ": 1" in line and "methods x 1 rounds" in line]
    assert len(per_prompt) == 2  # one per prompt, with where the bench stands and the time to go
    assert "about" in per_prompt[0] and "to go" in per_prompt[0] and " 0 left" in per_prompt[1]
    assert all("method x prompt decodes done" in line for line in per_prompt)
    assert "…" not in printed and "━" in printed
    table_lines = [line for line in lines if line.startswith(("┃", "│", "┏", "└"))]
    assert table_lines and max(map(len, table_lines)) <= 80
    assert "live[/]" not in printed and "cllm_jacobi, the CLLM on the engine (n = 4, 8 recycled drafts" in printed
    assert "tokens: " in printed and "one per forward (as AR)" in printed


def test_demo_ends_with_the_verdict_of_its_own_table_and_a_legend_under_it(tiny, tmp_path, capsys):
    """The last line is the verdict, one line, computed from the bench.json the demo wrote; the
    table has its legend (one line per column)."""
    from cllm.bench.verdict import verdict

    out = tmp_path / "demo"
    config = DemoConfig(target=str(tiny["target"]), cllm=str(tiny["cllm"]), prompts=str(tiny["prompts"]),
                        out=str(out), **SMALL)
    assert run(config) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    methods = json.loads((out / "bench.json").read_text())["methods"]
    assert lines[-1] == verdict(methods) and lines[-1].startswith("verdict: ")
    assert f"{methods['target_lookahead']['tokens_per_forward']:.2f} tok/fwd" in lines[-1]
    assert any(line.split()[:1] == ["tok/fwd"] and "forward pass" in line for line in lines)
