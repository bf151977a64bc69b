"""Collecting trajectories (`cllm collect`): Jacobi-decode a prompt set with the target model and
record every block's trajectory (see `cllm.data.trajectories` for the record format).

The engine (`cllm.decoding.jacobi_decode`, KV cache + fast-forward commit) reports every
iteration of every block through its `on_iteration` hook; this module turns those events into
records, drops degenerate ones, optionally augments them, and writes shards. It never runs a
forward pass of its own, so collecting costs exactly one Jacobi decode per prompt.

Cleaning: a record whose fixed point repeats one token 10+ times in a row is dropped (the
reference's filter) and counted; later blocks of the prompt keep it in their prefix. With
`--drop-loops`, a prompt's blocks are also dropped from the first one after which the generated
text ends in a short loop ('_cache_cache_cache...'): the one-token test does not see those, and
an on-policy round should not make the CLLM's own loops its consistency targets (on the
embedded model this alone did not stop the repetition: benchmarks/distill_ablations.md).
Augmentation (`--augment`, off by default): for every state but the fixed point with k >= 2
wrong tokens, one extra state with the leftmost k // 2 of them copied from the fixed point,
stored apart from the true trajectory (`augmented_states`).

Reproducibility: each prompt's initial guesses come from its own generator, seeded from
(seed, prompt id), and records are a function of the prompt alone. So the output does not
depend on batch size, on the number of processes, or on how often the run was resumed.

Resume: a prompt's records all live in one shard, written atomically, whose footer lists the
prompts it completes. Rerunning with the same `--out` skips those prompts. A directory whose
meta.json names other settings (model, tokenizer, block size, ...) is refused untouched, and so
are the model's own directory and any non-empty directory without a meta.json (collect writes
only meta.json, config.json and its shards, and nothing before the prompts, tokenizer and model
have loaded).

Processes: launched as K processes, the prompts not yet done are dealt round-robin to them;
each writes its own shards (`shard-r<process>-<n>`); only the main process writes meta.json and
prints. On GPUs: `accelerate launch --multi_gpu --num_processes K -m cllm.cli collect ...`. On a
machine without GPUs the same command (or `torchrun --nproc_per_node K -m cllm.cli collect`)
runs K gloo CPU processes; note that `accelerate launch --cpu --num_processes K` starts a single
process unless MPI is installed (accelerate 1.x).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Sequence
from dataclasses import astuple, dataclass, fields
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import PartialState
from accelerate.utils import parse_flag_from_env

from cllm.core import __version__
from cllm.core.config import write_config
from cllm.core.errors import UserError, first_line
from cllm.core.outputs import check_folder, claim_folder
from cllm.core.progress import progress_bar
from cllm.core.seeds import derived_seed
from cllm.data import trajectories as tj
from cllm.data.prompts import Prompt, PromptText, load_prompts, prompt_ids, reference_ids
from cllm.decoding import jacobi_decode
from cllm.decoding.inputs import left_pad, position_limit
from cllm.decoding.trajectory import TrajectoryRecorder, block_states
from cllm.evaluation.text import ends_in_loop, is_degenerate
from cllm.models import (
    fingerprint,
    load_model,
    load_tokenizer,
    pad_token_id,
    resolve_dtype,
    resolve_model_path,
    tokenizer_fingerprint,
)
from cllm.runtime import Runtime, open_runtime
from cllm.training.config import CollectConfig

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class CollectSummary:
    """What one `collect` run did, summed over processes."""

    out: str
    prompts: int  # prompts decoded by this run
    skipped: int  # prompts already complete in `out` (resumed)
    records: int  # records written
    states: int  # states in written records (augmented states not included)
    augmented_states: int
    dropped: int  # degenerate records dropped
    dropped_loops: int  # records dropped by --drop-loops
    new_tokens: int  # tokens the target generated (dropped records included)
    forward_passes: int  # forward passes per row, summed over rows (prefill included)
    seconds: float  # wall clock of the main process's decoding loop
    processes: int = 1  # that decoded

    def lines(self) -> list[str]:
        """What the run did, in three lines."""
        return [f"collected {self.prompts} prompts ({self.skipped} already done) into {self.out} with "
                f"{self.processes} process{'es' if self.processes > 1 else ''} in {self.seconds:.1f} s",
                f"  records {self.records}, states {self.states} ({self.mean_states:.2f} per record), dropped "
                f"{self.dropped} degenerate" + (f" + {self.dropped_loops} looping" if self.dropped_loops else "")
                + f", augmented states {self.augmented_states}",
                f"  target: {self.new_tokens} tokens, {self.tokens_per_forward:.3f} tokens per forward, "
                f"{self.tokens_per_second:.0f} tokens/s"]

    @property
    def mean_states(self) -> float:
        """Mean trajectory length: states per record, initial guess and fixed point included."""
        return self.states / max(self.records, 1)

    @property
    def tokens_per_forward(self) -> float:
        return self.new_tokens / max(self.forward_passes, 1)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / max(self.seconds, 1e-9)


@dataclass
class _Counts:
    records: int = 0
    states: int = 0
    augmented: int = 0
    dropped: int = 0
    dropped_loops: int = 0
    new_tokens: int = 0
    row_forwards: int = 0  # forward passes each row took part in, summed over rows

    def add(self, other: _Counts) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


# ---------------------------------------------------------------------------------------------
# Cleaning and augmentation (pure functions of token lists)

LOOP_WINDOW = 16  # --drop-loops: the last 16 tokens repeat a pattern of <= 8 (shorter than the
# quality measure's 24, so a block is dropped as soon as the loop shows)


def augment_states(states: Sequence[Sequence[int]], fixed_point: Sequence[int]) -> list[list[int]]:
    """Extra intermediate states made by copying fixed-point tokens into real states.

    For each state but the last with k >= 2 wrong tokens, one new state with its leftmost
    k // 2 wrong tokens replaced by the fixed point's: a state halfway between it and the fixed
    point that Jacobi iteration did not visit. Deterministic; duplicates are skipped.
    """
    seen = {tuple(s) for s in states}
    extra = []
    for state in states[:-1]:
        wrong = [i for i, (a, b) in enumerate(zip(state, fixed_point, strict=True)) if a != b]
        if len(wrong) < 2:
            continue
        new = list(state)
        for i in wrong[: len(wrong) // 2]:
            new[i] = fixed_point[i]
        if tuple(new) not in seen:
            seen.add(tuple(new))
            extra.append(new)
    return extra


def decode_batch(
    model, prompts: list[tuple[int, Prompt]], config: CollectConfig, *, eos_token_id, pad_id, device
) -> tuple[list[tj.TrajectoryRecord], _Counts]:
    """Jacobi-decode one batch of (position in the set, prompt) and turn its trajectories into
    records."""
    input_ids, attention_mask = left_pad([p.ids for _, p in prompts], pad_id)  # (B, T)
    generators = [torch.Generator().manual_seed(derived_seed(config.seed, p.id)) for _, p in prompts]
    recorder = TrajectoryRecorder()
    out = jacobi_decode(
        model, input_ids.to(device), attention_mask.to(device),
        block_size=config.block_size, max_new_tokens=config.max_new_tokens,
        eos_token_id=eos_token_id, guess=config.guess, generator=generators,
        on_iteration=recorder,
    )
    records: list[tj.TrajectoryRecord] = []
    counts = _Counts(row_forwards=out.stats.row_forwards)
    for row, (index, prompt) in enumerate(prompts):
        blocks = [(b.block_index, block_states(b), list(b.fixed_point)) for b in recorder.blocks[row]]
        # The hook and the output must tell the same story; anything else is an engine bug.
        joined = [t for _, _, fixed in blocks for t in fixed]
        if [b for b, _, _ in blocks] != list(range(len(blocks))) or joined != out.new_tokens[row]:
            raise RuntimeError(f"jacobi_decode's trajectory events disagree with its output for prompt {prompt.id!r}")
        counts.new_tokens += len(joined)
        prefix = list(prompt.ids)
        looping = False
        for block_index, states, fixed in blocks:
            looping = looping or (config.drop_loops and ends_in_loop(prefix[len(prompt.ids):] + fixed,
                                                                        min_length=LOOP_WINDOW))
            if looping:
                counts.dropped_loops += 1
            elif is_degenerate(fixed):
                counts.dropped += 1
            else:
                extra = augment_states(states, fixed) if config.augment else []
                records.append(tj.TrajectoryRecord(
                    prompt_id=prompt.id, prompt_index=index, block_index=block_index,
                    prompt_len=len(prompt.ids), prefix_ids=list(prefix), states=states,
                    fixed_point=fixed, labels=prompt.reference or None, augmented_states=extra,
                ))
                counts.records += 1
                counts.states += len(states)
                counts.augmented += len(extra)
            prefix += fixed
    return records, counts


def _prepare_out_dir(out: Path, meta: tj.TrajectoryMeta, model_dir: Path | None) -> None:
    """Refuse (touching nothing) a folder `check_trajectory_folder` refuses, or one collected with other
    settings."""
    check_trajectory_folder(out, model_dir)
    if (out / tj.META_FILE).exists():
        differences = tj.read_meta(out).mismatches(meta)
        if differences:
            raise UserError(
                f"{out} holds trajectories collected with other settings ({'; '.join(differences)}); "
                "use another --out or delete it"
            )


def check_trajectory_folder(out: Path, model_dir: Path | None) -> None:
    """--out is a folder `collect` may write (`cllm.core.outputs`: a new one, or one it marked),
    never the model's own directory."""
    check_folder(out, "collect", inputs=[("--model", model_dir)])


