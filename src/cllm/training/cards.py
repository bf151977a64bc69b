"""Model cards (MODEL_CARD.md) of the checkpoints `cllm train` and `cllm distill` write: what
the model is, how it was trained, and its evaluation, from the run's own summary files."""

from __future__ import annotations

import json


def fmt(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _objective_line(cfg: dict) -> str:
    """The training objective in one line of the model card."""
    teacher = cfg.get("consistency_teacher", "model")
    parts = [f"consistency `{cfg['consistency']}` / `{cfg['distance']}`, teacher: "
             + ("the frozen target" if teacher == "target" else "the model itself")]
    if cfg.get("ar_weight"):
        parts.append(f"{cfg['ar_weight']} x AR on `{cfg['ar_target']}`")
    if cfg.get("kd_weight"):
        rollouts = cfg.get("rollout_prompts") or 0
        parts.append(f"{cfg['kd_weight']} x `{cfg.get('kd_distance', 'fkl')}` to the frozen target on "
                     f"`{cfg['ar_target']}`"
                     + (f" and {rollouts} rollouts per step" if rollouts else ""))
    return " + ".join(parts)


def cllm_card(info: dict, extra: str = "") -> str:
    """MODEL_CARD.md from train_summary.json (and an optional extra section, e.g. distill's)."""
    s, meta, ev = info["summary"], info["data_meta"], info["eval_settings"]
    before, after = s["eval_before"] or {}, s["eval_after"] or {}
    return f"""# CLLM distilled from `{info['base_model']}`

A consistency LLM (Kou et al. 2024): the base model fine-tuned with `cllm train` so that greedy
Jacobi decoding converges in fewer forward passes. An ordinary Hugging Face checkpoint (no extra
heads); decode it with `cllm.jacobi_decode`, whose output equals greedy decoding exactly.

- base model: `{info['base_model']}` (fingerprint `{info['base_fingerprint']}`)
- this checkpoint: fingerprint `{info['model_fingerprint']}`
- trajectories: `{info['data']}` ({s['records']} records; collected from `{meta['prompts']}` with block
  size {meta['block_size']}, {meta['max_new_tokens']} new tokens, guess `{meta['guess']}`, {meta['dtype']})
- training: {s['steps']} steps, {s['train_time_s']} s, final loss {fmt(s['final_loss'])}{_selected(s)}
  ({_objective_line(info['config'])})

## Evaluation

Held-out prompts `{ev['prompts']}` (first {ev['count']}), greedy, Jacobi block size {ev['block_size']},
{ev['max_new_tokens']} new tokens. Tokens per forward = new tokens / forward passes, prefill
included (cllm's docs/method.md#counting); AR loss = mean nats/token on the prompts' references.

| | base model | this CLLM |
|---|---|---|
| Jacobi tokens per forward | {fmt(before.get('tokens_per_forward'))} | {fmt(after.get('tokens_per_forward'))} |
| AR validation loss | {fmt(before.get('ar_loss'))} | {fmt(after.get('ar_loss'))} |
{extra}
## Config

```json
{json.dumps(info['config'], indent=2, sort_keys=True)}
```

## Trajectory meta

```json
{json.dumps(meta, indent=2, sort_keys=True)}
```
"""


def _selected(s: dict) -> str:
    step = s.get("selected_step")
    return "" if step is None else f"; weights of step {step}, chosen by the quality gates (--select gated)"


def evaluation_table(ev: dict) -> str:
    """Markdown table of an evaluation.json."""
    tpf, exact = ev["tokens_per_forward"], ev["cllm_jacobi_equals_greedy"]
    lines = ["| | target | CLLM |", "|---|---|---|"]
    for n in tpf["cllm"]:
        lines.append(f"| Jacobi tokens per forward, n = {n} | {fmt(tpf['target'][n])} | {fmt(tpf['cllm'][n])} |")
    for n, value in exact.items():
        lines.append(f"| CLLM Jacobi == CLLM greedy, n = {n} | | {value:.0%} of prompts |")
    lines.append(f"| AR validation loss (nats/token) | {fmt(ev['ar_loss']['target'])} | "
                 f"{fmt(ev['ar_loss']['cllm'])} |")
    lines.append(f"| greedy output == target's | | {ev['greedy_agreement']:.0%} of prompts, "
                 f"{ev['token_agreement']:.0%} of tokens |")
    for key, what in (("degenerate", "one token 10+ times in a row"), ("looping", "ending in a loop")):
        if key in ev:
            lines.append(f"| greedy completions {what} | {ev[key]['target']:.0%} | {ev[key]['cllm']:.0%} |")
    if "quality" in ev:
        (q,) = ev["quality"]["sets"].values()
        t, c = q["target"], q["cllm"]
        for n in c["tpf_not_looping"]:
            lines.append(f"| Jacobi tokens per forward, n = {n}, completions that do not loop | "
                         f"{fmt(t['tpf_not_looping'][n])} | {fmt(c['tpf_not_looping'][n])} |")
        if t["parse_rate"] is not None:  # Python prompt sets only
            lines.append(f"| greedy completions that parse | {t['parse_rate']:.0%} | {c['parse_rate']:.0%} |")
        lines.append(f"| target's NLL of the greedy completions (nats/token) | {fmt(t['target_nll'])} | "
                     f"{fmt(c['target_nll'])} |")
        lines.append(f"| first token that differs from the target's greedy text (mean index) | | "
                     f"{fmt(c['first_divergence'], 1)} |")
    for g in ev.get("gates", []):
        lines.append(f"| gate: {g['name']} {g['bar']} | | {fmt(g['value'], 4)} "
                     f"({'pass' if g['passed'] else 'FAIL'}) |")
    return "\n".join(lines)
