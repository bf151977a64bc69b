"""Our decoding on llama.cpp against llama.cpp's own greedy decoding, as a user would run both:
`cllm.models.load_for_decoding("X.gguf")` then `jacobi_decode(fast.model, ids, **fast.settings)`,
against llama-cpp-python's `Llama.generate` (top_k=1) on the same file, and against our greedy
decoding on the same runtime (llama.cpp's forward, one token per decode). HumanEval prompts
(third-party text), interleaved rounds, the median tokens/s of each; tokens per forward, the
share of outputs ending in a loop or degenerate, and whether every output equals the reference.

    .venv-llamacpp/bin/cllm export --model stdlib-coder-cllm --gguf /tmp/cllm.gguf
    .venv-llamacpp/bin/python scripts/llamacpp_speed.py /tmp/cllm.gguf --threads 2 --rounds 5

A third-party model and prompt set (`make smollm2`; 8 code + 8 chat prompts), with the peers and
settings measured beside (`--extra`: llama-cpp-python's prompt lookup, our engine with
`exact=False`, our engine at the fixed budget of 24 fed tokens):

    .venv-llamacpp/bin/python scripts/llamacpp_speed.py ~/.cache/cllm/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        --prompt-file benchmarks/smollm2/prompts.jsonl --extra lookup,relaxed,fixed --rounds 3

llama.cpp's own greedy decoding runs with the KV cache type the runtime chose for the file (f16,
llama.cpp's default, for a quantized file; f32 for an f32 file).

A quantized file (`cllm export --quantize q8_0`): llama-cpp-python's generate crashed on such
files on an Intel Xeon with AMX (its AMX kernels; the runtime turns them off), so pass
`--no-llama-generate`: the reference is then our greedy decoding on the runtime.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from cllm.core.machine import load_average_1min, machine_info
from cllm.data.prompts import encode_prompts
from cllm.decoding import greedy_decode, jacobi_decode
from cllm.evaluation.text import ends_in_loop, first_divergence, is_degenerate
from cllm.models import load_for_decoding
from cllm.models.fast import file_identity, measure_step_costs


def llama_generate(path: str, threads: int, eos: int, max_new_tokens: int, *, f32_cache: bool, lookup: int = 0):
    """llama.cpp's own greedy decoding (llama-cpp-python), with the runtime's KV cache type;
    `lookup` > 0: with its prompt lookup drafting that many tokens."""
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    cache = llama_cpp.GGML_TYPE_F32 if f32_cache else llama_cpp.GGML_TYPE_F16
    llm = llama_cpp.Llama(model_path=path, n_ctx=1024, n_batch=1024, n_threads=threads, n_threads_batch=threads,
                          n_gpu_layers=0, seed=0, type_k=cache, type_v=cache, verbose=False, logits_all=bool(lookup),
                          draft_model=LlamaPromptLookupDecoding(num_pred_tokens=lookup) if lookup else None)

    def run(prompt: list[int]) -> tuple[list[int], int]:
        llm.reset()
        out = []
        for token in llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
            out.append(int(token))
            if token == eos or len(out) >= max_new_tokens:
                break
        return out, None if lookup else len(out)  # llama-cpp-python does not say how many forwards drafts took

    return run


def ours(decode, model, eos: int, max_new_tokens: int, **settings):
    def run(prompt: list[int]) -> tuple[list[int], int]:
        out = decode(model, torch.tensor([prompt]), max_new_tokens=max_new_tokens, eos_token_id=eos, **settings)
        return out.new_tokens[0], out.forward_passes

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-file", help="a JSONL file of {\"prompt\": text} (as the model reads it, chat "
                        "template included) instead of HumanEval's")
    parser.add_argument("--extra", default="", help="more methods, comma-separated: lookup (llama-cpp-python's "
                        "prompt lookup, 10 tokens), relaxed (ours with exact=False), fixed (ours at a fixed budget of "
                        "24 fed tokens, exact=False)")
    parser.add_argument("--no-llama-generate", action="store_true")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    load = load_average_1min()
    fast = load_for_decoding(args.gguf, threads=args.threads)
    eos, new = fast.tokenizer.eos_token_id, args.max_new_tokens
    if args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as f:
            texts = [json.loads(line)["prompt"] for line in f if line.strip()][: args.prompts]
        prompts = [fast.tokenizer.encode(t) for t in texts]
    else:
        prompts = [p.ids for p in encode_prompts("humaneval", fast.tokenizer, limit=args.prompts, keep=384)]
    settings = {k: v for k, v in fast.settings.items() if k != "draft_table"}
    methods = {"ours greedy": ours(greedy_decode, fast.model, eos, new),
               "ours jacobi": ours(jacobi_decode, fast.model, eos, new, **fast.settings)}
    extra = [e for e in args.extra.split(",") if e]
    if {"relaxed", "fixed"} & set(extra) and fast.model.step_costs is None:  # exact decoding measured none
        measure_step_costs(fast.model, file_identity(args.gguf), f"{fast.model.threads} threads")
    if "relaxed" in extra:
        methods["ours jacobi, exact=False"] = ours(jacobi_decode, fast.model, eos, new, **{**fast.settings,
                                                                                          "exact": False})
    if "fixed" in extra:
        methods["ours jacobi, budget 24"] = ours(jacobi_decode, fast.model, eos, new, **{
            **fast.settings, "exact": False, "adaptive": False, "recycle_budget": 24})
    f32 = fast.model.f32_cache
    if "lookup" in extra:
        methods["llama.cpp prompt lookup"] = llama_generate(args.gguf, args.threads, eos, new, f32_cache=f32, lookup=10)
    if not args.no_llama_generate:
        methods = {"llama.cpp greedy": llama_generate(args.gguf, args.threads, eos, new, f32_cache=f32), **methods}
    reference = next(iter(methods))
    times = {name: [] for name in methods}
    outputs = {}
    names = list(methods)
    for r in range(args.rounds):  # interleaved: every method once per round, the order rotated
        for name in names[r % len(names):] + names[: r % len(names)]:
            t0 = time.perf_counter()
            results = [methods[name](p) for p in prompts]
            times[name].append(time.perf_counter() - t0)
            if name in outputs and [t for t, _ in outputs[name]] != [t for t, _ in results]:
                print(f"note: {name} gave other tokens in round {r}")
            outputs[name] = results
    base = None
    report = {"file": args.gguf, "runtime": fast.model.describe(), "settings": settings, "threads": args.threads,
              "step_costs": fast.model.step_costs, "prompt_file": args.prompt_file,
              "load_1min_before": load, "machine": machine_info(torch.device("cpu")), "prompts": len(prompts),
              "max_new_tokens": new, "rounds": args.rounds, "reference": reference, "methods": {}}
    for name in methods:
        tokens = [t for t, _ in outputs[name]]
        count = sum(len(t) for t in tokens)
        tps = count / statistics.median(times[name])
        base = base or tps
        report["methods"][name] = {
            "tokens_per_second": round(tps, 1), "vs_reference": round(tps / base, 3),
            "tokens_per_forward": (round(count / sum(f for _, f in outputs[name]), 3)
                                   if all(f for _, f in outputs[name]) else None),
            "looping": sum(ends_in_loop(t) for t in tokens) / len(tokens),
            "degenerate": sum(is_degenerate(t) for t in tokens) / len(tokens),
            "equal_to_reference": sum(t == r for t, (r, _) in zip(tokens, outputs[reference], strict=True)),
            "first_parting": [first_divergence(t, r) if t != r else None
                              for t, (r, _) in zip(tokens, outputs[reference], strict=True)],
        }
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
