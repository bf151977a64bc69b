"""How far a wide forward's logits part from a one-token forward's on the llama.cpp runtime: the
probe behind `Runtime.batch_invariant` and the engine's `exact` setting.

For a GGUF file, after a cached prefix of the file's own greedy text, the logits after each of the next k
tokens are computed twice: by k forwards of one token (greedy decoding's), and by one forward
feeding the k tokens as a chain (a verification). Printed per k and KV cache type: the largest
logit difference over `--positions` positions, and how often the argmax differs. A second probe
feeds the same chain after a tree step that left holes among the row's cells (a kept path off
the first branch), against the same chain on contiguous cells.

    .venv-llamacpp/bin/python scripts/width_numerics.py ~/.cache/cllm/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
"""

from __future__ import annotations

import argparse
import json

import torch

from cllm.decoding import greedy_decode
from cllm.runtime.llamacpp import LlamaCppRuntime


def one_by_one(runtime: LlamaCppRuntime, prefix: list[int], fed: list[int]) -> torch.Tensor:
    """The logits after each token of `fed`, each fed alone (greedy decoding's forwards): (k, V)."""
    session = runtime.session()
    rows, _ = session.open([prefix])
    out = []
    for token in fed:
        out.append(session.feed(rows, [[token]]).logits[0, 0].clone())
        session.keep(rows, [[0]])
    session.close(rows)
    return torch.stack(out)


def logits_at(runtime: LlamaCppRuntime, prefix: list[int], fed: list[int], *, holes: bool = False) -> torch.Tensor:
    """The logits after each token of `fed`, fed as one chain after `prefix`: (k, V); `holes`:
    after a tree step whose kept path left a freed cell among the row's cells."""
    session = runtime.session()
    rows, _ = session.open([prefix[:-2] if holes else prefix])
    if holes:  # a tree of 3, [a, x, b] with x and b children of a: keeping a then b frees the x cell between them
        a, b = prefix[-2], prefix[-1]
        session.feed(rows, [[a, 0, b]], parents=[[-1, 0, 0]])
        session.keep(rows, [[0, 2]])  # a, then b on the second branch: the x cell is freed between them
    out = session.feed(rows, [fed]).logits[0, : len(fed)].clone()
    session.close(rows)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--positions", type=int, default=24, help="positions probed (the greedy text's)")
    parser.add_argument("--widths", default="2,4,8,16")
    args = parser.parse_args()
    widths = [int(k) for k in args.widths.split(",")]
    report = {"file": args.gguf, "widths": {}, "holes": {}}
    for cache in ("f16", "f32"):
        rt = LlamaCppRuntime(args.gguf, threads=args.threads, f32_cache=cache == "f32")
        prompt = list(range(10, 42))  # token ids of no meaning: the model's own greedy text follows
        text = prompt + greedy_decode(rt, torch.tensor([prompt]), max_new_tokens=args.positions + max(widths)
                                      ).new_tokens[0]
        for k in widths:
            worst, flips = 0.0, 0
            for p in range(len(prompt), len(prompt) + args.positions, k):
                one = one_by_one(rt, text[:p], text[p : p + k])
                wide = logits_at(rt, text[:p], text[p : p + k])
                worst = max(worst, float((one - wide).abs().max()))
                flips += int((one.argmax(-1) != wide.argmax(-1)).sum())
            report["widths"][f"{cache} cache, k={k}"] = {"max_abs_logit_diff": worst, "argmax_differs": flips}
        worst = 0.0
        for p in range(len(prompt) + 2, len(prompt) + args.positions):
            plain = logits_at(rt, text[:p], text[p : p + 4])
            holed = logits_at(rt, text[:p], text[p : p + 4], holes=True)
            worst = max(worst, float((plain - holed).abs().max()))
        report["holes"][f"{cache} cache"] = {"max_abs_logit_diff": worst}
        report.setdefault("ftype", rt.ftype)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
