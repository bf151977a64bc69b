"""report.py and pictures.py: trajectory marks agree with the counting definitions, the HTML page is
self-contained and escaped, plots and tables come out of any bench JSON."""

from __future__ import annotations

import re

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from cllm.bench.pictures import render_block_terminal, token_marks, trajectory_html
from cllm.bench.report import (
    markdown_report,
    methods_table,
    plot_accepted_histograms,
    plot_speedup,
    plot_tpf_vs_block_size,
)
from cllm.decoding import jacobi_decode
from cllm.decoding.stats import fast_forwarded_per_update, stationary_count
from cllm.decoding.trajectory import BlockTrajectory, TrajectoryRecorder


def scripted_block() -> BlockTrajectory:
    # fixed point 1 2 3 4 5; position 3 is right from the start and position 4 from state 1,
    # both while position 2 is still wrong: two stationary tokens
    states = [(1, 9, 9, 4, 9), (1, 2, 9, 4, 5), (1, 2, 3, 4, 5)]
    return BlockTrajectory(0, 0, states=states, committed=[1, 2, 5], fixed_point=(1, 2, 3, 4, 5))


def marks_summary(block: BlockTrajectory) -> tuple[list[int], int]:
    marks = token_marks(block)
    ff = [sum(m.fast_forwarded for m in row) for row in marks[1:]]
    stationary = {i for row in marks for i, m in enumerate(row) if m.stationary}
    return ff, len(stationary)


def test_marks_of_a_scripted_block_follow_the_definitions():
    block = scripted_block()
    marks = token_marks(block)
    assert [m.cls for m in marks[0]] == ["final", "wrong", "wrong", "correct", "wrong"]
    assert [i for i, m in enumerate(marks[1]) if m.fast_forwarded] == [1]
    assert [i for i, m in enumerate(marks[2]) if m.fast_forwarded] == [2, 3, 4]
    assert [i for i, m in enumerate(marks[0]) if m.stationary] == [3]
    assert [i for i, m in enumerate(marks[1]) if m.stationary] == [3, 4]
    assert marks_summary(block) == ([1, 3], 2)


def test_marks_agree_with_the_engine_statistics_on_real_trajectories():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3)).eval()
    for seed in range(3):
        recorder = TrajectoryRecorder()
        prompt = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(seed))
        out = jacobi_decode(model, prompt, block_size=8, max_new_tokens=32, on_iteration=recorder,
                            generator=torch.Generator().manual_seed(seed))
        blocks = recorder.blocks[0]
        assert [t for b in blocks for t in b.fixed_point] == out.new_tokens[0]
        ff = [n for b in blocks for n in marks_summary(b)[0]]
        assert ff == [n for b in blocks for n in fast_forwarded_per_update(b.states, b.fixed_point)]
        assert sum(ff) == sum(out.stats.fast_forwarded)
        assert sum(marks_summary(b)[1] for b in blocks) == out.stats.stationary_tokens
        assert [stationary_count(b.states, b.fixed_point) for b in blocks] == out.stats.stationary


def test_trajectory_html_is_self_contained_and_escapes_token_text():
    page = trajectory_html([("target", [scripted_block()]), ("cllm <x>", [scripted_block(), scripted_block()])],
                           lambda t: f"<b>&{t}", prompt="if a < b:", title="t & t")
    assert "&lt;b&gt;&amp;3" in page and "<b>&" not in page
    assert "if a &lt; b:" in page and "cllm &lt;x&gt;" in page and "t &amp; t" in page
    assert "<style>" in page and "<script" not in page and "<link" not in page and "http" not in page
    assert page.count("<tr>") == 9  # 3 iterations x 3 blocks shown
    assert "(no such block)" in page  # the target has one block fewer
    assert 'class="t correct stationary"' in page and "ff" in page


def test_terminal_rendering_has_one_line_per_state():
    lines = render_block_terminal(scripted_block(), lambda t: "\n" if t == 9 else str(t))
    assert len(lines) == 3 and "\\n" in lines[0].plain


def fake_bench_json(with_data: bool = True) -> dict:
    method = dict(tokens_per_second=100.0, tokens_per_forward=1.0, speedup_vs_ar=1.0, exact_match_own_ar=1.0,
                  agreement_with_target=1.0, n_prompts=2, new_tokens=10, ms_per_forward=10.0,
                  mean_fast_forwarded=None, stationary_tokens=None, accepted_histogram={"1": 10})
    jacobi = dict(method, tokens_per_forward=1.5, speedup_vs_ar=1.2, mean_fast_forwarded=1.4, stationary_tokens=3,
                  accepted_histogram={"1": 4, "2": 3} if with_data else None)
    return {
        "config": {"prompts": "humaneval", "max_new_tokens": 5, "block_size": 4, "guess": "prompt", "repeats": 3,
                   "warmup": 1},
        "machine": {"cpu": "x", "cores": 2, "threads": 2, "device": "cpu", "dtype": "float32", "torch": "t",
                    "transformers": "t", "seed": 0, "load_average_1min": None, "date": "d"},
        "methods": {"target_ar": method, "target_jacobi": jacobi,
                    "cllm_jacobi": dict(jacobi, agreement_with_target=0.5)},
        "models": {"target": {"name": "a", "parameters": 10, "val_loss": 2.5},
                   "cllm": {"name": "b", "parameters": 10, "val_loss": None}},
        "counting": "c", "val_set": {"name": "stdlib-val"}, "prompt_ids": ["p0", "p1"], "trajectory_prompt": "p0",
        "sweep": {"target": {"4": {"tokens_per_forward": 1.1}, "16": {"tokens_per_forward": 1.2}}} if with_data else {},
        "exactness": {"target_jacobi": {"mismatches": [], "ok": True}}, "notes": ["a note"],
    }


