"""One bench run: every method on the same prompts, timed, checked and counted; then the report.

`run_bench` reads as its steps: the machine and what to measure (`_start`), every method on every
prompt, interleaved and timed (`cllm.bench.timing`), the exactness promises on every prompt
(`cllm.bench.metrics`) and, if asked, the HumanEval tests; tokens per forward against block size
(`sweep`, counts only), one prompt's Jacobi trajectories for the picture, each model's validation
loss; then the bench JSON (docs/method.md#bench-json). `write_report` writes the report folder.

Nothing measured is lost (`cllm.bench.log`): each prompt's decodes, each sweep point and each
validation loss go to OUT/progress.jsonl as soon as they are measured, and the same command
resumes from it after a crash or Ctrl-C.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers

from cllm.bench import report
from cllm.bench.config import (
    CHECKPOINT_REFERENCES,
    GGUF_REFERENCES,
    LLAMACPP_METHODS,
    BenchConfig,
    References,
    with_references,
)
from cllm.bench.llamacpp import llamacpp_runtime, project, shape_costs, skipped_note
from cllm.bench.log import BenchLog, run_key
from cllm.bench.methods import Decoded, ForwardCounter, Method, build_methods, engine_decoder
from cllm.bench.metrics import ExactnessError, all_metrics, check_exact, check_promises, exact_match, merge_stats
from cllm.bench.models import ROLES, BenchModels, check_vocabularies, fingerprints, is_shipped_family, model_info
from cllm.bench.pictures import write_trajectory_html
from cllm.bench.timing import measure
from cllm.bench.vllm import VLLM_METHODS, vllm_methods
from cllm.core.config import config_to_dict, is_off
from cllm.core.errors import UserError, first_line
from cllm.core.machine import load_warning, machine_info
from cllm.core.outputs import check_distinct, check_folder, check_new_file, claim_folder
from cllm.core.progress import Progress
from cllm.data.prompts import Prompt, encode_prompts, load_prompts
from cllm.decoding.inputs import position_limit
from cllm.decoding.trajectory import TrajectoryRecorder
from cllm.evaluation.heldout import heldout_prompts, reference_loss
from cllm.evaluation.humaneval import STOP, completion_text, run_tests
from cllm.models import SHIPPED
from cllm.profiling.steptime import forward_ms, time_forwards
from cllm.runtime import Runtime, open_runtime

COUNTING = ("docs/method.md#counting: forward passes = every model call (prefill included; the target's or CLLM's "
            "calls for the draft methods); tokens/s = new tokens / sum over prompts of the median seconds over "
            "repeats")


@dataclass
class BenchResult:
    data: dict[str, Any]  # the JSON (docs/method.md#bench-json)
    prompts: list[Prompt]
    outputs: dict[str, list[list[int]]]  # method -> per prompt new tokens
    trajectories: dict[str, Any]  # role -> TrajectoryRecorder of the drawn prompt
    violations: list[dict[str, Any]]


@dataclass
class _Run:
    """What the steps of one run share: set by `_start`, then filled in step by step."""

    config: BenchConfig
    models: BenchModels
    progress: Progress
    log: BenchLog | None
    device: torch.device
    machine: dict[str, Any]
    notes: list[str]
    wanted: list[str]  # the methods asked for and their references (empty: every one available)
    prompts: list[Prompt]
    prints: dict[str, str]  # role -> fingerprint
    val_set: str | None  # the set whose references give the validation loss (None: none)
    runtimes: dict[str, Runtime]  # role -> what our decoders run its model on
    compiled: bool  # whether the target's runtime runs a compiled forward (--compile)
    refs: References  # what the methods are measured against (a GGUF target: llama.cpp's greedy decoding)
    methods: list[Method] = field(default_factory=list)
    decoded: dict[str, list[Decoded]] = field(default_factory=dict)
    seconds: dict[str, list[float]] = field(default_factory=dict)
    outputs: dict[str, list[list[int]]] = field(default_factory=dict)
    exactness: dict[str, Any] = field(default_factory=dict)
    violations: list[dict[str, Any]] = field(default_factory=list)
    quality: dict[str, Any] | None = None
    sweep: dict[str, Any] = field(default_factory=dict)
    trajectories: dict[str, Any] = field(default_factory=dict)
    val: dict[str, float | None] = field(default_factory=dict)
    forward_cost: dict[str, Any] = field(default_factory=dict)
    shape_cost: dict[str, Any] = field(default_factory=dict)

    @property
    def trajectory_prompt(self) -> Prompt:
        return self.prompts[min(self.config.trajectory_prompt, len(self.prompts) - 1)]


def run_bench(config: BenchConfig, models: BenchModels, prompts: list[Prompt] | None = None, *,
              progress: Progress | None = None, log: BenchLog | bool | None = None) -> BenchResult:
    """Measure every method on the same prompts (see the module docstring for how).

    Args:
        progress: where to report what is being done (`cllm.core.progress`; None: silently).
        log: a `BenchLog` to record into and resume from; True: open config.out's (the CLI's
            way: a crash or Ctrl-C keeps what was measured); None: nothing is recorded.
    """
    run = _start(config, models, prompts, progress or Progress.off(), log)  # 1. machine, runtimes, methods, ...
    with _counting(models, run.runtimes) as counters, _transformers_quiet():
        _time_methods(run, counters)  # 2. every method on every prompt, interleaved and timed
        _check_outputs(run)  # 3. the exactness promises, every prompt; the HumanEval tests when asked
        _sweep(run, counters)  # 4. tokens per forward against block size (counts only)
        run.trajectories = record_trajectories(models, config, counters, run.trajectory_prompt)  # 5. the picture's
        run.val = validation_losses(models, config, run.val_set, run.progress, run.log)  # 6. each model's
    run.forward_cost = forward_cost(run.runtimes["target"], config, run.progress, run.compiled,
                                    llamacpp_for_cost(config, models, run.runtimes))  # 7. one forward
    run.shape_cost = shape_costs(config, models.tokenizer, FORWARD_PREFIX, run.progress)  # 8. ... at other sizes
    return _result(run)  # 9. the bench JSON


def _start(config: BenchConfig, models: BenchModels, prompts: list[Prompt] | None, progress: Progress,
           log: BenchLog | bool | None) -> _Run:
    """Threads and seed; each model's runtime (--runtime), readied; the machine (its load read
    before any work of ours); the methods with the references they need; the prompts; the
    validation set; the record to resume from."""
    torch.set_num_threads(config.threads)
    runtimes = open_runtimes(models, config)
    for runtime in runtimes.values():
        runtime.prepare()  # as `load_for_decoding` readies it, at the bench's threads
    torch.manual_seed(config.seed)
    gguf = models.target is None  # GGUF files: no torch weights, llama.cpp's greedy decoding is the reference
    device = runtimes["target"].device if gguf else next(models.target.parameters()).device
    # a GGUF's weights are its file's type ("Q4_1", "all F32"), not --dtype
    dtype = f"GGUF {runtimes['target'].ftype}" if gguf else config.dtype
    machine = {**machine_info(device), "dtype": dtype, "seed": config.seed}
    machine["load_warning"] = load_warning(machine["load_average_1min"], machine["cores"], config.threads)
    notes = list(models.notes) + skipped_note(config.methods)  # llama-cpp-python missing: no llamacpp_* methods
    if machine["load_warning"]:
        progress.warn(machine["load_warning"])
        notes.append(machine["load_warning"])
    compiled = False
    if config.compile:
        compiled, compile_notes = compile_models(runtimes, progress)
        notes += compile_notes
    refs = GGUF_REFERENCES if gguf else CHECKPOINT_REFERENCES
    wanted, added = with_references(config.methods, refs)
    val_set, val_note = validation_set(config) if not gguf else (None, None)  # no torch model to score
    for note in [*added, *([val_note] if val_note else [])]:
        progress.line(note)
        notes.append(note)
    prompts = prompts if prompts is not None else bench_prompts(config, models)
    check_vocabularies(models)
    prints = fingerprints(models)
    if log is True:
        key = run_key(config_to_dict(config), prints, {k: machine[k] for k in ("torch", "transformers", "device")})
        log = BenchLog.open(config.out, key, resume=config.resume)
        if log.note:
            progress.line(log.note)
    return _Run(config, models, progress, log or None, device, machine, notes, wanted, prompts, prints, val_set,
                runtimes, compiled, refs)


def bench_prompts(config: BenchConfig, models: BenchModels) -> list[Prompt]:
    """--prompts encoded, each cut from the left to leave --max-new-tokens in the target's positions."""
    limit = position_limit(models.verifier("target"))
    if limit is not None and config.max_new_tokens >= limit:
        raise UserError(f"--max-new-tokens {config.max_new_tokens} leaves no room for a prompt in the "
                        f"target's {limit} positions")
    return encode_prompts(config.prompts, models.tokenizer, limit=config.max_prompts,
                          keep=limit - config.max_new_tokens if limit else None)


