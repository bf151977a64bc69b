"""`cllm generate --chat`: the prompt is sent as a user's turn, written by the model's chat
template, and the output is greedy decoding's reply to it; a model without a template is a
one-line error."""

from __future__ import annotations

import pytest

from cllm.cli import main
from tests.commands.test_generate import CHAT_TEMPLATE, NEW, Oracle, save_tiny_model


@pytest.fixture(scope="module")
def templated(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("chat"), chat_template=CHAT_TEMPLATE)


def test_generate_chat_writes_the_prompt_as_a_users_turn_with_the_template(templated, capsys):
    oracle = Oracle(templated)
    capsys.readouterr()
    prompt = "def f(x):"
    assert main(["generate", "--model", str(templated), "--prompt", prompt, "--chat",
                 "--max-new-tokens", str(NEW)]) == 0
    out = capsys.readouterr().out
    assert out == oracle.text(oracle.chat_ids([{"role": "user", "content": prompt}])) + "\n"
    assert out != oracle.text(prompt) + "\n"


def test_generate_chat_without_a_template_is_one_line(tmp_path, capsys):
    plain = save_tiny_model(tmp_path / "plain")
    capsys.readouterr()
    assert main(["generate", "--model", str(plain), "--prompt", "x", "--chat"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "no chat template" in err
