"""No command writes into a folder or over a file it did not write: each one, pointed at a
user's folder or a model's checkpoint, stops with one line and every byte there stays as it
was; a draft table or heads of a model are replaced only with --force; a damaged trajectory
shard is collected again on resume."""

import hashlib
import json

import pytest

from cllm.cli import main
from cllm.core.outputs import MARKER
from tests.commands.test_generate import save_tiny_model


def digest(folder) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("outputs") / "model")


@pytest.fixture
def users_folder(tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    for name in ("report.md", "config.json", "MODEL_CARD.md", "outputs.jsonl", "train_config.json", "progress.jsonl"):
        (folder / name).write_text(f"the user's own {name}\n")
    (folder / "progress.jsonl").write_text("1\n")
    return folder


def commands(model, prompts, out):
    """Each writing command's arguments with `out` as where it writes."""
    small = ["--max-prompts", "2", "--max-new-tokens", "8"]
    return {
        "collect": ["collect", "--model", model, "--prompts", prompts, "--out", out, *small],
        "train": ["train", "--model", model, "--data", str(out) + "-none", "--out", out, "--eval-count", "0"],
        "distill": ["distill", "--model", model, "--prompts", prompts, "--out", out, "--eval-prompts", prompts],
        "medusa": ["medusa", "--model", model, "--prompts", prompts, "--out", out],
        "bench": ["bench", "--target", model, "--cllm", "none", "--draft-model", "none", "--prompts", prompts,
                  "--out", out, "--max-prompts", "1", "--max-new-tokens", "4", "--sweep-block-sizes", ""],
        "pretrain": ["pretrain", "--out", out],
        "profile": ["profile", "--shape", "tiny", "--k", "1", "--out", out],
    }


@pytest.mark.parametrize("name", ["collect", "train", "distill", "medusa", "bench", "pretrain", "profile"])
def test_no_command_writes_into_a_users_folder_or_a_model(model, prompt_file, users_folder, capsys, name):
    for target in (users_folder, model):
        before = digest(target)
        capsys.readouterr()
        assert main([str(a) for a in commands(str(model), str(prompt_file), target)[name]]) == 2, (name, target)
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and str(target) in err, err
        assert digest(target) == before, (name, target)
        assert not (target / MARKER).exists()


def test_drafts_never_overwrites_a_file_that_is_not_its_table_and_its_own_only_with_force(model, prompt_file,
                                                                                          tmp_path, capsys):
    before = digest(model)
    base = ["drafts", "--model", str(model), "--prompts", str(prompt_file), "--max-new-tokens", "8"]
    notes = tmp_path / "notes.safetensors"
    notes.write_text("mine")
    for out, force, words in ((model / "model.safetensors", [], "lies inside the --model folder"),
                              (model / "model.safetensors", ["--force"], "lies inside the --model folder"),
                              (notes, [], "--force"), (notes, ["--force"], "not a draft table"),
                              (tmp_path, [], "is a folder")):
        capsys.readouterr()
        assert main([*base, "--out", str(out), *force]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and words in err, err
    assert digest(model) == before and not list(tmp_path.glob("*.tmp")) and notes.read_text() == "mine"
    assert main(base) == 0  # the model's own table: a new file
    table = model / "drafts" / "ngram.safetensors"
    made = table.read_bytes()
    capsys.readouterr()
    assert main(base) == 2 and "--force" in capsys.readouterr().err and table.read_bytes() == made
    assert main([*base, "--force"]) == 0


def test_bench_json_never_replaces_a_users_file(model, prompt_file, tmp_path, capsys):
    notes = tmp_path / "notes.md"
    notes.write_text("my notes\n")
    args = commands(str(model), str(prompt_file), tmp_path / "report")["bench"]
    assert main([str(a) for a in args] + ["--json", str(notes)]) == 2
    assert "--json" in capsys.readouterr().err and notes.read_text() == "my notes\n"
    assert not (tmp_path / "report").exists()  # refused before anything was written
    bench_json = tmp_path / "bench.json"
    assert main([str(a) for a in args] + ["--json", str(bench_json)]) == 0
    assert main([str(a) for a in args] + ["--json", str(bench_json)]) == 0  # its own JSON: rewritten
    assert {"config", "machine", "methods"} <= json.loads(bench_json.read_text()).keys()


def test_a_damaged_shard_is_collected_again_on_resume(model, prompt_file, tmp_path, capsys, caplog):
    out = tmp_path / "traj"
    args = ["collect", "--model", str(model), "--prompts", str(prompt_file), "--out", str(out),
            "--max-new-tokens", "8", "--block-size", "4", "--shard-size", "2"]
    assert main(args) == 0
    shards = sorted(out.glob("shard-*.parquet"))
    assert len(shards) >= 2
    data = bytearray(shards[0].read_bytes())
    data[len(data) // 3] ^= 0xFF  # one flipped byte in a data page; the footer still reads
    shards[0].write_bytes(bytes(data))
    assert main(args) == 0
    assert (out / (shards[0].name + ".damaged")).exists()
    assert "collected again" in caplog.text
    from cllm.data.trajectories import TrajectoryReader

    records = TrajectoryReader(out).records()
    assert {r.prompt_id for r in records} == {f"p{i}" for i in range(8)}
