"""`cllm demo`: the whole story in a few minutes on the shipped models.

1. a short `cllm bench` (8 HumanEval prompts, 128 tokens, n = 4): every method on the same
   prompts, the table printed, the report folder written (JSON, Markdown, PNGs, HTML);
2. one prompt decoded live by Jacobi iteration (the CLLM when there is one), then its first
   blocks' trajectories coloured: final / correct / wrong, fast-forwarded and stationary marked;
3. the verdict (`cllm.bench.verdict`): what made the speed in the table above, drafting or
   consistency training, and what to expect on your own model.

What it falls back to, so that `make demo` never fails on a fresh clone: without the shipped
CLLM, the target-only story (vanilla Jacobi, ~1.0x: docs/method.md#jacobi-decoding); without the
shipped target too, a tiny random Llama with a tokenizer trained on the spot, whose text is noise
but whose exactness and counting are real.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace

import torch
from rich.console import Console
from rich.live import Live
from rich.text import Text
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

from cllm.bench.config import BenchConfig, DemoConfig
from cllm.bench.models import BenchModels, load_models
from cllm.bench.pictures import (
    SOURCE_STYLES,
    render_block_terminal,
    show_token,
    sources_legend,
    sources_summary,
    token_marks,
    trajectory_legend,
)
from cllm.bench.report import IN_LAW, results_renderables, sampled
from cllm.bench.run import BenchResult, raise_on_violations, run_bench, write_report
from cllm.bench.verdict import verdict
from cllm.core.config import write_config
from cllm.core.machine import load_average_1min, threads_for_load
from cllm.core.outputs import check_folder
from cllm.core.progress import Progress
from cllm.data.prompts import load_prompts
from cllm.data.tokenizer import train_tokenizer
from cllm.decoding import RECOMMENDED_CONFIG, jacobi_decode
from cllm.decoding.trajectory import TrajectoryRecorder
from cllm.models import SHIPPED

FALLBACK_PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'


Config = DemoConfig


def _shipped_missing(name: str | None) -> bool:
    return name in SHIPPED and not (SHIPPED[name] / "config.json").is_file()


def fallback_models() -> BenchModels:
    """A tiny random Llama + a small BPE trained on the spot (HumanEval prompts, or one snippet)."""
    try:
        texts = [p.text for p in load_prompts("humaneval", limit=40)]
    except Exception:  # noqa: BLE001 - the fallback must run even without the prompt sets
        texts = [FALLBACK_PROMPT]
    tokenizer = train_tokenizer(texts * 2, vocab_size=512, min_frequency=1)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         initializer_range=0.2, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = LlamaForCausalLM(config).eval()
    return BenchModels(model, tokenizer, names={"target": "tiny random Llama (fallback)"})


def live_decode(console, model, tokenizer, prompt_ids: list[int], *, max_new_tokens: int, delay: float,
                seed: int = 0, **engine):
    """Decode one prompt on the engine (`engine`: jacobi_decode's options, e.g. the bench's
    cllm_jacobi setting), redrawing the text at every iteration: final tokens coloured by where
    they came from (`pictures.SOURCE_STYLES`), the block's not-yet-final tail red. In a log (not a
    terminal) only the last frame is printed, without pauses. Returns (DecodeOutput, TrajectoryRecorder)."""
    recorder = TrajectoryRecorder()
    finished: list[tuple[int, str]] = []  # (token, source) of converged blocks
    live_view = console.is_terminal

    def view(state: tuple[int, ...] = (), committed: int = 0, sources: tuple[str, ...] = (),
             iteration: int = 0) -> Text:
        text = Text()
        for token, source in finished + list(zip(state[:committed], sources)):
            text.append(tokenizer.decode([token]), style=SOURCE_STYLES.get(source, "green"))
        for token in state[committed:]:
            text.append(show_token(tokenizer.decode([token])), style="red dim")
        text.append(f"\n[{len(finished) + committed} tokens final · block iteration {iteration}]", style="dim")
        return text

    with Live(view(), console=console, auto_refresh=False, transient=False) as live:
        def on_iteration(event) -> None:
            recorder(event)
            if event.converged:
                finished.extend(zip(event.state[: event.committed], event.sources))
            if live_view:
                live.update(view() if event.converged else
                            view(event.state, event.committed, event.sources, event.iteration), refresh=True)
                if delay:
                    time.sleep(delay)

        out = jacobi_decode(model, torch.tensor([prompt_ids], device=next(model.parameters()).device),
                            max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                            generator=torch.Generator().manual_seed(seed), on_iteration=on_iteration, **engine)
        final = view()
        final.right_crop(len(final.plain) - len(final.plain.rsplit("\n", 1)[0]))  # no iteration counter
        live.update(final, refresh=True)
    if not console.is_terminal:
        console.print()  # a non-terminal Live leaves its last frame unterminated
    return out, recorder


def _headline(data: dict) -> str:
    m = data["methods"]
    busy = " (machine busy: see the warning)" if data["machine"].get("load_warning") else ""
    parts = [f"{name}: {m[name]['tokens_per_forward']:.2f} tokens/forward, {m[name]['speedup_vs_ar']:.2f}x wall clock"
             for name in ("target_jacobi", "cllm_jacobi_plain", "prompt_lookup", "target_lookahead", "cllm_jacobi")
             if name in m]
    lines = [" · ".join(parts) + busy]
    for name in ("target_lookahead", "cllm_jacobi"):
        if m.get(name, {}).get("token_sources"):
            lines.append(f"{name}'s {sources_summary(m[name]['token_sources'])}")
    exact = all(e["ok"] for e in data["exactness"].values())
    sampling = [name for name in m if sampled(name)]
    lines.append("[bold green]every exact method reproduced greedy decoding token for token[/]" if exact
                 else "[bold red]an exactness promise broke (see the report)[/]")
    if exact and sampling:
        lines.append(f"{' and '.join(sampling)} sample at temperature {data['config'].get('temperature', '?')}: "
                     "exact in law (the distribution of AR sampling), not token for token, so their =AR reads "
                     f"'{IN_LAW}'")
    return "\n".join(lines)


def run(config: Config) -> int:
    """1. a short bench, its table and report folder; 2. one prompt decoded live on the engine
    the headline measures, then its first blocks' trajectories."""
    hf_logging.disable_progress_bar()  # one progress display: ours
    check_folder(config.out, "bench")  # its report folder is a bench report's (refused before anything loads)
    console = Console()
    threads = _threads(config, console)
    bench_config, models = _models(config, threads, console)
    result = _short_bench(config, bench_config, models, console)
    _live(config, bench_config, models, result, console)
    if (line := verdict(result.data["methods"])) is not None:  # 3. what made the speed, from the table above
        console.rule("[bold]verdict[/]")
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    raise_on_violations(result)
    return 0


