"""`cllm collect` end to end on a tiny random Llama: records agree with greedy decoding, survive
SIGKILL + resume, refuse foreign directories, and do not depend on batch size or process count.

The model's init scale (0.1) makes greedy outputs repetitive enough that some blocks are
degenerate and some Jacobi iterations fast-forward several tokens: both paths get exercised.
"""

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from cllm.cli import main as cli_main
from cllm.core.errors import UserError
from cllm.core.outputs import MARKER, claim_folder
from cllm.core.seeds import derived_seed as prompt_seed
from cllm.data.tokenizer import EOT, train_tokenizer
from cllm.data.trajectories import (
    TrajectoryReader,
    list_shards,
    read_records,
    read_shard_info,
    write_meta,
)
from cllm.decoding import IterationEvent, greedy_decode
from cllm.decoding.trajectory import TrajectoryRecorder, block_states
from cllm.evaluation.text import ends_in_loop as _ends_in_loop
from cllm.evaluation.text import is_degenerate
from cllm.runtime import open_runtime
from cllm.training.collect import (
    LOOP_WINDOW,
    CollectConfig,
    augment_states,
    collect,
)
from tests.tiny import CODE_TEXTS

BLOCK, NEW = 12, 36
TEXTS = CODE_TEXTS
PROMPTS = ["def f(x):", "class A:", "import re", "for k in d:", "x = 1", "while x:",
           "def g(a, b):", "import os", "y = x + 1", "class B(A):"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
       "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


def save_model(directory: Path, tokenizer, *, seed=0) -> Path:
    """A tiny random Llama (vocab 320, covering the tokenizer) + the tokenizer, in one dir."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128, initializer_range=0.1,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("collect")
    tokenizer = train_tokenizer(TEXTS * 3, vocab_size=320, min_frequency=1)
    model_dir = save_model(root / "model", tokenizer)
    prompts = root / "prompts.jsonl"
    with open(prompts, "w") as fh:
        for i, text in enumerate(PROMPTS):
            row = {"id": f"q{i}", "prompt": text, "reference": f" return {i}\n" if i % 2 else None}
            fh.write(json.dumps(row) + "\n")
    return root, model_dir, prompts, tokenizer


def config(setup, out, **overrides) -> CollectConfig:
    root, model_dir, prompts, _ = setup
    values = dict(model=str(model_dir), prompts=str(prompts), out=str(out), block_size=BLOCK,
                  max_new_tokens=NEW, batch_size=3, shard_size=4, augment=True)
    values.update(overrides)
    return CollectConfig(**values)


def cli_args(cfg: CollectConfig) -> list[str]:
    args = ["collect"]
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if value is not None:
            args += ["--" + f.name.replace("_", "-"), str(value).lower() if isinstance(value, bool) else str(value)]
    return args


@pytest.fixture(scope="module")
def reference(setup):
    """One uninterrupted single-process run (batch 3, with padding): the records to match."""
    out = setup[0] / "reference"
    summary = collect(config(setup, out))
    return out, summary, read_records(out)


def snapshot(directory: Path) -> dict:
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(directory.iterdir())}


def greedy(setup, ids, eos=None):
    model = open_runtime(LlamaForCausalLM.from_pretrained(setup[1]).eval(), "transformers")  # the reference
    return greedy_decode(model, torch.tensor([ids]), max_new_tokens=NEW, eos_token_id=eos).new_tokens[0]


# ------------------------------------------------------------------------------------------
# What the records say


def greedy_blocks(setup):
    """Per prompt: its index, token ids, greedy continuation (to EOS) and that cut into blocks."""
    tokenizer = setup[3]
    model = open_runtime(LlamaForCausalLM.from_pretrained(setup[1]).eval(), "transformers")  # the reference
    for i, text in enumerate(PROMPTS):
        ids = tokenizer(text)["input_ids"]
        want = greedy_decode(model, torch.tensor([ids]), max_new_tokens=NEW,
                             eos_token_id=tokenizer.eos_token_id).new_tokens[0]
        yield i, ids, want, [want[k : k + BLOCK] for k in range(0, len(want), BLOCK)]


def test_joined_fixed_points_of_every_prompt_equal_greedy_decode(setup, reference):
    _, summary, records = reference
    tokenizer = setup[3]
    by_prompt = {}
    for r in records:
        by_prompt.setdefault(r.prompt_id, []).append(r)
    degenerate_blocks = 0
    for i, ids, want, blocks in greedy_blocks(setup):
        kept = {k: b for k, b in enumerate(blocks) if not is_degenerate(b)}
        degenerate_blocks += len(blocks) - len(kept)
        got = by_prompt.get(f"q{i}", [])
        assert [r.block_index for r in got] == list(kept)
        for r in got:
            assert r.fixed_point == kept[r.block_index]
            # the prefix is the prompt plus every earlier fixed point (dropped ones included)
            assert r.prefix_ids == ids + want[: BLOCK * r.block_index]
            assert r.prompt_len == len(ids)
            assert r.labels == (tokenizer(f" return {i}\n")["input_ids"] if i % 2 else None)
    assert summary.dropped == degenerate_blocks > 0  # the filter has work to do here
    assert summary.records == len(records)


def test_every_trajectory_starts_at_a_guess_and_ends_at_its_fixed_point(reference):
    _, summary, records = reference
    for r in records:
        assert r.states[-1] == r.fixed_point
        assert all(len(s) == len(r.fixed_point) for s in r.states)
        assert all(a != b for a, b in zip(r.states, r.states[1:], strict=False))  # no repeats
    assert any(len(r.states) < len(r.fixed_point) for r in records)  # some fast-forwarding
    assert summary.states == sum(len(r.states) for r in records)
    assert summary.augmented_states == sum(len(r.augmented_states) for r in records) > 0
    assert 1.0 <= summary.tokens_per_forward <= BLOCK


def test_eos_inside_a_block_cuts_every_state_to_the_fixed_point(setup, tmp_path):
    root, model_dir, _, tokenizer = setup
    # Make a token that greedy produces mid-block the EOS (same weights, other tokenizer).
    ids = tokenizer(PROMPTS[0])["input_ids"]
    want = greedy(setup, ids)
    eos = next(t for k, t in enumerate(want) if k % BLOCK not in (0, BLOCK - 1) and t not in want[:k])
    eos_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(tokenizer.backend_tokenizer.to_str()),
        eos_token=tokenizer.convert_ids_to_tokens(eos),
        pad_token=EOT, bos_token=EOT, clean_up_tokenization_spaces=False)
    assert eos_tokenizer(PROMPTS[0])["input_ids"] == ids
    other = save_model(tmp_path / "model", eos_tokenizer)
    collect(config(setup, tmp_path / "out", model=str(other), max_prompts=1))
    records = read_records(tmp_path / "out")
    last = records[-1]
    cut = want.index(eos)
    assert last.block_index == cut // BLOCK
    assert last.fixed_point == want[BLOCK * last.block_index : cut + 1]
    assert last.fixed_point[-1] == eos and len(last.fixed_point) < BLOCK
    assert all(len(s) == len(last.fixed_point) for s in last.states)


def test_degenerate_records_are_dropped_and_counted(reference):
    out, summary, records = reference
    assert all(not is_degenerate(r.fixed_point) for r in records)
    reader = TrajectoryReader(out)
    assert sum(read_shard_info(p).dropped for p in reader.shards) == summary.dropped > 0


def test_drop_loops_drops_a_prompts_blocks_from_its_first_looping_one(setup, reference, tmp_path):
    _, plain, _ = reference
    summary = collect(config(setup, tmp_path / "out", drop_loops=True))
    by_prompt = {}
    for r in read_records(tmp_path / "out"):
        by_prompt.setdefault(r.prompt_id, []).append(r.block_index)
    looping_blocks = 0
    for i, _, want, blocks in greedy_blocks(setup):
        first_loop = next((k for k in range(len(blocks)) if ends_in_loop(want[: BLOCK * (k + 1)])), len(blocks))
        looping_blocks += len(blocks) - first_loop
        assert by_prompt.get(f"q{i}", []) == [k for k in range(first_loop) if not is_degenerate(blocks[k])]
    assert summary.dropped_loops == looping_blocks > 0  # the tiny model loops: the filter has work
    assert summary.records + summary.dropped + summary.dropped_loops == plain.records + plain.dropped
    assert json.loads((tmp_path / "out" / "meta.json").read_text())["drop_loops"] is True


def ends_in_loop(ids):  # the collector's window
    return _ends_in_loop(ids, min_length=LOOP_WINDOW)


def test_ends_in_loop_needs_a_short_period_over_the_whole_window():
    assert ends_in_loop([9, 8] + [1, 2, 3] * 6)  # 20 tokens, last 16 periodic
    assert ends_in_loop([7] * 16)
    assert not ends_in_loop([1, 2, 3] * 4)  # only 12 tokens
    assert not ends_in_loop(list(range(9)) * 2)  # period 9 > 8
    assert not ends_in_loop([5] * 15 + [6])


# ------------------------------------------------------------------------------------------
# Safety: resume, foreign directories, damage


def test_killed_collection_resumes_to_exactly_the_uninterrupted_records(setup, reference, tmp_path):
    out = tmp_path / "out"
    cfg = config(setup, out, batch_size=1, shard_size=1)  # many shards, other batch composition
    cmd = [sys.executable, "-m", "cllm.cli", *cli_args(cfg)]
    log = tmp_path / "stderr.txt"
    with open(log, "wb") as stderr:
        proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=stderr)
        try:
            deadline = time.monotonic() + 120
            while not list_shards(out) and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert proc.poll() is None, f"exited before it could be killed: {log.read_text()[-800:]}"
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait()
    written = len(list_shards(out))
    assert 1 <= written < len(PROMPTS)
    summary = collect(cfg)
    assert summary.skipped >= written and summary.skipped + summary.prompts == len(PROMPTS)
    assert read_records(out) == reference[2]
    assert not [p for p in out.iterdir() if p.name.startswith(".") and p.name != MARKER]  # no partial files left
    again = collect(cfg)  # a finished directory: nothing left to do
    assert again.prompts == 0 and again.skipped == len(PROMPTS)
    assert read_records(out) == reference[2]


def test_a_first_run_failing_before_its_first_shard_leaves_no_folder_but_the_users_stays(
        setup, tmp_path, monkeypatch, capsys):
    import cllm.training.collect as collecting
    from cllm.cli import main

    def fails(*a, **k):
        raise UserError("decoding failed")

    monkeypatch.setattr(collecting, "decode_batch", fails)
    out = tmp_path / "new"
    assert main(cli_args(config(setup, out))) == 2
    assert "decoding failed" in capsys.readouterr().err and not out.exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    assert main(cli_args(config(setup, mine))) == 2
    assert mine.is_dir()


def test_ctrl_c_says_where_it_stopped_and_the_same_command_resumes(setup, reference, tmp_path, monkeypatch, capsys):
    """Ctrl-C in the middle of the second shard: one line says how many prompts are in and that
    the same command resumes; it does, to the uninterrupted run's records."""
    import cllm.training.collect as collecting
    from cllm.cli import main

    out = tmp_path / "out"
    args = cli_args(config(setup, out, batch_size=1, shard_size=1))
    decode, calls = collecting.decode_batch, []

    def ctrl_c_at_the_second_batch(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return decode(*a, **k)

    monkeypatch.setattr(collecting, "decode_batch", ctrl_c_at_the_second_batch)
    assert main(args) == 130
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert said == f"cllm collect: stopped with 1 prompt collected in {out}; run the same command again to resume"
    monkeypatch.setattr(collecting, "decode_batch", decode)
    assert main(args) == 0
    assert "(1 already done)" in capsys.readouterr().out
    assert read_records(out) == reference[2]


@pytest.mark.parametrize("change, key", [
    ({"block_size": 8}, "block_size"), ({"seed": 1}, "seed"), ({"guess": "random"}, "guess"),
    ("model", "model_fingerprint"), ("tokenizer", "tokenizer_fingerprint"),
])
def test_directory_with_other_meta_is_refused_and_left_untouched(setup, reference, tmp_path, change, key, capsys):
    out = reference[0]
    before = snapshot(out)
    overrides = change if isinstance(change, dict) else {}
    if change in ("model", "tokenizer"):  # other weights, or the same weights + another tokenizer
        tokenizer = setup[3]
        if change == "tokenizer":
            tokenizer = train_tokenizer(TEXTS[:3] * 3 + ["lambda q: q\n"], vocab_size=320, min_frequency=1)
        overrides = {"model": str(save_model(tmp_path / "m", tokenizer, seed=int(change == "model")))}
    cfg = config(setup, out, **overrides)
    with pytest.raises(UserError, match="other settings") as exc:
        collect(cfg)
    assert f"({key}: " in str(exc.value)  # only the setting that differs is named
    capsys.readouterr()
    assert cli_main(cli_args(cfg)) == 2  # the CLI says it in one line
    err = capsys.readouterr().err.strip()
    assert err.startswith("cllm collect: error:") and "\n" not in err
    assert snapshot(out) == before


def test_shards_collect_did_not_mark_stop_it_and_a_damaged_shard_of_its_own_is_redone(setup, reference, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    shard = list_shards(reference[0])[0]
    (out / shard.name).write_bytes(shard.read_bytes()[:100])
    with pytest.raises(UserError, match="did not write"):
        collect(config(setup, out))
    claim_folder(out, "collect")  # now its own folder, with a cut shard in it
    write_meta(out, TrajectoryReader(reference[0]).meta)
    collect(config(setup, out))
    assert (out / (shard.name + ".damaged")).exists()
    assert sorted(r.prompt_id for r in TrajectoryReader(out).records()) == \
        sorted(r.prompt_id for r in TrajectoryReader(reference[0]).records())


@pytest.mark.parametrize("where", ["the model", "a foreign directory"])
def test_an_out_that_is_the_model_or_holds_foreign_files_is_refused_untouched(setup, tmp_path, where, capsys):
    if where == "the model":
        out = setup[1]
    else:
        out = tmp_path / "mine"
        out.mkdir()
        (out / "config.json").write_text('{"mine": true}')
        (out / ".draft.partial").write_text("not collect's")
    before = snapshot(out)
    cfg = config(setup, out)
    with pytest.raises(UserError, match="is the --model folder" if where == "the model" else "did not write"):
        collect(cfg)
    capsys.readouterr()
    assert cli_main(cli_args(cfg)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("cllm collect: error:") and "\n" not in err
    assert snapshot(out) == before


def test_nothing_is_written_before_the_model_has_loaded(setup, reference, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(setup[1], broken)
    (broken / "model.safetensors").write_bytes(b"\x00not weights" * 32)
    out = tmp_path / "out"
    with pytest.raises(UserError, match="model.safetensors is damaged"):
        collect(config(setup, out, model=str(broken)))
    assert not out.exists()  # no meta.json to block the rerun
    shutil.copy(setup[1] / "model.safetensors", broken / "model.safetensors")
    collect(config(setup, out, model=str(broken)))
    assert read_records(out) == reference[2]


# ------------------------------------------------------------------------------------------
# Several processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_runtime_changes_nothing_in_the_records(setup, reference, tmp_path):
    """--runtime auto decoded on the lean runtime; transformers' forward writes the same records."""
    summary = collect(config(setup, tmp_path / "hf", runtime="transformers"))
    assert summary.records == reference[1].records and read_records(tmp_path / "hf") == reference[2]


@pytest.mark.slow
def test_two_processes_give_the_same_records_as_one(setup, reference, tmp_path):
    out = tmp_path / "out"
    cfg = config(setup, out, batch_size=2, shard_size=2)
    accelerate = Path(sys.executable).with_name("accelerate")
    # `--multi_gpu` on a machine without GPUs: torchrun starts 2 gloo CPU processes
    # (accelerate's `--cpu` launcher would start only one, without MPI).
    cmd = [str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(free_port()), "-m", "cllm.cli", *cli_args(cfg)]
    env = {**ENV, "CUDA_VISIBLE_DEVICES": "", "ACCELERATE_USE_CPU": "true"}  # gloo, even on a GPU box
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    # a rank's own error comes before the launcher's summary: both go into the message
    causes = [line for line in done.stderr.splitlines() if "rror" in line or "terminate" in line or "what()" in line]
    assert done.returncode == 0, "\n".join(causes[:20]) + "\n" + done.stderr[-2000:]
    names = [p.name for p in list_shards(out)]
    assert any(n.startswith("shard-r000-") for n in names)
    assert any(n.startswith("shard-r001-") for n in names)
    assert read_records(out) == reference[2]
    assert done.stdout.count("collected ") == 1  # only the main process prints


# ------------------------------------------------------------------------------------------
# Pieces


def test_recorder_cuts_states_at_eos_and_drops_repeated_states():
    recorder = TrajectoryRecorder()
    events = [((5, 1, 1, 1), 1, False), ((5, 6, 2, 2), 2, False), ((5, 6, 7, 9), 3, False),
              ((5, 6, 7, 9), 3, True)]  # EOS = 7 at index 2; the last event repeats the state
    for j, (state, committed, converged) in enumerate(events):
        recorder(IterationEvent(row=0, block_index=0, iteration=j, state=state,
                                committed=committed, converged=converged))
    (block,) = recorder.blocks[0]
    assert block.fixed_point == (5, 6, 7) and block_states(block) == [[5, 1, 1], [5, 6, 2], [5, 6, 7]]


def test_prompt_seed_depends_on_seed_and_prompt_only():
    assert prompt_seed(0, "a") == prompt_seed(0, "a")
    assert len({prompt_seed(0, "a"), prompt_seed(1, "a"), prompt_seed(0, "b")}) == 3


def test_degenerate_means_one_token_ten_times_in_a_row():
    assert not is_degenerate([3] * 9 + [4] + [3] * 9)
    assert is_degenerate([1, 2] + [3] * 10 + [4])


def test_augmented_states_are_new_and_closer_to_the_fixed_point():
    fixed = [1, 2, 3, 4, 5, 6]
    states = [[9, 9, 9, 9, 9, 9], [1, 9, 9, 9, 9, 9], [1, 2, 3, 9, 5, 9], fixed]
    # 6 wrong -> fix the leftmost 3; 5 wrong -> fix 2 (a duplicate, skipped); 2 wrong -> fix 1
    assert augment_states(states, fixed) == [[1, 2, 3, 9, 9, 9], [1, 2, 3, 4, 5, 9]]


@pytest.mark.parametrize("bad", [{"block_size": 0}, {"batch_size": -1}, {"guess": "zeros"},
                                 {"dtype": "float8"}, {"max_prompts": 0}, {"runtime": "onnx"}])
def test_bad_options_are_user_errors(bad):
    with pytest.raises(UserError):
        CollectConfig(**bad)


def test_most_blocks_dropped_is_called_a_bad_sign_with_the_share_and_what_it_means():
    from cllm.training.collect import CollectSummary, dropped_warning

    def summary(records: int, dropped: int, loops: int = 0) -> CollectSummary:
        return CollectSummary(out="o", prompts=3, skipped=0, records=records, states=4 * records, augmented_states=0,
                              dropped=dropped, dropped_loops=loops, new_tokens=100, forward_passes=10, seconds=1.0)

    line = dropped_warning(summary(records=3, dropped=237))
    assert line.startswith("237 of 240 blocks (99%) were dropped (237 degenerate)") and "\n" not in line
    assert "bad sign" in line and "loops or repeats" in line and "3 trajectories kept will teach little" in line
    assert "looping" in dropped_warning(summary(records=2, dropped=1, loops=5))
    assert dropped_warning(summary(records=0, dropped=8)).startswith("no trajectory was kept: 8 of 8 blocks")
    assert dropped_warning(summary(records=120, dropped=120)) is None  # half: not most
    assert dropped_warning(summary(records=230, dropped=10)) is None
