"""The demo's closing verdict follows the table it is given: the CLLM winning, losing, absent."""

from __future__ import annotations

import re

from cllm.bench.verdict import verdict


def row(tok_s: float, tpf: float, looping: float = 0.0, degenerate: float = 0.0) -> dict:
    return {"tokens_per_second": tok_s, "tokens_per_forward": tpf, "looping_rate": looping,
            "degenerate_rate": degenerate}


def table(cllm_tok_s: float, cllm_tpf: float) -> dict:
    return {"target_ar": row(200.0, 1.0, 0.16), "target_jacobi": row(180.0, 1.04, 0.16),
            "cllm_jacobi_plain": row(185.0, 1.09, 0.28), "target_lookahead": row(600.0, 3.72, 0.16),
            "cllm_jacobi": row(cllm_tok_s, cllm_tpf, 0.28)}


def test_a_table_where_the_cllm_loses_says_drafting_made_the_speed_with_its_numbers():
    line = verdict(table(cllm_tok_s=480.0, cllm_tpf=3.10))
    assert line.startswith("verdict: drafting made the speed here, not consistency training")
    assert "\n" not in line
    assert "3.00x its greedy" in line and "600.0 vs 200.0 tok/s" in line  # 600 / 200
    assert "lost ground (0.80x)" in line and "480.0 vs the target's 600.0" in line
    assert "3.10 tok/fwd, looping 28%, degenerate 0%" in line and "3.72 tok/fwd, looping 16%" in line
    assert "plain Jacobi 1.09 vs 1.04" in line and "distill_ablations.md" in line


def test_a_table_where_the_cllm_wins_says_training_added_and_by_how_much():
    line = verdict(table(cllm_tok_s=780.0, cllm_tpf=4.71))
    assert "consistency training added 1.30x on top" in line and "780.0 vs the target's 600.0" in line
    assert line.startswith("verdict: drafting made most of the speed here, consistency training added to it")
    # training's factor above drafting's: training is said to have made most of it
    big = verdict({**table(0, 0), "target_lookahead": row(240.0, 1.5), "cllm_jacobi": row(960.0, 5.0)})
    assert big.startswith("verdict: consistency training made most of the speed here") and "4.00x on top" in big


def test_a_near_tie_is_called_level_and_the_numbers_are_the_tables():
    line = verdict(table(cllm_tok_s=612.0, cllm_tpf=3.8))
    assert "was about level (1.02x)" in line
    numbers = {float(x) for x in re.findall(r"\d+\.\d+", line)}
    assert {612.0, 600.0, 200.0, 3.8, 3.72} <= numbers


def test_without_a_cllm_the_verdict_is_drafting_alone_and_without_its_rows_there_is_none():
    alone = verdict({k: v for k, v in table(0, 0).items() if not k.startswith("cllm")})
    assert alone.startswith("verdict: the speed here is drafting (no CLLM in this table)") and "3.00x" in alone
    assert verdict({"target_ar": row(200.0, 1.0)}) is None