def _threads(config: DemoConfig, console: Console) -> int:
    """--threads, or 2; 1 on a shared CPU (two that wait on each other made the demo take an hour)."""
    threads = config.threads
    if not threads:
        load = load_average_1min()
        threads = threads_for_load(load, os.cpu_count())
        if threads < 2:
            console.print(f"[yellow]note:[/] load average {load:.1f} on {os.cpu_count()} cores: the demo uses "
                          "1 torch thread (--threads 2 to insist)", highlight=False)
    torch.set_num_threads(threads)
    return threads


def _models(config: DemoConfig, threads: int, console: Console) -> tuple[BenchConfig, BenchModels]:
    """The short bench's settings and its models: the shipped ones, or the tiny random fallback."""
    cllm, target, models = config.cllm, config.target, None
    if _shipped_missing(config.target):
        console.print(f"[yellow]No trained target at {SHIPPED[config.target]} yet (`cllm pretrain` builds it): "
                      "using a tiny random Llama. Its text is noise; its exactness and counting are real.[/]")
        models, cllm, target = fallback_models(), None, "tiny-random-llama (fallback)"
    bench_config = BenchConfig(target=target, cllm=cllm, prompts=config.prompts, max_prompts=config.max_prompts,
                               max_new_tokens=config.max_new_tokens,
                               engine=replace(RECOMMENDED_CONFIG, block_size=config.block_size),
                               sweep_block_sizes=config.sweep_block_sizes, repeats=config.repeats,
                               threads=threads, val_prompts=config.val_prompts, out=config.out,
                               resume=config.resume)
    if models is None:
        models = load_models(bench_config)
        if models.cllm is None:
            console.print("[yellow]No CLLM yet (`cllm distill` makes one): the target-only story. Plain Jacobi "
                          "on an AR-trained model gets ~1 token per forward (docs/method.md).[/]")
    return bench_config, models