def validation_set(config: BenchConfig) -> tuple[str | None, str | None]:
    """The set whose references give each model's validation loss, and a note when --val-set auto
    chose other than the shipped models' stdlib-val: for another target, stdlib-val (Python's
    standard library) is another domain, so its --prompts set when those carry references, else
    none (no validation loss)."""
    if config.val_set != "auto":
        return config.val_set, None
    if is_shipped_family(config.target):
        return "stdlib-val", None
    scored = config.val_prompts > 0 and config.val_tokens > 0  # else nothing is scored: nothing to say
    if any(p.reference for p in load_prompts(config.prompts)):
        note = (f"validation loss on the --prompts set {config.prompts!r}, whose prompts carry references "
                f"(--val-set auto: {config.target!r} is not a shipped model, and stdlib-val is their domain)")
        return config.prompts, note if scored else None
    note = (f"no validation loss: the prompts of {config.prompts!r} carry no references, and stdlib-val is the "
            f"shipped models' domain, not {config.target!r}'s (--val-set FILE scores a set with references)")
    return None, note if scored else None


def open_runtimes(models: BenchModels, config: BenchConfig) -> dict[str, Runtime]:
    """role -> its model on the runtime --runtime names ("auto": each model's own choice;
    "llamacpp": the model's GGUF export, `cllm.bench.llamacpp.bench_gguf`); a GGUF file: the
    llama.cpp runtime `load_gguf_models` opened it on."""
    out = {role: fast.model for role, fast in models.gguf.items()}
    for role in ROLES:
        model = getattr(models, role)
        if model is not None:
            try:
                if config.runtime == "llamacpp":
                    out[role] = llamacpp_runtime(config, model, models.tokenizer)
                else:
                    out[role] = open_runtime(model, config.runtime)
            except ValueError as e:
                raise UserError(f"--runtime {config.runtime}: the {role}: {first_line(e)}") from None
    return out


