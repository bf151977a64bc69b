"""`cllm bench` on tiny random models: the JSON contract, exactness of every promised method on
every prompt (and a loud failure when a promise breaks), honest counting, the report folder.

No wall-clock thresholds: timing is only checked to be present and positive.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import cllm.bench.methods as methods_module
import cllm.bench.timing as timing_module
import cllm.commands.bench as command_module
from cllm.bench.config import BenchConfig, with_references
from cllm.bench.methods import ForwardCounter
from cllm.bench.metrics import ExactnessError, check_exact
from cllm.bench.models import load_models
from cllm.bench.run import validation_set
from cllm.cli import main
from cllm.core.errors import UserError
from cllm.core.machine import load_warning, threads_for_load
from cllm.data.prompts import Prompt
from cllm.data.tokenizer import train_tokenizer
from cllm.decoding import greedy_decode, jacobi_decode
from cllm.models import SHIPPED
from cllm.runtime import open_runtime
from tests.tiny import CODE_TEXTS

TEXTS = CODE_TEXTS
PROMPTS = ["def f(x):", "class A:", "import re", "for k in d:", "if a < b & c:"]
NEW, BLOCK = 20, 8
CONTRACT = {"tokens_per_second": float, "tokens_per_forward": float, "speedup_vs_ar": float,
            "exact_match_own_ar": float, "agreement_with_target": float, "n_prompts": int, "new_tokens": int}
EXACT = {"target_jacobi": "target_ar", "cllm_jacobi": "cllm_ar", "hf_generate": "target_ar",
         "prompt_lookup": "target_ar", "assisted": "target_ar", "target_lookahead": "target_ar",
         "cllm_jacobi_plain": "cllm_ar", "speculative": "target_ar", "cllm_speculative": "cllm_ar",
         "medusa": "target_ar", "medusa2": "medusa2_ar", "eagle": "target_ar"}


def save_model(directory: Path, tokenizer, *, seed: int, layers: int = 2) -> Path:
    """A tiny random Llama (vocab 320 covers the tokenizer) + the tokenizer, in one directory."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      initializer_range=0.1, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def make_tiny_setup(root: Path) -> dict[str, Path]:
    """Target, a 'CLLM' (another random model: its outputs differ from the target's), a 1-layer
    draft, a prompt file and a validation file with references."""
    tokenizer = train_tokenizer(TEXTS * 3, vocab_size=320, min_frequency=1)
    paths = {"target": save_model(root / "target", tokenizer, seed=0),
             "cllm": save_model(root / "cllm", tokenizer, seed=1),
             "draft": save_model(root / "draft", tokenizer, seed=2, layers=1),
             "prompts": root / "prompts.jsonl", "val": root / "val.jsonl"}
    with open(paths["prompts"], "w") as fh:
        for i, text in enumerate(PROMPTS):
            fh.write(json.dumps({"id": f"q{i}", "prompt": text}) + "\n")
    with open(paths["val"], "w") as fh:
        for i, text in enumerate(TEXTS):
            head, _, body = text.partition("\n")
            fh.write(json.dumps({"id": f"v{i}", "prompt": head + "\n", "reference": body}) + "\n")
    return paths


