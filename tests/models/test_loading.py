"""Model/tokenizer loading: local checkpoints, clear errors, fingerprints."""

import json
import re

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from cllm.core.errors import UserError
from cllm.models import fingerprint, load_model, load_tokenizer, resolve_dtype


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


def test_load_model_from_local_dir_in_eval_mode_and_dtype(tmp_path):
    tiny_llama().save_pretrained(tmp_path / "m")
    model = load_model(tmp_path / "m", dtype="bfloat16")
    assert not model.training
    assert next(model.parameters()).dtype == torch.bfloat16


def test_missing_dir_and_non_checkpoint_dir_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_model(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no config.json"):
        load_model(tmp_path / "empty")


def test_unknown_dtype_is_user_error():
    with pytest.raises(UserError, match="unknown dtype"):
        resolve_dtype("float8")


def test_fingerprint_tells_models_apart_and_is_stable(tmp_path):
    tiny_llama(0).save_pretrained(tmp_path / "a")
    tiny_llama(1).save_pretrained(tmp_path / "b")
    assert fingerprint(tmp_path / "a") == fingerprint(tmp_path / "a")
    assert fingerprint(tmp_path / "a") != fingerprint(tmp_path / "b")
    assert fingerprint(tiny_llama(0)) != fingerprint(tiny_llama(1))


def _spy_hub(monkeypatch, error: Exception | None = None) -> list[str]:
    """Record every hub look-up (and fail it with `error`); the hub is treated as online."""
    import huggingface_hub

    from cllm.models import loading as models

    calls: list[str] = []

    def model_info(repo_id, *args, **kwargs):
        calls.append(repo_id)
        if error is not None:
            raise error
        return object()

    models._hub_problem.cache_clear()
    monkeypatch.setattr(models, "_hub_offline", lambda: False)
    monkeypatch.setattr(huggingface_hub, "model_info", model_info)
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda *a, **k: None)
    return calls


@pytest.mark.parametrize("name", ["runs/nothing", "./nothing", "nothing", "a/b/c", "~/nothing/model"])
def test_a_missing_local_path_fails_at_once_without_asking_the_hub(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()  # `runs/nothing` beside a runs/ folder is a local path
    calls = _spy_hub(monkeypatch)
    with pytest.raises(UserError, match=f"^model directory not found: {re.escape(name)}$"):
        load_model(name)
    assert calls == []


def test_a_hub_id_is_looked_up_once_and_an_unreachable_hub_is_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    calls = _spy_hub(monkeypatch, error=ConnectionError("Name or service not known"))
    with pytest.raises(UserError, match="model directory not found: owner/name, and the hub could not be reached"):
        load_model("owner/name")
    with pytest.raises(UserError):
        load_tokenizer("owner/name")
    assert calls == ["owner/name"]  # one request, remembered: no retries


def test_a_hub_id_the_hub_has_is_handed_to_transformers(tmp_path, monkeypatch):
    from cllm.models import resolve_model_path

    monkeypatch.chdir(tmp_path)
    calls = _spy_hub(monkeypatch)
    assert resolve_model_path("owner/name") == "owner/name" and calls == ["owner/name"]


def test_offline_a_hub_id_that_is_not_cached_fails_without_a_request(tmp_path, monkeypatch):
    from cllm.models import loading as models

    monkeypatch.chdir(tmp_path)
    calls = _spy_hub(monkeypatch)
    monkeypatch.setattr(models, "_hub_offline", lambda: True)
    with pytest.raises(UserError, match="nor a cached hub model"):
        load_model("owner/name")
    assert calls == []


def test_a_mistyped_shipped_name_suggests_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match="did you mean the shipped model stdlib-coder"):
        load_model("stdlib-codr")


@pytest.mark.parametrize(("torch_v", "tf_v", "fine"), [
    ("2.13.0+cpu", "5.24.0", True), ("2.6.0", "5.0.0", True), ("2.5.1+cu121", "5.24.0", False),
    ("2.5.1", "4.57.6", True), ("2.1.0", "4.56.0", True), ("2.0.1", "4.56.0", False)])
def test_a_torch_that_transformers_would_disable_is_named_in_one_line(torch_v, tf_v, fine):
    from cllm.core.versions import version_problem

    problem = version_problem(torch_v, tf_v)
    assert (problem is None) == fine
    if not fine:
        assert torch_v in problem and tf_v in problem and "\n" not in problem
    if torch_v.startswith("2.5") and not fine:
        assert "transformers>=4.56,<5" in problem