def llamacpp_for_cost(config: BenchConfig, models: BenchModels, runtimes: dict[str, Runtime]) -> Runtime | None:
    """The target's GGUF on llama.cpp, for `forward_cost`, when the run decodes on llama.cpp (a
    llamacpp method, or --runtime llamacpp: then it is the target's runtime already) and can."""
    wanted = set(config.methods or LLAMACPP_METHODS)
    if runtimes["target"].name == "llamacpp" or not wanted & set(LLAMACPP_METHODS) or skipped_note(config.methods):
        return None
    return llamacpp_runtime(config, models.target, models.tokenizer)


@contextmanager
def _counting(models: BenchModels, runtimes: dict[str, Runtime]) -> Iterator[dict[str, ForwardCounter]]:
    """role -> a ForwardCounter on its model and runtime, removed when the run ends."""
    counters = {r: ForwardCounter(getattr(models, r), runtimes[r]) for r in ROLES if r in runtimes}
    try:
        yield counters
    finally:
        for c in counters.values():
            c.remove()


@contextmanager
def _transformers_quiet() -> Iterator[None]:
    """generate's per-call notices would drown the output."""
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(verbosity)


def _time_methods(run: _Run, counters: dict[str, ForwardCounter]) -> None:
    if run.models.target is None:  # GGUF files: build_methods refuses every method they cannot run, vLLM's too
        run.methods = build_methods(run.config, run.models, counters, run.wanted)
    else:
        ours = [m for m in run.wanted if m not in VLLM_METHODS]  # the engines' methods are built apart
        run.methods = [*build_methods(run.config, run.models, counters, ours),
                       *vllm_methods(run.config, run.models, run.wanted).values()]
    run.decoded, run.seconds = measure(run.methods, run.prompts, repeats=run.config.repeats,
                                       warmup=run.config.warmup, device=run.device, progress=run.progress,
                                       log=run.log)
    run.outputs = {name: [d.tokens for d in per] for name, per in run.decoded.items()}


