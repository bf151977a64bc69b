"""`cllm eagle` on a tiny random Llama saved in tmp_path: the head, log, config and evaluation land
in MODEL/eagle (the checkpoint's fingerprint does not move), training lowers the held-out loss,
decoding with the saved head is greedy's, a saved head loads back to the same outputs and only
for its own model, an interrupted run resumes to the very same head, a finished head is not
replaced without --force, and bad input is a one-line error. Plus the loss alone."""

import json

import pytest
import torch
import torch.nn.functional as F

from cllm.cli import main
from cllm.core.errors import UserError
from cllm.core.outputs import MARKER
from cllm.decoding import eagle_decode, greedy_decode
from cllm.modeling.eagle import CONFIG_FILE, DRAFT_CONFIG_FILE, EAGLE_DIR, WEIGHTS_FILE
from cllm.models import fingerprint, load_eagle, load_model
from cllm.training.eagle import eagle_loss, eagle_terms
from tests.commands.test_generate import save_tiny_model
from tests.training.test_drafts import run

TINY = ["--max-new-tokens", "16", "--holdout", "2", "--max-steps", "8", "--batch-size", "3", "--eval-every", "4",
        "--eval-count", "2", "--eval-max-new-tokens", "12", "--tree-nodes", "4", "--tree-depth", "3", "--top-k", "2",
        "--lr", "1e-2"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, prompt_file):
    """A tiny model with a head trained by the CLI, and the fingerprint it had before."""
    directory = save_tiny_model(tmp_path_factory.mktemp("eagle"))
    before = fingerprint(directory)
    code = main(["eagle", "--model", str(directory), "--prompts", str(prompt_file), "--eval-prompts", str(prompt_file),
                 *TINY])
    assert code == 0
    return directory, before


def test_help_lists_the_options(capsys):
    with pytest.raises(SystemExit) as info:
        main(["eagle", "--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0
    for flag in ("--max-steps", "--prompts", "--out", "--force", "--tree-nodes", "--tree-depth", "--w-cls", "--noise"):
        assert flag in out


def test_the_loss_is_zero_for_identical_inputs_and_ignores_masked_positions():
    g = torch.Generator().manual_seed(0)
    f, logits = torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 11, generator=g)
    mask = torch.ones(2, 5, dtype=torch.bool)
    assert float(eagle_loss(f, f, logits, logits, mask)) == pytest.approx(0.0, abs=1e-6)
    other, other_logits = torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 11, generator=g)
    reg, cls = eagle_terms(other, f, other_logits, logits, mask)
    assert float(reg) == pytest.approx(float(F.smooth_l1_loss(other, f, reduction="sum")) / 8, rel=1e-5)
    kl = F.kl_div(F.log_softmax(other_logits, -1), F.log_softmax(logits, -1), log_target=True, reduction="sum")
    assert float(cls) == pytest.approx(float(kl), rel=1e-4)
    mask[1, 3:] = False
    changed = other.clone()
    changed[1, 3:] += 100
    loss = eagle_loss(other, f, other_logits, logits, mask)
    assert torch.equal(loss, eagle_loss(changed, f, other_logits, logits, mask))


def test_the_head_lands_beside_the_checkpoint_and_training_lowers_the_held_out_loss(trained):
    directory, before = trained
    folder = directory / EAGLE_DIR
    assert fingerprint(directory) == before
    assert {p.name for p in folder.iterdir()} == {CONFIG_FILE, WEIGHTS_FILE, DRAFT_CONFIG_FILE, "eagle_log.jsonl",
                                                  "eagle_train_config.json", "evaluation.json", MARKER}
    record = json.loads((folder / CONFIG_FILE).read_text())
    assert record["model_fingerprint"] == before and record["tree"] == {"nodes": 4, "depth": 3, "top_k": 2}
    assert record["training"]["texts"] == 6 and record["training"]["holdout_texts"] == 2
    training = record["training"]
    assert training["holdout_after"]["loss"] < training["holdout_before"]["loss"]
    log = [json.loads(line) for line in (folder / "eagle_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(9)) and "holdout" in log[4] and "holdout" in log[8]
    evaluation = json.loads((folder / "evaluation.json").read_text())
    assert evaluation["exact"] == evaluation["prompts"] == 2
    # the layer in EAGLE-1's layout: fc without bias, one Llama layer without its input norm
    from safetensors import safe_open

    with safe_open(str(folder / WEIGHTS_FILE), framework="pt") as file:
        names = set(file.keys())
    assert "fc.weight" in names and "layers.0.self_attn.q_proj.weight" in names
    assert not any(n.startswith(("embed_tokens", "lm_head", "norm", "layers.0.input_layernorm")) for n in names)
    draft = json.loads((folder / DRAFT_CONFIG_FILE).read_text())
    assert draft["num_hidden_layers"] == 1 and draft["architectures"] == ["LlamaForCausalLM"]
    # config.json describes those tensors: a one-layer Llama takes all but fc, lacking only what
    # EAGLE-1 shares with the target or leaves out
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in draft.items() if k != "architectures"}))
    with safe_open(str(folder / WEIGHTS_FILE), framework="pt") as file:
        state = {"model." + name: file.get_tensor(name) for name in file.keys()}
    missing, unexpected = llama.load_state_dict(state, strict=False)
    assert unexpected == ["model.fc.weight"]
    assert set(missing) == {"model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight",
                            "lm_head.weight"}


