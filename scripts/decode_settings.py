"""Wall clock and tokens per forward of a few engine settings against greedy AR (one model).

    python scripts/decode_settings.py stdlib-coder-cllm --threads 2 --count 12
    python scripts/decode_settings.py stdlib-coder-cllm --threads 1 --clock cpu --settings 8,1,8,1 4,1,8,1
    python scripts/decode_settings.py stdlib-coder-cllm --threads 2 --settings 8,4,8,1,1 8,4,16,1,2

Settings are (block size n, recycled drafts, draft width, blocks in flight[, min n-gram of a
draft's match, default 2]). Greedy AR and every
setting run in turn, `--rounds` times (interleaved, so a slow patch of the machine hits them all);
the speedup is the median over rounds of the setting's tokens/s over AR's in the same round.
`--clock cpu` times the process's CPU time (one thread: less sensitive to other jobs).
Every output is greedy's (the engine's tests guarantee it); this only times them, on the first
HumanEval prompts.
"""

from __future__ import annotations

import argparse
import statistics
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
    ap.add_argument("--count", type=int, default=12, help="HumanEval prompts")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved repeats (median)")
    ap.add_argument("--settings", nargs="+", default=None, metavar="N,R,W,K[,M]",
                    help="block size, recycled drafts, draft width, blocks in flight (default: a fixed list)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model, dtype="float32"), load_tokenizer(args.model)
    prompts = [torch.tensor([tok(p.text)["input_ids"]]) for p in load_prompts("humaneval", limit=args.count)]
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    settings = [tuple(map(int, s.split(","))) for s in args.settings] if args.settings else SETTINGS

    def run(setting: tuple[int, ...] | None) -> tuple[float, float, float]:
        start, new, forwards, fed = clock(), 0, 0, []
        for ids in prompts:
            if setting:
                n, recycle, width, blocks, *min_ngram = setting
                out = jacobi_decode(model, ids, max_new_tokens=128, eos_token_id=tok.eos_token_id,
                                    generator=torch.Generator().manual_seed(0), block_size=n,
                                    recycle=recycle, recycle_width=width, blocks_in_flight=blocks,
                                    **({"recycle_min_ngram": min_ngram[0]} if min_ngram else {}))
                fed += out.stats.fed
            else:
                out = greedy_decode(model, ids, max_new_tokens=128, eos_token_id=tok.eos_token_id)
            new, forwards = new + len(out.new_tokens[0]), forwards + out.forward_passes
        return new / (clock() - start), new / forwards, sum(fed) / max(len(fed), 1)

    run(None)  # warm-up
    base, speed, tpf, fed = [], {s: [] for s in settings}, {}, {}
    for _ in range(args.rounds):
        base.append(run(None)[0])
        for s in settings:
            tps, tpf[s], fed[s] = run(s)
            speed[s].append(tps / base[-1])
    print(f"greedy AR: {statistics.median(base):.1f} tokens/s (median of {args.rounds} rounds, "
          f"{args.threads} thread(s), {args.clock} clock)")
    for s in settings:
        n, recycle, width, blocks, *min_ngram = s
        print(f"n={n} recycle={recycle} width={width} blocks={blocks} min-ngram={min_ngram[0] if min_ngram else 'default'}: "
              f"{tpf[s]:.2f} tokens/forward, {fed[s]:.1f} fed/forward, "
              f"{statistics.median(speed[s]):.2f}x (rounds: {' '.join(f'{x:.2f}' for x in speed[s])})",
              flush=True)


if __name__ == "__main__":
    main()
