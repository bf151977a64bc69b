"""`cllm drafts` on a tiny random Llama saved in tmp_path: the table lands beside the checkpoint
(whose fingerprint does not move), `generate` picks it up and stays greedy, and bad tables are
one-line errors."""

import json

import pytest

from cllm.cli import main
from cllm.decoding.draft_table import DraftTable
from cllm.models import DRAFT_TABLE, fingerprint, load_draft_table
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