def test_decoding_with_the_saved_head_is_greedy_and_a_reload_gives_the_same_outputs(trained):
    directory, _ = trained
    model = load_model(directory)
    head = load_eagle(directory, model)
    again = load_eagle(directory / EAGLE_DIR, model)
    assert head is not None and head.tree == {"nodes": 4, "depth": 3, "top_k": 2}
    features, tokens = torch.randn(1, 6, head.hidden_size), torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        torch.testing.assert_close(head(features, tokens), again(features, tokens), atol=0, rtol=0)
    for ids in ([5, 6, 7], [40, 41], [100]):
        prompt = torch.tensor([ids])
        expected = greedy_decode(model, prompt, max_new_tokens=30).new_tokens
        assert eagle_decode(model, head, prompt, max_new_tokens=30).new_tokens == expected
    assert load_eagle(save_tiny_model(directory.parent / "bare"), model) is None


def test_a_head_of_another_model_is_refused(trained, tmp_path):
    directory, _ = trained
    other = save_tiny_model(tmp_path / "other", seed=3)
    model = load_model(other)
    with pytest.raises(UserError, match="another model") as info:
        load_eagle(directory / EAGLE_DIR, model, model_path=other)
    assert "\n" not in str(info.value)
    with pytest.raises(UserError, match="another model"):
        load_eagle(directory / EAGLE_DIR, model)  # by the parameters' fingerprint


def test_finished_head_is_not_replaced_without_force(trained, prompt_file, capsys):
    directory, _ = trained
    weights = (directory / EAGLE_DIR / WEIGHTS_FILE).read_bytes()
    code, _, err = run(capsys, "eagle", "--model", directory, "--prompts", prompt_file, *TINY)
    assert code == 2 and "--force" in err and err.count("\n") == 1
    assert (directory / EAGLE_DIR / WEIGHTS_FILE).read_bytes() == weights


def test_an_interrupted_run_resumes_to_the_same_head(trained, prompt_file, tmp_path, monkeypatch, capsys):
    """Ctrl-C after the first step saves a checkpoint; the rerun ends with the head of the
    uninterrupted run (`trained`, same options), exactly; --force starts over."""
    from contextlib import contextmanager

    import cllm.training.skeleton

    directory, _ = trained
    out = tmp_path / "head"
    args = ["eagle", "--model", directory, "--prompts", prompt_file, *TINY, "--eval-count", "0", "--out", out]

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
    a, b = load_eagle(out, model), load_eagle(directory, model)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    assert run(capsys, *args, "--max-steps", "3", "--force")[0] == 0
    assert json.loads((out / CONFIG_FILE).read_text())["training"]["steps"] == 3


@pytest.mark.parametrize(("args", "message"), [
    (["--max-steps", "0"], "--max-steps must be an int >= 1"),
    (["--noise", "-1"], "--noise must be >= 0"),
    (["--tree-depth", "0"], "--tree-depth must be an int >= 1"),
    (["--max-prompts", "4", "--holdout", "4"], "--holdout 4 leaves no prompt"),
    (["--holdout", "8"], "leave none to train on"),  # known once the prompt file is read
])
def test_bad_options_are_one_line_errors(trained, prompt_file, tmp_path, capsys, args, message):
    directory, _ = trained
    code, _, err = run(capsys, "eagle", "--model", directory, "--prompts", prompt_file, "--out", tmp_path / "x",
                       "--max-new-tokens", "4", *args)
    last = err.strip().splitlines()[-1]  # after the progress bars, if any
    assert code == 2 and last.startswith("cllm eagle: error:") and message in last and "Traceback" not in err
    assert not (tmp_path / "x").exists()  # a refused run leaves nothing: no folder, no marker


