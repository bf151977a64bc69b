"""Wall clock and tokens per forward of a few engine settings against greedy AR (one model).

    python scripts/decode_settings.py stdlib-coder-cllm --threads 2 --count 12

Settings are (block size n, recycled drafts, draft width, blocks in flight). Every output is
greedy's (the engine's tests guarantee it); this only times them, on the first HumanEval prompts.
"""

from __future__ import annotations

import argparse
import time

import torch

from cllm import greedy_decode, jacobi_decode
from cllm.data.prompts import load_prompts
from cllm.models import load_model, load_tokenizer

SETTINGS = [(16, 0, 8, 1), (16, 1, 8, 1), (8, 1, 8, 1), (16, 3, 8, 2), (8, 1, 8, 2), (16, 1, 8, 2)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--count", type=int, default=12)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model, dtype="float32"), load_tokenizer(args.model)
    prompts = [torch.tensor([tok(p.text)["input_ids"]]) for p in load_prompts("humaneval", limit=args.count)]

    def run(**kw) -> tuple[float, float]:
        start, new, forwards = time.perf_counter(), 0, 0
        for ids in prompts:
            if kw:
                out = jacobi_decode(model, ids, max_new_tokens=128, eos_token_id=tok.eos_token_id,
                                    generator=torch.Generator().manual_seed(0), **kw)
            else:
                out = greedy_decode(model, ids, max_new_tokens=128, eos_token_id=tok.eos_token_id)
            new, forwards = new + len(out.new_tokens[0]), forwards + out.forward_passes
        return new / (time.perf_counter() - start), new / forwards

    run()  # warm-up
    base = run()[0]
    print(f"greedy AR: {base:.1f} tokens/s")
    for n, recycle, width, blocks in SETTINGS:
        tps, tpf = run(block_size=n, recycle=recycle, recycle_width=width, blocks_in_flight=blocks)
        print(f"n={n} recycle={recycle} width={width} blocks={blocks}: {tpf:.2f} tokens/forward, "
              f"{tps:.1f} tokens/s, {tps / base:.2f}x", flush=True)


if __name__ == "__main__":
    main()