def test_load_for_decoding_brings_the_table_and_decodes_as_the_three_calls_and_the_cli(tmp_path):
    """One call (model, tokenizer, draft table, the CLI's setting) against the README's three
    calls with the setting spelled out, and against `cllm generate`'s decode: same tokens, same
    forward passes (the count depends on the setting and the table)."""
    from cllm.cli import main
    from cllm.commands.generate import GenerateConfig
    from cllm.decoding import RECOMMENDED, jacobi_decode
    from cllm.models import load_draft_table, load_for_decoding
    from cllm.serving.completion import TextCodec, complete
    from tests.bench.test_bench import make_tiny_setup

    paths = make_tiny_setup(tmp_path)
    model_dir = str(paths["cllm"])
    assert main(["drafts", "--model", model_dir, "--prompts", str(paths["val"]), "--max-new-tokens", "24",
                 "--min-count", "1", "--min-share", "0.1"]) == 0
    fast = load_for_decoding(model_dir)
    assert fast.draft_table is not None and fast.settings["draft_table"] is fast.draft_table
    assert {k: v for k, v in fast.settings.items() if k != "draft_table"} == dict(RECOMMENDED)
    model, tok, table = load_model(model_dir), load_tokenizer(model_dir), load_draft_table(model_dir)
    cli = GenerateConfig(model=model_dir, prompt="x")
    for text in ("def add(a, b):\n", "class Point:\n    def"):
        ids = tok(text, return_tensors="pt").input_ids
        seed = dict(generator=torch.Generator().manual_seed(0))  # the guesses' seed, as the CLI's default
        stop = TextCodec(tok).eos_ids  # the eos and end-of-turn ids (generation_config.json's), as the CLI stops at
        one = jacobi_decode(fast.model, ids, max_new_tokens=40, eos_token_id=stop,
                            **seed, **fast.settings)
        seed = dict(generator=torch.Generator().manual_seed(0))
        three = jacobi_decode(model, ids, max_new_tokens=40, eos_token_id=stop, block_size=4, recycle=8,
                              recycle_width=16, recycle_min_ngram=2, recycle_budget=24, draft_table=table, **seed)
        generated = complete(model, TextCodec(tok), ids[0].tolist(), cli.params().__class__(
            **{**cli.params().__dict__, "max_new_tokens": 40}), draft_table=table)
        assert one.new_tokens == three.new_tokens and one.new_tokens[0] == generated.tokens
        assert one.forward_passes == three.forward_passes == generated.forward_passes
    assert load_for_decoding(model_dir, draft_table="none").settings["draft_table"] is None


def test_load_for_decoding_opens_the_runtime_asked_for_and_refuses_one_that_cannot_run_the_model(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from cllm.decoding import greedy_decode
    from cllm.models import load_for_decoding
    from tests.bench.test_bench import make_tiny_setup

    model_dir = str(make_tiny_setup(tmp_path)["target"])
    auto, hf = load_for_decoding(model_dir), load_for_decoding(model_dir, runtime="transformers")
    assert (auto.model.name, hf.model.name) == ("lean", "transformers") and auto.module is not None
    assert "auto: a llama model" in auto.model.describe() and hf.model.describe().endswith("(asked for)")
    ids = auto.tokenizer("def add(a, b):\n", return_tensors="pt").input_ids
    assert (greedy_decode(auto.model, ids, max_new_tokens=16).new_tokens
            == greedy_decode(hf.model, ids, max_new_tokens=16).new_tokens)
    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(vocab_size=320, n_embd=32, n_layer=1, n_head=2)).save_pretrained(gpt2)
    auto.tokenizer.save_pretrained(gpt2)
    assert load_for_decoding(gpt2).model.name == "transformers"  # auto: the lean runtime cannot run it
    with pytest.raises(UserError, match="--runtime lean: the lean runtime cannot run this model"):
        load_for_decoding(gpt2, runtime="lean")