def test_the_shipped_head_loads_and_decodes_greedys_text():
    from cllm.models import resolve_model_path

    directory = resolve_model_path("stdlib-coder")
    model = load_model(directory)
    head = load_eagle(directory, model)
    assert head is not None and head.tree == {"nodes": 4, "depth": 3, "top_k": 4}
    prompt = torch.tensor([list(range(40, 72))])
    expected = greedy_decode(model, prompt, max_new_tokens=40, eos_token_id=0).new_tokens
    out = eagle_decode(model, head, prompt, max_new_tokens=40, eos_token_id=0)
    assert out.new_tokens == expected and out.forward_passes < len(expected[0])


# ------------------------------------------------------------------ cllm generate / chat --eagle


@pytest.mark.parametrize("spec", ["auto", "folder"])
def test_generate_with_the_head_writes_greedy_text_token_for_token(trained, capsys, spec):
    from cllm.serving.completion import DecodeParams, TextCodec, complete
    from tests.commands.test_generate import PROMPTS, Oracle

    directory, _ = trained
    oracle = Oracle(directory)
    head = load_eagle(directory, load_model(directory))
    for prompt in PROMPTS:
        expected = oracle.tokens(oracle.ids(prompt))
        got = complete(oracle.model, TextCodec(oracle.tokenizer), oracle.ids(prompt),
                       DecodeParams(max_new_tokens=24), eagle=head)
        assert got.tokens == expected and got.method == "eagle", prompt
        code, out, err = run(capsys, "generate", "--model", directory, "--prompt", prompt, "--max-new-tokens", 24,
                             "--eagle", directory / EAGLE_DIR if spec == "folder" else spec)
        assert code == 0 and out == oracle.text(prompt) + "\n", (spec, prompt)
        assert err.strip().splitlines()[-1].startswith("[eagle]")


def test_chat_with_the_head_replies_greedys_text(trained, capsys, monkeypatch):
    import io
    import sys

    from tests.commands.test_generate import Oracle

    directory, _ = trained
    oracle = Oracle(directory)
    monkeypatch.setattr(sys, "stdin", io.StringIO("def f(x):\n/exit\n"))
    code, out, err = run(capsys, "chat", "--model", directory, "--max-new-tokens", 24, "--eagle", "auto")
    assert code == 0 and out == oracle.text("def f(x):") + "\n" and "[eagle]" in err, err


def test_generate_eagle_errors_are_one_line(trained, tmp_path, capsys):
    directory, _ = trained
    bare = save_tiny_model(tmp_path / "bare")
    for args, message in ((["--eagle", bare], "no EAGLE head"), (["--eagle", tmp_path / "missing"], "not found"),
                          (["--eagle", "auto", "--temperature", "0.5"], "decodes greedily"),
                          (["--eagle", "auto", "--medusa", "auto"], "not both")):
        code, _, err = run(capsys, "generate", "--model", directory, "--prompt", "x", *args)
        last = err.strip().splitlines()[-1]
        assert code == 2 and last.startswith("cllm generate: error:") and message in last, err



def test_a_first_run_failing_before_its_first_checkpoint_leaves_no_folder_but_the_users_stays(
        prompt_file, tmp_path, monkeypatch, capsys):
    """The folder is claimed (marker, config) once the inputs are checked: a failure after that
    (here while the texts are decoded) removes the folder the run made, never one that was there."""
    import importlib

    def fails(*args, **kwargs):
        raise UserError("decoding failed")

    monkeypatch.setattr(importlib.import_module("cllm.training.drafter"), "training_texts", fails)
    directory = save_tiny_model(tmp_path / "model")
    code, _, err = run(capsys, "eagle", "--model", directory, "--prompts", prompt_file, *TINY)
    assert code == 2 and "decoding failed" in err and not (directory / EAGLE_DIR).exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    code, _, err = run(capsys, "eagle", "--model", directory, "--prompts", prompt_file, *TINY, "--out", mine)
    assert code == 2 and "decoding failed" in err and mine.is_dir()