def _check_outputs(run: _Run) -> None:
    """Every promise of greedy's tokens, on every prompt; with --quality humaneval-exec, what the
    completions are worth: their HumanEval tests, run."""
    run.exactness, run.violations = check_promises(run.methods, run.prompts, run.outputs, run.config.tie_tolerance,
                                                   run.refs)
    if run.config.quality == "humaneval-exec":
        run.quality = humaneval_quality(run.methods, run.prompts, run.outputs, run.models.tokenizer,
                                        run.config.quality_timeout, run.progress)


def _sweep(run: _Run, counters: dict[str, ForwardCounter]) -> None:
    """Tokens per forward against block size, for the models whose greedy output was measured
    (not a GGUF's: its note says so)."""
    if run.models.target is None:
        return
    own_ar = {role: run.outputs[f"{role}_ar"] for role in ("target", "cllm") if f"{role}_ar" in run.outputs}
    if run.config.sweep_block_sizes and run.models.cllm is not None and "cllm" not in own_ar:
        run.notes.append("no block-size sweep of the CLLM: cllm_ar (its greedy output) is not among --methods")
    if run.config.sweep_block_sizes:
        run.sweep, bad = sweep(run.models, run.config, run.prompts, own_ar, counters, run.progress, run.log)
        run.violations += bad


def _result(run: _Run) -> BenchResult:
    """The bench JSON (docs/method.md#bench-json) and what the report draws besides."""
    config, notes = run.config, run.notes
    if run.log is not None and run.log.reused:
        notes.append(f"resumed: {run.log.reused} of {len(run.methods) * len(run.prompts)} (method, prompt) decodes, "
                     f"with their timings, come from an earlier run of the same settings ({run.log.path})")
    metrics = all_metrics(run.methods, run.decoded, run.seconds, run.refs)
    quality = dict(run.quality) if run.quality is not None else None
    if quality is not None:
        for name, share in quality.pop("pass_at_1").items():
            metrics[name]["pass_at_1"] = share
    data = {
        "config": config_to_dict(config),
        "machine": run.machine,
        "methods": metrics,
        "models": model_info(run.models, run.prints, run.val),
        "counting": COUNTING,
        "val_set": {"name": run.val_set, "prompts": config.val_prompts, "tokens_per_prompt": config.val_tokens},
        "sweep": run.sweep,
        "forward_cost": run.forward_cost,
        "exactness": run.exactness,
        "reference": run.refs.ar,  # the method every speedup_vs_ar is relative to
        "exactness_enforced": _exactness_enforced(run.models),
        "trajectory_prompt": run.trajectory_prompt.id,
        "prompt_ids": [q.id for q in run.prompts],
        "notes": notes,
    }
    if quality is not None:
        data["quality"] = quality
    if run.shape_cost:
        project(run.shape_cost, metrics)
        data["shape_cost"] = run.shape_cost
    return BenchResult(data, run.prompts, run.outputs, run.trajectories, run.violations)


def _exactness_enforced(models: BenchModels) -> bool:
    """The promise holds in float32; in lower precision mismatches are reported, not fatal. On
    GGUF files: where a wide forward gives a one-token forward's logits (f32 weights and KV
    cache: `LlamaCppRuntime.batch_invariant`)."""
    if models.target is None:
        return all(fast.model.batch_invariant for fast in models.gguf.values())
    return next(models.target.parameters()).dtype == torch.float32


FORWARD_PREFIX = 128  # cached tokens before a timed forward (a typical position in a completion)