def _encode(prompts, tokenizer, *, max_prompt_len: int) -> tuple[list[tuple[int, Prompt]], int]:
    """Token ids of the prompts (and of their references, as labels). Prompts longer than the
    model's context allows are cut from the left; returns how many were cut."""
    encoded, cut = [], 0
    for index, p in prompts:
        ids = prompt_ids(tokenizer, p.text)
        if len(ids) > max_prompt_len:
            ids, cut = ids[-max_prompt_len:], cut + 1
        encoded.append((index, Prompt(p.id, p.text, ids, reference_ids(tokenizer, p.reference))))
    return encoded, cut


def _sum_over_processes(state, values: list[float]) -> list[float]:
    if state.num_processes == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=state.device)
    dist.all_reduce(t)
    return t.tolist()


def collect(config: CollectConfig) -> CollectSummary:
    """Collect Jacobi trajectories of `config.model` on `config.prompts` into `config.out`.

    Resumable (rerun with the same `out`), multi-process under `accelerate launch`, and
    independent of batch size and process count. Returns the run's summary (all processes).
    """
    check_inputs(config)
    # Without a GPU, run as (gloo) CPU processes when launched as several: accelerate only
    # sets that up when asked, and its `--cpu` launcher starts one process (see the docstring).
    use_cpu = parse_flag_from_env("ACCELERATE_USE_CPU") or not torch.cuda.is_available()
    state = PartialState(cpu=use_cpu)
    out = Path(config.out)
    # 1. what this run produces: settings, prompts, fingerprints
    prompts, tokenizer, meta = _plan(config)
    # 2. check the output directory before touching it; learn what is done before any process
    #    writes, so that every process deals the same remaining prompts
    _prepare_out_dir(out, meta, Path(resolve_model_path(config.model)))
    if state.is_main_process:  # a shard that does not read whole is collected again
        for moved in tj.set_aside_damaged_shards(out):
            log.warning("%s does not read whole: set aside as %s, its prompts are collected again",
                        moved.with_suffix(""), moved.name)
    state.wait_for_everyone()
    done = tj.completed_prompt_ids(out)
    remaining = [(i, p) for i, p in enumerate(prompts) if p.id not in done]
    mine = remaining[state.process_index :: state.num_processes]
    # 3. model and token ids (no model at all when this process has nothing left to do)
    model, encoded = _load_inputs(config, mine, tokenizer, state.device)
    # 4. only now that every input has loaded: the directory, its meta.json and config.json
    #    (a failed load leaves nothing behind that would block the rerun)
    if state.is_main_process:
        _write_run_files(out, meta, config)
    state.wait_for_everyone()
    # 5. decode shard by shard
    totals, seconds = _decode_shards(model, encoded, config, meta, out, state)
    # 6. sum over processes; the main process prints
    summed = _sum_over_processes(state, [len(encoded), *astuple(totals)])
    n_prompts, *rest = (int(v) for v in summed)
    t = _Counts(*rest)
    summary = CollectSummary(
        out=str(out), prompts=n_prompts, skipped=len(prompts) - len(remaining), records=t.records,
        states=t.states, augmented_states=t.augmented, dropped=t.dropped, dropped_loops=t.dropped_loops,
        new_tokens=t.new_tokens, forward_passes=t.row_forwards, seconds=seconds, processes=state.num_processes,
    )
    if (warning := dropped_warning(summary)) is not None:
        log.warning("%s", warning)
    return summary


