"""Model cards (MODEL_CARD.md): the one writer of the cards of the checkpoints cllm makes.

Every card is built from the same pieces: a title, a paragraph that says what the model is and
what it is for (its role), tables of facts, an evaluation section and how it was made, put
together by `render_card`. Two cards use them, from the run's own summary files:

- `cllm_card`: a CLLM that `cllm train` / `cllm distill` wrote (base model, trajectories,
  training, Jacobi tokens per forward before and after, the config);
- `target_card`: a model `cllm pretrain` trained from scratch (the embedded target, a draft
  model): architecture, corpus and optimiser, validation loss and completion quality, samples.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

from cllm.evaluation.text import DEGENERATE_RUN

# ------------------------------------------------------------------------ the pieces


def fmt(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _row(cells: Sequence[str]) -> str:
    return "|" + "|".join(f" {c} " if c else " " for c in cells) + "|"


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    """A markdown table's lines; empty cells stay empty (``| |``)."""
    return [_row(header), "|" + "|".join("---" for _ in header) + "|", *(_row(r) for r in rows)]


def facts_table(rows: Iterable[tuple[str, str]]) -> list[str]:
    """A two-column table of facts without a header: ``| what | value |``."""
    return table(("", ""), rows)


def card_section(heading: str, *blocks: Sequence[str]) -> list[str]:
    """``## heading``, then its blocks of lines, a blank line between two."""
    lines = [f"## {heading}"]
    for block in blocks:
        lines += ["", *block] if block else []
    return lines


def code_block(text: str, language: str = "") -> list[str]:
    return [f"```{language}", text, "```"]


def render_card(title: str, about: Sequence[str], sections: Iterable[Sequence[str]]) -> str:
    """The card: ``# title``, the paragraph(s) about the model, then the sections, a blank line
    between each two parts."""
    parts = [[f"# {title}"], list(about), *(list(s) for s in sections if s)]
    return "\n\n".join("\n".join(part) for part in parts) + "\n"


# ------------------------------------------------------------------------ the CLLM's card


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


def _selected(s: dict) -> str:
    step = s.get("selected_step")
    return "" if step is None else f"; weights of step {step}, chosen by the quality gates (--select gated)"


def cllm_card(info: dict, section: str = "") -> str:
    """MODEL_CARD.md from train_summary.json (`info`), and an optional extra markdown section
    (e.g. distill's evaluation) after the evaluation."""
    s, meta, ev = info["summary"], info["data_meta"], info["eval_settings"]
    before, after = s["eval_before"] or {}, s["eval_after"] or {}
    about = [
        "A consistency LLM (Kou et al. 2024): the base model fine-tuned with `cllm train` so that greedy",
        "Jacobi decoding converges in fewer forward passes. An ordinary Hugging Face checkpoint (no extra",
        "heads); decode it with `cllm.jacobi_decode`, whose output equals greedy decoding exactly.",
        "",
        f"- base model: `{info['base_model']}` (fingerprint `{info['base_fingerprint']}`)",
        f"- this checkpoint: fingerprint `{info['model_fingerprint']}`",
        f"- trajectories: `{info['data']}` ({s['records']} records; collected from `{meta['prompts']}` with block",
        f"  size {meta['block_size']}, {meta['max_new_tokens']} new tokens, guess `{meta['guess']}`, {meta['dtype']})",
        f"- training: {s['steps']} steps, {s['train_time_s']} s, final loss {fmt(s['final_loss'])}{_selected(s)}",
        f"  ({_objective_line(info['config'])})",
    ]
    settings = [
        f"Held-out prompts `{ev['prompts']}` (first {ev['count']}), greedy, Jacobi block size {ev['block_size']},",
        f"{ev['max_new_tokens']} new tokens. Tokens per forward = new tokens / forward passes, prefill",
        "included (cllm's docs/method.md#counting); AR loss = mean nats/token on the prompts' references.",
    ] if ev.get("prompts") and ev.get("count") else [
        "No held-out evaluation during training (no held-out prompts were given: `--eval-prompts`)."]
    measures = table(("", "base model", "this CLLM"), [
        ("Jacobi tokens per forward", fmt(before.get("tokens_per_forward")), fmt(after.get("tokens_per_forward"))),
        ("AR validation loss", fmt(before.get("ar_loss")), fmt(after.get("ar_loss"))),
    ])
    extra = section.strip("\n")
    return render_card(f"CLLM distilled from `{info['base_model']}`", about, [
        card_section("Evaluation", settings, measures),
        extra.split("\n") if extra else [],
        card_section("Config", code_block(json.dumps(info["config"], indent=2, sort_keys=True), "json")),
        card_section("Trajectory meta", code_block(json.dumps(meta, indent=2, sort_keys=True), "json")),
    ])


