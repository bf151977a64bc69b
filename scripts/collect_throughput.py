"""Collection throughput vs plain greedy decoding of the same prompts, measured in one run.

    python scripts/collect_throughput.py --model stdlib-coder --prompts stdlib-train --count 64

Greedy is timed with the same batching as collection (left-padded batches of --batch-size), so
the ratio shows what recording trajectories costs on top of decoding.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from cllm.collect import CollectConfig, collect
from cllm.data.prompts import load_prompts
from cllm.decoding import greedy_decode
from cllm.models import load_model, load_tokenizer


def greedy_tokens_per_second(model, tokenizer, texts, *, batch_size, max_new_tokens):
    tokenizer.padding_side = "left"
    tokens, start = 0, time.perf_counter()
    for i in range(0, len(texts), batch_size):
        batch = tokenizer(texts[i : i + batch_size], return_tensors="pt", padding=True)
        out = greedy_decode(model, batch.input_ids, batch.attention_mask,
                            max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id)
        tokens += sum(map(len, out.new_tokens))
    return tokens / (time.perf_counter() - start), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="stdlib-coder")
    parser.add_argument("--prompts", default="stdlib-train")
    parser.add_argument("--count", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model, tokenizer = load_model(args.model), load_tokenizer(args.model)
    texts = [p.text for p in load_prompts(args.prompts, limit=args.count)]
    print("| batch | greedy_decode tok/s | cllm collect tok/s | collect / greedy | target TPF | states/record |")
    print("|---|---|---|---|---|---|")
    for batch_size in map(int, args.batch_sizes.split(",")):
        greedy_tps, _ = greedy_tokens_per_second(model, tokenizer, texts, batch_size=batch_size,
                                                 max_new_tokens=args.max_new_tokens)
        with tempfile.TemporaryDirectory() as out:
            summary = collect(CollectConfig(
                model=args.model, prompts=args.prompts, out=out, max_prompts=args.count,
                block_size=args.block_size, max_new_tokens=args.max_new_tokens, batch_size=batch_size))
        collect_tps = summary.new_tokens / summary.seconds
        print(f"| {batch_size} | {greedy_tps:.0f} | {collect_tps:.0f} | {collect_tps / greedy_tps:.2f} "
              f"| {summary.new_tokens / summary.forward_passes:.3f} | {summary.mean_states:.1f} |")


if __name__ == "__main__":
    main()
