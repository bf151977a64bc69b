"""The one output rule (`cllm.core.outputs`): a folder is a command's own only by its marker,
files are replaced only when recognised or with --force, bad paths are one line."""

import os

import pytest

from cllm.core.errors import UserError
from cllm.core.outputs import (
    MARKER,
    Input,
    check_distinct,
    check_folder,
    check_new_file,
    claim_folder,
    read_marker,
    replacing,
    share_like_siblings,
    write_failures,
)


def refused(call, *words) -> str:
    with pytest.raises(UserError) as info:
        call()
    message = str(info.value)
    assert len(message.splitlines()) == 1 and all(w in message for w in words), message
    return message


def test_a_new_or_empty_folder_is_taken_and_marked_and_the_same_command_finds_it_again(tmp_path):
    new, empty = tmp_path / "a" / "b", tmp_path / "empty"
    empty.mkdir()
    for folder in (new, empty):
        assert check_folder(folder, "train") == folder and not (folder / MARKER).exists()
        claim_folder(folder, "train")
        marker = read_marker(folder)
        assert marker["command"] == "train" and marker["run_id"]
        (folder / "train_log.jsonl").write_text("{}\n")
        check_folder(folder, "train")  # its own run: resumed
        claim_folder(folder, "train")
        assert read_marker(folder) == marker  # the run keeps its id


def test_a_users_folder_or_another_commands_is_refused_unless_forced(tmp_path):
    mine = tmp_path / "notes"
    mine.mkdir()
    (mine / "train_config.json").write_text("{}")  # a file name that matches proves nothing
    refused(lambda: check_folder(mine, "train"), "did not write", MARKER)
    assert "--force" not in refused(lambda: check_folder(mine, "train"))
    assert "--force" in refused(lambda: check_folder(mine, "medusa", force=False))
    check_folder(mine, "medusa", force=True)
    other = tmp_path / "bench-run"
    claim_folder(other, "bench")
    (other / "report.md").write_text("x")
    refused(lambda: check_folder(other, "collect"), "holds a cllm bench run")


def test_files_inputs_and_unwritable_places_are_one_line(tmp_path):
    file = tmp_path / "f.txt"
    file.write_text("x")
    refused(lambda: check_folder(file, "bench"), "is a file, not a folder")
    model = tmp_path / "model"
    model.mkdir()
    refused(lambda: check_folder(model, "train", inputs=[("--model", model)]), "is the --model folder")
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        refused(lambda: check_folder(locked / "out", "train"), "not writable")
        refused(lambda: claim_folder(locked / "out", "train"), "cannot write")


def test_an_existing_file_is_replaced_only_when_recognised_or_forced(tmp_path):
    notes = tmp_path / "notes.md"
    notes.write_text("my notes")
    refused(lambda: check_new_file(notes, flag="--json", what="bench JSON"), "--json", "--force")
    check_new_file(notes, force=True)
    check_new_file(notes, replaceable=lambda p: p.read_text() == "my notes")
    refused(lambda: check_new_file(tmp_path, what="draft table"), "is a folder")
    assert check_new_file(tmp_path / "new.json") == tmp_path / "new.json"


def test_a_private_weights_file_gets_its_siblings_permissions(tmp_path):
    (tmp_path / "model.safetensors").write_text("x")
    (tmp_path / "model.safetensors").chmod(0o600)
    (tmp_path / "config.json").write_text("{}")
    share_like_siblings(tmp_path)
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask


@pytest.fixture
def model(tmp_path):
    """A checkpoint folder as a command reads it."""
    folder = tmp_path / "model"
    folder.mkdir()
    for name, text in (("config.json", "{}"), ("model.safetensors", "weights"), ("tokenizer.json", "{}")):
        (folder / name).write_text(text)
    return folder


