"""`cllm demo`: greedy vs Jacobi decoding side by side on the embedded default model.

It decodes one prompt both ways with the same model, shows that the texts are identical, how
many forward passes each used, and how the first Jacobi blocks converged (coloured trajectory).
Without a shipped model (a bare checkout) it falls back to a tiny random Llama, whose text is
noise but whose exactness and counting are real.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from cllm.decoding import greedy_decode, jacobi_decode
from cllm.models import SHIPPED, load_model, load_tokenizer
from cllm.report import TrajectoryRecorder, render_block_terminal

FALLBACK_PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'


@dataclass
class DemoConfig:
    model: str = field(default="stdlib-coder", metadata={"help": "model dir, shipped name or hub id"})
    prompt: str | None = field(default=None, metadata={"help": "text to continue (default: the first HumanEval prompt)"})
    block_size: int = field(default=16, metadata={"help": "Jacobi block size n"})
    max_new_tokens: int = field(default=128, metadata={"help": "token budget"})
    show_blocks: int = field(default=2, metadata={"help": "how many blocks' trajectories to print"})
    threads: int = field(default=2, metadata={"help": "torch CPU threads"})

    def __post_init__(self):
        if self.block_size < 1:
            raise ValueError(f"--block-size must be >= 1, got {self.block_size}")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}")


def _tiny_random_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                         initializer_range=0.2)
    return LlamaForCausalLM(config).eval()


def _default_prompt() -> str:
    try:
        from cllm.data.prompts import load_prompts

        return load_prompts("humaneval", limit=1)[0].text
    except Exception:  # noqa: BLE001 - the demo must run even without the prompt sets
        return FALLBACK_PROMPT


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def demo(config: DemoConfig) -> int:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    torch.set_num_threads(config.threads)
    shipped = config.model in SHIPPED and (SHIPPED[config.model] / "config.json").is_file()
    if config.model in SHIPPED and not shipped:
        console.print(f"[yellow]shipped model {config.model!r} not found; using a tiny random Llama "
                      "(its text is noise, its exactness is real)[/]")
        model, tokenizer = _tiny_random_model(), None
    else:
        model, tokenizer = load_model(config.model), load_tokenizer(config.model)

    prompt = config.prompt if config.prompt is not None else _default_prompt()
    if tokenizer is not None:
        input_ids = tokenizer(prompt, return_tensors="pt").input_ids
        eos = tokenizer.eos_token_id
        decode_token = lambda t: tokenizer.decode([t])  # noqa: E731
        decode_text = lambda ids: tokenizer.decode(ids)  # noqa: E731
    else:
        input_ids = torch.tensor([list(prompt.encode("utf-8"))])
        eos = None
        decode_token = lambda t: bytes([t]).decode("latin-1")  # noqa: E731
        decode_text = lambda ids: bytes(ids).decode("utf-8", errors="replace")  # noqa: E731
    if input_ids.shape[1] == 0:
        raise ValueError("the prompt is empty")

    budget = dict(max_new_tokens=config.max_new_tokens, eos_token_id=eos)
    greedy_decode(model, input_ids, max_new_tokens=4, eos_token_id=eos)  # warm-up
    ar, t_ar = _timed(lambda: greedy_decode(model, input_ids, **budget))
    recorder = TrajectoryRecorder()
    jac, t_jac = _timed(lambda: jacobi_decode(
        model, input_ids, block_size=config.block_size, on_iteration=recorder,
        generator=torch.Generator().manual_seed(0), **budget))

    console.rule(f"[bold]cllm demo[/] · {config.model} · n = {config.block_size} · "
                 f"{config.max_new_tokens} new tokens")
    console.print("[dim]prompt:[/]")
    console.print(prompt.rstrip(), markup=False, highlight=False)
    same = ar.new_tokens == jac.new_tokens
    table = Table(show_lines=True)
    table.add_column("greedy autoregressive", overflow="fold", ratio=1)
    table.add_column(f"Jacobi (n = {config.block_size})", overflow="fold", ratio=1)
    table.add_row(decode_text(ar.new_tokens[0]), decode_text(jac.new_tokens[0]))
    n_tokens = len(ar.new_tokens[0])
    table.add_row(
        f"{ar.forward_passes} forward passes · {ar.stats.tokens_per_forward:.2f} tokens/forward · "
        f"{n_tokens / t_ar:.1f} tokens/s",
        f"{jac.forward_passes} forward passes · {jac.stats.tokens_per_forward:.2f} tokens/forward · "
        f"{n_tokens / t_jac:.1f} tokens/s",
    )
    console.print(table)
    verdict = "[bold green]identical[/]" if same else "[bold red]DIFFERENT (a bug: please report)[/]"
    console.print(f"outputs: {verdict} · speed ratio Jacobi/AR {t_ar / t_jac:.2f}x (wall clock, one run)")
    console.print(f"accepted tokens per forward (histogram): {jac.stats.accepted_histogram()}")
    console.print(f"fast-forwarded per update (mean): {jac.stats.mean_fast_forwarded:.2f} · "
                  f"stationary tokens: {jac.stats.stationary_tokens}")
    for block in recorder.blocks[0][: config.show_blocks]:
        console.print(f"\n[bold]block {block.block_index}[/] trajectory "
                      "([green]final[/] · [yellow]correct, not yet final[/] · [red]wrong[/])")
        for line in render_block_terminal(block, decode_token):
            console.print(line)
    return 0 if same else 1