DROPPED_WARNING = 0.5  # warn when more than this share of the blocks was dropped


def dropped_warning(summary: CollectSummary) -> str | None:
    """One line when most blocks were dropped as degenerate or looping: the model repeats itself
    on these prompts, and the few trajectories kept will teach little."""
    dropped = summary.dropped + summary.dropped_loops
    blocks = summary.records + dropped
    if not summary.prompts or not blocks or dropped <= DROPPED_WARNING * blocks:
        return None
    what = f"{dropped} of {blocks} blocks ({dropped / blocks:.0%}) were dropped ({summary.dropped} degenerate" + (
        f", {summary.dropped_loops} looping)" if summary.dropped_loops else ")")
    if not summary.records:
        return (f"no trajectory was kept: {what}, so `cllm train` has nothing to learn from; the model's greedy text "
                "repeats itself on these prompts")
    return (f"{what}: a bad sign: the model loops or repeats one token on these prompts, so the "
            f"{summary.records} trajectories kept will teach little; try other prompts (or a better model)")


def check_inputs(config: CollectConfig) -> None:
    """The model, the prompt set and the output folder, each problem one UserError, before any
    model loads."""
    model_dir = Path(resolve_model_path(config.model))
    _prompt_set(config)
    check_trajectory_folder(Path(config.out), model_dir)


