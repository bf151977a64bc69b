"""`cllm train` end to end on a tiny Llama and a synthetic language where consistency training
has a clear, learnable effect.

The language: a prompt is six filler words and one content word ``c``; the continuation repeats
``c``. The target is pretrained (here, in seconds) on continuations that switch content words at
random, so it learns to *copy the previous token*: its greedy output repeats ``c``, but a Jacobi
guess (filler words sampled from the prompt) derails it, so plain Jacobi decoding gains almost
nothing. A CLLM must learn to output ``c`` whatever the (wrong) tokens before it: one attention
head's worth, so a hundred steps show it on held-out prompts.
"""

import dataclasses
import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from cllm.cli import main as cli_main
from cllm.core.config import build_config, config_to_dict
from cllm.core.errors import UserError
from cllm.data.trajectories import TrajectoryReader, read_meta, shard_name, write_shard
from cllm.evaluation.heldout import decode_prompts, heldout_prompts
from cllm.modeling import forwards as rows
from cllm.modeling.forwards import checkpointed, enable_checkpointing
from cllm.training import distributed as parallel
from cllm.training.batches import Counts, make_micro_batch
from cllm.training.collect import CollectConfig, collect
from cllm.training.config import TrainConfig
from cllm.training.objective import micro_batch_loss
from cllm.training.run import CHECKPOINT
from cllm.training.train import train

FILLER = [f"r{i}" for i in range(16)]
CONTENT = [f"c{i}" for i in range(8)]
VOCAB = ["<eot>", *FILLER, *CONTENT]
BLOCK, NEW = 8, 16
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
       "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


# ------------------------------------------------------------------------------------------
# The synthetic world (shared with tests/training/test_distill.py)


def make_tokenizer(vocab=VOCAB) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<eot>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eot>", pad_token="<eot>",
                                   bos_token="<eot>")


def random_prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(FILLER) for _ in range(6)) + " " + rng.choice(CONTENT)


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(VOCAB), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=64, tie_word_embeddings=False,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(cfg)


def pretrain_target(directory: Path, tokenizer, *, steps: int = 250, seed: int = 0) -> Path:
    """Teacher-forced training on prompts + continuations that switch content words (p = 1/4)."""
    rng = random.Random(seed)
    model = tiny_llama(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def sample() -> list[int]:
        words = random_prompt(rng).split()
        for _ in range(NEW):
            words.append(rng.choice(CONTENT) if rng.random() < 0.25 else words[-1])
        return tokenizer(" ".join(words))["input_ids"]

    for _ in range(steps):
        x = torch.tensor([sample() for _ in range(32)])
        model(input_ids=x, labels=x).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def write_prompts(path: Path, n: int, seed: int, *, references: bool = True) -> Path:
    rng = random.Random(seed)
    with open(path, "w") as fh:
        for i in range(n):
            p = random_prompt(rng)
            row = {"id": f"s{seed}-{i}", "prompt": p}
            if references:
                row["reference"] = (" " + p.split()[-1]) * NEW
            fh.write(json.dumps(row) + "\n")
    return path


@dataclasses.dataclass
class World:
    root: Path
    target: Path
    tokenizer: PreTrainedTokenizerFast
    train_prompts: Path
    val_prompts: Path
    data: Path


def build_world(root: Path) -> World:
    tokenizer = make_tokenizer()
    target = pretrain_target(root / "target", tokenizer)
    train_prompts = write_prompts(root / "train.jsonl", 48, seed=1)
    val_prompts = write_prompts(root / "val.jsonl", 16, seed=2)
    data = root / "trajectories"
    collect(CollectConfig(model=str(target), prompts=str(train_prompts), out=str(data),
                          block_size=BLOCK, max_new_tokens=NEW, batch_size=16))
    return World(root, target, tokenizer, train_prompts, val_prompts, data)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    return build_world(tmp_path_factory.mktemp("train"))


def config(world: World, out, **overrides) -> TrainConfig:
    values = dict(model=str(world.target), data=str(world.data), out=str(out),
                  eval_prompts=str(world.val_prompts), eval_count=16, eval_max_new_tokens=NEW,
                  batch_size=16, lr=1e-3, label_smoothing=0.0, max_steps=120, eval_interval=60,
                  checkpoint_interval=50)
    values.update(overrides)
    return build_config(TrainConfig, values, {})  # flat options, as on the command line


def cli_args(cfg: TrainConfig) -> list[str]:
    args = ["train"]
    for name, value in config_to_dict(cfg).items():
        if value is not None:
            args += ["--" + name.replace("_", "-"), str(value).lower() if isinstance(value, bool) else str(value)]
    return args


def step_losses(out: Path) -> list[tuple]:
    rows = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["gc"], r["lc"], r["ar"], r["grad_norm"]) for r in rows if "loss" in r]


