"""The one output rule (`cllm.core.outputs`): a folder is a command's own only by its marker,
files are replaced only when recognised or with --force, bad paths are one line."""

import os

import pytest

from cllm.core.errors import UserError
from cllm.core.outputs import MARKER, check_folder, check_new_file, claim_folder, read_marker, share_like_siblings


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
