"""`cllm import FILE.gguf --out DIR` (`cllm.models.from_gguf`): a tiny Llama built here, written to
GGUF f32 by `cllm.runtime.gguf.write_gguf`, imported, and loaded back with `load_model` /
`load_tokenizer` gives the same logits and the same token ids as the model it came from. The
bad inputs and the output-folder rule need no `gguf` package; what reads a GGUF is marked
`llamacpp` (`.venv-llamacpp`). One slow test imports the real SmolLM2-135M-Instruct Q4_1 (make
smollm2) and checks its greedy next token against transformers' own reading of the file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from cllm.cli import main
from cllm.commands.import_gguf import Config, run
from cllm.core.outputs import MARKER
from cllm.data.tokenizer import train_tokenizer
from cllm.models import from_gguf, load_model, load_tokenizer
from cllm.runtime.gguf import write_gguf
from tests.reference import needs, reference
from tests.tiny import CODE_TEXTS

VOCAB = 320
TEXTS = ["def add(a, b):\n    return a + b\n", "class Point:", "    self.x = x  # é ✓", "import os\nx = [1, 2]"]


def one_line_error(capsys, argv: list[str]) -> str:
    capsys.readouterr()  # what came before
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err.strip()


@pytest.fixture
def fake_gguf(tmp_path) -> Path:
    """A file that starts as a GGUF does (the checks before reading look no further)."""
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"GGUF" + bytes(60))
    return path


def test_a_missing_file_is_one_line(tmp_path, capsys):
    err = one_line_error(capsys, ["import", str(tmp_path / "none.gguf"), "--out", str(tmp_path / "out")])
    assert err == f"cllm import: error: no GGUF file at {tmp_path / 'none.gguf'}"
    assert not (tmp_path / "out").exists()


def test_a_file_that_is_not_a_gguf_is_one_line(tmp_path, capsys):
    text = tmp_path / "model.gguf"
    text.write_text("not a model\n")
    err = one_line_error(capsys, ["import", str(text), "--out", str(tmp_path / "out")])
    assert err == f"cllm import: error: {text} is not a GGUF file (it does not start with GGUF)"


def test_a_folder_given_as_the_gguf_is_one_line(tmp_path, capsys):
    err = one_line_error(capsys, ["import", str(tmp_path), "--out", str(tmp_path / "out")])
    assert err == f"cllm import: error: {tmp_path} is a folder, not a GGUF file"


def test_no_file_or_no_out_says_what_is_required(tmp_path, fake_gguf, capsys):
    assert "cllm import FILE.gguf --out DIR" in one_line_error(capsys, ["import", "--out", str(tmp_path / "o")])
    assert "--out DIR is required" in one_line_error(capsys, ["import", str(fake_gguf)])


def test_a_folder_of_the_users_files_is_refused_without_force(tmp_path, fake_gguf, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    err = one_line_error(capsys, ["import", str(fake_gguf), "--out", str(out)])
    assert "holds files cllm import did not write" in err and "--force" in err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_the_gguf_file_itself_is_never_the_output(fake_gguf, capsys):
    err = one_line_error(capsys, ["import", str(fake_gguf), "--out", str(fake_gguf), "--force"])
    assert err == f"cllm import: error: --out {fake_gguf} is a file, not a folder"


# ---------------------------------------------------------------------------- with gguf


def tiny_llama(seed: int, *, tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         rms_norm_eps=1e-5, initializer_range=0.1, tie_word_embeddings=tied, bos_token_id=0,
                         eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(CODE_TEXTS * 3, vocab_size=VOCAB, min_frequency=1)


def write_tiny_gguf(path: Path, tokenizer, *, seed: int = 0, tied: bool = False) -> LlamaForCausalLM:
    model = tiny_llama(seed, tied=tied)
    write_gguf(model, tokenizer, path, out_type="f32", name="tiny")
    return model


def import_file(gguf: Path, out: Path, **options) -> int:
    return run(Config(file=str(gguf), out=str(out), **options))


def logits(model, tokenizer, text: str) -> torch.Tensor:
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        return model(ids).logits[0]


@pytest.mark.llamacpp
@pytest.mark.parametrize("tied", [False, True])
def test_the_imported_folder_gives_the_original_models_logits_in_float32(tmp_path, tokenizer, tied):
    original = write_tiny_gguf(tmp_path / "tiny.gguf", tokenizer, seed=1, tied=tied)
    assert import_file(tmp_path / "tiny.gguf", tmp_path / "ckpt") == 0
    loaded = load_model(tmp_path / "ckpt")  # refuses a checkpoint with a weight missing or extra
    assert loaded.config.tie_word_embeddings == tied
    for text in TEXTS:
        torch.testing.assert_close(logits(loaded, tokenizer, text), logits(original, tokenizer, text),
                                   rtol=0, atol=1e-5)


@pytest.mark.llamacpp
def test_a_tied_embedding_is_written_once(tmp_path, tokenizer):
    write_tiny_gguf(tmp_path / "tiny.gguf", tokenizer, tied=True)
    import_file(tmp_path / "tiny.gguf", tmp_path / "ckpt")
    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names


@pytest.mark.llamacpp
def test_the_imported_tokenizer_encodes_as_the_original(tmp_path, tokenizer):
    write_tiny_gguf(tmp_path / "tiny.gguf", tokenizer)
    import_file(tmp_path / "tiny.gguf", tmp_path / "ckpt")
    imported = load_tokenizer(tmp_path / "ckpt")
    for text in TEXTS:
        assert imported(text).input_ids == tokenizer(text).input_ids, text
        assert imported.decode(tokenizer(text).input_ids) == text


@pytest.mark.llamacpp
def test_the_folder_is_an_ordinary_checkpoint_with_the_ggufs_end_ids(tmp_path, tokenizer):
    write_tiny_gguf(tmp_path / "tiny.gguf", tokenizer)
    import_file(tmp_path / "tiny.gguf", tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    generation = json.loads((tmp_path / "ckpt" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tokenizer.eos_token_id
    readme = (tmp_path / "ckpt" / "README.md").read_text()
    assert "tiny.gguf" in readme and from_gguf.sha256_of(tmp_path / "tiny.gguf") in readme
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left


@pytest.mark.llamacpp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dtype_writes_the_dequantized_weights_cast_once(tmp_path, tokenizer, dtype):
    original = write_tiny_gguf(tmp_path / "tiny.gguf", tokenizer)
    import_file(tmp_path / "tiny.gguf", tmp_path / "ckpt", dtype=str(dtype).removeprefix("torch."))
    loaded = load_model(tmp_path / "ckpt", dtype=dtype)
    expected = original.state_dict()
    for name, weight in loaded.state_dict().items():
        assert weight.dtype == dtype and torch.equal(weight, expected[name].to(dtype)), name


@pytest.mark.llamacpp
def test_an_imported_folder_is_replaced_only_with_force(tmp_path, tokenizer, capsys):
    write_tiny_gguf(tmp_path / "a.gguf", tokenizer, seed=1)
    second = write_tiny_gguf(tmp_path / "b.gguf", tokenizer, seed=2)
    assert import_file(tmp_path / "a.gguf", tmp_path / "ckpt") == 0
    err = one_line_error(capsys, ["import", str(tmp_path / "b.gguf"), "--out", str(tmp_path / "ckpt")])
    assert err.endswith("holds an earlier cllm import: choose a new folder, or --force to replace it")
    assert main(["import", str(tmp_path / "b.gguf"), "--out", str(tmp_path / "ckpt"), "--force"]) == 0
    loaded = load_model(tmp_path / "ckpt")
    torch.testing.assert_close(logits(loaded, tokenizer, TEXTS[0]), logits(second, tokenizer, TEXTS[0]),
                               rtol=0, atol=1e-5)
    assert "b.gguf" in (tmp_path / "ckpt" / "README.md").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.gguf", "b.gguf", "ckpt"]  # the old one gone


@pytest.mark.llamacpp
def test_an_import_stopped_while_writing_leaves_no_folder(tmp_path, tokenizer, monkeypatch):
    write_tiny_gguf(tmp_path / "tiny.gguf", tokenizer)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(from_gguf, "save_file", interrupted)  # ours: the weights are written first
    with pytest.raises(KeyboardInterrupt):
        import_file(tmp_path / "tiny.gguf", tmp_path / "ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.gguf"]


@pytest.mark.llamacpp
def test_a_force_into_the_users_folder_keeps_their_files(tmp_path, tokenizer):
    write_tiny_gguf(tmp_path / "tiny.gguf", tokenizer)
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    assert import_file(tmp_path / "tiny.gguf", out, force=True) == 0
    assert (out / "notes.txt").read_text() == "mine\n"
    load_model(out)


# ---------------------------------------------------------------------------- the real model


@pytest.mark.slow
@pytest.mark.llamacpp
@needs("smollm2")
def test_smollm2_imported_gives_transformers_greedy_next_token_on_a_chatml_prompt(tmp_path):
    gguf = reference("smollm2")
    assert main(["import", str(gguf), "--out", str(tmp_path / "smollm2")]) == 0
    model, tokenizer = load_model(tmp_path / "smollm2"), load_tokenizer(tmp_path / "smollm2")
    theirs = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        ours, reference_logits = model(ids).logits[0, -1], theirs(ids).logits[0, -1]
    assert int(ours.argmax()) == int(reference_logits.argmax())
    torch.testing.assert_close(ours, reference_logits, rtol=0, atol=1e-4)
    assert tokenizer.eos_token == "<|im_end|>"
    assert json.loads((tmp_path / "smollm2" / "generation_config.json").read_text())["eos_token_id"] == \
        tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert (tmp_path / "smollm2" / MARKER).is_file()
