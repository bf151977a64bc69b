"""A command that trains or collects on a checkpoint folder, given a GGUF file, says so in one line
and names `cllm import`, which makes a folder of it (`cllm.models.loading.resolve_model_path`,
where every torch-side command resolves its model), before it writes anything."""

from __future__ import annotations

import shlex

import pytest

from cllm.cli import main
from cllm.core.errors import UserError
from cllm.models import load_model, load_tokenizer, resolve_model_path


def gguf_like(path):
    path.write_bytes(b"GGUF" + bytes(60))  # GGUF's magic: nothing past it is read
    return path


def expected(command: str, model) -> str:
    return (f"cllm {command}: error: this command needs a checkpoint folder, and {model} is a GGUF file: make one "
            f"with `cllm import {shlex.quote(str(model))} --out DIR`")


@pytest.mark.parametrize("command", ["collect", "train"])
def test_collect_and_train_given_a_gguf_name_cllm_import_in_one_line(command, tmp_path, capsys):
    model = gguf_like(tmp_path / "x.gguf")
    assert main([command, "--model", str(model), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == expected(command, model) + "\n"
    assert not (tmp_path / "out").exists()


@pytest.mark.llamacpp  # export checks for the gguf package first
def test_export_given_a_gguf_names_cllm_import_in_one_line(tmp_path, capsys):
    model = gguf_like(tmp_path / "my model.gguf")
    assert main(["export", "--model", str(model), "--gguf", str(tmp_path / "out.gguf")]) == 2
    assert capsys.readouterr().err == expected("export", model) + "\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my model.gguf"]


def test_a_gguf_is_told_by_its_first_bytes_whatever_its_name(tmp_path):
    model = gguf_like(tmp_path / "weights.bin")
    for load in (resolve_model_path, load_model, load_tokenizer):
        with pytest.raises(UserError, match="is a GGUF file: make one with `cllm import"):
            load(model)


def test_a_missing_gguf_is_still_not_found(tmp_path):
    with pytest.raises(UserError, match="^model directory not found"):
        resolve_model_path(tmp_path / "none.gguf")