def compile_models(runtimes: dict[str, Runtime], progress: Progress) -> tuple[bool, list[str]]:
    """--compile: the target's and the CLLM's forward compiled before anything is timed (at the
    run's thread count); whether the target's was, and a note per model that says which forward
    it runs now, or why it was not compiled."""
    notes, target = [], False
    for role, name in (("target", "target"), ("cllm", "CLLM")):
        if role not in runtimes:
            continue
        progress.line(f"compiling the {name}'s forward")
        reason = runtimes[role].compile()
        target = target or (role == "target" and reason is None)
        notes.append(f"{name}: forward not compiled: {reason}" if reason else
                     f"{name}: {runtimes[role].describe()} (compiled before timing)")
        progress.line(notes[-1])
    return target, notes


def forward_cost(runtime: Runtime, config: BenchConfig, progress: Progress, compiled: bool = False,
                 llamacpp: Runtime | None = None) -> dict[str, Any]:
    """Milliseconds of one causal forward of the target (`runtime`, what its decoders run on) at
    each --forward-tokens and --forward-batches, on each runtime that runs it (the lean one where
    it can; `runtime` too when `compiled`, its forward compiled; llama.cpp's when it runs the
    llamacpp methods, `llamacpp`, or is `runtime`) and on transformers' forward: the min over
    --repeats interleaved rounds (`cllm.profiling.steptime.time_forwards`)."""
    model = runtime.model if runtime.name != "llamacpp" else None
    extra = {"llamacpp": runtime if model is None else llamacpp} if model is None or llamacpp else None
    ks, batches = config.forward_tokens, config.forward_batches
    if not ks or not batches:
        return {}
    limit = position_limit(runtime) or FORWARD_PREFIX + max(ks) + 1
    prefix = max(1, min(FORWARD_PREFIX, limit - max(ks)))
    with progress.stage("forward cost", 1, detail=f"k = {ks}, batch = {batches}, {prefix} cached tokens") as stage:
        times = time_forwards(model, ks, batches, prefix=prefix, rounds=config.repeats, seed=config.seed,
                              compiled=runtime if compiled else None, extra=extra)
        stage.advance()
    return {"prefix": prefix, "forward": runtime.describe(), "ms": forward_ms(times)}


def humaneval_quality(methods: list[Method], prompts: list[Prompt], outputs: dict[str, list[list[int]]],
                      tokenizer, timeout: float, progress: Progress | None = None) -> dict[str, Any]:
    """pass@1 per method: each completion (cut where its function ends) run against its HumanEval
    tests (`cllm.evaluation.humaneval`); identical completions are run once."""
    texts = {m.name: [completion_text(tokenizer, p.ids, out) for p, out in zip(prompts, outputs[m.name], strict=True)]
             for m in methods}
    tasks = [(p.id, p.text, texts[m.name][i]) for m in methods for i, p in enumerate(prompts)]
    results = run_tests(tasks, timeout=timeout, progress=progress)
    verdicts = {m.name: [results[p.id, texts[m.name][i]] for i, p in enumerate(prompts)] for m in methods}
    return {
        "kind": "humaneval-exec", "timeout_s": timeout, "stop_sequences": list(STOP),
        "distinct_completions": len(results),
        "pass_at_1": {name: sum(v["passed"] for v in per) / len(per) for name, per in verdicts.items()},
        "results": {p.id: {name: per[i]["result"] for name, per in verdicts.items()} for i, p in enumerate(prompts)},
    }


def sweep(models: BenchModels, config: BenchConfig, prompts: list[Prompt],
          own_ar: dict[str, list[list[int]]], counters: dict[str, ForwardCounter],
          progress: Progress | None = None, log: BenchLog | None = None) -> tuple[dict, list]:
    """Tokens per forward of plain Jacobi at every sweep block size, for each model whose greedy
    output was measured (`own_ar`; counts only, untimed); every output is checked against it.
    With a `log`, each (model, n) point is recorded once done, or taken from it."""
    progress = progress or Progress.off()
    result, violations = {}, []
    roles = [r for r in ("target", "cllm") if getattr(models, r) is not None and r in own_ar]
    sizes = config.sweep_block_sizes
    with progress.stage("sweep", len(roles) * len(sizes) * len(prompts),
                        detail=f"plain Jacobi, n = {', '.join(map(str, sizes))}, counts only") as stage:
        for role in roles:
            result[role] = {}
            for n in sizes:
                record = log.sweeps.get((role, n)) if log is not None else None
                if record is None:
                    record = _sweep_point(models, config, prompts, own_ar[role], counters[role], role, n, stage)
                    if log is not None:
                        log.add_sweep(role, n, record["result"], record["violations"])
                else:
                    stage.advance(len(prompts))
                result[role][str(n)] = record["result"]
                violations += record["violations"]
                stage.note(f"{role} n = {n}: {record['result']['tokens_per_forward']:.2f} tokens/forward")
    return result, violations


