"""Does the layout of the Linear weights change t(k)/t(1) on the CPU? (engine_step_profile.md)

    python scripts/linear_layout_step.py stdlib-coder-cllm --threads 1 --reps 100

Three copies of one model: as loaded (`F.linear`), every Linear weight stored transposed and
contiguous (`x @ W^T`), and MKL's pre-packed sgemm weights (`torch.ops.mkl`, what Inductor's
freezing uses; skipped where this torch lacks it). One decoding step = a forward over k new
tokens after a 200-token cache + argmax + rolling the cache back. Steps of every (layout, k) run
in a shuffled order per repetition (a noisy machine hits them all alike); median and 20th
percentile in ms, and each over its layout's k = 1. The copies' logits are checked equal first.
A scratch measurement: nothing in the package uses these layouts.
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import time

import torch
from transformers import DynamicCache

from cllm.models import load_model

KS = (1, 2, 4, 8, 12, 16, 24, 32)


class TransposedLinear(torch.nn.Module):
    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.weight_t = linear.weight.detach().t().contiguous()
        self.bias = linear.bias

    def forward(self, x):
        y = x @ self.weight_t
        return y if self.bias is None else y + self.bias


class PackedLinear(torch.nn.Module):
    def __init__(self, linear: torch.nn.Linear, batch_hint: int = 8):
        super().__init__()
        self.weight = linear.weight.detach()
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(self.weight, batch_hint)
        self.bias, self.hint = linear.bias, batch_hint

    def forward(self, x):
        y = torch.ops.mkl._mkl_linear(x.reshape(-1, x.shape[-1]), self.packed, self.weight, self.bias, self.hint)
        return y.reshape(*x.shape[:-1], -1)


def with_linears(model, wrap):
    model = copy.deepcopy(model)
    for name in [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]:
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, leaf, wrap(getattr(owner, leaf)))
    return model


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=100)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    base = load_model(args.model, dtype="float32").eval()
    layouts = {"F.linear": base, "transposed": with_linears(base, TransposedLinear)}
    if hasattr(torch.ops.mkl, "_mkl_linear"):
        layouts["mkl packed"] = with_linears(base, PackedLinear)
    x = torch.randint(0, base.config.vocab_size, (1, 50))
    ref = base(input_ids=x).logits
    for name, m in layouts.items():
        print(f"{name}: max |logit - F.linear's| = {(m(input_ids=x).logits - ref).abs().max().item():.2e}")
    prompt = torch.randint(0, base.config.vocab_size, (1, 200))
    caches = {}
    for name, m in layouts.items():
        caches[name] = DynamicCache()
        m(input_ids=prompt, cache=caches[name], use_cache=True)
    ids = {k: torch.randint(0, base.config.vocab_size, (1, k)) for k in KS}
    pos = {k: torch.arange(200, 200 + k)[None] for k in KS}
    times = {(n, k): [] for n in layouts for k in KS}
    order = list(times)
    for _ in range(args.reps):
        random.shuffle(order)
        for name, k in order:
            start = time.perf_counter()
            out = layouts[name](input_ids=ids[k], cache=caches[name], use_cache=True, position_ids=pos[k])
            out.logits.argmax(-1).tolist()
            caches[name].crop(-k)
            times[name, k].append(time.perf_counter() - start)
    print(f"{args.threads} thread(s), {args.reps} shuffled repetitions; ms and t(k)/t(1)")
    for name in layouts:
        for label, stat in (("median", statistics.median), ("p20", lambda v: statistics.quantiles(v, n=10)[1])):
            t1 = stat(times[name, 1])
            cells = " ".join(f"k={k}: {1e3 * stat(times[name, k]):.2f} ({stat(times[name, k]) / t1:.2f})" for k in KS)
            print(f"{name:>11} {label:>6}  {cells}")


if __name__ == "__main__":
    main()
