"""`cllm demo` end to end: on tiny models, without a CLLM, and on a bare checkout (fallback)."""

from __future__ import annotations

import json

import pytest

from cllm.cli import main
from cllm.demo import DemoConfig, demo
from cllm.models import SHIPPED
from tests.test_bench import make_tiny_setup

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
    assert demo(config) == 0
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
    assert demo(config) == 0
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