def _sweep_point(models: BenchModels, config: BenchConfig, prompts: list[Prompt], own_ar: list[list[int]],
                 counter: ForwardCounter, role: str, n: int, stage) -> dict[str, Any]:
    """One model's plain Jacobi at block size n over every prompt: its counts and violations."""
    model = getattr(models, role)
    run = engine_decoder(counter, jacobi=True, block_size=n, max_new_tokens=config.max_new_tokens,
                         eos=models.tokenizer.eos_token_id, guess=config.engine.guess, seed=config.seed)
    decoded = []
    for p in prompts:
        counter.reset()
        decoded.append(run(p))
        stage.advance()
    stats = merge_stats([d.stats for d in decoded])
    bad = check_exact(model, prompts, [d.tokens for d in decoded], own_ar, config.tie_tolerance)
    point = {"tokens_per_forward": stats.tokens_per_forward, "mean_fast_forwarded": stats.mean_fast_forwarded,
             "stationary_tokens": stats.stationary_tokens,
             "exact_match_own_ar": exact_match([d.tokens for d in decoded], own_ar)}
    return {"result": point, "violations": [dict(m, method=f"{role}_jacobi n={n}") for m in bad if not m["near_tie"]]}


def validation_losses(models: BenchModels, config: BenchConfig, val_set: str | None,
                      progress: Progress | None = None, log: BenchLog | None = None) -> dict[str, float | None]:
    """Each model's next-token loss (nats/token) on the references of `val_set` (recorded in
    `log`, or taken from it); None for every model when there is no set or nothing to score."""
    progress = progress or Progress.off()
    tok = models.tokenizer
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    roles = [r for r in ROLES if getattr(models, r) is not None]
    if val_set is None or config.val_prompts == 0 or config.val_tokens == 0:
        return dict.fromkeys(roles)
    out = {}
    with progress.stage("validation loss", len(roles), detail=f"{config.val_prompts} prompts of {val_set}") as stage:
        for role in roles:
            name = f"val_loss/{role}/{val_set}/{config.val_prompts}/{config.val_tokens}"
            if log is not None and name in log.values:
                out[role] = log.values[name]
            else:
                model = getattr(models, role)
                context = position_limit(model)  # a short context scores fewer tokens, leaving room for the prompt
                tokens = min(config.val_tokens, context // 2) if context else config.val_tokens
                prompts = heldout_prompts(val_set, tok, count=config.val_prompts, max_new_tokens=tokens,
                                          context=context)
                out[role] = reference_loss(model, prompts, pad_id=pad_id)
                if log is not None:
                    log.add_value(name, out[role])
            stage.advance()
            stage.note(f"{role}: " + (f"{out[role]:.3f} nats/token" if out[role] is not None else "no tokens scored"))
    return out


def record_trajectories(models: BenchModels, config: BenchConfig, counters: dict[str, ForwardCounter],
                        prompt: Prompt) -> dict[str, Any]:
    """One prompt's trajectories on the engine the headline measures (cllm_jacobi's setting for
    the CLLM, target_lookahead's for the target: block size, recycling, each model's own draft
    table), per model: role -> TrajectoryRecorder. Each block knows where its tokens came from."""
    recorders = {}
    for role in ("target", "cllm"):
        model = getattr(models, role)
        if model is None:
            continue
        recorders[role] = TrajectoryRecorder()
        counters[role].reset()
        engine_decoder(counters[role], jacobi=True, max_new_tokens=config.max_new_tokens,
                       eos=models.tokenizer.eos_token_id, guess=config.engine.guess, seed=config.seed,
                       on_iteration=recorders[role], draft_table=models.tables.get(role),
                       **config.jacobi_kwargs())(prompt)
    return recorders


def write_report(result: BenchResult, out: str | Path, tokenizer, *, json_path: str | None = None) -> Path:
    """The report folder: bench.json, outputs.jsonl, report.md, PNGs, trajectory.html."""
    out = Path(out)
    claim_folder(out, "bench")
    plots = report.plotting_available()
    if not plots and report.PLOTS_MISSING not in result.data["notes"]:
        result.data["notes"].append(report.PLOTS_MISSING)
    text = json.dumps(result.data, indent=2) + "\n"
    (out / "bench.json").write_text(text)
    if json_path:
        check_new_file(json_path, flag="--json", replaceable=is_bench_json, what="bench JSON")
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(text)
    with open(out / "outputs.jsonl", "w") as fh:
        for i, p in enumerate(result.prompts):
            row = {"prompt_id": p.id, "prompt_ids": p.ids, **{m: o[i] for m, o in result.outputs.items()}}
            fh.write(json.dumps(row) + "\n")
    if plots:
        report.plot_speedup(result.data["methods"], out / "speedup.png")
        report.plot_accepted_histograms(result.data["methods"], out / "accepted_histogram.png")
        report.plot_tpf_vs_block_size(result.data["sweep"], out / "tpf_vs_block_size.png")
    _write_trajectory_page(result, out / "trajectory.html", tokenizer)
    (out / "report.md").write_text(report.markdown_report(result.data))
    return out


def _write_trajectory_page(result: BenchResult, path: Path, tokenizer) -> None:
    """trajectory.html: the drawn prompt's first blocks, target beside CLLM, on the headline's engine."""
    prompt = next(p for p in result.prompts if p.id == result.data["trajectory_prompt"])
    cfg = result.data["config"]
    method = {"target": "target_lookahead", "cllm": "cllm_jacobi"}
    panels = [(f"{role} ({result.data['models'][role]['name']}): {method[role]}"
               + (", its draft table" if "draft_table" in result.data["models"][role] else ", no draft table"),
               rec.blocks[0]) for role, rec in result.trajectories.items()]
    write_trajectory_html(path, panels, lambda t: tokenizer.decode([t]), prompt=prompt.text,
                          title=f"Jacobi trajectories of {prompt.id} on the engine the headline measures: "
                          f"n = {cfg['block_size']}, {cfg['recycle']} recycled n-gram drafts per forward, each "
                          "model's draft table when it has one")


def check_out_is_bench_folder(config: BenchConfig) -> None:
    """Refuse, before anything loads or is written, an --out that is a model's folder or holds
    files bench did not write (`cllm.core.outputs`), and a --json file that is not a bench JSON."""
    models = [(flag, SHIPPED.get(name, Path(name).expanduser()))
              for name, flag in ((config.target, "--target"), (config.cllm, "--cllm"),
                                 (config.draft_model, "--draft-model")) if name and not is_off(name)]
    check_folder(config.out, "bench", inputs=models)
    if config.json:
        check_distinct([("--json", config.json), ("--out's bench.json", Path(config.out) / "bench.json")])
        check_new_file(config.json, flag="--json", replaceable=is_bench_json, what="bench JSON",
                       inputs=[*models, ("--prompts", config.prompts)])


def is_bench_json(path: Path) -> bool:
    """Whether `path` holds a bench JSON (what --json writes): an object with its top keys."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and {"config", "machine", "methods"} <= data.keys()


def raise_on_violations(result: BenchResult) -> None:
    """After the report is written: a broken exactness promise (in float32) is an ExactnessError."""
    if result.violations and result.data["exactness_enforced"]:
        first = result.violations[0]
        raise ExactnessError(
            f"{len(result.violations)} exactness violation(s); first: {first['method']} on prompt "
            f"{first['prompt_id']!r} differs from greedy at new token {first['first_difference']} "
            f"(top-2 logit margin {first['top2_margin']}: not a near-tie). Report written anyway.")
