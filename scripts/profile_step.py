"""t(k)/t(1): what one decoding step over k tokens costs, against a 1-token step, with a KV cache.

Why it matters: Jacobi decoding's wall-clock speedup over AR is at most
TPF x t(1) / t(n) (tokens per forward times the cost ratio of a 1-token step and an n-token
step). On a GPU t(n) ~ t(1) for small n; on a CPU it need not be.

Model: a random-weight Llama of the embedded target's shape (4 layers x 256, 4 heads, MLP 704,
vocab 8192, tied embeddings; ~5.3M parameters), float32, `--context` tokens already cached.
One step = one forward over k new tokens + argmax at every position (the one device sync) +
rolling the cache back to `--context` (so every step sees the same cache length):

  bare    plain transformers: model(input_ids, cache=DynamicCache) + cache.crop
  engine  our adapter (cllm.decoding.cache): kv.feed + kv.commit, as jacobi_decode calls them

Timing: interleaved rounds over (variant, k) so background load hits all alike; min and median
over rounds (min = the machine's best; a busy machine only ever adds time). Then the torch
profiler's top ops for k = 1 and k = 16 (bare, sdpa).

    python scripts/profile_step.py --threads 2
    python scripts/profile_step.py --threads 1 --attn sdpa,eager --compile
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
import transformers
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from cllm.decoding import cache as kv

SHAPE = dict(vocab_size=8192, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True,
             max_position_embeddings=1024, initializer_range=0.02)


def build(attn: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SHAPE, attn_implementation=attn)).eval()


class Bare:
    """A DynamicCache holding `context` tokens; a step feeds k tokens and crops back."""

    def __init__(self, model, prompt: torch.Tensor, forward=None):
        self.model, self.context = model, prompt.shape[1]
        self.forward = model if forward is None else forward
        self.cache = DynamicCache()
        with torch.inference_mode():
            model(input_ids=prompt, cache=self.cache, use_cache=True)

    @torch.inference_mode()
    def step(self, ids: torch.Tensor) -> list[int]:
        logits = self.forward(input_ids=ids, cache=self.cache, use_cache=True).logits  # (1, k, V)
        out = logits[0].argmax(-1).tolist()
        self.cache.crop(-ids.shape[1])  # negative = remove that many (transformers 5.x)
        return out


class Engine:
    """Our cache adapter, exactly as jacobi_decode drives it (prefill, feed, commit)."""

    def __init__(self, model, prompt: torch.Tensor):
        self.model = model
        with torch.inference_mode():
            self.rc, _ = kv.prefill(model, prompt, torch.ones_like(prompt))

    @torch.inference_mode()
    def step(self, ids: torch.Tensor) -> list[int]:
        k = ids.shape[1]
        logits = kv.feed(self.model, self.rc, ids, fed=[k])  # (1, k, V)
        out = logits[0].argmax(-1).tolist()
        kv.commit(self.rc, keep=[0], fed=k)  # roll all k back: the next step sees the same cache
        return out


def measure(runners: dict, ks: list[int], rounds: int, clock=time.perf_counter) -> dict[tuple[str, int], list[float]]:
    g = torch.Generator().manual_seed(1)
    ids = {k: torch.randint(SHAPE["vocab_size"], (1, k), generator=g) for k in ks}
    times = {(name, k): [] for name in runners for k in ks}
    for name in runners:  # warm-up: every shape once, twice
        for k in ks:
            runners[name].step(ids[k])
            runners[name].step(ids[k])
    for r in range(rounds):
        order = [(name, k) for name in runners for k in ks]
        shift = r % len(order)
        for name, k in order[shift:] + order[:shift]:
            t0 = clock()
            runners[name].step(ids[k])
            times[(name, k)].append(clock() - t0)
    return times


def table(times, names: list[str], ks: list[int]) -> str:
    lines = ["| variant | k | min ms | median ms | t(k)/t(1) (min) | t(k)/t(1) (median) | ms per token (min) |",
             "|---|---|---|---|---|---|---|"]
    for name in names:
        base_min, base_med = min(times[(name, 1)]), statistics.median(times[(name, 1)])
        for k in ks:
            t = times[(name, k)]
            lines.append(f"| {name} | {k} | {1e3 * min(t):.3f} | {1e3 * statistics.median(t):.3f} | "
                         f"{min(t) / base_min:.2f} | {statistics.median(t) / base_med:.2f} | {1e3 * min(t) / k:.3f} |")
    return "\n".join(lines)


def profile(model, prompt, k: int, steps: int = 20, top: int = 12) -> str:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    bare = Bare(model, prompt)
    ids = torch.randint(SHAPE["vocab_size"], (1, k), generator=torch.Generator().manual_seed(2))
    for _ in range(3):
        bare.step(ids)
    with torch_profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(steps):
            bare.step(ids)
    # grouped by input shape, so the LM head's (k, 256) x (256, 8192) product stands apart from the layers'
    return prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=top,
                                                              max_name_column_width=40, max_shapes_column_width=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--ks", default="1,2,4,8,16,32")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--attn", default="sdpa", help="comma list of attn_implementation: sdpa, eager")
    parser.add_argument("--no-engine", action="store_true", help="bare transformers only")
    parser.add_argument("--compile", action="store_true", help="also a torch.compile'd bare forward (dynamic shapes)")
    parser.add_argument("--profile", action="store_true", help="torch profiler top ops, k = 1 and 16")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="wall: perf_counter; cpu: this thread's CPU time (with --threads 1 on a busy "
                             "machine it leaves out the time other processes hold the core)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ks = [int(k) for k in args.ks.split(",")]
    assert ks[0] == 1, "k = 1 must come first (the baseline)"
    prompt = torch.randint(SHAPE["vocab_size"], (1, args.context), generator=torch.Generator().manual_seed(0))
    runners = {}
    for attn in args.attn.split(","):
        model = build(attn)
        runners[f"bare/{attn}"] = Bare(model, prompt)
        if not args.no_engine:
            runners[f"engine/{attn}"] = Engine(model, prompt)
        if args.compile:
            compiled = torch.compile(model, dynamic=True)
            runners[f"bare/{attn}+compile"] = Bare(model, prompt, forward=compiled)
    n_params = sum(p.numel() for p in build("sdpa").parameters())
    print(f"# torch {torch.__version__}, transformers {transformers.__version__}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, {args.threads} threads, float32, {n_params / 1e6:.2f}M params, "
          f"{args.context} cached tokens, {args.rounds} interleaved rounds, {args.clock} clock, load average {os.getloadavg()[0]:.2f}\n")
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    times = measure(runners, ks, args.rounds, clock)
    print(table(times, list(runners), ks))
    if args.profile:
        for k in (1, 16):
            print(f"\n## torch profiler, bare/sdpa, k = {k} (20 steps)\n\n```\n{profile(build('sdpa'), prompt, k)}```")


if __name__ == "__main__":
    main()
