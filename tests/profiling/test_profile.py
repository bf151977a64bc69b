"""`cllm profile` on a tiny random model: every k measured, ratios against k = 1, the JSON
contract, predictions that follow the cost model, and one-line errors.

No wall-clock thresholds: times are only checked to be present and positive.
"""

from __future__ import annotations

import json

import pytest
import torch

import cllm.profiling.steptime as steptime
from cllm.cli import main
from cllm.profiling.profile import ProfileConfig, StepProfile, markdown, parse_tpf, profile

KS = [1, 2, 4, 8]
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256}


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("shape") / "config.json"
    path.write_text(json.dumps(TINY))
    return path


@pytest.fixture(scope="module")
def measured(tiny_config, tmp_path_factory):
    out = tmp_path_factory.mktemp("profile")
    cfg = ProfileConfig(shape=str(tiny_config), device="cpu", prefix=32, k=KS[1:], repeats=2, host_tokens=6,
                        tpf="ar=1,jacobi=1.2,engine=3", forward_batches=[1, 3], decode_tokens=12, out=str(out))
    return profile(cfg), out


def test_the_table_has_every_k_with_positive_times_and_ratios(measured):
    result, _ = measured
    assert result.ks == KS  # k = 1 added: every ratio is against it
    for row in result.rows:
        assert row.min_ms > 0 and row.median_ms >= row.min_ms
        assert row.ratio > 0 and row.ratio_median > 0 and row.tree_ratio > 0
        assert row.host_jacobi_ms is not None and row.host_engine_ms is not None


def test_the_steps_are_timed_on_the_runtime_asked_for(tiny_config, monkeypatch):
    import cllm.profiling.profile as profile_module

    timed = []
    real = profile_module.time_steps
    monkeypatch.setattr(profile_module, "time_steps", lambda runtime, *a, **k: timed.append(runtime.name)
                        or real(runtime, *a, **k))
    for runtime, name, forward in (("transformers", "transformers", "transformers' forward (asked for)"),
                                   ("auto", "lean", "lean (llama")):
        result = profile(ProfileConfig(shape=str(tiny_config), device="cpu", prefix=8, k=[2], repeats=1,
                                       host_tokens=0, tree=False, forward_batches=[], decode_tokens=0,
                                       runtime=runtime, out=None))
        assert timed.pop() == name and result.model["forward"].startswith(forward)


def test_predicted_speedup_is_tpf_times_t1_over_tk(measured):
    result, _ = measured
    t1 = result.rows[0].min_ms
    for row in result.rows:
        for name, tpf in result.tpf.items():
            assert row.predicted[name]["speedup_vs_ar"] == pytest.approx(tpf * t1 / row.min_ms)
            assert row.predicted[name]["tokens_per_second"] == pytest.approx(1e3 * tpf / row.min_ms)
    assert result.rows[0].predicted["ar"]["speedup_vs_ar"] == pytest.approx(1.0)


def test_the_json_round_trips(measured):
    result, out = measured
    data = json.loads((out / "profile.json").read_text())
    assert StepProfile.from_dict(data) == result
    assert data["model"]["dtype"] == "float32" and data["model"]["device"] == "cpu"
    assert data["machine"]["torch"] == torch.__version__