def test_no_output_is_an_input_or_lies_inside_one_force_or_not(model, tmp_path):
    given = [Input("--model", model, owned=("drafts", "decode_defaults.json"))]
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        refused(lambda n=name: check_new_file(model / n, force=True, flag="--gguf", inputs=given), "--model")
    refused(lambda: check_new_file(model / "new.gguf", force=True, inputs=given), "lies inside the --model folder")
    assert check_new_file(model / "drafts" / "ngram.safetensors", inputs=given)  # where cllm keeps its own files
    (model / "decode_defaults.json").write_text("{}")
    assert check_new_file(model / "decode_defaults.json", force=True, inputs=given)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("{}\n")
    refused(lambda: check_new_file(prompts, force=True, inputs=[Input("--prompts", prompts)]), "is the --prompts file")
    refused(lambda: check_folder(model / "sub", "collect", inputs=[("--model", model)]), "lies inside")
    assert (model / "model.safetensors").read_text() == "weights"


def test_a_link_to_an_input_is_the_input(model, tmp_path):
    given = [Input("--model", model)]
    soft, hard = tmp_path / "soft.gguf", tmp_path / "hard.gguf"
    soft.symlink_to(model / "model.safetensors")
    os.link(model / "tokenizer.json", hard)
    refused(lambda: check_new_file(soft, force=True, inputs=given), "--model")
    refused(lambda: check_new_file(hard, force=True, inputs=given), "is a link to a file of the --model folder")
    linked_folder = tmp_path / "elsewhere"
    linked_folder.symlink_to(model, target_is_directory=True)
    refused(lambda: check_new_file(linked_folder / "x.json", force=True, inputs=given), "lies inside")


def test_a_file_of_any_checkpoint_is_never_replaced_nor_a_model_folder_written_into(model):
    refused(lambda: check_new_file(model / "model.safetensors", force=True), "a file of the model checkpoint")
    refused(lambda: check_folder(model, "medusa", force=True), "model checkpoint folder", "--force never")
    claim_folder(model / "run", "train")
    (model / "run" / "config.json").write_text("{}")  # a checkpoint train wrote: its own run
    assert check_folder(model / "run", "train") == model / "run"
    refused(lambda: check_folder(model / "run", "medusa", force=True), "model checkpoint folder")


def test_two_outputs_of_one_command_never_share_a_path(tmp_path):
    check_distinct([("--gguf", tmp_path / "a"), ("--lookup-cache", tmp_path / "b"), ("--json", None)])
    refused(lambda: check_distinct([("--gguf", tmp_path / "a"), ("--lookup-cache", tmp_path / "x" / ".." / "a")]),
            "--lookup-cache and --gguf are the same path")


def test_replacing_leaves_the_users_files_of_any_temporary_name_and_writes_whole_or_nothing(tmp_path):
    out = tmp_path / "table.safetensors"
    mine = [tmp_path / "table.tmp", tmp_path / "table.safetensors.tmp", tmp_path / ".table.safetensors.partial"]
    for file in mine:
        file.write_text("mine")
    with replacing(out) as tmp:
        assert tmp.parent == tmp_path and tmp not in mine
        tmp.write_text("new")
    assert out.read_text() == "new" and all(f.read_text() == "mine" for f in mine)
    with pytest.raises(RuntimeError), replacing(out) as tmp:
        tmp.write_text("half")
        raise RuntimeError("the write failed")
    assert out.read_text() == "new" and sorted(tmp_path.iterdir()) == sorted([out, *mine])
    target = tmp_path / "target.txt"
    target.write_text("the link's target")
    link = tmp_path / "link.txt"
    link.symlink_to(target)
    with replacing(link) as tmp:
        tmp.write_text("replaced")
    assert not link.is_symlink() and link.read_text() == "replaced" and target.read_text() == "the link's target"


def test_a_failed_write_names_the_file_it_was_writing(tmp_path):
    def full_disk():
        with write_failures(tmp_path / "cache.lookup"):
            raise OSError(28, "No space left on device", str(tmp_path / ".cache.lookup.x.partial"))
    refused(full_disk, f"cannot write {tmp_path / 'cache.lookup'}: No space left on device")
