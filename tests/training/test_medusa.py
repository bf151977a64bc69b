"""`cllm medusa` on a tiny random Llama saved in tmp_path: heads, log, config and evaluation land
in MODEL/medusa (the checkpoint's fingerprint does not move), decoding with the saved heads is
greedy's, an interrupted run resumes to the very same heads, finished heads are not replaced
without --force, and bad input is a one-line error."""

import json

import pytest
import torch

from cllm.cli import main
from cllm.core.outputs import MARKER
from cllm.decoding import greedy_decode
from cllm.decoding.rivals.medusa import medusa_decode
from cllm.modeling.heads import CONFIG_FILE, HEADS_DIR, WEIGHTS_FILE
from cllm.models import fingerprint, load_heads, load_model
from tests.commands.test_generate import save_tiny_model
from tests.training.test_drafts import run

TINY = ["--heads", "2", "--max-new-tokens", "16", "--holdout", "2", "--max-steps", "6", "--batch-size", "3",
        "--eval-every", "3", "--eval-count", "2", "--eval-max-new-tokens", "12", "--top-k", "3", "--tree-nodes", "5"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, prompt_file):
    """A tiny model with heads trained by the CLI, and the fingerprint it had before."""
    directory = save_tiny_model(tmp_path_factory.mktemp("medusa"))
    before = fingerprint(directory)
    code = main(["medusa", "--model", str(directory), "--prompts", str(prompt_file), "--eval-prompts", str(prompt_file),
                 *TINY])
    assert code == 0
    return directory, before