def test_plots_are_non_empty_pngs_with_or_without_data(tmp_path):
    for with_data in (True, False):
        data = fake_bench_json(with_data)
        paths = [plot_speedup(data["methods"], tmp_path / f"s{with_data}.png"),
                 plot_accepted_histograms(data["methods"], tmp_path / f"h{with_data}.png"),
                 plot_tpf_vs_block_size(data["sweep"], tmp_path / f"t{with_data}.png")]
        for path in paths:
            blob = path.read_bytes()
            assert blob.startswith(b"\x89PNG") and len(blob) > 1000


def test_markdown_and_terminal_tables_list_every_method():
    from rich.console import Console

    data = fake_bench_json()
    md = markdown_report(data)
    assert all(f"`{m}`" in md for m in data["methods"]) and "| 16 | 1.200 |" in md and "- a note" in md
    console = Console(width=120, record=True)
    console.print(methods_table(data))
    text = console.export_text()
    assert all(m in text for m in data["methods"]) and "1.20x" in text


def test_the_methods_table_fits_80_columns_with_no_cell_cut():
    """Every method, full-size figures and the longest method name: wider than 80 columns as one
    table, so it is split in two, and every figure is printed whole (rich cuts cells with '…')."""
    from rich.console import Console

    from cllm.bench.report import methods_tables

    data = fake_bench_json()
    big = dict(data["methods"]["target_jacobi"], tokens_per_second=12345.6, mean_fed_tokens=123.4,
               ms_per_forward=1234.5, tokens_per_forward_not_looping=4.25, looping_rate=0.5, degenerate_rate=0.25)
    data["methods"] = {"cllm_jacobi_sampling": big, "target_lookahead": dict(big, speedup_vs_ar=12.34)}
    console = Console(width=80, record=True)
    tables = methods_tables(data, width=80)
    for table in tables:
        console.print(table)
    text = console.export_text()
    assert len(tables) == 2 and max(map(len, text.splitlines())) <= 80 and "…" not in text
    for figure in ("12345.6", "12.34x", "123.4", "1234.5", "4.25", "50%", "25%", "cllm_jacobi_sampling"):
        assert figure in text, figure
    assert len(methods_tables(data, width=200)) == 1


def test_every_plot_with_data_has_a_legend_naming_what_it_shows():
    from cllm.bench.report import accepted_figure, speedup_figure, tpf_figure

    data = fake_bench_json()
    labels = {}
    for name, fig in (("speedup", speedup_figure(data["methods"])), ("accepted", accepted_figure(data["methods"])),
                      ("tpf", tpf_figure(data["sweep"]))):
        legend = fig.axes[0].get_legend()
        assert legend is not None, name
        labels[name] = [t.get_text() for t in legend.get_texts()]
    assert "target AR (1.00x)" in labels["speedup"] and any("cllm_" in t for t in labels["speedup"])
    assert any(t.startswith("cllm_jacobi (mean 1.50)") for t in labels["accepted"])
    assert {"target", "AR"} <= set(labels["tpf"])


def test_the_printed_table_has_a_legend_line_per_column_and_sampling_rows_read_in_law():
    from rich.console import Console

    from cllm.bench.report import LEGEND, legend_lines, results_renderables

    data = fake_bench_json()
    data["methods"]["cllm_jacobi_sampling"] = dict(data["methods"]["cllm_jacobi"], exact_match_own_ar=0.0)
    lines = legend_lines(data)
    shown = ["tok/s", "×AR", "tok/fwd", "=AR", "agree", "ff", "stat", "ms/fwd"]
    assert [line.split()[0] for line in lines] == shown and all(LEGEND[s] in "\n".join(lines) for s in shown)
    console = Console(width=200, record=True)
    for item in results_renderables(data, width=200):
        console.print(item)
    text = console.export_text()
    sampling_row = next(line for line in text.splitlines() if "cllm_jacobi_sampling" in line)
    assert "in law" in sampling_row and re.search(r"(?<!\d)0%", sampling_row) is None  # not a 0% "failure"
    assert "exact in law" in text and "stationary" in text
    assert "| in law |" in markdown_report(data)
