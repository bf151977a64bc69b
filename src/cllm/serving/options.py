"""`cllm generate` and `cllm chat`: a prompt (or a conversation) decoded and its text streamed
as it becomes final, through `cllm.serving.completion` (which the HTTP server shares).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from cllm.core.config import is_off
from cllm.core.errors import UserError, first_line
from cllm.decoding import RECOMMENDED_CONFIG, IterationEvent, JacobiConfig
from cllm.serving.completion import (
    METHODS,
    DecodeParams,
    TextCodec,
    complete,
)


def unescape(text: str) -> str:
    r"""`\n`, `\t` and `\\` typed on a command line -> the characters."""
    out, i = [], 0
    while i < len(text):
        pair = text[i : i + 2]
        if pair in ("\\n", "\\t", "\\\\"):
            out.append({"\\n": "\n", "\\t": "\t", "\\\\": "\\"}[pair])
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


@dataclass
class _DecodeOptions:
    model: str = field(default="stdlib-coder", metadata={"help": "model dir, shipped name or hub id"})
    method: Literal["jacobi", "ar"] = field(default="jacobi", metadata={"help": "decoder: Jacobi (blocks) or AR (token "
        "by token)"})
    max_new_tokens: int = field(default=128, metadata={"help": "token budget"})
    stop: list[str] = field(default_factory=list, metadata={"help": r"stop strings, comma-separated (\n, \t "
        r"understood); output is cut at the first"})
    temperature: float = field(default=0.0, metadata={"help": "0 = greedy (exact); > 0 samples, with Jacobi losslessly "
        "(the law of AR sampling)"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling (with --temperature > 0)"})
    top_k: int | None = field(default=None, metadata={"help": "sample among the k most likely tokens (with "
        "--temperature > 0)"})
    seed: int | None = field(default=None, metadata={"help": "seed of the guesses and the sampling draws (default: 0)"})
    engine: JacobiConfig = field(default_factory=lambda: RECOMMENDED_CONFIG, metadata={"help": "the Jacobi engine's "
        "settings (flags --block-size, --recycle, ...)"})
    draft_table: str = field(default="auto", metadata={"help": "Jacobi: the model's draft table (cllm drafts): auto "
        "(the one saved beside the checkpoint, if any), none, or a file; speed only, the output is unchanged"})
    medusa: str = field(default="none", metadata={"help": "decode with Medusa heads (cllm medusa) instead of --method: "
        "auto (those in MODEL/medusa, if any), none, or a heads folder; greedy only, the text is greedy's"})
    dtype: str = field(default="float32", metadata={"help": "float32, bfloat16 or float16"})
    device: str = field(default="cpu", metadata={"help": "torch device"})
    threads: int = field(default=0, metadata={"help": "torch CPU threads (0: torch's default)"})

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"--method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        self.stop = [unescape(s) for s in self.stop]
        if any(s == "" for s in self.stop):
            raise ValueError("--stop strings must not be empty")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"--top-k must be >= 1, got {self.top_k}")
        if self.threads < 0:
            raise ValueError(f"--threads must be >= 0, got {self.threads}")
        if not is_off(self.medusa) and self.temperature > 0:
            raise ValueError("--medusa decodes greedily: use --temperature 0 (or --medusa none)")

    def params(self) -> DecodeParams:
        return DecodeParams(method=self.method, engine=self.engine,
                            max_new_tokens=self.max_new_tokens, stop=tuple(self.stop),
                            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                            seed=self.seed)

    def load(self):
        """The model, its tokenizer (as a TextCodec), its draft table and its Medusa heads (each
        None when not used)."""
        from transformers.utils import logging as hf_logging

        from cllm.models import load_draft_table, load_model, load_tokenizer

        hf_logging.disable_progress_bar()  # stderr is for our own one-line summaries
        if self.threads:
            torch.set_num_threads(self.threads)
        tokenizer = load_tokenizer(self.model)
        table = load_draft_table(self.model, self.draft_table)
        model = load_model(self.model, dtype=self.dtype, device=self.device)
        return model, TextCodec(tokenizer), table, self._heads(model)

    def _heads(self, model):
        from cllm.modeling.heads import load_heads
        from cllm.models import resolve_model_path

        if is_off(self.medusa):
            return None
        path = Path(resolve_model_path(self.model))
        if self.medusa == "auto":
            return load_heads(path, model) if path.is_dir() else None
        heads = load_heads(self.medusa, model, model_path=path if path.is_dir() else None)
        if heads is None:
            raise UserError(f"no Medusa heads in {self.medusa} (cllm medusa writes them)")
        return heads


@dataclass
class GenerateConfig(_DecodeOptions):
    prompt: str | None = field(default=None, metadata={"help": "text to continue; '-' reads stdin (as does a pipe when "
        "no prompt is given)"})
    prompt_file: str | None = field(default=None, metadata={"help": "read the prompt from this file"})
    show_trajectory: bool = field(default=False, metadata={"help": "print every Jacobi iteration, tokens coloured "
        "(final / correct / wrong)"})

    def __post_init__(self):
        super().__post_init__()
        if self.prompt is not None and self.prompt_file is not None:
            raise ValueError("give either --prompt or --prompt-file, not both")
        if self.show_trajectory and (self.method != "jacobi" or self.temperature > 0 or not is_off(self.medusa)):
            raise ValueError("--show-trajectory needs greedy Jacobi decoding (--method jacobi, --temperature 0)")


def read_prompt(config: GenerateConfig) -> str:
    if config.prompt_file is not None:
        path = Path(config.prompt_file)
        if not path.is_file():
            raise UserError(f"prompt file not found: {path}")
        text = path.read_text(encoding="utf-8")
    elif config.prompt == "-" or (config.prompt is None and not sys.stdin.isatty()):
        text = sys.stdin.read()
    elif config.prompt is None:
        raise UserError("no prompt: give --prompt TEXT, --prompt-file FILE, or pipe it on stdin")
    else:
        text = config.prompt
    if not text:
        raise UserError("the prompt is empty")
    return text


def _write(chunk: str) -> None:
    sys.stdout.write(chunk)
    sys.stdout.flush()


def generate(config: GenerateConfig) -> int:
    """Decode one prompt; the text goes to stdout as it converges, the speed line to stderr."""
    from rich.console import Console

    from cllm.bench.report import (
        render_block_terminal,
        sources_summary,
        trajectory_legend,
    )
    from cllm.decoding.trajectory import TrajectoryRecorder

    prompt = read_prompt(config)
    model, codec, table, heads = config.load()
    prompt_ids = codec.encode(prompt)
    if not prompt_ids:
        raise UserError("the prompt encodes to no tokens")

    on_iteration, on_text = None, _write
    if config.show_trajectory:
        console, recorder = Console(file=sys.stdout, highlight=False), TrajectoryRecorder()
        on_text = None  # the text comes after the trajectories
        console.print(trajectory_legend())

        def on_iteration(event: IterationEvent) -> None:
            recorder(event)
            if event.converged:
                block = recorder.blocks[event.row][-1]
                console.print(f"[bold]block {block.block_index}[/] · {len(block.states) - 1} iterations · "
                              f"{sources_summary(block.sources)}")
                for line in render_block_terminal(block, lambda t: codec.decode([t])):
                    console.print(line)

    result = complete(model, codec, prompt_ids, config.params(),
                      on_text=on_text, on_iteration=on_iteration, draft_table=table, heads=heads)
    if config.show_trajectory:
        console.rule("text")
        _write(result.text)
    _write("\n")
    print(result.summary(), file=sys.stderr)
    return 0


@dataclass
class ChatConfig(_DecodeOptions):
    system: str | None = field(default=None, metadata={"help": "system message (used with a chat template)"})


CHAT_COMMANDS = {"/help": "show this", "/reset": "forget the conversation (the system message stays)",
                 "/exit": "quit (so do Ctrl-D, and Ctrl-C while no reply is being written)"}
CHAT_HELP = ("commands: " + " · ".join(f"{c} {what}" for c, what in CHAT_COMMANDS.items())
             + " · Ctrl-C during a reply stops it and keeps the chat")


def trim_history(messages: list[dict], prompt_length: Callable[[list[dict]], int], room: int) -> tuple[list[dict], int]:
    """Drop the oldest turns (a system message stays) until the prompt for the next reply is at
    most `room` tokens long. A dropped user message takes the assistant's reply after it along,
    so the history still starts with a user turn. Returns (messages kept, how many dropped);
    raises UserError when the last message alone does not fit."""
    head = [m for m in messages[:1] if m["role"] == "system"]
    turns = messages[len(head):]
    dropped = 0
    while prompt_length(head + turns) > room:
        if len(turns) <= 1:
            raise UserError(f"this message alone leaves no room for a reply within the model's context "
                            f"({prompt_length(head + turns)} prompt tokens, {room} at most): send a shorter one")
        turns, dropped = turns[1:], dropped + 1
        while len(turns) > 1 and turns[0]["role"] != "user":
            turns, dropped = turns[1:], dropped + 1
    return head + turns, dropped


def _show(shown: list[str], chunk: str) -> None:
    shown.append(chunk)
    _write(chunk)


def chat(config: ChatConfig) -> int:
    """Read a user turn per line from stdin, stream the reply; `/exit`, EOF or Ctrl-C at the
    prompt quits. `/help` and `/reset` are commands, never sent to the model. The history is
    trimmed from its oldest turns when it would not leave the reply room in the model's context
    (said on stderr); Ctrl-C during a reply stops it and the chat goes on.

    With a chat template, turns are formatted by it; without one, the model continues the plain
    concatenation of every turn's text (a base model's "chat").
    """
    from cllm.decoding.inputs import position_limit

    model, codec, table, heads = config.load()
    interactive = sys.stdin.isatty()
    if not codec.has_chat_template:
        print("(this tokenizer has no chat template: the model continues the conversation's "
              "plain text)", file=sys.stderr)
    if interactive:
        print(f"({CHAT_HELP})", file=sys.stderr)
    limit = position_limit(model)
    room = limit - config.max_new_tokens if limit is not None else None
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
        if room is not None:
            try:
                messages, dropped = trim_history(messages, lambda m: len(codec.chat_ids(m)), room)
            except UserError as exc:
                messages.pop()
                print(f"error: {exc}", file=sys.stderr)
                continue
            if dropped:
                print(f"(history trimmed: the {dropped} oldest message(s) dropped to leave {config.max_new_tokens} "
                      f"new tokens room in the model's {limit} positions)", file=sys.stderr)
        shown: list[str] = []
        try:
            result = complete(model, codec, codec.chat_ids(messages), config.params(),
                              on_text=functools.partial(_show, shown), draft_table=table, heads=heads)
        except KeyboardInterrupt:  # stop this reply; what was shown stays in the conversation
            _write("\n")
            print("(reply stopped; the chat goes on)", file=sys.stderr)
            if shown:
                messages.append({"role": "assistant", "content": "".join(shown)})
            else:
                messages.pop()
            continue
        except ValueError as exc:  # the prompt does not fit a model without a known position limit
            messages.pop()
            print(f"error: {first_line(exc)}", file=sys.stderr)
            continue
        _write("\n")
        print(result.summary(), file=sys.stderr)
        messages.append({"role": "assistant", "content": result.text})