def _damage(path, how: str) -> None:
    data = path.read_bytes()
    path.write_bytes({"garbage": b"\x00garbage" * 64, "truncated": data[: len(data) // 2],
                      "not json": b"{not json", "wrong json": b'{"a": 1}'}[how])


@pytest.mark.parametrize("file, how, loader", [
    ("model.safetensors", "garbage", "model"),
    ("model.safetensors", "truncated", "model"),
    ("config.json", "not json", "model"),
    ("tokenizer.json", "not json", "tokenizer"),
    ("tokenizer.json", "wrong json", "tokenizer"),
    ("drafts/ngram.safetensors", "garbage", "table"),
])
def test_a_damaged_checkpoint_file_is_one_line_naming_it(tmp_path, file, how, loader):
    from cllm.models import load_draft_table
    from tests.commands.test_generate import save_tiny_model

    directory = save_tiny_model(tmp_path / "m")
    (directory / "drafts").mkdir()
    (directory / "drafts" / "ngram.safetensors").write_bytes(b"placeholder")
    _damage(directory / file, how)
    load = {"model": load_model, "tokenizer": load_tokenizer, "table": load_draft_table}[loader]
    with pytest.raises(UserError) as info:
        load(directory)
    message = str(info.value)
    assert len(message.splitlines()) == 1 and file.split("/")[-1] in message, message


def test_generate_and_serve_on_damaged_weights_exit_with_one_line_naming_the_file(tmp_path, capsys):
    from cllm.cli import main
    from tests.commands.test_generate import save_tiny_model

    directory = save_tiny_model(tmp_path / "m")
    _damage(directory / "model.safetensors", "garbage")
    capsys.readouterr()  # the save's progress bar
    for command in (["generate", "--prompt", "x"], ["serve", "--port", "0"]):
        assert main([*command, "--model", str(directory)]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "model.safetensors is damaged" in err, err


def test_a_config_transformers_cannot_use_is_blamed_on_the_config_not_the_tokenizer(tmp_path, capsys):
    from cllm.cli import main
    from tests.commands.test_generate import save_tiny_model

    directory = save_tiny_model(tmp_path / "m")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "dtype": "float128"}))
    capsys.readouterr()  # the save's progress bar
    with pytest.raises(UserError, match="cannot use the model's config .*config.json: .*float128"):
        load_tokenizer(directory)  # transformers' tokenizer loader reads the config too
    assert main(["generate", "--model", str(directory), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "config.json" in err and "tokenizer" not in err, err


def test_a_model_folder_without_a_tokenizer_is_one_line_naming_it(tmp_path, capsys):
    """transformers 5 would build an empty tokenizer from it, and every prompt would encode to
    nothing (collect: 0 records, generate: "the prompt encodes to no tokens")."""
    from cllm.cli import main

    directory = tmp_path / "m"
    tiny_llama().save_pretrained(directory)
    with pytest.raises(UserError) as info:
        load_tokenizer(directory)
    message = str(info.value)
    assert len(message.splitlines()) == 1 and message.startswith(f"{directory} has no tokenizer"), message
    assert "save_pretrained" in message
    capsys.readouterr()
    assert main(["generate", "--model", str(directory), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and f"{directory} has no tokenizer" in err, err


def test_a_tokenizer_with_an_empty_vocabulary_is_one_line_naming_the_folder(tmp_path):
    """A tokenizer_config.json alone (no vocabulary files): transformers 5 builds the tokenizer
    class it names with nothing in it but its special tokens."""
    directory = tmp_path / "m"
    tiny_llama().save_pretrained(directory)
    (directory / "tokenizer_config.json").write_text('{"tokenizer_class": "Qwen2Tokenizer"}')
    with pytest.raises(UserError) as info:
        load_tokenizer(directory)
    message = str(info.value)
    assert len(message.splitlines()) == 1 and message.startswith(f"{directory} has a tokenizer with an empty "
                                                                  "vocabulary"), message


def test_a_tokenizer_class_this_transformers_lacks_is_blamed_on_tokenizer_config(tmp_path, monkeypatch):
    """A tokenizer saved by transformers 5 (class TokenizersBackend) read by transformers 4: with
    a tokenizer.json the class is not used (the file is read as it is); without one, transformers
    fails on it, and the failure is said to be in tokenizer_config.json."""
    import json

    from tokenizers import Tokenizer

    from cllm.models import loading as models
    from tests.commands.test_generate import save_tiny_model

    directory = save_tiny_model(tmp_path / "m")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "FromTheFuture"}))
    raw = Tokenizer.from_file(str(directory / "tokenizer.json"))
    assert load_tokenizer(directory).encode("def f(x):", add_special_tokens=False) == raw.encode("def f(x):").ids
    (directory / "tokenizer.json").unlink()  # vocabulary files only: the class the config names builds them
    (directory / "vocab.json").write_text("{}")

    class Transformers4:  # what AutoTokenizer 4.x raises on a class name it does not know
        @staticmethod
        def from_pretrained(*args, **kwargs):
            raise ValueError("Tokenizer class FromTheFuture does not exist or is not currently imported.")

    monkeypatch.setattr(models, "AutoTokenizer", Transformers4)
    with pytest.raises(UserError) as info:
        load_tokenizer(directory)
    message = str(info.value)
    assert len(message.splitlines()) == 1, message
    assert f"{directory / 'tokenizer_config.json'} names the tokenizer class 'FromTheFuture'" in message, message
    assert "tokenizer.json" not in message.replace("tokenizer_config.json", ""), message


@pytest.mark.parametrize("damage", ["missing", "unexpected", "shape"])
def test_a_checkpoint_that_lacks_a_weight_is_refused_not_filled_with_random_weights(tmp_path, capsys, damage):
    from safetensors.torch import load_file, save_file

    from cllm.cli import main
    from tests.commands.test_generate import save_tiny_model

    directory = save_tiny_model(tmp_path / "m")
    weights = load_file(directory / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    if damage == "missing":
        del weights[name]
    elif damage == "unexpected":
        weights["model.layers.9.extra.weight"] = torch.zeros(3)
        name = "model.layers.9.extra.weight"
    else:
        weights[name] = weights[name][:, :-1].contiguous()
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError) as info:
        load_model(directory)
    message = str(info.value)
    assert len(message.splitlines()) == 1 and name in message and "random weights" in message, message
    capsys.readouterr()
    for command in (["generate", "--prompt", "x"], ["serve", "--port", "0"]):
        assert main([*command, "--model", str(directory)]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and name in err, err
    if damage == "missing":  # a user who knows the checkpoint is partial can still take it
        assert load_model(directory, allow_missing=True) is not None


def _qwen2_folder_with_gpt2_split(directory):
    """A tiny qwen2-config model whose tokenizer.json is a byte-level BPE with GPT-2's split
    (digit runs kept whole), unlike the Qwen2 tokenizer's own pre-tokenizer (one digit a piece,
    NFC); its tokenizer_config.json names Qwen2Tokenizer, as a Qwen2 fine-tune's would."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tests.tiny import CODE_TEXTS

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, min_frequency=1, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CODE_TEXTS * 5 + ["x = 12345 + 2024\n", "total = 99 * 2024\n"], trainer=trainer)
    directory.mkdir(parents=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "unk_token": None, "model_max_length": 4096,
        "chat_template": "{% for m in messages %}{{ m['content'] }}<|endoftext|>{% endfor %}"}))
    config = Qwen2Config(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    Qwen2ForCausalLM(config).save_pretrained(directory)
    return directory


TEXTS_TO_SPLIT = ["x = 12345 + 2024", "total = 99 * 2024\n", "  def f(a, b):\n\treturn a+b  ",
                  "caf\u0065\u0301 \u00e9 \u2126", "<|endoftext|>x = 1<|endoftext|>"]


def test_the_tokenizer_encodes_as_the_folders_tokenizer_json_and_its_save_is_the_same_tokenizer(tmp_path):
    from tokenizers import Tokenizer

    from cllm.models import save_tokenizer, tokenizer_fingerprint

    source = _qwen2_folder_with_gpt2_split(tmp_path / "qwen2-custom")
    raw = Tokenizer.from_file(str(source / "tokenizer.json"))
    assert raw.encode("x = 12345 + 2024").ids[:4] != raw.encode("x = 1").ids  # the case under test: digits kept whole
    tokenizer = load_tokenizer(source)
    for text in TEXTS_TO_SPLIT:
        assert tokenizer.encode(text, add_special_tokens=False) == raw.encode(text).ids, text
        assert tokenizer(text)["input_ids"] == raw.encode(text).ids, text
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.chat_template is not None

    out = tmp_path / "trained"
    out.mkdir()
    save_tokenizer(tokenizer, out)  # what `cllm train` and `cllm medusa --joint` write beside the weights
    saved = load_tokenizer(out)
    for text in TEXTS_TO_SPLIT:
        assert saved.encode(text, add_special_tokens=False) == raw.encode(text).ids, text
    assert tokenizer_fingerprint(out) == tokenizer_fingerprint(source)
    assert saved.chat_template == tokenizer.chat_template


def test_a_tokenizer_changed_in_memory_is_saved_as_it_now_is(tmp_path):
    from cllm.models import save_tokenizer

    source = _qwen2_folder_with_gpt2_split(tmp_path / "qwen2-custom")
    tokenizer = load_tokenizer(source)
    tokenizer.add_tokens(["<extra>"])
    out = tmp_path / "out"
    save_tokenizer(tokenizer, out)
    saved = load_tokenizer(out)
    for text in [*TEXTS_TO_SPLIT, "a <extra> b"]:
        assert saved.encode(text, add_special_tokens=False) == tokenizer.encode(text, add_special_tokens=False), text