def test_help_lists_the_options(capsys):
    with pytest.raises(SystemExit) as info:
        main(["medusa", "--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0
    for flag in ("--heads", "--max-steps", "--prompts", "--out", "--force", "--tree-nodes", "--loss"):
        assert flag in out


def test_heads_land_beside_the_checkpoint_without_changing_it(trained):
    directory, before = trained
    folder = directory / HEADS_DIR
    assert fingerprint(directory) == before
    assert {p.name for p in folder.iterdir()} == {CONFIG_FILE, WEIGHTS_FILE, "medusa_log.jsonl",
                                                  "medusa_train_config.json", "evaluation.json", MARKER}
    record = json.loads((folder / CONFIG_FILE).read_text())
    assert record["model_fingerprint"] == before and record["num_heads"] == 2 and len(record["tree"]) == 5
    assert record["training"]["texts"] == 6 and record["training"]["holdout_texts"] == 2
    log = [json.loads(line) for line in (folder / "medusa_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(7)) and "holdout" in log[3] and "holdout" in log[6]
    evaluation = json.loads((folder / "evaluation.json").read_text())
    assert evaluation["exact"] == evaluation["prompts"] == 2 and evaluation["tree_nodes"] == 5


def test_decoding_with_the_saved_heads_is_greedy(trained):
    directory, _ = trained
    model = load_model(directory)
    heads = load_heads(directory, model)
    assert heads is not None and heads.tree is not None
    for ids in ([5, 6, 7], [40, 41], [100]):
        prompt = torch.tensor([ids])
        expected = greedy_decode(model, prompt, max_new_tokens=30).new_tokens
        assert medusa_decode(model, heads, prompt, max_new_tokens=30).new_tokens == expected


def test_finished_heads_are_not_replaced_without_force(trained, prompt_file, capsys):
    directory, _ = trained
    weights = (directory / HEADS_DIR / WEIGHTS_FILE).read_bytes()
    code, _, err = run(capsys, "medusa", "--model", directory, "--prompts", prompt_file, *TINY)
    assert code == 2 and "--force" in err and err.count("\n") == 1
    assert (directory / HEADS_DIR / WEIGHTS_FILE).read_bytes() == weights


def test_an_interrupted_run_resumes_to_the_same_heads(trained, prompt_file, tmp_path, monkeypatch, capsys):
    """Ctrl-C after the first step saves a checkpoint; the rerun ends with the heads of the
    uninterrupted run (`trained`, same options), byte for byte; --force starts over."""
    from contextlib import contextmanager

    import cllm.training.skeleton

    directory, _ = trained
    out = tmp_path / "heads"
    args = ["medusa", "--model", directory, "--prompts", prompt_file, *TINY, "--eval-count", "0", "--out", out]

    @contextmanager
    def pressed():
        yield {"set": True}

    with monkeypatch.context() as m:
        m.setattr(cllm.training.skeleton, "sigint_flag", pressed)
        code, out_text, _ = run(capsys, *args)
    assert code == 130 and "resume" in out_text and (out / "checkpoint.pt").exists()
    assert not (out / WEIGHTS_FILE).exists()
    code, out_text, err = run(capsys, *args)
    assert code == 0 and "resuming" in out_text and not (out / "checkpoint.pt").exists(), err
    model = load_model(directory)
    a, b = load_heads(out, model), load_heads(directory, model)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    assert run(capsys, *args, "--max-steps", "3", "--force")[0] == 0
    assert json.loads((out / CONFIG_FILE).read_text())["training"]["steps"] == 3


@pytest.mark.parametrize(("args", "message"), [
    (["--heads", "0"], "--heads must be an int >= 1"),
    (["--head-decay", "1.5"], "--head-decay must be in"),
    (["--max-prompts", "4", "--holdout", "4"], "--holdout 4 leaves no prompt"),
    (["--holdout", "8"], "leave none to train on"),  # known once the prompt file is read
])
def test_bad_options_are_one_line_errors(trained, prompt_file, tmp_path, capsys, args, message):
    directory, _ = trained
    code, _, err = run(capsys, "medusa", "--model", directory, "--prompts", prompt_file, "--out", tmp_path / "x",
                       "--max-new-tokens", "4", *args)
    last = err.strip().splitlines()[-1]  # after the progress bars, if any
    assert code == 2 and last.startswith("cllm medusa: error:") and message in last and "Traceback" not in err
    assert not (tmp_path / "x").exists()  # a refused run leaves nothing: no folder, no marker


def test_an_out_folder_of_other_files_or_the_model_itself_is_refused(trained, tmp_path, capsys):
    directory, _ = trained
    (tmp_path / "notes.txt").write_text("mine")
    for out, why in ((tmp_path, "did not write"), (directory, "is the --model folder")):
        code, _, err = run(capsys, "medusa", "--model", directory, "--out", out)
        assert code == 2 and err.count("\n") == 1 and why in err
    assert (tmp_path / "notes.txt").read_text() == "mine"
    other = save_tiny_model(tmp_path / "other")  # --force never writes into a model, nor marks it
    capsys.readouterr()
    for out, why in ((other, "model checkpoint folder"), (directory, "is the --model folder"),
                     (directory / "sub", "lies inside the --model folder")):
        code, _, err = run(capsys, "medusa", "--model", directory, "--out", out, "--force")
        assert code == 2 and err.count("\n") == 1 and why in err
    assert not (other / MARKER).exists() and not (directory / MARKER).exists() and not (directory / "sub").exists()


# ------------------------------------------------------------------ cllm generate --medusa


@pytest.mark.parametrize("spec", ["auto", "folder"])
def test_generate_with_the_heads_writes_greedy_text(trained, capsys, spec):
    from tests.commands.test_generate import PROMPTS, Oracle

    directory, _ = trained
    oracle = Oracle(directory)
    medusa = directory / HEADS_DIR if spec == "folder" else spec
    for prompt in PROMPTS:
        code, out, err = run(capsys, "generate", "--model", directory, "--prompt", prompt, "--max-new-tokens", 24,
                             "--medusa", medusa)
        assert code == 0 and out == oracle.text(prompt) + "\n", (spec, prompt)
        assert err.strip().splitlines()[-1].startswith("[medusa]")


def test_generate_medusa_errors_are_one_line(trained, tmp_path, capsys):
    directory, _ = trained
    bare = save_tiny_model(tmp_path / "bare")
    for args, message in ((["--medusa", bare], "no Medusa heads"), (["--medusa", tmp_path / "missing"], "not found"),
                          (["--medusa", "auto", "--temperature", "0.5"], "decodes greedily")):
        code, _, err = run(capsys, "generate", "--model", directory, "--prompt", "x", *args)
        last = err.strip().splitlines()[-1]
        assert code == 2 and last.startswith("cllm generate: error:") and message in last, err


def test_heads_train_on_collected_trajectories_of_the_same_model(trained, prompt_file, tmp_path, capsys):
    """`--data`: the fixed points of `cllm collect` are the model's greedy text (the same texts
    `greedy_texts` decodes); trajectories of another model are refused."""
    from cllm.data.trajectories import read_records
    from cllm.models import load_tokenizer
    from cllm.training.medusa import greedy_texts, texts_from_trajectories

    directory, _ = trained
    data = tmp_path / "trajectories"
    assert main(["collect", "--model", str(directory), "--prompts", str(prompt_file), "--out", str(data),
                 "--block-size", "4", "--max-new-tokens", "16"]) == 0
    model, tokenizer = load_model(directory), load_tokenizer(directory)
    collected = texts_from_trajectories(read_records(data))
    prompts = [tokenizer(json.loads(line)["prompt"])["input_ids"] for line in prompt_file.read_text().splitlines()]
    assert collected == greedy_texts(model, prompts, max_new_tokens=16, batch_size=8,
                                     eos_token_id=tokenizer.eos_token_id, pad_id=0)
    out = tmp_path / "heads"
    code, _, _ = run(capsys, "medusa", "--model", directory, "--data", data, *TINY, "--eval-count", "0", "--out", out)
    assert code == 0 and json.loads((out / CONFIG_FILE).read_text())["training"]["texts"] == 6
    other = save_tiny_model(tmp_path / "other", seed=3)
    code, _, err = run(capsys, "medusa", "--model", other, "--data", data, "--out", tmp_path / "o", *TINY)
    assert code == 2 and "another model" in err.strip().splitlines()[-1]


def test_a_model_of_its_own_is_evaluated_on_its_held_out_texts_with_a_warning_for_a_large_holdout(
        trained, prompt_file, tmp_path, capsys):
    """--eval-prompts auto: HumanEval is the stdlib domain's; a model with a tokenizer of its own
    is evaluated on the prompts of its held-out texts, and says so. A holdout that leaves fewer
    texts to train on than it holds out (8 prompts, --holdout 5: 3 left) is one warning line."""
    from cllm.training.drafter import stdlib_domain

    assert stdlib_domain("stdlib-coder") and not stdlib_domain(str(trained[0]))
    directory, _ = trained
    out = tmp_path / "heads"
    code, text, err = run(capsys, "medusa", "--model", directory, "--prompts", prompt_file, *TINY, "--holdout", 5,
                          "--out", out)
    assert code == 0, err
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert warnings == ["cllm medusa: warning: --holdout 5 leaves 3 of 8 texts to train on, fewer than it holds out; "
                        "give more prompts or a smaller --holdout"]
    assert "evaluating on holdout" in text and "holdout x 2" in text
    evaluation = json.loads((out / "evaluation.json").read_text())
    assert evaluation["prompt_set"] == "holdout" and evaluation["exact"] == evaluation["prompts"] == 2


def test_a_large_holdout_is_not_warned_about_when_eval_prompts_names_the_evaluation_set(
        trained, prompt_file, tmp_path, capsys):
    """With --eval-prompts the evaluation does not run on the held-out texts' prompts: the
    holdout warning of the test above is not given."""
    directory, _ = trained
    code, text, err = run(capsys, "medusa", "--model", directory, "--prompts", prompt_file, *TINY, "--holdout", 5,
                          "--eval-prompts", prompt_file, "--out", tmp_path / "heads")
    assert code == 0, err
    assert not [line for line in err.splitlines() if "warning" in line], err


def test_max_steps_is_the_steps_flag_and_steps_stays_as_its_deprecated_alias(capsys, tmp_path):
    """`cllm train`'s name, --max-steps; the old --steps (flag or config-file key) still sets it."""
    from cllm.cli import build_parser
    from cllm.core.config import build_config, read_config_file
    from cllm.training.medusa import MedusaConfig

    parser = build_parser("medusa")
    for flag in ("--max-steps", "--steps"):
        assert vars(parser.parse_args(["medusa", flag, "7"]))["max_steps"] == 7
    file = tmp_path / "old.json"
    file.write_text(json.dumps({"steps": 9}))
    assert build_config(MedusaConfig, read_config_file(file), {}).max_steps == 9
    with pytest.raises(SystemExit):
        main(["medusa", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--max-steps MAX_STEPS, --steps MAX_STEPS" in help_text and "--steps: its old name, deprecated" in help_text


def test_a_first_run_failing_before_its_first_checkpoint_leaves_no_folder_but_the_users_stays(
        prompt_file, tmp_path, monkeypatch, capsys):
    """The folder is claimed (marker, config) once the inputs are checked: a failure after that
    (here while the texts are decoded) removes the folder the run made, never one that was there."""
    import importlib

    from cllm.core.errors import UserError

    def fails(*args, **kwargs):
        raise UserError("decoding failed")

    monkeypatch.setattr(importlib.import_module("cllm.training.drafter"), "training_texts", fails)
    directory = save_tiny_model(tmp_path / "model")
    code, _, err = run(capsys, "medusa", "--model", directory, "--prompts", prompt_file, *TINY)
    assert code == 2 and "decoding failed" in err and not (directory / HEADS_DIR).exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    code, _, err = run(capsys, "medusa", "--model", directory, "--prompts", prompt_file, *TINY, "--out", mine)
    assert code == 2 and "decoding failed" in err and mine.is_dir()