def evaluation_table(ev: dict) -> str:
    """Markdown table of an evaluation.json (`cllm distill`'s target vs CLLM)."""
    tpf, exact = ev["tokens_per_forward"], ev["cllm_jacobi_equals_greedy"]
    rows = [(f"Jacobi tokens per forward, n = {n}", fmt(tpf["target"][n]), fmt(tpf["cllm"][n])) for n in tpf["cllm"]]
    rows += [(f"CLLM Jacobi == CLLM greedy, n = {n}", "", f"{value:.0%} of prompts") for n, value in exact.items()]
    rows.append(("AR validation loss (nats/token)", fmt(ev["ar_loss"]["target"]), fmt(ev["ar_loss"]["cllm"])))
    rows.append(("greedy output == target's", "",
                 f"{ev['greedy_agreement']:.0%} of prompts, {ev['token_agreement']:.0%} of tokens"))
    for key, what in (("degenerate", "one token 10+ times in a row"), ("looping", "ending in a loop")):
        if key in ev:
            rows.append((f"greedy completions {what}", f"{ev[key]['target']:.0%}", f"{ev[key]['cllm']:.0%}"))
    if "quality" in ev:
        (q,) = ev["quality"]["sets"].values()
        t, c = q["target"], q["cllm"]
        rows += [(f"Jacobi tokens per forward, n = {n}, completions that do not loop", fmt(t["tpf_not_looping"][n]),
                  fmt(c["tpf_not_looping"][n])) for n in c["tpf_not_looping"]]
        if t["parse_rate"] is not None:  # Python prompt sets only
            rows.append(("greedy completions that parse", f"{t['parse_rate']:.0%}", f"{c['parse_rate']:.0%}"))
        rows.append(("target's NLL of the greedy completions (nats/token)", fmt(t["target_nll"]), fmt(c["target_nll"])))
        rows.append(("first token that differs from the target's greedy text (mean index)", "",
                     fmt(c["first_divergence"], 1)))
    rows += [(f"gate: {g['name']} {g['bar']}", "", f"{fmt(g['value'], 4)} ({'pass' if g['passed'] else 'FAIL'})")
             for g in ev.get("gates", [])]
    return "\n".join(table(("", "target", "CLLM"), rows))


# ------------------------------------------------------------------------ a pretrained model's card


def target_card(*, name: str, role: str, evaluation: dict, architecture: dict, config: dict, summary: dict,
                reproduce: str) -> str:
    """MODEL_CARD.md of a model `cllm pretrain` trained: `evaluation` is its evaluation.json
    (`cllm.training.pretrain.evaluate_target`), `architecture` its config.json, `config` and
    `summary` the run's pretrain_config.json and pretrain_summary.json ({} when absent), `role`
    the sentence that says what the model is for, `reproduce` the command that remakes it."""
    tokenizer = (f"the byte-level BPE tokenizer of `{config['tokenizer']}`." if config.get("tokenizer")
                 else "its own byte-level BPE tokenizer.")
    about = [
        f"A {evaluation['parameters'] / 1e6:.2f}M-parameter Llama-architecture causal LM trained from",
        f"scratch by `cllm pretrain` on the Python standard library, with {tokenizer}",
        role,
        "It completes Python code in stdlib style; it is not a useful assistant.",
    ]
    samples = [[f"`{s['id']}`", "", *code_block(s["prompt"] + s["completion"].rstrip("\n"), "python")]
               for s in evaluation["samples"]]
    return render_card(name, about, [
        card_section("Architecture", facts_table(_architecture_rows(architecture))),
        card_section("Training", facts_table(_training_rows(config, summary))),
        card_section("Evaluation (float32, greedy)", facts_table(_evaluation_rows(evaluation))),
        card_section("Samples (stdlib-val prompts; the completion follows the docstring)", *samples),
        card_section("Reproduce", code_block(reproduce), [
            "The corpus is the running interpreter's stdlib: another Python version gives another corpus",
            "(compare the sha256 above).",
        ]),
    ])