@pytest.fixture(scope="module")
def trained(world):
    out = world.root / "cllm"
    return out, train(config(world, out))


# ------------------------------------------------------------------------------------------
# What training does


def test_consistency_training_raises_jacobi_tokens_per_forward_on_held_out_prompts(trained):
    _, summary = trained
    before = summary.eval_before["tokens_per_forward"]
    after = summary.eval_after["tokens_per_forward"]
    assert before < 1.4  # plain Jacobi on the target: derailed by the guess
    assert after > before + 0.7, (before, after)
    assert summary.eval_after["ar_loss"] < summary.eval_before["ar_loss"]  # labels kept it an LM


def test_trained_model_decodes_by_jacobi_exactly_as_by_greedy(world, trained):
    out, _ = trained
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    prompts = heldout_prompts(str(world.val_prompts), world.tokenizer, count=16,
                                max_new_tokens=2 * NEW, context=64)
    greedy = decode_prompts(model, prompts, method="greedy", max_new_tokens=2 * NEW, eos_token_id=0)
    for n in (BLOCK, 2 * BLOCK):
        jacobi = decode_prompts(model, prompts, method="jacobi", block_size=n,
                                max_new_tokens=2 * NEW, eos_token_id=0)
        assert jacobi.new_tokens == greedy.new_tokens
        assert jacobi.tokens_per_forward > 1.8


def test_output_dir_is_an_hf_checkpoint_with_config_log_and_model_card(world, trained):
    out, summary = trained
    for name in ("model.safetensors", "config.json", "tokenizer.json", "train_config.json",
                 "train_log.jsonl", "train_summary.json", "MODEL_CARD.md", CHECKPOINT):
        assert (out / name).is_file(), name
    assert json.loads((out / "train_config.json").read_text())["consistency"] == "gc"
    card = (out / "MODEL_CARD.md").read_text()
    info = json.loads((out / "train_summary.json").read_text())
    assert info["base_fingerprint"] in card and str(world.data) in card
    assert f"{summary.eval_after['tokens_per_forward']:.3f}" in card
    evals = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in evals if "eval_tokens_per_forward" in r] == [0, 60, 120]


def test_rerunning_a_finished_run_trains_nothing_more(world, trained):
    out, summary = trained
    log_before = (out / "train_log.jsonl").read_text()
    again = train(config(world, out))
    assert again.finished and again.steps == summary.steps
    assert (out / "train_log.jsonl").read_text() == log_before


# ------------------------------------------------------------------------------------------
# Exactness of the loop: accumulation, resume, Ctrl-C


def test_accumulated_micro_batches_give_the_full_batch_gradient(world):
    cfg = config(world, world.root / "unused", consistency="gc+lc", ar_target="both")
    reader = TrajectoryReader(world.data)
    records = reader.records()[:12]
    draws = torch.rand(12, 64, generator=torch.Generator().manual_seed(0))
    model = tiny_llama(3)

    def gradient(micro: int) -> torch.Tensor:
        mbs = [make_micro_batch(records[i : i + micro], draws[i : i + micro], pad_id=0,
                                block_size=BLOCK, config=cfg) for i in range(0, 12, micro)]
        counts = Counts()
        for mb in mbs:
            counts.add(mb, cfg)
        model.zero_grad()
        for mb in mbs:
            micro_batch_loss(model, mb, counts, cfg, pad_id=0).total.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    full = gradient(12)
    assert counts_are_mixed(records)
    assert torch.allclose(gradient(4), full, atol=1e-6, rtol=1e-4)
    assert torch.allclose(gradient(3), full, atol=1e-6, rtol=1e-4)