def _short_bench(config: DemoConfig, bench_config: BenchConfig, models: BenchModels,
                 console: Console) -> BenchResult:
    """1. Every method on a few prompts: the table, the headline, the report folder."""
    console.rule("[bold]cllm demo[/]")  # a rule's title would be cut at the terminal's width: the details below it
    console.print(f"short bench: {config.max_prompts} × {config.prompts} · {config.max_new_tokens} tokens · "
                  f"n = {config.block_size}", highlight=False)
    start = time.perf_counter()
    result = run_bench(bench_config, models, progress=Progress(console), log=True)
    out = write_report(result, config.out, models.tokenizer)
    write_config(bench_config, out / "config.json")
    write_config(config, out / "demo_config.json")
    for item in results_renderables(result.data, console.width):
        console.print(item)
    console.print(_headline(result.data))
    losses = ", ".join(f"{role} {m['val_loss']:.3f}" for role, m in result.data["models"].items()
                       if m["val_loss"] is not None)
    if losses:
        console.print(f"validation loss ({result.data['val_set']['name']}, nats/token): {losses}")
    console.print(f"report folder: [bold]{out}[/] (bench.json, report.md, PNGs, trajectory.html) · "
                  f"{time.perf_counter() - start:.0f} s")
    return result


def _live(config: DemoConfig, bench_config: BenchConfig, models: BenchModels, result: BenchResult,
          console: Console) -> None:
    """2. One prompt, live, on the engine the headline measures (cllm_jacobi; target_lookahead
    without a CLLM), then its first blocks' trajectories."""
    role = "cllm" if models.cllm is not None else "target"
    model, method = getattr(models, role), {"cllm": "cllm_jacobi", "target": "target_lookahead"}[role]
    table = models.tables.get(role)
    if config.prompt is not None:
        prompt_ids = list(models.tokenizer(config.prompt)["input_ids"]) or [models.tokenizer.eos_token_id or 0]
        text = config.prompt
    else:
        first = next(p for p in result.prompts if p.id == result.data["trajectory_prompt"])
        prompt_ids, text = first.ids, first.text
    setting = (f"n = {config.block_size}, {bench_config.engine.recycle} recycled drafts"
               + (", its draft table" if table is not None else ", no draft table"))
    console.rule("[bold]live[/]")
    console.print(f"{method}, the {role.upper() if role == 'cllm' else role} on the engine ({setting})",
                  highlight=False)
    console.print(text.rstrip(), style="dim", markup=False, highlight=False)
    decoded, recorder = live_decode(console, model, models.tokenizer, prompt_ids, max_new_tokens=config.max_new_tokens,
                                    delay=config.live_delay, draft_table=table, **bench_config.jacobi_kwargs())
    console.print(f"colours: {sources_legend()}")
    console.print(f"{decoded.forward_passes} forward passes ({decoded.stats.tokens_per_forward:.2f} tokens/forward) "
                  f"for {sources_summary(decoded.stats.sources)} · accepted per forward "
                  f"{decoded.stats.accepted_histogram()}", highlight=False)
    for block in recorder.blocks[0][: config.show_blocks]:
        ff = sum(m.fast_forwarded for row in token_marks(block)[1:] for m in row)
        console.print(f"\n[bold]block {block.block_index}[/] ({len(block.states) - 1} updates, {ff} tokens "
                      f"fast-forwarded; {sources_summary(block.sources)}): {trajectory_legend()}", highlight=False)
        for line in render_block_terminal(block, lambda t: models.tokenizer.decode([t])):
            console.print(line)