def _architecture_rows(arch: dict) -> list[tuple[str, str]]:
    heads, width = arch["num_attention_heads"], arch["hidden_size"]
    return [
        ("layers x width", f"{arch['num_hidden_layers']} x {width}"),
        ("heads (head dim)", f"{heads} ({width // heads})"),
        ("MLP (SwiGLU)", f"{arch['intermediate_size']}"),
        ("vocabulary", f"{arch['vocab_size']} (byte-level BPE, `<|endoftext|>` = EOS = BOS = pad, id "
                       f"{arch['eos_token_id']})"),
        ("context", f"{arch['max_position_embeddings']} tokens"),
        ("embeddings", f"tied; weights stored as {arch.get('dtype', arch.get('torch_dtype', 'float32'))}"),
    ]


def _training_rows(cfg: dict, summary: dict) -> list[tuple[str, str]]:
    rows = []
    for split in ("train", "validation"):
        c = summary.get("corpus", {}).get(split)
        if c:
            rows.append((f"corpus, {split}", f"Python {c['python']} stdlib, {c['files']} files, {c['chars']:,} chars, "
                                             f"sha256 `{c['sha256'][:16]}`"))
    if cfg:
        rows += [
            ("steps x batch x context", f"{cfg['steps']} x {cfg['batch_size']} x {cfg['context']} = "
                                        f"{cfg['steps'] * cfg['batch_size'] * cfg['context']:,} tokens"),
            ("optimiser", f"AdamW (0.9, 0.95), lr {cfg['lr']} -> {cfg['min_lr']} cosine, {cfg['warmup_steps']} "
                          f"warm-up steps, weight decay {cfg['weight_decay']}, clip {cfg['grad_clip']}, bf16 autocast "
                          f"{cfg['bf16']}"),
            ("seed, threads", f"{cfg['seed']}, {cfg['threads']}"),
        ]
    if summary:
        rows.append(("training time", f"{summary['train_time_s'] / 60:.1f} min ({summary['machine']['platform']}, "
                                      f"torch {summary['machine']['torch']})"))
        rows.append(("tokenizer sha256", f"`{summary['tokenizer_sha256'][:16]}`"))
    return rows


def _evaluation_rows(ev: dict) -> list[tuple[str, str]]:
    return [
        ("validation loss", f"{ev['val_loss']:.3f} nats/token over all {ev['val_tokens']:,} tokens of the validation "
                            f"split (sha256 `{ev['corpus_sha256'][:16]}`)"),
        ("function parses", f"{ev['parse_rate']:.0%} of {ev['n_prompts']} stdlib-val prompts (signature + docstring, "
                            f"ending at its closing quotes): {ev['max_new_tokens']}-token completion cut at the end of "
                            "the function, `ast.parse` succeeds and the body has a statement"),
        ("degenerate", f"{ev['degenerate_rate']:.0%} (one token repeated {DEGENERATE_RUN}+ times in a row)"),
        ("looping", f"{ev['looping_rate']:.0%} (the last 24 tokens repeat a pattern of at most 8 tokens)"),
    ]


# ------------------------------------------------------------------------ a Medusa-2 model's card