def test_the_markdown_has_a_row_per_k(measured):
    result, out = measured
    table = (out / "profile.md").read_text()
    assert table == markdown(result)
    rows = [line for line in table.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [int(line.split("|")[1]) for line in rows] == KS


def test_one_forward_is_timed_on_every_path_at_every_batch_and_k(measured):
    result, out = measured
    assert list(result.forwards) == ["lean", "lean-mkl", "transformers"]  # float32 on a CPU: every path
    for per_batch in result.forwards.values():
        assert {B: sorted(map(int, per_k)) for B, per_k in per_batch.items()} == {"1": KS, "3": KS}
        assert all(ms > 0 for per_k in per_batch.values() for ms in per_k.values())
    table = (out / "profile.md").read_text()
    assert "| forward | B | k = 1 | k = 2 | k = 4 | k = 8 |" in table
    rows = [line for line in table.splitlines() if line.startswith(("| lean |", "| lean-mkl |", "| transformers |"))]
    assert len(rows) == 6 + 2  # 3 paths x 2 batches, and the decode table's 2 paths


def test_a_greedy_decode_is_timed_on_the_runner_and_on_transformers_with_the_same_tokens(measured):
    result, out = measured
    assert result.decode["new_tokens"] == 12 and result.decode["same_tokens"] is True  # float32: exact
    assert sorted(result.decode["tokens_per_second"]) == ["lean", "transformers"]
    assert all(tps > 0 for tps in result.decode["tokens_per_second"].values())
    assert "the paths decoded the same tokens" in (out / "profile.md").read_text()


def test_the_forward_table_and_the_decode_can_be_skipped(tiny_config, tmp_path):
    result = profile(ProfileConfig(shape=str(tiny_config), device="cpu", prefix=8, k=[2], repeats=1, host_tokens=0,
                                   tree=False, forward_batches=[], decode_tokens=0, out=str(tmp_path / "p")))
    assert result.forwards == {} and result.decode == {}
    assert "One causal forward" not in markdown(result) and "greedy decoding" not in markdown(result)


def test_the_tree_step_feeds_exactly_k_tokens_through_the_engines_trie():
    for k in range(1, 65):
        tokens, parents = steptime.tree_layout(k)
        assert len(tokens) == len(parents) == k and len(set(tokens)) == k
        assert parents[0] == -1 and all(0 <= parents[i] < i for i in range(1, k))  # one root, parents first


def test_the_named_shapes_have_their_nominal_sizes():
    assert steptime.parameter_count(steptime.shape_config("small")) == pytest.approx(5.3e6, rel=0.02)
    assert steptime.parameter_count(steptime.shape_config("1b")) == pytest.approx(1.24e9, rel=0.02)
    assert steptime.parameter_count(steptime.shape_config("7b")) == pytest.approx(6.74e9, rel=0.02)


@pytest.mark.parametrize("args, expected", [
    (["--k", "0"], "--k must be ints >= 1"),
    (["--shape", "70b"], "unknown shape '70b'"),
    (["--tpf", "engine"], "--tpf takes NAME=TOKENS_PER_FORWARD"),
    (["--tpf", "engine=-1"], "--tpf takes NAME=TOKENS_PER_FORWARD"),
    (["--repeats", "0"], "--repeats must be an int >= 1"),
    (["--dtype", "int3"], "unknown dtype"),
    (["--prefix", "4090"], "exceeds the model's position limit"),
    (["--decode-tokens", "-1"], "--decode-tokens must be an int >= 0"),
    (["--forward-batches", "0"], "--forward-batches must be ints >= 1"),
])
def test_bad_inputs_are_one_line_errors(args, expected, capsys, tmp_path):
    code = main(["profile", "--device", "cpu", "--out", str(tmp_path), *args])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("cllm profile: error:") and "\n" not in err and expected in err


def test_a_model_too_large_for_the_cpu_memory_is_refused_in_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(steptime, "available_memory", lambda: 8 * 2**30)
    code = main(["profile", "--shape", "7b", "--device", "cpu", "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "needs 25.1 GiB" in err and "\n" not in err


def test_tpf_pairs_parse():
    assert parse_tpf("ar=1, jacobi=1.05,cllm=3") == {"ar": 1.0, "jacobi": 1.05, "cllm": 3.0}


def test_time_forwards_times_every_forward_the_model_takes_at_every_batch_and_k():
    """A float32 Llama on the CPU: the runner on packed weights, on MKL's GEMM, and transformers'."""
    import transformers as tf

    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**{k: v for k, v in TINY.items() if k not in (
        "architectures", "model_type")})).eval()
    times = steptime.time_forwards(model, [1, 3], [1, 2], prefix=8, rounds=2)
    assert list(times) == ["lean", "lean-mkl", "transformers"]
    for per_batch in times.values():
        assert {B: sorted(per_k) for B, per_k in per_batch.items()} == {1: [1, 3], 2: [1, 3]}
        assert all(len(s) == 2 and min(s) > 0 for per_k in per_batch.values() for s in per_k.values())
