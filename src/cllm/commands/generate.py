"""`cllm generate`: one prompt decoded and its text streamed to stdout as it becomes final,
through `cllm.serving.completion` (which `cllm chat` and the HTTP server share); the speed line
goes to stderr. `--chat` sends the prompt as a user's turn through the model's chat template;
`--show-trajectory` prints every Jacobi iteration instead, tokens coloured.
"""

from __future__ import annotations

import sys
from pathlib import Path

from rich.console import Console

from cllm.bench.pictures import render_block_terminal, sources_summary, trajectory_legend
from cllm.core.errors import UserError
from cllm.decoding import IterationEvent
from cllm.decoding.trajectory import TrajectoryRecorder
from cllm.serving.completion import TextCodec, complete
from cllm.serving.loading import load_options
from cllm.serving.options import GenerateConfig

Config = GenerateConfig


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
    """Text to stdout at once (a stream's chunks are shown as they come)."""
    sys.stdout.write(chunk)
    sys.stdout.flush()


def _trajectory_printer(codec: TextCodec):
    """The engine's `on_iteration` hook for `--show-trajectory`: each block's iterations printed
    when it converges, tokens coloured; returns (hook, console)."""
    console, recorder = Console(file=sys.stdout, highlight=False), TrajectoryRecorder()
    console.print(trajectory_legend())

    def on_iteration(event: IterationEvent) -> None:
        recorder(event)
        if event.converged:
            block = recorder.blocks[event.row][-1]
            console.print(f"[bold]block {block.block_index}[/] · {len(block.states) - 1} iterations · "
                          f"{sources_summary(block.sources)}")
            for line in render_block_terminal(block, lambda t: codec.decode([t])):
                console.print(line)

    return on_iteration, console


def chat_ids(codec: TextCodec, prompt: str) -> list[int]:
    """`--chat`: the prompt as a user's turn, with the assistant's turn opened (the chat
    template's generation prompt)."""
    if not codec.has_chat_template:
        raise UserError("--chat: this model's tokenizer has no chat template (leave --chat out to continue the "
                        "prompt's text)")
    return codec.chat_ids([{"role": "user", "content": prompt}])


def run(config: Config) -> int:
    """Decode one prompt; the text goes to stdout as it converges, the speed line to stderr."""
    prompt = read_prompt(config)
    served = load_options(config)
    if config.verbose:
        print(f"forward: {served.model.describe()}", file=sys.stderr)
        print(f"decoding: {config.params().label}, {config.engine}", file=sys.stderr)
    prompt_ids = chat_ids(served.codec, prompt) if config.chat else served.codec.encode(prompt)
    if not prompt_ids:
        raise UserError("the prompt encodes to no tokens")

    on_iteration, on_text = None, _write
    if config.show_trajectory:
        on_iteration, console = _trajectory_printer(served.codec)
        on_text = None  # the text comes after the trajectories
    result = complete(served.model, served.codec, prompt_ids, config.params(), on_text=on_text,
                      on_iteration=on_iteration, draft_table=served.draft_table, heads=served.heads,
                      eagle=served.eagle)
    if config.show_trajectory:
        console.rule("text")
        _write(result.text)
    _write("\n")
    print(result.summary(), file=sys.stderr)
    return 0