def medusa2_card(info: dict, evaluation: dict | None, section: str = "") -> str:
    """MODEL_CARD.md of a model `cllm medusa --joint` trained with its heads: `info` holds the
    run's config, the command that makes it, the heads' record (`medusa/medusa_config.json`'s
    fields) and sizes;
    `evaluation` its evaluation.json (None without one); `section`, an optional extra markdown
    section after the evaluation (e.g. a comparison measured apart)."""
    cfg, heads = info["config"], info["heads"]
    training = heads["training"]
    before, after = training["holdout_before"], training["holdout_after"]
    about = [
        f"`{heads['base_model']}` fine-tuned together with {cfg['heads']} Medusa heads (Medusa-2, Cai et al. 2024,",
        "arXiv 2401.10774, section 2.2.2) by `cllm medusa --joint`. An ordinary Hugging Face checkpoint with its",
        "heads in `medusa/`; `cllm.decoding.rivals.medusa.medusa_decode` with them writes exactly this model's",
        "greedy output. The model itself changed, so its greedy text is not the base model's: how far it moved",
        "is measured below.",
        "",
        f"- base model: `{heads['base_model']}` (fingerprint `{heads['base_fingerprint']}`)",
        f"- this checkpoint: fingerprint `{heads['model_fingerprint']}`; heads add {info['parameters_added']:,} "
        "parameters",
        f"- training text: the base model's greedy continuations of `{cfg['prompts']}` ({training['texts']} texts, "
        f"{training['positions']:,} positions; {training['holdout_texts']} more held out)",
        f"- training: {cfg.get('max_steps', cfg.get('steps'))} steps of {cfg['batch_size']} texts, "
        + (f"the first {cfg['warmup_heads']} the heads alone" if cfg["warmup_heads"] else "all of them joint")
        + f"; loss = KL(base || model) + {cfg['heads_weight']} x the heads' loss (head k learns the base's "
        f"distribution k tokens on); lr heads {cfg['lr']}, model {cfg['backbone_lr']}; {training['seconds']} s",
        "- heads: " + (f"started from `{cfg['init_heads']}` (the base model's Medusa-1 heads)" if cfg.get("init_heads")
                       else "fresh"),
    ]
    held = table(("held-out texts (teacher-forced)", "start", "end"), [
        ("KL(base \\|\\| model) per position", fmt(before["backbone_kl"], 4), fmt(after["backbone_kl"], 4)),
        ("model's greedy token = base's", fmt(before["model_agreement"]), fmt(after["model_agreement"])),
        ("heads' loss", fmt(before["heads_loss"]), fmt(after["heads_loss"])),
        *((f"head {k + 1} top-1 = base's token {k + 2} ahead", fmt(b), fmt(a))
          for k, (b, a) in enumerate(zip(before["agreement"], after["agreement"], strict=True))),
    ])
    sections = [card_section("Training, held-out texts", held)]
    if evaluation:
        sections.append(card_section("Evaluation", _medusa2_evaluation(evaluation)))
    if section.strip("\n"):
        sections.append(section.strip("\n").split("\n"))
    sections.append(card_section("Reproduce", code_block(info["command"])))
    sections.append(card_section("Config", code_block(json.dumps(cfg, indent=2, sort_keys=True), "json")))
    return render_card(f"`{heads['base_model']}` + Medusa-2 heads", about, sections)


def _medusa2_evaluation(ev: dict) -> list[str]:
    lines = [f"Prompts: `{ev['prompt_set']}`, greedy, {ev['max_new_tokens']} new tokens, {ev['dtype']}."]
    if "exact" in ev:
        lines += ["", f"Medusa decoding with the saved {ev['tree_nodes']}-node tree, batch 1, on the first "
                      f"{ev['prompts']}: {fmt(ev['tokens_per_forward'], 2)} tokens per forward (new tokens / "
                      f"forward passes, prefill included); Medusa output = this model's greedy output on "
                      f"{ev['exact']} of {ev['prompts']}."]
    q = ev.get("quality")
    if q:
        base, mine = q["original"], q["model"]
        rows = [(name, pct(base[key]), pct(mine[key])) for name, key in (
            ("greedy completions that parse", "parse_rate"), ("degenerate (one token 10+ times in a row)",
                                                              "degenerate_rate"),
            ("ending in a loop", "looping_rate")) if base[key] is not None]
        rows += [("base model's NLL of the greedy completions (nats/token)", fmt(base["target_nll"]),
                  fmt(mine["target_nll"])),
                 ("loss on the base's held-out greedy text (nats/token)", fmt(q["heldout_text_loss"]["original"]),
                  fmt(q["heldout_text_loss"]["model"])),
                 ("greedy completion = base's", "", pct(mine["same_as_target"])),
                 ("greedy tokens = base's (position by position)", "", pct(mine["token_agreement"])),
                 ("first token that differs from the base's (mean index)", "", fmt(mine["first_divergence"], 1))]
        lines += ["", f"Greedy text against the base model's, first {q['prompts']} prompts:", "",
                  *table(("", "base model", "this model"), rows)]
    return lines


def pct(value) -> str:
    return "-" if value is None else f"{value:.0%}"
