"""A model's chat template is untrusted input, checked when its tokenizer loads
(`cllm.models.chat`): one that reaches for Python's internals is refused by the sandbox, never
run; one that is not Jinja or cannot write a plain conversation is refused too, each in one line
naming the file it came from, before `cllm generate` / `chat` / `serve` start; a template that
refuses only a system message loads. The ids a reply ends at include generation_config.json's.
"""

from __future__ import annotations

import json

import pytest

from cllm.cli import main
from cllm.core.errors import UserError
from cllm.data.tokenizer import train_tokenizer
from cllm.models import load_tokenizer
from cllm.models.chat import end_of_turn_ids
from tests.commands.test_generate import save_tiny_model
from tests.tiny import CODE_TEXTS

# each tries to reach Python's internals from the sandbox; the last would create a file if it ran
ESCAPES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{% for m in messages %}{{ cycler.__init__.__globals__ }}{% endfor %}",
    "{{ joiner.__init__.__globals__.os.system('touch {marker}') }}{{ messages[0]['content'] }}",
]
INTERNALS = ("<class", "subclasses", "__globals__': {", "<module", "<built-in")


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(CODE_TEXTS * 3, vocab_size=300, min_frequency=1)


def folder_with_template(tmp_path, tokenizer, template: str, where: str = "chat_template.jinja"):
    """A tokenizer folder whose chat template is `template`, in `where`: chat_template.jinja, or
    tokenizer_config.json's "chat_template"."""
    folder = tmp_path / "tok"
    tokenizer.save_pretrained(folder)
    if where == "chat_template.jinja":
        (folder / where).write_text(template)
    else:
        config = json.loads((folder / where).read_text())
        (folder / where).write_text(json.dumps({**config, "chat_template": template}))
    return folder


@pytest.mark.parametrize("escape", ESCAPES)
def test_a_template_that_reaches_for_python_internals_is_refused_at_load_and_never_runs(tmp_path, tokenizer,
                                                                                        escape):
    marker = tmp_path / "ran"
    folder = folder_with_template(tmp_path, tokenizer, escape.replace("{marker}", str(marker)))
    with pytest.raises(UserError) as caught:
        load_tokenizer(folder)
    said = str(caught.value)
    assert len(said.splitlines()) == 1 and str(folder / "chat_template.jinja") in said and "sandbox" in said
    assert not any(x in said for x in INTERNALS) and not marker.exists()


@pytest.mark.parametrize("template, why", [
    ("{% for m in messages %}{{ m['content'] }}", "not valid Jinja"),
    ("{{ raise_exception('this template is broken') }}", "this template is broken"),
    ("{{ messages[0]['content'] + 1 }}", "cannot write a conversation"),
])
@pytest.mark.parametrize("where", ["chat_template.jinja", "tokenizer_config.json"])
def test_a_template_that_cannot_write_a_conversation_is_refused_in_one_line_naming_its_file(
        tmp_path, tokenizer, template, why, where):
    folder = folder_with_template(tmp_path, tokenizer, template, where)
    with pytest.raises(UserError, match=why) as caught:
        load_tokenizer(folder)
    assert len(str(caught.value).splitlines()) == 1 and str(folder / where) in str(caught.value)


def test_a_template_that_refuses_only_a_system_message_loads(tmp_path, tokenizer):
    """Gemma's template raises on a system role: the model still chats without one."""
    template = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
                "{% endif %}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    loaded = load_tokenizer(folder_with_template(tmp_path, tokenizer, template))
    assert loaded.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "<user>hi"


@pytest.mark.parametrize("command", [["generate", "--prompt", "def f(x):"], ["chat"], ["serve", "--port", "0"]])
def test_the_commands_refuse_a_model_with_a_sandbox_escaping_template_in_one_line(tmp_path, capsys, command):
    model = save_tiny_model(tmp_path / "model")
    (model / "chat_template.jinja").write_text(ESCAPES[0])
    capsys.readouterr()  # saving's progress bar
    assert main([command[0], "--model", str(model), *command[1:], "--threads", "1"]) == 2
    out, err = capsys.readouterr()
    assert len(err.strip().splitlines()) == 1 and "chat_template.jinja" in err and "Traceback" not in err
    assert not any(x in out + err for x in INTERNALS)


def test_a_reply_ends_at_the_eos_and_the_eos_ids_of_generation_config(tmp_path, tokenizer):
    tokenizer.save_pretrained(tmp_path)
    assert end_of_turn_ids(load_tokenizer(tmp_path)) == {tokenizer.eos_token_id}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, tokenizer.eos_token_id]}))
    assert end_of_turn_ids(load_tokenizer(tmp_path)) == {tokenizer.eos_token_id, 7}
    (tmp_path / "generation_config.json").write_text("{not json")  # said in the log; the tokenizer's EOS stays
    assert end_of_turn_ids(load_tokenizer(tmp_path)) == {tokenizer.eos_token_id}
