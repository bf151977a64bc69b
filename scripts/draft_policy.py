"""Tokens per forward, fed tokens and a cost-model speedup of recycling settings (no timing noise).

    python scripts/draft_policy.py stdlib-coder-cllm --count 32 --settings 4,4,16,2,0 4,8,16,2,24

Settings are (block size n, recycled drafts, draft width, min n-gram of a draft's match[, budget
of fed tokens per forward, 0 = none; absent = the engine's default]). Every setting decodes the
same prompts (default: the first HumanEval ones) greedily; the output is greedy's whatever the
setting, so the settings differ only in how many forwards they take and how many tokens each
forward feeds. Wall clock on a shared 2-core machine moves 10-30% between identical runs, so
this script ranks settings by a cost model instead: a forward feeding k tokens costs t(k) / t(1)
AR steps, interpolated from `--cost` (`cllm.profiling.costs.step_cost`; default: the two-thread
ratios of the development machine, `benchmarks/engine_step_profile.md`; `cllm profile --k
1,2,4,8,16,32` measures yours). The estimate ignores the per-step Python work, so it runs above
the measured speedup; `cllm bench` gives the wall-clock number of one setting.
"""

from __future__ import annotations

import argparse

import torch

from cllm import jacobi_decode
from cllm.data.prompts import load_prompts
from cllm.models import load_draft_table, load_model, load_tokenizer
from cllm.profiling.costs import COST_2_THREADS, COST_K, step_cost


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--prompts", default="humaneval",
                    help="prompt set: humaneval, stdlib-val, stdlib-train or a JSONL file")
    ap.add_argument("--count", type=int, default=32, help="first N prompts of the set")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--settings", nargs="+", required=True, metavar="N,R,W,M[,B]")
    ap.add_argument("--draft-table", default="none",
                    help="auto (the model's own table, `cllm drafts`), none, or a file")
    ap.add_argument("--cost", default=",".join(map(str, COST_2_THREADS)),
                    help=f"t(k)/t(1) at k = {', '.join(map(str, COST_K))} (default: the development CPU's, 2 threads)")
    args = ap.parse_args()
    ratios = tuple(float(x) for x in args.cost.split(","))
    if len(ratios) != len(COST_K):
        ap.error(f"--cost needs {len(COST_K)} ratios")
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model, dtype="float32"), load_tokenizer(args.model)
    table = load_draft_table(args.model, args.draft_table)
    prompts = [torch.tensor([tok(p.text)["input_ids"]]) for p in load_prompts(args.prompts, limit=args.count)]
    print(f"{args.model}, {len(prompts)} {args.prompts} prompts, {args.max_new_tokens} new tokens, "
          + (f"draft table of {len(table):,} contexts" if table is not None else "no draft table"))
    print("| n | drafts | width | min n-gram | budget | tokens/forward | fed/forward | estimated speedup |")
    print("|---|---|---|---|---|---|---|---|")
    for setting in args.settings:
        n, recycle, width, min_ngram, *budget = map(int, setting.split(","))
        limit = {"recycle_budget": budget[0] or None} if budget else {}
        tokens, fed = 0, []
        for ids in prompts:
            out = jacobi_decode(model, ids, max_new_tokens=args.max_new_tokens, eos_token_id=tok.eos_token_id,
                                generator=torch.Generator().manual_seed(0), block_size=n, recycle=recycle,
                                recycle_width=width, recycle_min_ngram=min_ngram, draft_table=table, **limit)
            tokens += len(out.new_tokens[0])
            fed += out.stats.fed
        cost = sum(step_cost(k, ratios) for k in fed)
        print(f"| {n} | {recycle} | {width} | {min_ngram} | {(budget[0] or 'none') if budget else 'default'} | "
              f"{tokens / len(fed):.2f} | "
              f"{sum(fed) / len(fed):.1f} | {tokens / cost:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