def test_gradient_checkpointing_gives_the_same_gradient(world):
    """Checkpointed layers drop the KV cache the shared-prefix forward reuses: the states then get
    their own prefix rows (`rows.forward_prefix_per_block`), and the gradient is the same."""
    cfg = config(world, world.root / "unused", consistency="gc+lc", ar_target="both", states_per_record=3)
    records = TrajectoryReader(world.data).records()[:6]
    draws = torch.rand(6, 64, generator=torch.Generator().manual_seed(1))
    mb = make_micro_batch(records, draws, pad_id=0, block_size=BLOCK, config=cfg)
    counts = Counts()
    counts.add(mb, cfg)
    model = tiny_llama(5).train()

    def gradient() -> torch.Tensor:
        model.zero_grad()
        micro_batch_loss(model, mb, counts, cfg, pad_id=0).total.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    plain = gradient()
    enable_checkpointing(model)
    assert checkpointed(model)  # the second gradient really recomputes its activations
    assert torch.allclose(gradient(), plain, atol=1e-6, rtol=1e-4)


def test_gradient_checkpointing_flag_trains_like_without_it_with_lora(world, tmp_path, monkeypatch):
    per_block = []
    monkeypatch.setattr(rows, "forward_prefix_per_block", spy(rows.forward_prefix_per_block, per_block))
    common = dict(max_steps=4, eval_count=0, lora=True, lora_r=4, lr=3e-3, micro_batch_size=8)
    train(config(world, tmp_path / "plain", **common))
    assert not per_block
    train(config(world, tmp_path / "checkpointed", gradient_checkpointing=True, **common))
    assert per_block  # the flag reached the model's layers
    plain, checkpointed = step_losses(tmp_path / "plain"), step_losses(tmp_path / "checkpointed")
    assert torch.allclose(torch.tensor(checkpointed), torch.tensor(plain), rtol=1e-4, atol=1e-6)


def spy(fn, calls: list):
    def wrapper(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)

    return wrapper


def counts_are_mixed(records) -> bool:
    """The micro-batches differ in counted positions (else any normalisation would pass)."""
    return len({len(r.states) for r in records}) > 1


@pytest.mark.parametrize("overrides", [
    dict(consistency="gc+lc", ar_target="both", distance="jsd"),
    dict(lora=True, lora_dropout=0.1, ar_target="fixed_points", micro_batch_size=8),
    dict(consistency="lc", distance="rkl", dtype="bfloat16", label_smoothing=0.1),
    dict(layout="packed", batch_size=4, micro_batch_size=2, states_per_record=1, state_schedule="progressive",
         consistency_teacher="target", kd_weight=1.0, ar_target="fixed_points"),
], ids=["full-gc+lc-jsd", "lora-dropout", "bf16-lc-rkl", "packed-jacobi-forcing"])
def test_run_stopped_and_resumed_reproduces_the_uninterrupted_losses(world, tmp_path, overrides):
    common = dict(max_steps=14, eval_count=0, checkpoint_interval=5, **overrides)
    train(config(world, tmp_path / "straight", **common))
    stopped = train(config(world, tmp_path / "resumed", stop_at_step=8, **common))
    assert not stopped.finished and stopped.steps == 8
    assert not (tmp_path / "resumed" / "model.safetensors").exists()
    assert torch.load(tmp_path / "resumed" / CHECKPOINT, weights_only=False)["step"] == 8
    train(config(world, tmp_path / "resumed", **common))
    assert step_losses(tmp_path / "resumed") == step_losses(tmp_path / "straight")
    if overrides.get("layout") == "packed":  # a step draws prompts: 48 prompts are 12 steps of 4
        log = [json.loads(line) for line in (tmp_path / "straight" / "train_log.jsonl").read_text().splitlines()]
        assert [r["epoch"] for r in log if r["step"] == 12] == [1.0]