def _prompt_set(config: CollectConfig) -> list[PromptText]:
    """Every prompt of the set (ids must be unique: a resume skips the prompts it finished by id)."""
    prompts = load_prompts(config.prompts, text_field=config.text_field)
    if len({p.id for p in prompts}) != len(prompts):
        raise UserError(f"prompt set {config.prompts!r} has duplicate prompt ids")
    return prompts


def _plan(config: CollectConfig) -> tuple[list, object, tj.TrajectoryMeta]:
    """The prompts to collect, the tokenizer, and the meta that says what the run produces
    (a rerun must produce the same to resume)."""
    all_prompts = _prompt_set(config)
    prompts_hash = hashlib.sha256()
    for p in all_prompts:
        prompts_hash.update(repr((p.id, p.text, p.reference)).encode())
    tokenizer = load_tokenizer(config.model)
    meta = tj.TrajectoryMeta(
        model=config.model, model_fingerprint=fingerprint(config.model),
        tokenizer_fingerprint=tokenizer_fingerprint(config.model), block_size=config.block_size,
        max_new_tokens=config.max_new_tokens, guess=config.guess,
        dtype=str(resolve_dtype(config.dtype)).removeprefix("torch."), seed=config.seed,
        prompts=config.prompts, prompts_fingerprint=prompts_hash.hexdigest()[:16],
        text_field=config.text_field, augment=config.augment, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=pad_token_id(tokenizer), cllm_version=__version__, drop_loops=config.drop_loops,
    )
    return all_prompts[: config.max_prompts], tokenizer, meta


def _load_inputs(config: CollectConfig, mine: list, tokenizer,
                 device) -> tuple[Runtime | None, list[tuple[int, Prompt]]]:
    """This process's model, on the runtime it decodes on, and encoded prompts (None and [] when
    it has nothing to do)."""
    if not mine:
        return None, []
    model = load_model(config.model, dtype=config.dtype, device=device)
    try:
        runtime = open_runtime(model, config.runtime)
    except ValueError as exc:
        raise UserError(f"runtime {config.runtime}: {first_line(exc)}") from None
    runtime.prepare()
    context = position_limit(model) or 1 << 30
    if context - config.max_new_tokens < 1:
        raise UserError(f"max-new-tokens {config.max_new_tokens} leaves no room for a prompt in the model's "
                        f"{context} positions")
    encoded, cut = _encode(mine, tokenizer, max_prompt_len=context - config.max_new_tokens)
    if cut:
        log.warning("%d prompts were cut from the left to fit the model's context", cut)
    return runtime, encoded


def _write_run_files(out: Path, meta: tj.TrajectoryMeta, config: CollectConfig) -> None:
    """The output directory with meta.json (once) and config.json; leftovers of a crash go."""
    claim_folder(out, "collect")
    if not (out / tj.META_FILE).exists():
        tj.write_meta(out, meta)
    write_config(config, out / "config.json")
    tj.remove_partial_files(out)


def _decode_shards(model, encoded: list[tuple[int, Prompt]], config: CollectConfig, meta: tj.TrajectoryMeta, out: Path,
                   state) -> tuple[_Counts, float]:
    """Jacobi-decode this process's prompts, a shard at a time; a prompt's records all go to
    one atomically written shard. Returns the counts and the seconds it took."""
    totals = _Counts()
    seq = tj.next_shard_seq(out, state.process_index)
    bar = progress_bar(total=len(encoded), unit="prompt", desc="collect", disable=not state.is_main_process)
    start = time.perf_counter()
    for s in range(0, len(encoded), config.shard_size):
        # Batch prompts of similar length together (less padding); records don't care.
        chunk = sorted(encoded[s : s + config.shard_size], key=lambda item: len(item[1].ids))
        decodable = [item for item in chunk if item[1].ids]  # an empty prompt is done, with no records
        bar.update(len(chunk) - len(decodable))
        records, dropped = [], 0
        for b in range(0, len(decodable), config.batch_size):
            batch = decodable[b : b + config.batch_size]
            with torch.inference_mode():
                batch_records, counts = decode_batch(model, batch, config, eos_token_id=meta.eos_token_id,
                                                     pad_id=meta.pad_token_id, device=state.device)
            records += batch_records
            dropped += counts.dropped
            totals.add(counts)
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{totals.new_tokens / (time.perf_counter() - start):.0f}", refresh=False)
        records.sort(key=lambda r: (r.prompt_index, r.block_index))
        done_ids = [p.id for _, p in sorted(chunk, key=lambda item: item[0])]
        tj.write_shard(out / tj.shard_name(state.process_index, seq), records,
                       completed_prompt_ids=done_ids, dropped=dropped, meta=meta)
        seq += 1
    bar.close()
    return totals, time.perf_counter() - start
