"""How much time our decode loops add on top of the model's own forward passes.

(a) greedy_decode vs a bare loop of 1-token forwards with a DynamicCache (argmax fed back);
(b) jacobi_decode at n=16 vs a bare loop that replays the same forward widths and cache
    rollbacks (recorded from the Jacobi run) with plain transformers calls.

Columns: ours and bare ms per forward end to end (min over interleaved repeats: a busy machine
only ever adds time), and "loop ms/fwd": the time our decode call spends outside the model per
forward (Python, cache bookkeeping, syncs), measured by timing the model calls from inside.
Random-weight Llama models, float32, CPU unless CUDA is present.

    python scripts/bench_engine_overhead.py --threads 2
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
import transformers
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from cllm import greedy_decode, jacobi_decode

MODELS = {
    "tiny (2x64, V256)": dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    ),
    "5M (4x256, V8192)": dict(
        vocab_size=8192, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True,
    ),
}  # fmt: skip


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def interleaved_min(fns: dict, device: torch.device, repeats: int) -> dict[str, float]:
    """Min wall-clock seconds of each fn over `repeats` rounds, run in turn (A B A B ...) so that
    a noisy neighbour hurts both alike; min, not mean, because noise only ever adds time."""
    best = {name: float("inf") for name in fns}
    for _ in range(repeats + 1):  # the first round warms up
        for name, fn in fns.items():
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


class Recorder(torch.nn.Module):
    """Wraps a model: records (fed width, cache length before) of every call and the time spent
    inside the model, so that total - inside = the decode loop's own time."""

    def __init__(self, model, device: torch.device):
        super().__init__()
        self.model, self.device = model, device
        self.calls: list[tuple[int, int]] = []
        self.inside = 0.0

    def forward(self, input_ids, cache=None, **kwargs):
        self.calls.append((input_ids.shape[1], cache.get_seq_length()))
        sync(self.device)
        t0 = time.perf_counter()
        out = self.model(input_ids=input_ids, cache=cache, **kwargs)
        sync(self.device)
        self.inside += time.perf_counter() - t0
        return out


def loop_time(decode, model, device: torch.device, repeats: int) -> tuple[float, list]:
    """Min over repeats of (time outside the model) for one decode call; and its forward schedule."""
    best, schedule = float("inf"), []
    for _ in range(repeats + 1):
        recorder = Recorder(model, device)
        t0 = time.perf_counter()
        decode(recorder)
        sync(device)
        best = min(best, time.perf_counter() - t0 - recorder.inside)
        schedule = recorder.calls
    return best, schedule


@torch.inference_mode()
def bare_greedy(model, prompt: torch.Tensor, steps: int) -> None:
    cache = DynamicCache()
    logits = model(input_ids=prompt, cache=cache, use_cache=True).logits
    token = logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(steps - 1):
        logits = model(input_ids=token, cache=cache, use_cache=True).logits
        token = logits[:, -1].argmax(-1, keepdim=True)


@torch.inference_mode()
def bare_replay(model, prompt: torch.Tensor, schedule: list[tuple[int, int]], vocab: int) -> None:
    """Replay Jacobi's forwards: feed `width` tokens, then crop the cache back to the next length."""
    cache = DynamicCache()
    model(input_ids=prompt, cache=cache, use_cache=True)
    feeds = [torch.randint(vocab, (1, width), device=prompt.device) for width, _ in schedule[1:]]
    for ids, (_, next_length) in zip(feeds, schedule[2:] + [(0, None)], strict=True):
        logits = model(input_ids=ids, cache=cache, use_cache=True).logits
        logits.argmax(-1)
        if next_length is not None and cache.get_seq_length() > next_length:
            cache.crop(next_length - cache.get_seq_length())


def bench_model(name: str, kwargs: dict, args, device: torch.device) -> list[list[str]]:
    torch.manual_seed(0)
    config = LlamaConfig(max_position_embeddings=1024, initializer_range=0.02, **kwargs)
    model = LlamaForCausalLM(config).to(device).eval()
    prompt = torch.randint(kwargs["vocab_size"], (1, args.prompt_len), device=device)
    new, vocab = args.max_new_tokens, kwargs["vocab_size"]

    def greedy(m=model):
        return greedy_decode(m, prompt, max_new_tokens=new)

    def jacobi(m=model):
        gen = torch.Generator().manual_seed(0)
        return jacobi_decode(m, prompt, block_size=16, max_new_tokens=new, generator=gen)

    # 1. the decode loops' own time (total minus time inside the model), and Jacobi's schedule
    loop_greedy, _ = loop_time(greedy, model, device, args.repeats)
    loop_jacobi, schedule = loop_time(jacobi, model, device, args.repeats)
    passes = len(schedule)
    mean_width = statistics.mean(w for w, _ in schedule[1:])
    # 2. end to end against bare transformers loops doing the same forwards
    t = interleaved_min(
        {
            "greedy": greedy,
            "bare_greedy": lambda: bare_greedy(model, prompt, new),
            "jacobi": jacobi,
            "bare_replay": lambda: bare_replay(model, prompt, schedule, vocab),
        },
        device,
        args.repeats,
    )

    def ms(seconds: float, k: int) -> str:
        return f"{1e3 * seconds / k:.3f}"

    def row(decoder: str, k: int, ours: float, bare: float, loop: float) -> list[str]:
        return [
            name,
            decoder,
            str(k),
            ms(ours, k),
            ms(bare, k),
            f"{100 * (ours - bare) / bare:+.1f}%",
            ms(loop, k),
        ]

    return [
        row("greedy (1 tok/fwd)", new, t["greedy"], t["bare_greedy"], loop_greedy),
        row(
            f"jacobi n=16 (mean width {mean_width:.1f})",
            passes,
            t["jacobi"],
            t["bare_replay"],
            loop_jacobi,
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(
        f"# torch {torch.__version__}, transformers {transformers.__version__}, {device}, "
        f"{args.threads} threads, {platform.machine()}, float32, seed 0, "
        f"prompt {args.prompt_len}, {args.max_new_tokens} new tokens, min of {args.repeats}"
    )
    header = [
        "model",
        "decoder",
        "forwards",
        "ours ms/fwd",
        "bare ms/fwd",
        "vs bare",
        "loop ms/fwd",
    ]
    rows = [row for name in args.models for row in bench_model(name, MODELS[name], args, device)]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, ["-" * w for w in widths], *rows]:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |")


if __name__ == "__main__":
    main()