def test_ar_on_text_windows_trains_and_resumes_exactly(world, tmp_path):
    rng = random.Random(0)
    text = tmp_path / "corpus.txt"
    text.write_text(" ".join(rng.choice(VOCAB[1:]) for _ in range(400)))
    common = dict(max_steps=10, eval_count=0, checkpoint_interval=4, ar_text=str(text), ar_text_windows=3,
                  ar_text_length=12, micro_batch_size=8)
    train(config(world, tmp_path / "straight", **common))
    train(config(world, tmp_path / "resumed", stop_at_step=6, **common))
    train(config(world, tmp_path / "resumed", **common))
    assert step_losses(tmp_path / "resumed") == step_losses(tmp_path / "straight")
    plain = train(config(world, tmp_path / "plain", **{**common, "ar_text": None}))
    assert plain.final_loss != step_losses(tmp_path / "straight")[-1][1]  # the windows count
    with pytest.raises(UserError, match="ar-text"):
        train(config(world, tmp_path / "bad", **{**common, "ar_text": str(tmp_path / "missing.txt")}))


def test_accelerate_state_checkpoints_resume_exactly(world, tmp_path, monkeypatch):
    """The checkpoints of FSDP and DeepSpeed (accelerate's save_state in a state-<step> folder,
    last.pt naming it), written and resumed here by one process."""
    sharded = parallel.Engine("single", accelerate_checkpoints=True)
    common = dict(max_steps=10, eval_count=0, checkpoint_interval=3, micro_batch_size=8)
    with monkeypatch.context() as m:
        m.setattr(parallel, "engine_of", lambda accelerator: sharded)
        train(config(world, tmp_path / "straight", **common))
        train(config(world, tmp_path / "resumed", stop_at_step=5, **common))
    saved = torch.load(tmp_path / "resumed" / CHECKPOINT, weights_only=False)
    assert saved["step"] == 5 and saved["accelerate_state"] == "state-00000005" and "trainable" not in saved
    assert [p.name for p in (tmp_path / "resumed" / "checkpoints").glob("state-*")] == ["state-00000005"]
    with pytest.raises(UserError, match="FSDP / DeepSpeed"):  # not mistaken for a DDP checkpoint
        train(config(world, tmp_path / "resumed", **common))
    with monkeypatch.context() as m:
        m.setattr(parallel, "engine_of", lambda accelerator: sharded)
        train(config(world, tmp_path / "resumed", **common))
    assert step_losses(tmp_path / "resumed") == step_losses(tmp_path / "straight")
    lrs = [[r["lr"] for r in map(json.loads, (tmp_path / d / "train_log.jsonl").read_text().splitlines())]
           for d in ("resumed", "straight")]
    assert lrs[0] == lrs[1]  # the scheduler came back too