def bench_args(paths: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return ["bench", "--target", str(paths["target"]), "--cllm", str(paths["cllm"]),
            "--prompts", str(paths["prompts"]), "--val-set", str(paths["val"]), "--val-prompts", "3",
            "--max-new-tokens", str(NEW), "--block-size", str(BLOCK), "--repeats", "2", "--threads", "1",
            "--draft-model", "none", "--out", str(out), *extra]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """The tiny setup, the CLLM with a draft table of its own (from the validation prompts)."""
    paths = make_tiny_setup(tmp_path_factory.mktemp("bench"))
    assert main(["drafts", "--model", str(paths["cllm"]), "--prompts", str(paths["val"]), "--max-new-tokens", "24",
                 "--min-count", "1", "--min-share", "0.1"]) == 0
    # the target's Medusa heads (in its medusa/ folder, where `cllm bench` finds them)
    assert main(["medusa", "--model", str(paths["target"]), "--prompts", str(paths["val"]), "--heads", "2",
                 "--max-new-tokens", "16", "--holdout", "2", "--steps", "3", "--batch-size", "2",
                 "--eval-count", "0", "--tree-nodes", "4", "--threads", "1"]) == 0
    # ... and its EAGLE head (in its eagle/ folder)
    assert main(["eagle", "--model", str(paths["target"]), "--prompts", str(paths["val"]), "--max-new-tokens", "16",
                 "--holdout", "2", "--steps", "3", "--batch-size", "2", "--eval-count", "0", "--threads", "1"]) == 0
    # a Medusa-2 checkpoint of the target: its own backbone and heads, in a folder of its own
    paths["medusa2"] = paths["target"].parent / "medusa2"
    assert main(["medusa", "--joint", "--model", str(paths["target"]), "--prompts", str(paths["val"]), "--heads", "2",
                 "--max-new-tokens", "16", "--holdout", "2", "--steps", "3", "--batch-size", "2", "--warmup-heads", "1",
                 "--eval-count", "0", "--quality-count", "0", "--tree-nodes", "4", "--threads", "1",
                 "--out", str(paths["medusa2"])]) == 0
    return paths


@pytest.fixture(scope="module")
def report(tiny, tmp_path_factory) -> Path:
    """One full run through the CLI: every method, a sweep, a copy of the JSON via --json."""
    out = tmp_path_factory.mktemp("report") / "bench"
    args = bench_args(tiny, out, "--draft-model", str(tiny["draft"]), "--medusa2", str(tiny["medusa2"]),
                      "--sweep-block-sizes", "2,4,8",
                      "--json", str(out.parent / "copy.json"))
    assert main(args) == 0
    return out


def load(report: Path) -> dict:
    return json.loads((report / "bench.json").read_text())


def test_bench_json_matches_the_design_contract(report):
    data = load(report)
    assert {"config", "machine", "methods", "models"} <= set(data)
    assert list(data["methods"]) == ["target_ar", "target_jacobi", "cllm_ar", "cllm_jacobi",
                                     "hf_generate", "prompt_lookup", "assisted", "target_lookahead",
                                     "cllm_jacobi_plain", "cllm_ar_sampling", "cllm_jacobi_sampling",
                                     "speculative", "cllm_speculative", "medusa", "medusa2_ar",
                                     "medusa2", "eagle"]
    for name, m in data["methods"].items():
        for key, kind in CONTRACT.items():
            assert isinstance(m[key], kind), (name, key, m[key])
        assert m["n_prompts"] == len(PROMPTS) and m["tokens_per_second"] > 0
    assert data["methods"]["target_ar"]["speedup_vs_ar"] == 1.0
    for key in ("cpu", "cores", "threads", "torch", "transformers", "dtype", "seed"):
        assert key in data["machine"]
    assert data["machine"]["threads"] == 1 and data["config"]["block_size"] == BLOCK
    assert set(data["models"]) == {"target", "cllm", "draft", "medusa2"}
    # memory beside the model: the draft's parameters for the draft methods, the table for cllm_jacobi
    draft_params = data["models"]["draft"]["parameters"]
    added = {name: m["added_parameters"] for name, m in data["methods"].items()}
    assert added["speculative"] == added["assisted"] == added["cllm_speculative"] == draft_params > 0
    assert data["methods"]["speculative"]["added_mb"] == pytest.approx(4 * draft_params / 2**20)  # float32
    assert 0 < added["medusa"] < draft_params  # the heads' residual blocks (the LM head is shared)
    # two heads each; the Medusa-2 backbone replaces the target, adding nothing
    assert added["medusa2"] == added["medusa"] > 0 == added["medusa2_ar"]
    assert 0 < added["eagle"] < draft_params  # one layer and its input projection (embeddings, LM head shared)
    assert data["methods"]["eagle"]["draft_forward_passes"] > 0  # the head's forwards, counted apart
    assert (data["methods"]["cllm_jacobi"]["added_mb"] > 0 == added["cllm_jacobi"]
            == data["methods"]["target_lookahead"]["added_mb"])
    # cllm_jacobi drafted from the CLLM's table (`tiny`); the target has none
    assert data["models"]["cllm"]["draft_table"]["contexts"] > 0 and "draft_table" not in data["models"]["target"]
    assert all(isinstance(m["val_loss"], float) for m in data["models"].values())
    assert json.loads((report.parent / "copy.json").read_text()) == data


def test_every_promised_method_reproduces_greedy_on_every_prompt(report, tiny):
    rows = [json.loads(line) for line in (report / "outputs.jsonl").read_text().splitlines()]
    assert len(rows) == len(PROMPTS)
    models = {role: LlamaForCausalLM.from_pretrained(tiny[role]).eval() for role in ("target", "cllm", "medusa2")}
    eos = 0  # <|endoftext|>
    for row in rows:
        for role in ("target", "cllm", "medusa2"):  # the bench's AR outputs are greedy decoding's own
            oracle = greedy_decode(models[role], torch.tensor([row["prompt_ids"]]), max_new_tokens=NEW,
                                   eos_token_id=eos)
            assert row[f"{role}_ar"] == oracle.new_tokens[0]
        for method, reference in EXACT.items():
            assert row[method] == row[reference], (method, row["prompt_id"])
    data = load(report)
    assert all(e["ok"] and not e["mismatches"] for e in data["exactness"].values())
    assert set(data["exactness"]) == set(EXACT)
    assert all(per["exact_match_own_ar"] == 1.0 for role in data["sweep"].values() for per in role.values())


def test_sampling_methods_decode_the_budget_and_jacobi_needs_no_more_forwards(report):
    data = load(report)
    rows = [json.loads(line) for line in (report / "outputs.jsonl").read_text().splitlines()]
    eos = 0  # <|endoftext|>
    for name in ("cllm_ar_sampling", "cllm_jacobi_sampling"):
        samples = [row[name] for row in rows]
        for t in samples:  # every prompt decodes the whole budget, or stops at its first EOS
            assert t.index(eos) == len(t) - 1 if eos in t else len(t) == NEW, (name, t)
        assert data["methods"][name]["new_tokens"] == sum(map(len, samples))
    # sampled at T = 0.7, not greedy: some prompt leaves the greedy path
    assert any(row["cllm_ar_sampling"] != row["cllm_ar"] for row in rows)
    assert any(row["cllm_jacobi_sampling"] != row["cllm_ar"] for row in rows)
    ar, jac = data["methods"]["cllm_ar_sampling"], data["methods"]["cllm_jacobi_sampling"]
    assert ar["forward_passes"] == ar["new_tokens"]  # AR: one token per forward
    assert jac["forward_passes"] <= jac["new_tokens"]  # Jacobi: never more than one per token
    assert jac["speedup_vs_own_ar"] > 0 and data["config"]["temperature"] == 0.7


def test_counts_follow_the_reference_definitions(report):
    data = load(report)
    for name, m in data["methods"].items():
        assert m["tokens_per_forward"] == pytest.approx(m["new_tokens"] / m["forward_passes"])
        hist = {int(k): v for k, v in m["accepted_histogram"].items()}  # present for every method
        assert sum(hist.values()) == m["forward_passes"], name
        assert sum(k * v for k, v in hist.items()) == m["new_tokens"], name
    for name in ("target_ar", "cllm_ar", "hf_generate"):
        assert data["methods"][name]["tokens_per_forward"] == 1.0
    for name in ("target_jacobi", "cllm_jacobi", "cllm_jacobi_plain", "target_lookahead"):
        m = data["methods"][name]
        assert m["mean_fast_forwarded"] >= 1.0
        # a stationary token is one a forward did not have to make final: at most the tokens
        # past the one each forward makes final for sure
        assert 0 <= m["stationary_tokens"] <= m["new_tokens"] - m["forward_passes"] + m["n_prompts"], name
    for name in ("assisted", "speculative", "cllm_speculative"):  # target forwards counted, the draft's apart
        assert data["methods"][name]["draft_forward_passes"] > 0, name
    for name in ("speculative", "cllm_speculative"):  # one verify forward makes 1 .. k + 1 tokens final
        m = data["methods"][name]
        assert (1.0 <= m["tokens_per_forward"]
                and max(map(int, m["accepted_histogram"])) <= data["config"]["draft_tokens"] + 1)
        assert m["draft_forward_passes"] <= data["config"]["draft_tokens"] * m["forward_passes"]
    assert data["methods"]["cllm_speculative"]["speedup_vs_own_ar"] > 0
    assert data["methods"]["target_ar"]["agreement_with_target"] == 1.0
    assert set(data["sweep"]) == {"target", "cllm"} and set(data["sweep"]["target"]) == {"2", "4", "8"}
    assert data["sweep"]["target"][str(BLOCK)]["tokens_per_forward"] == pytest.approx(
        data["methods"]["target_jacobi"]["tokens_per_forward"])
    assert data["sweep"]["cllm"][str(BLOCK)]["tokens_per_forward"] == pytest.approx(
        data["methods"]["cllm_jacobi_plain"]["tokens_per_forward"])


def test_report_folder_holds_pictures_html_markdown_and_resolved_config(report):
    for name in ("speedup.png", "accepted_histogram.png", "tpf_vs_block_size.png"):
        blob = (report / name).read_bytes()
        assert blob.startswith(b"\x89PNG\r\n\x1a\n") and len(blob) > 1000, name
    page = (report / "trajectory.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "<style>" in page and page.count('class="panel"') >= 4
    assert "target (" in page and "cllm (" in page and "<script" not in page and "http" not in page
    md = (report / "report.md").read_text()
    assert all(f"`{m}`" in md for m in load(report)["methods"])
    assert "`cllm_jacobi` the cllm's draft table" in md
    config = json.loads((report / "config.json").read_text())
    assert config["block_size"] == BLOCK and config["max_new_tokens"] == NEW


def test_bench_fails_loudly_when_an_exactness_promise_breaks(tiny, tmp_path, monkeypatch):
    real = methods_module.jacobi_decode

    def broken(*args, **kwargs):  # a Jacobi engine that gets the last token wrong
        out = real(*args, **kwargs)
        out.new_tokens[0][-1] = (out.new_tokens[0][-1] + 1) % 320
        return out

    monkeypatch.setattr(methods_module, "jacobi_decode", broken)
    out = tmp_path / "broken"
    args = bench_args(tiny, out, "--methods", "target_ar,target_jacobi", "--sweep-block-sizes", "",
                      "--val-prompts", "0", "--repeats", "1", "--tie-tolerance", "0")
    with pytest.raises(ExactnessError, match="target_jacobi"):
        main(args)
    data = load(out)  # the evidence is written before the failure
    assert not data["exactness"]["target_jacobi"]["ok"]
    assert data["methods"]["target_jacobi"]["exact_match_own_ar"] == 0.0


def test_a_mismatch_is_excused_only_as_a_near_tie(tiny):
    model = LlamaForCausalLM.from_pretrained(tiny["target"]).eval()
    prompt = Prompt("p", "x", [5, 6, 7])
    expected = greedy_decode(model, torch.tensor([prompt.ids]), max_new_tokens=4).new_tokens[0]
    wrong = expected[:2] + [(expected[2] + 1) % 320] + expected[3:]
    strict = check_exact(model, [prompt], [wrong], [expected], tolerance=0.0)
    lenient = check_exact(model, [prompt], [wrong], [expected], tolerance=1e9)
    assert strict[0]["first_difference"] == 2 and strict[0]["top2_margin"] > 0
    assert not strict[0]["near_tie"] and lenient[0]["near_tie"]
    assert check_exact(model, [prompt], [expected], [expected], tolerance=0.0) == []


def test_forward_counter_reads_tokens_made_final_per_call(tiny):
    model = LlamaForCausalLM.from_pretrained(tiny["target"]).eval()
    counter = ForwardCounter(model, open_runtime(model, "transformers"))
    out = greedy_decode(counter.runtime, torch.tensor([[5, 6, 7]]), max_new_tokens=6)
    assert counter.calls == counter.runtime_forwards == out.forward_passes == 6
    assert counter.accepted(3, 6) == [1] * 6
    counter.check(6)
    with pytest.raises(RuntimeError, match="forward count mismatch: decoder 5, runtime 6, hook 6"):
        counter.check(5)
    counter.remove()
    greedy_decode(counter.runtime, torch.tensor([[5, 6, 7]]), max_new_tokens=2)
    assert counter.calls == 6 and counter.runtime_forwards == 8  # removed: the hook no longer counts


def test_forward_counter_checks_a_lean_decoder_against_the_runtimes_own_count(tiny):
    """The lean runtime never calls the transformers model: its own count is what checks ours."""
    model = LlamaForCausalLM.from_pretrained(tiny["target"]).eval()
    counter = ForwardCounter(model, open_runtime(model, "lean"))
    out = jacobi_decode(counter.runtime, torch.tensor([[5, 6, 7]]), block_size=3, max_new_tokens=9)
    assert counter.calls == 0 and counter.runtime_forwards == out.forward_passes
    counter.check(out.forward_passes)
    with pytest.raises(RuntimeError, match="forward count mismatch"):
        counter.check(out.forward_passes + 1)
    counter.reset()
    assert counter.runtime_forwards == 0


def test_a_missing_shipped_cllm_is_skipped_with_a_note(tiny, tmp_path, monkeypatch):
    monkeypatch.setitem(SHIPPED, "stdlib-coder-cllm", tmp_path / "absent")
    models = load_models(BenchConfig(target=str(tiny["target"]), draft_model="none"))
    assert models.cllm is None and "not present" in models.notes[0]
    assert BenchConfig(cllm="none").cllm is None


def test_the_shipped_companions_are_not_used_with_another_target(tiny, monkeypatch):
    monkeypatch.setitem(SHIPPED, "stdlib-coder-cllm", tiny["cllm"])  # present, but made for another target
    monkeypatch.setitem(SHIPPED, "stdlib-coder-draft", tiny["cllm"])
    monkeypatch.setitem(SHIPPED, "stdlib-coder-medusa2", tiny["medusa2"])
    models = load_models(BenchConfig(target=str(tiny["target"])))
    assert models.cllm is None and models.draft is None and models.medusa2 is None and len(models.notes) == 3
    assert all("goes with the shipped target 'stdlib-coder'" in n for n in models.notes)
    given = load_models(BenchConfig(target=str(tiny["target"]), cllm=str(tiny["cllm"]), draft_model=str(tiny["cllm"]),
                                    medusa2=str(tiny["medusa2"])))
    assert given.cllm is not None and given.draft is not None and not given.notes  # named by path: used
    assert given.medusa2 is not None and given.medusa2_heads.num_heads == 2


def test_a_medusa2_checkpoint_without_heads_and_an_eagle_folder_without_a_head_are_refused(tiny, tmp_path):
    with pytest.raises(UserError, match="no Medusa heads in it"):
        load_models(BenchConfig(target=str(tiny["target"]), cllm="none", draft_model="none", medusa2=str(tiny["cllm"])))
    with pytest.raises(UserError, match="no EAGLE head there"):
        load_models(BenchConfig(target=str(tiny["target"]), cllm="none", draft_model="none", medusa2="none",
                                eagle=str(tmp_path)))


def test_a_missing_shipped_draft_model_skips_the_draft_methods_with_a_note(tiny, tmp_path, monkeypatch):
    monkeypatch.setitem(SHIPPED, "stdlib-coder-draft", tmp_path / "absent")
    config = BenchConfig(target=str(tiny["target"]), cllm=str(tiny["cllm"]))
    assert config.draft_model == "stdlib-coder-draft"  # the default
    models = load_models(config)
    assert models.draft is None and "cllm" in models.names
    assert any("draft model 'stdlib-coder-draft' not present" in n and "speculative" in n for n in models.notes)
    assert BenchConfig(draft_model="none").draft_model is None
    out = tmp_path / "b"
    args = small_args(tiny, out, "--methods", "target_ar,speculative", "--sweep-block-sizes", "")
    args[args.index("--draft-model") + 1] = "stdlib-coder-draft"
    assert main(args) == 2  # asked for by name: a one-line error, not a silent skip


@pytest.mark.parametrize("bad", [["--block-size", "0"], ["--methods", "nope"],
                                 ["--repeats", "0"], ["--sweep-block-sizes", "4,0"], ["--draft-tokens", "0"]])
def test_bad_settings_are_one_line_errors(bad, capsys):
    assert main(["bench", *bad]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("cllm bench: error:") and "\n" not in err


def test_an_unknown_method_is_refused_with_the_known_ones(capsys):
    assert main(["bench", "--methods", "target_ar,nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown method(s) nope; choose from target_ar, target_jacobi," in err and err.count("\n") == 1


def test_the_references_a_method_needs_are_added_with_a_note():
    assert with_references([]) == ([], [])
    assert with_references(["target_ar", "target_jacobi"]) == (["target_ar", "target_jacobi"], [])
    methods, notes = with_references(["target_jacobi"])
    assert methods == ["target_ar", "target_jacobi"] and notes[0].startswith("added target_ar: every speedup")
    methods, notes = with_references(["cllm_jacobi", "target_ar"])
    assert methods == ["target_ar", "cllm_ar", "cllm_jacobi"]
    assert notes == ["added cllm_ar: cllm_jacobi's exactness and agreement are measured against it"]
    methods, notes = with_references(["cllm_jacobi_plain", "cllm_ar_sampling"])
    assert methods == ["target_ar", "cllm_ar", "cllm_jacobi_plain", "cllm_ar_sampling"] and len(notes) == 2
    assert notes[1] == ("added cllm_ar: cllm_jacobi_plain's and cllm_ar_sampling's exactness and agreement are "
                        "measured against it")


def small_args(tiny, out, *extra):
    return bench_args(tiny, out, "--repeats", "1", "--val-prompts", "0", *extra)


def test_methods_without_the_cllms_own_ar_and_a_sweep_work(tiny, tmp_path, capsys):
    """The reported crash: the CLLM loaded, its greedy method left out, a block-size sweep."""
    out = tmp_path / "b"
    assert main(small_args(tiny, out, "--methods", "target_ar,target_jacobi", "--sweep-block-sizes", "2,4")) == 0
    data = load(out)
    assert set(data["methods"]) == {"target_ar", "target_jacobi"} and set(data["sweep"]) == {"target"}
    assert any("no block-size sweep of the CLLM" in n for n in data["notes"])
    assert "no block-size sweep of the CLLM" in capsys.readouterr().out


@pytest.mark.parametrize("methods", ["target_ar,cllm_jacobi", "target_ar,cllm_jacobi_sampling",
                                     "target_ar,cllm_ar_sampling,cllm_jacobi_plain", "cllm_jacobi"])
def test_a_cllm_method_without_cllm_ar_gets_it_added_with_a_note(methods, tiny, tmp_path, capsys):
    """Once refused ("needs cllm_ar too"): the references are added and the run says so."""
    out = tmp_path / "b"
    assert main(small_args(tiny, out, "--methods", methods, "--sweep-block-sizes", "")) == 0
    data = load(out)
    asked = methods.split(",")
    assert set(data["methods"]) == {"target_ar", "cllm_ar", *asked}
    added = [n for n in data["notes"] if n.startswith("added ")]
    whose = " and ".join(f"{m}'s" for m in asked if m != "target_ar")
    assert f"added cllm_ar: {whose} exactness and agreement are measured against it" in added
    assert any(n.startswith("added target_ar: ") for n in added) == ("target_ar" not in asked)
    printed = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert f"added cllm_ar: {whose} exactness" in printed
    assert all(e["ok"] for e in data["exactness"].values()) and data["config"]["methods"] == asked


def test_the_validation_set_is_the_shipped_domain_or_the_prompts_own_references(tiny):
    """--val-set auto: stdlib-val for the shipped models only; another target's own --prompts set
    when its prompts carry references; else no validation loss, with a note. A named set is kept."""
    assert validation_set(BenchConfig()) == ("stdlib-val", None)
    assert validation_set(BenchConfig(target=str(SHIPPED["stdlib-coder"]))) == ("stdlib-val", None)
    assert validation_set(BenchConfig(target=str(tiny["target"]), val_set="stdlib-val")) == ("stdlib-val", None)
    name, note = validation_set(BenchConfig(target=str(tiny["target"]), prompts=str(tiny["val"])))
    assert name == str(tiny["val"]) and "validation loss on the --prompts set" in note
    name, note = validation_set(BenchConfig(target=str(tiny["target"]), prompts=str(tiny["prompts"])))
    assert name is None and note.startswith("no validation loss: ") and "carry no references" in note
    assert validation_set(BenchConfig(target=str(tiny["target"]), prompts=str(tiny["prompts"]), val_prompts=0)) == (
        None, None)  # nothing would be scored: nothing to say


@pytest.mark.parametrize("prompts", ["val", "prompts"])
def test_another_targets_validation_loss_comes_from_its_prompts_or_is_skipped(prompts, tiny, tmp_path, capsys):
    out = tmp_path / "b"
    args = small_args(tiny, out, "--methods", "target_ar,target_jacobi", "--sweep-block-sizes", "",
                      "--prompts", str(tiny[prompts]), "--val-prompts", "2")  # the last of a flag counts
    args[args.index("--val-set"):args.index("--val-set") + 2] = []  # the default: auto
    assert main(args) == 0
    data = load(out)
    assert data["config"]["val_set"] == "auto" and data["val_set"]["prompts"] == 2
    losses = [m["val_loss"] for m in data["models"].values()]
    if prompts == "val":  # its prompts carry references
        assert data["val_set"]["name"] == str(tiny["val"]) and all(isinstance(v, float) for v in losses)
        assert any(n.startswith("validation loss on the --prompts set") for n in data["notes"])
    else:
        assert data["val_set"]["name"] is None and losses == [None, None]
        assert any(n.startswith("no validation loss: ") for n in data["notes"])
        assert "val loss (no set, nats/token)" in (out / "report.md").read_text()
    assert "validation loss" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("where", ["the target", "the cllm", "a foreign directory"])
def test_an_out_that_is_a_model_or_holds_foreign_files_is_refused_before_anything_loads(
        where, tiny, tmp_path, monkeypatch, capsys):
    def never(*args, **kwargs):
        raise AssertionError("models were loaded")

    monkeypatch.setattr(command_module, "load_models", never)
    out = {"the target": tiny["target"], "the cllm": tiny["cllm"]}.get(where, tmp_path / "mine")
    out.mkdir(exist_ok=True)
    (out / "notes.txt").write_text("mine")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert main(small_args(tiny, out)) == 2
    err = capsys.readouterr().err
    why = "folder: choose another" if where != "a foreign directory" else "did not write"
    assert err.count("\n") == 1 and why in err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    (out / "notes.txt").unlink()


def test_every_method_subset_with_its_references_runs(tiny, tmp_path):
    """Each method alone beside the references it needs (target_ar; cllm_ar for cllm_*)."""
    for method in ("target_jacobi", "hf_generate", "prompt_lookup", "target_lookahead", "cllm_jacobi",
                   "cllm_jacobi_plain", "cllm_ar_sampling", "cllm_jacobi_sampling", "speculative", "cllm_speculative"):
        wanted = ["target_ar", *(["cllm_ar"] if method.startswith("cllm") else []), method]
        out = tmp_path / method
        draft = ["--draft-model", str(tiny["draft"]), "--draft-tokens", "3"] if "speculative" in method else []
        assert main(small_args(tiny, out, "--methods", ",".join(wanted), "--sweep-block-sizes", "4",
                               *draft)) == 0, method
        assert set(load(out)["methods"]) == set(wanted)


def test_an_interrupted_bench_keeps_its_decodes_and_the_same_command_resumes(tiny, tmp_path, monkeypatch, capsys):
    real = timing_module.timed
    calls = []

    def interrupt_after(limit):
        def timed(method, prompt, device):
            calls.append((method.name, prompt.id))
            if len(calls) > limit:
                raise KeyboardInterrupt
            return real(method, prompt, device)
        return timed

    out = tmp_path / "b"
    args = small_args(tiny, out, "--methods", "target_ar,target_jacobi,cllm_ar,cllm_jacobi", "--sweep-block-sizes", "4",
                      "--warmup", "0")
    per_prompt = 4  # methods x 1 round
    monkeypatch.setattr(timing_module, "timed", interrupt_after(2 * per_prompt + 1))  # Ctrl-C in prompt 3
    assert main(args) == 130
    assert "the same command resumes" in capsys.readouterr().out
    records = [json.loads(line) for line in (out / "progress.jsonl").read_text().splitlines()]
    assert [r["prompt_id"] for r in records if r["kind"] == "decode"] == ["q0"] * 4 + ["q1"] * 4
    calls.clear()
    monkeypatch.setattr(timing_module, "timed", interrupt_after(10**6))
    assert main(args) == 0
    assert {p for _, p in calls} == {"q2", "q3", "q4"} and len(calls) == 3 * per_prompt  # q0, q1 not redone
    data = load(out)
    assert any(n.startswith("resumed: 8 of 20") for n in data["notes"])
    resumed = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    # the resumed run reports what one uninterrupted run reports (tokens; timings differ)
    monkeypatch.setattr(timing_module, "timed", real)
    fresh_out = tmp_path / "fresh"
    assert main(small_args(tiny, fresh_out, *args[len(small_args(tiny, out)):])) == 0
    fresh = [json.loads(line) for line in (fresh_out / "outputs.jsonl").read_text().splitlines()]
    assert resumed == fresh
    assert load(fresh_out)["sweep"] == data["sweep"]


def test_a_run_with_other_settings_keeps_the_old_record_and_measures_afresh(tiny, tmp_path, monkeypatch):
    out = tmp_path / "b"
    base = small_args(tiny, out, "--methods", "target_ar,target_jacobi", "--sweep-block-sizes", "")
    assert main(base) == 0
    calls = []
    real = timing_module.timed
    monkeypatch.setattr(timing_module, "timed", lambda *a: calls.append(1) or real(*a))
    assert main([*base, "--block-size", "2"]) == 0
    assert len(calls) == 2 + 2 * len(PROMPTS)  # warm-up + every prompt: nothing reused
    kept = list(out.glob("progress-*.jsonl"))
    assert len(kept) == 1 and kept[0].read_text().count('"kind": "decode"') == 2 * len(PROMPTS)
    calls.clear()
    assert main([*base, "--block-size", "2", "--resume", "false"]) == 0
    assert len(calls) == 2 + 2 * len(PROMPTS) and len(list(out.glob("progress-*.jsonl"))) >= 1


@pytest.mark.parametrize(("load", "cores", "threads", "warns"), [
    (0.1, 2, 2, False), (2.3, 2, 2, True), (0.9, 2, 1, False), (1.6, 2, 1, True), (3.0, 16, 2, False),
    (None, 2, 2, False)])
def test_a_busy_machine_is_warned_about(load, cores, threads, warns):
    message = load_warning(load, cores, threads)
    assert (message is not None) == warns
    if warns:
        assert "unreliable" in message and f"{load:.1f}" in message


def test_without_matplotlib_the_report_is_written_without_plots(tiny, tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib...` now fails
    out = tmp_path / "b"
    assert main(small_args(tiny, out, "--methods", "target_ar,target_jacobi", "--sweep-block-sizes", "")) == 0
    assert not list(out.glob("*.png")) and "matplotlib is not installed" in " ".join(load(out)["notes"])
    assert "](speedup.png)" not in (out / "report.md").read_text()


def test_humaneval_exec_reports_pass_at_1_per_method(tiny, tmp_path, capsys):
    """The tiny random models write noise: every completion fails its tests (pass@1 0), and the
    exact method's completions are its AR's (run once)."""
    out = tmp_path / "b"
    args = small_args(tiny, out, "--methods", "target_ar,target_jacobi", "--sweep-block-sizes", "", "--prompts",
                      "humaneval", "--max-prompts", "2", "--quality", "humaneval-exec", "--quality-timeout", "2")
    assert main(args) == 0
    data = load(out)
    assert {m: r["pass_at_1"] for m, r in data["methods"].items()} == {"target_ar": 0.0, "target_jacobi": 0.0}
    q = data["quality"]
    assert q["kind"] == "humaneval-exec" and q["distinct_completions"] == 2 and set(q["results"]) == {"HumanEval/0",
                                                                                                      "HumanEval/1"}
    assert all(r != "passed" for per in q["results"].values() for r in per.values())
    assert "pass@1" in capsys.readouterr().out and "## HumanEval tests (pass@1)" in (out / "report.md").read_text()


def test_humaneval_exec_needs_the_humaneval_prompts(capsys):
    assert main(["bench", "--quality", "humaneval-exec", "--prompts", "stdlib-val"]) == 2
    assert "needs --prompts humaneval" in capsys.readouterr().err


@pytest.mark.parametrize(("load", "cores", "threads"), [(0.2, 2, 2), (0.9, 2, 1), (3.8, 2, 1), (3.0, 16, 2),
                                                         (None, 2, 2), (1.4, 4, 2)])
def test_the_demo_takes_one_thread_when_others_keep_the_cpu_busy(load, cores, threads):
    assert threads_for_load(load, cores) == threads


def test_the_bench_progress_line_counts_decodes_done_and_left_and_the_time_to_go():
    from cllm.bench.timing import eta_text

    assert eta_text(10, 40, 20.0) == "10/40 method x prompt decodes done, 30 left · 20 s elapsed, about 60 s to go"
    assert eta_text(5, 10, 300.0) == "5/10 method x prompt decodes done, 5 left · 5.0 min elapsed, about 5.0 min to go"
    assert eta_text(40, 40, 80.0) == "40/40 method x prompt decodes done, 0 left · 80 s elapsed"
    assert eta_text(0, 0, 0.0) == "0/0 method x prompt decodes done, 0 left · 0 s elapsed"
