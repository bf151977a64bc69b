"""`cllm drafts` on a tiny random Llama saved in tmp_path: the table lands beside the checkpoint
(whose fingerprint does not move), `generate` picks it up and stays greedy, and bad tables are
one-line errors."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from cllm.cli import main
from cllm.core.errors import UserError
from cllm.decoding import jacobi_decode
from cllm.decoding.draft_table import DraftTable
from cllm.models import DRAFT_TABLE, fingerprint, load_draft_table, load_model
from tests.commands.test_generate import PROMPTS, Oracle, save_tiny_model

NEW = 24


def run(capsys, *args):
    code = main([*map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def drafted(tmp_path_factory, prompt_file):
    """A tiny model with its table built by the CLI, and the fingerprint it had before."""
    directory = save_tiny_model(tmp_path_factory.mktemp("drafted"))
    before = fingerprint(directory)
    code = main(["drafts", "--model", str(directory), "--prompts", str(prompt_file), "--max-new-tokens", "32",
                 "--batch-size", "3", "--min-count", "1", "--min-share", "0.1"])
    assert code == 0
    return directory, before


def test_drafts_saves_a_table_beside_the_checkpoint_without_changing_it(drafted):
    directory, before = drafted
    table = DraftTable.load(directory / DRAFT_TABLE)
    assert len(table) > 0 and table.meta["num_prompts"] == 8 and table.meta["new_tokens"] > 0
    assert table.meta["model_fingerprint"] == before == fingerprint(directory)
    assert json.loads((directory / DRAFT_TABLE).with_suffix(".config.json").read_text())["min_count"] == 1


def test_the_table_holds_what_the_model_wrote(drafted, prompt_file):
    """Every kept context's next token is one the model wrote after that context (min share
    0.1, min count 1: every context of its greedy completions is there)."""
    directory, _ = drafted
    oracle = Oracle(directory)
    table = load_draft_table(directory)
    texts = [json.loads(line)["prompt"] for line in prompt_file.read_text().splitlines()]
    written = set()
    for text in texts:
        ids = oracle.ids(text)
        seq = ids[-4:] + oracle.tokens(ids, 32)
        written |= {tuple(seq[i : i + k]) for k in (5, 4, 3) for i in range(len(seq) - k + 1)}
    assert all(ctx + (nxt,) in written for ctx, nxt in table.next_token.items())


@pytest.mark.parametrize("spec", ["auto", "none", "explicit"])
def test_generate_with_the_table_is_still_greedy(drafted, capsys, spec, monkeypatch):
    """The table drafts (a spy counts the tokens its look-ups return) and the text stays greedy's;
    with `none` it is never consulted."""
    directory, _ = drafted
    oracle = Oracle(directory)
    table = str(directory / DRAFT_TABLE) if spec == "explicit" else spec
    drafted_tokens = []
    lookup = DraftTable.continuation

    def spy(self, history, count):
        found = lookup(self, history, count)
        drafted_tokens.extend(found)
        return found

    monkeypatch.setattr(DraftTable, "continuation", spy)
    for prompt in PROMPTS:
        code, out, _ = run(capsys, "generate", "--model", directory, "--prompt", prompt, "--max-new-tokens", NEW,
                           "--block-size", 5, "--draft-table", table)
        assert code == 0 and out == oracle.text(prompt) + "\n", (spec, prompt)
    assert (len(drafted_tokens) > 0) == (spec != "none"), len(drafted_tokens)


def test_auto_finds_no_table_for_a_model_without_one(tmp_path):
    assert load_draft_table(save_tiny_model(tmp_path / "bare")) is None


def test_a_missing_or_foreign_table_is_a_one_line_error(drafted, tmp_path, capsys):
    directory, _ = drafted
    code, _, err = run(capsys, "generate", "--model", directory, "--prompt", "x", "--draft-table",
                       tmp_path / "no.safetensors")
    assert code == 2 and "draft table not found" in err and "Traceback" not in err
    foreign = DraftTable.build([[1, 2, 3, 4, 5] * 3], meta={"tokenizer": "someone-else", "model": "other"})
    foreign.save(tmp_path / "foreign.safetensors")
    code, _, err = run(capsys, "generate", "--model", directory, "--prompt", "x", "--draft-table",
                       tmp_path / "foreign.safetensors")
    assert code == 2 and "another tokenizer" in err and "Traceback" not in err


@pytest.mark.parametrize("args", [["--min-count", "0"], ["--min-share", "0"], ["--max-new-tokens", "0"]])
def test_bad_drafts_settings_are_one_line_errors(drafted, capsys, args):
    directory, _ = drafted
    code, _, err = run(capsys, "drafts", "--model", directory, *args)
    assert code == 2 and "Traceback" not in err and err.count("\n") == 1


def test_a_table_with_ids_outside_the_vocabulary_or_of_the_wrong_shape_is_refused_at_load(drafted, tmp_path, capsys):
    directory, _ = drafted
    meta = DraftTable.read_meta(directory / DRAFT_TABLE)
    wide = DraftTable.build([[1, 2, 3, 4, 400] * 3], meta={k: meta[k] for k in ("tokenizer", "model")})
    wide.save(tmp_path / "wide.safetensors")  # the model has 320 token ids
    with pytest.raises(UserError, match="holds token id 400, outside the model's vocabulary of 320"):
        load_draft_table(directory, str(tmp_path / "wide.safetensors"))
    code, _, err = run(capsys, "generate", "--model", directory, "--prompt", "x", "--draft-table",
                       tmp_path / "wide.safetensors")
    assert code == 2 and "outside the model's vocabulary" in err and "Traceback" not in err
    tensors = load_file(str(directory / DRAFT_TABLE))
    tensors["contexts_4"] = tensors["contexts_4"][:, :3].contiguous()  # contexts of 3 where the table says 4
    save_file(tensors, str(tmp_path / "bent.safetensors"), metadata={"cllm": json.dumps(meta)})
    with pytest.raises(UserError, match="order-4 tensors are not"):
        load_draft_table(directory, str(tmp_path / "bent.safetensors"))
    model = load_model(directory)  # the Python API: refused before a wrong id reaches the embedding
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        jacobi_decode(model, torch.tensor([[1, 2, 3]]), max_new_tokens=4, draft_table=wide)


def test_drafts_never_writes_over_the_models_files_nor_a_users_temporary_names(drafted, prompt_file, tmp_path, capsys):
    directory, _ = drafted
    weights = (directory / "model.safetensors").read_bytes()
    for out in (directory / "model.safetensors", directory / "config.json", directory / "ngram.safetensors"):
        code, _, err = run(capsys, "drafts", "--model", directory, "--prompts", prompt_file, "--out", out, "--force")
        assert code == 2 and err.count("\n") == 1 and "--model" in err, err
    assert (directory / "model.safetensors").read_bytes() == weights and not (directory / "ngram.safetensors").exists()
    out = tmp_path / "table.safetensors"
    mine = [tmp_path / "table.tmp", tmp_path / "table.safetensors.tmp"]
    for file in mine:
        file.write_text("mine")
    code, _, _ = run(capsys, "drafts", "--model", directory, "--prompts", prompt_file, "--out", out,
                     "--max-new-tokens", "8", "--batch-size", "8")
    assert code == 0 and DraftTable.load(out) and all(f.read_text() == "mine" for f in mine)
    code, _, err = run(capsys, "drafts", "--model", directory, "--prompts", prompt_file, "--out", out)
    assert code == 2 and "exists" in err and "--force" in err and "not a draft table" not in err
