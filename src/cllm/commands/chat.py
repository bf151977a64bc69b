"""`cllm chat`: a conversation in the terminal, one user turn per line of stdin, each reply
streamed as it becomes final through `cllm.serving.completion` (which `cllm generate` and the
HTTP server share). The history is kept within the model's context by
`cllm.serving.history.trim_history`.
"""

from __future__ import annotations

import functools
import sys

from cllm.core.errors import UserError, first_line
from cllm.decoding.inputs import position_limit
from cllm.serving.completion import complete
from cllm.serving.history import trim_history
from cllm.serving.loading import ServedModel, load_options
from cllm.serving.options import ChatConfig

Config = ChatConfig

CHAT_COMMANDS = {"/help": "show this", "/reset": "forget the conversation (the system message stays)",
                 "/exit": "quit (so do Ctrl-D, and Ctrl-C while no reply is being written)"}
CHAT_HELP = ("commands: " + " · ".join(f"{c} {what}" for c, what in CHAT_COMMANDS.items())
             + " · Ctrl-C during a reply stops it and keeps the chat")


def _write(chunk: str) -> None:
    sys.stdout.write(chunk)
    sys.stdout.flush()


def _show(shown: list[str], chunk: str) -> None:
    shown.append(chunk)
    _write(chunk)


def run(config: Config) -> int:
    """Read a user turn per line from stdin, stream the reply; `/exit`, EOF or Ctrl-C at the
    prompt quits. `/help` and `/reset` are commands, never sent to the model. The history is
    trimmed from its oldest turns when it would not leave the reply room in the model's context
    (said on stderr); Ctrl-C during a reply stops it and the chat goes on.

    With a chat template, turns are formatted by it; without one, the model continues the plain
    concatenation of every turn's text (a base model's "chat").
    """
    served = load_options(config)
    codec, interactive = served.codec, sys.stdin.isatty()
    if not codec.has_chat_template:
        print("(this tokenizer has no chat template: the model continues the conversation's "
              "plain text)", file=sys.stderr)
    if interactive:
        print(f"({CHAT_HELP})", file=sys.stderr)
    system = [{"role": "system", "content": config.system}] if config.system and codec.has_chat_template else []
    messages: list[dict] = list(system)
    while True:
        if interactive:
            print("you> ", end="", file=sys.stderr, flush=True)
        try:
            line = sys.stdin.readline()
        except KeyboardInterrupt:
            print(file=sys.stderr)
            return 0
        text = line.rstrip("\n")
        command = text.strip()
        if line == "" or command == "/exit":
            return 0
        if not command:
            continue
        if command.startswith("/") and " " not in command:
            if command == "/reset":
                messages = list(system)
                print("(conversation cleared)", file=sys.stderr)
            else:
                unknown = "" if command == "/help" else f"unknown command {command}; "
                print(f"({unknown}{CHAT_HELP})", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": text})
        if _fit(messages, served, config.max_new_tokens):
            _reply(messages, served, config)


def _fit(messages: list[dict], served: ServedModel, max_new_tokens: int) -> bool:
    """Trim the history in place to leave the reply `max_new_tokens` positions in the model's
    context (said on stderr); False, the new message taken back, when it alone does not fit."""
    limit = position_limit(served.model)
    if limit is None:
        return True
    room = limit - max_new_tokens
    try:
        messages[:], dropped = trim_history(messages, lambda m: len(served.codec.chat_ids(m)), room)
    except UserError as exc:
        messages.pop()
        print(f"error: {exc}", file=sys.stderr)
        return False
    if dropped:
        print(f"(history trimmed: the {dropped} oldest message(s) dropped to leave {max_new_tokens} "
              f"new tokens room in the model's {limit} positions)", file=sys.stderr)
    return True


def _reply(messages: list[dict], served: ServedModel, config: Config) -> None:
    """Stream the assistant's reply and append it to `messages`; Ctrl-C stops it, keeping what
    was shown."""
    shown: list[str] = []
    try:
        result = complete(served.model, served.codec, served.codec.chat_ids(messages), config.params(),
                          on_text=functools.partial(_show, shown), draft_table=served.draft_table,
                          heads=served.heads, eagle=served.eagle)
    except KeyboardInterrupt:  # stop this reply; what was shown stays in the conversation
        _write("\n")
        print("(reply stopped; the chat goes on)", file=sys.stderr)
        if shown:
            messages.append({"role": "assistant", "content": "".join(shown)})
        else:
            messages.pop()
        return
    except ValueError as exc:  # the prompt does not fit a model without a known position limit
        messages.pop()
        print(f"error: {first_line(exc)}", file=sys.stderr)
        return
    _write("\n")
    print(result.summary(), file=sys.stderr)
    messages.append({"role": "assistant", "content": result.text})