class Planted:
    """A pickle that runs code when it is loaded: it writes the file `path`."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return exec, (f"open({self.path!r}, 'w').write('ran')",)


def test_a_planted_pickle_in_a_resume_folder_is_refused_and_never_runs(world, tmp_path, monkeypatch):
    common = dict(max_steps=6, eval_count=0, checkpoint_interval=2)
    train(config(world, tmp_path / "run", stop_at_step=2, **common))
    ran = tmp_path / "ran"
    torch.save({"step": Planted(ran), "trainable": {}}, tmp_path / "run" / CHECKPOINT)
    with pytest.raises(UserError, match="objects other than tensors and plain data"):
        train(config(world, tmp_path / "run", **common))
    assert not ran.exists()
    # accelerate's state folder (FSDP, DeepSpeed): its scheduler state is one more pickle
    sharded = parallel.Engine("single", accelerate_checkpoints=True)
    monkeypatch.setattr(parallel, "engine_of", lambda accelerator: sharded)
    train(config(world, tmp_path / "state", stop_at_step=2, **common))
    (planted,) = (tmp_path / "state" / "checkpoints").glob("state-*/custom_checkpoint_0.pkl")
    torch.save(Planted(ran), planted)
    with pytest.raises(UserError, match="refusing to load it"):
        train(config(world, tmp_path / "state", **common))
    assert not ran.exists()


def test_trajectories_outside_the_vocabulary_or_from_another_collect_are_refused_before_any_output(world, tmp_path):
    def data_with(name: str, records, **kwargs) -> Path:
        folder = tmp_path / name
        shutil.copytree(world.data, folder)
        write_shard(folder / shard_name(9, 0), records, completed_prompt_ids=[r.prompt_id for r in records],
                    **kwargs)
        return folder

    meta = read_meta(world.data)
    good = TrajectoryReader(world.data).records()[0]
    foreign = dataclasses.replace(good, prompt_id="foreign", fixed_point=[len(VOCAB) + 5] * len(good.fixed_point),
                                  states=[[len(VOCAB) + 5] * len(good.fixed_point)])
    with pytest.raises(UserError, match="outside --model's vocabulary"):
        train(config(world, tmp_path / "out1", data=str(data_with("ids", [foreign], meta=meta))))
    short = dataclasses.replace(good, prompt_id="short", block_index=1,
                                prefix_ids=good.prefix_ids + good.fixed_point[:4])  # blocks of 4, not 8
    with pytest.raises(UserError, match="not 1 blocks of 8"):
        train(config(world, tmp_path / "out2", data=str(data_with("blocks", [short]))))  # a shard of an older cllm
    other = dataclasses.replace(meta, block_size=4)
    with pytest.raises(UserError, match="written by a collect with other settings"):
        train(config(world, tmp_path / "out3", data=str(data_with("meta", [good], meta=other))))
    assert not any((tmp_path / f"out{i}").exists() for i in (1, 2, 3))


def test_a_first_run_failing_before_its_first_checkpoint_leaves_no_folder_but_the_users_stays(
        world, tmp_path, monkeypatch, capsys):
    """The folder is claimed (marker, train_config.json) before the model loads: a failure after
    that removes the folder the run made, never one that was there before."""
    import cllm.training.train as training
    from cllm.cli import main

    def fails(*args):
        raise UserError("the model does not load")

    monkeypatch.setattr(training, "_build_model", fails)
    out = tmp_path / "new"
    assert main(cli_args(config(world, out, max_steps=2, eval_count=0))) == 2
    assert "the model does not load" in capsys.readouterr().err and not out.exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    assert main(cli_args(config(world, mine, max_steps=2, eval_count=0))) == 2
    assert mine.is_dir()


def test_ctrl_c_saves_a_checkpoint_and_the_rerun_matches_the_uninterrupted_run(world, tmp_path):
    cfg = config(world, tmp_path / "run", max_steps=80, eval_count=0, checkpoint_interval=1000)
    log = tmp_path / "run" / "train_log.jsonl"
    with open(tmp_path / "stderr.txt", "wb") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "cllm.cli", *cli_args(cfg)], env=ENV,
                                stdout=subprocess.DEVNULL, stderr=stderr)
        try:
            deadline = time.monotonic() + 120
            while proc.poll() is None and time.monotonic() < deadline:
                if log.exists() and len(log.read_text().splitlines()) >= 2:
                    break
                time.sleep(0.01)
            proc.send_signal(signal.SIGINT)
            rc = proc.wait(timeout=60)
        finally:
            proc.kill()
    assert rc == 130, (tmp_path / "stderr.txt").read_text()[-1500:]
    saved = torch.load(tmp_path / "run" / CHECKPOINT, weights_only=False)["step"]
    said = (tmp_path / "stderr.txt").read_text().strip().splitlines()[-1]
    assert said == f"cllm train: stopped at step {saved}; run the same command again to resume", said
    assert 2 <= saved < 80
    assert not (tmp_path / "run" / "model.safetensors").exists()
    train(cfg)
    train(dataclasses.replace(cfg, out=str(tmp_path / "straight")))
    assert step_losses(tmp_path / "run") == step_losses(tmp_path / "straight")


# ------------------------------------------------------------------------------------------
# LoRA, several processes


def test_lora_run_merges_the_adapter_into_an_ordinary_checkpoint(world, tmp_path):
    out = tmp_path / "lora"
    train(config(world, out, lora=True, lora_r=4, max_steps=10, eval_count=0, lr=3e-3))
    assert not (out / "adapter_config.json").exists()
    model = AutoModelForCausalLM.from_pretrained(out)
    base = AutoModelForCausalLM.from_pretrained(world.target)
    merged, original = model.state_dict(), base.state_dict()
    assert set(merged) == set(original)  # no lora_A / lora_B left
    changed = [k for k in merged if not torch.equal(merged[k], original[k])]
    assert any("q_proj" in k for k in changed) and "model.embed_tokens.weight" not in changed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


EXAMPLES = Path(__file__).parents[2] / "examples" / "accelerate"


@pytest.mark.slow
def test_two_processes_train_like_one_and_only_rank_0_writes(world, tmp_path):
    """The shipped DDP config, 2 gloo CPU processes, 8 records each per step, against one process
    accumulating two micro-batches of 8: the same losses, gradient norms and exported weights."""
    cfg = config(world, tmp_path / "two", max_steps=6, eval_count=4, eval_interval=6, checkpoint_interval=4,
                 consistency="gc+lc", ar_target="both")
    accelerate = Path(sys.executable).with_name("accelerate")
    cmd = [str(accelerate), "launch", "--config_file", str(EXAMPLES / "ddp.yaml"), "--num_processes", "2",
           "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(free_port()), "-m", "cllm.cli", *cli_args(cfg)]
    env = {**ENV, "CUDA_VISIBLE_DEVICES": "", "ACCELERATE_USE_CPU": "true"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("trained:") == 1  # rank 0 alone prints
    summary = json.loads((tmp_path / "two" / "train_summary.json").read_text())
    assert (summary["processes"], summary["engine"]) == (2, "ddp")
    # the same global batches in one process (two accumulated micro-batches): the same losses
    accumulating = dataclasses.replace(cfg.recipe, micro_batch_size=8)
    train(dataclasses.replace(cfg, out=str(tmp_path / "one"), recipe=accumulating))
    two, one = step_losses(tmp_path / "two"), step_losses(tmp_path / "one")
    assert [r[0] for r in two] == [r[0] for r in one] == list(range(1, 7))
    assert torch.allclose(torch.tensor(two)[:, 1:], torch.tensor(one)[:, 1:], rtol=1e-4, atol=1e-6)
    weights = [AutoModelForCausalLM.from_pretrained(tmp_path / d).state_dict() for d in ("two", "one")]
    for name, w in weights[0].items():
        assert torch.allclose(w, weights[1][name], rtol=1e-4, atol=1e-5), name
    # rank 0 alone writes: the same files, one log record per step and evaluation, not two
    files = [sorted(p.relative_to(tmp_path / d).as_posix() for p in (tmp_path / d).rglob("*")) for d in ("two", "one")]
    assert files[0] == files[1]
    log = [json.loads(line) for line in (tmp_path / "two" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [0, 1, 2, 3, 4, 5, 6]


# ------------------------------------------------------------------------------------------
# Bad input


def foreign_model(world: World, kind: str) -> Path:
    directory = world.root / f"foreign-{kind}"
    if not directory.exists():
        if kind == "tokenizer":  # the same weights, words in another order
            tiny = AutoModelForCausalLM.from_pretrained(world.target)
            tokenizer = make_tokenizer(["<eot>", *CONTENT, *FILLER])
        else:
            tiny, tokenizer = tiny_llama(seed=7), world.tokenizer
        tiny.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("case, message", [
    ("missing data", "trajectory directory not found"),
    ("not trajectories", "no meta.json"),
    ("other model", "collected with another model"),
    ("other tokenizer", "another tokenizer"),
    ("no labels", "no ground-truth labels"),
    ("bad option", "consistency must be one of"),
    ("foreign out", "did not write"),
])
def test_bad_input_is_a_one_line_error(world, tmp_path, capsys, case, message):
    overrides = {}
    if case == "missing data":
        overrides["data"] = str(tmp_path / "nowhere")
    elif case == "not trajectories":
        (tmp_path / "empty").mkdir()
        overrides["data"] = str(tmp_path / "empty")
    elif case in ("other model", "other tokenizer"):
        overrides["model"] = str(foreign_model(world, case.split()[1]))
    elif case == "no labels":
        prompts = write_prompts(tmp_path / "bare.jsonl", 16, seed=3, references=False)
        collect(CollectConfig(model=str(world.target), prompts=str(prompts), out=str(tmp_path / "bare"),
                              block_size=BLOCK, max_new_tokens=NEW, batch_size=16))
        overrides["data"] = str(tmp_path / "bare")
        overrides["ar_target"] = "labels"  # asked for explicitly (auto falls back to the fixed points)
    elif case == "foreign out":
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "notes.txt").write_text("mine")
    if case == "bad option":
        with pytest.raises(UserError, match=message):
            config(world, tmp_path / "out", consistency="xc")
        args = cli_args(config(world, tmp_path / "out"))
        args += ["--micro-batch-size", "5"]  # batch-size 16 is not a multiple of it
        capsys.readouterr()
        assert cli_main(args) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("cllm train: error:") and "\n" not in err and "micro-batch-size" in err
        return
    cfg = config(world, tmp_path / "out", **overrides)
    with pytest.raises(UserError, match=message):
        train(cfg)
    capsys.readouterr()
    assert cli_main(cli_args(cfg)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("cllm train: error:") and "\n" not in err and message in err


def test_fewer_records_than_the_batch_size_train_as_one_batch_with_a_note(world, tmp_path, caplog):
    """A user's first small data set: --batch-size larger than the records is cut to all of them
    (a note says so), not refused; the saved config says what ran."""
    from cllm.training.train import fit_batch_size

    cfg = config(world, tmp_path / "out", batch_size=4096, micro_batch_size=1024, max_steps=2, eval_count=0)
    records = len(TrajectoryReader(world.data).records())
    with caplog.at_level(logging.INFO, logger="cllm"):
        summary = train(cfg)
    assert summary.finished and summary.steps == 2
    assert f"holds {records} records, fewer than batch-size 4096: each step uses all {records} as one batch" \
        in caplog.text
    saved = json.loads((tmp_path / "out" / "train_config.json").read_text())
    assert (saved["batch_size"], saved["micro_batch_size"]) == (records, None)
    # several processes: a multiple of them; enough records: unchanged
    assert fit_batch_size(cfg, 7, processes=2).recipe.batch_size == 6
    assert fit_batch_size(cfg, 5000).recipe.batch_size == 4096
    with pytest.raises(UserError, match="fewer than the 2 processes"):
        fit_batch_size(cfg, 1, processes=2)


# ------------------------------------------------------------------------------------------
# Training length, the plan said at the start, inputs checked before anything long


def test_epochs_and_max_steps_are_one_or_the_other(world, tmp_path, capsys):
    with pytest.raises(UserError, match="not both"):
        config(world, tmp_path / "out", epochs=2)  # config() gives --max-steps
    args = cli_args(config(world, tmp_path / "out")) + ["--epochs", "2"]
    assert cli_main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("cllm train: error:") and "\n" not in err and "--max-steps" in err
    assert not (tmp_path / "out").exists()


def test_without_a_step_count_one_epoch_of_the_records_runs(world, tmp_path):
    summary = train(config(world, tmp_path / "epoch", max_steps=None, eval_count=0, batch_size=16))
    records = len(TrajectoryReader(world.data).records())
    assert summary.finished and summary.total_steps == records // 16 == summary.steps


def test_a_run_written_before_epochs_and_max_steps_were_exclusive_resumes(world, tmp_path):
    """Such a run's checkpoint carries epochs beside max_steps (which then decided): resuming it
    with the same --max-steps is the same run."""
    common = dict(max_steps=6, eval_count=0, checkpoint_interval=3)
    train(config(world, tmp_path / "straight", **common))
    train(config(world, tmp_path / "old", stop_at_step=3, **common))
    saved = torch.load(tmp_path / "old" / CHECKPOINT, weights_only=False)
    saved["config"]["epochs"] = 1  # what the old default wrote
    torch.save(saved, tmp_path / "old" / CHECKPOINT)
    train(config(world, tmp_path / "old", **common))
    assert step_losses(tmp_path / "old") == step_losses(tmp_path / "straight")
    with pytest.raises(UserError, match="holds a run of --max-steps 6, not 2 epochs"):
        train(config(world, tmp_path / "old", **{**common, "max_steps": None, "epochs": 2}))


def test_train_says_what_it_will_do_and_how_long_the_rest_takes(world, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="cllm"):
        train(config(world, tmp_path / "out", max_steps=4, eval_count=4, eval_interval=2))
    lines = [r.getMessage() for r in caplog.records]
    records = len(TrajectoryReader(world.data).records())
    plan = next(line for line in lines if "steps per epoch" in line)
    assert f"{records} records, batch size 16: {records // 16} steps per epoch, --max-steps 4" in plan
    assert any(f"held-out evaluation on {world.val_prompts} (its first 4 prompts at most)" in line for line in lines)
    eta = next(line for line in lines if "to go" in line)
    assert eta.startswith("step 1 took") and "(3 steps, 2 evaluations)" in eta


def test_without_eval_prompts_outside_the_stdlib_domain_there_is_no_evaluation_and_a_line_says_so(
        world, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="cllm"):
        summary = train(config(world, tmp_path / "out", eval_prompts=None, max_steps=2))
    assert summary.eval_before is None and summary.eval_after is None
    (line,) = [r.getMessage() for r in caplog.records if "no --eval-prompts" in r.getMessage()]
    assert str(world.train_prompts) in line and "pass a JSONL of held-out prompts" in line
    assert json.loads((tmp_path / "out" / "train_config.json").read_text())["eval_prompts"] is None


@pytest.mark.parametrize("case, message", [
    ("ar text", "--ar-text"),
    ("eval prompts", "not found"),
    ("teacher", "model directory not found"),
])
def test_inputs_are_checked_before_the_model_is_built(world, tmp_path, monkeypatch, case, message):
    overrides = {"ar text": dict(ar_text=str(tmp_path / "missing.txt")),
                 "eval prompts": dict(eval_prompts=str(tmp_path / "missing.jsonl")),
                 "teacher": dict(teacher=str(tmp_path / "nowhere"), kd_weight=1.0)}[case]
    monkeypatch.setattr("cllm.training.train.load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(UserError, match=message):
        train(config(world, tmp_path / "out", **overrides))
    assert not (tmp_path / "out").exists()


def test_the_summary_says_why_the_ar_validation_loss_is_blank():
    from cllm.training.train import TrainSummary

    def summary(ar_loss):
        return TrainSummary(out="runs/x", finished=True, steps=4, total_steps=4, records=8, train_time_s=3.0,
                            final_loss=1.0, eval_before={"tokens_per_forward": 1.1, "ar_loss": ar_loss},
                            eval_after={"tokens_per_forward": 1.3, "ar_loss": ar_loss}).lines()[-1]

    assert summary(None).endswith("AR validation loss - (none of the held-out prompts has a `reference` to score)")
    assert summary(2.5).endswith("AR validation loss 2.500 -> 2.500")
