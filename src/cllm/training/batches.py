"""What one training step of `cllm train` learns from: micro-batches of trajectory records
(which states, which positions count), text windows and rollouts, all drawn from the step number.

Every row is ``prefix (left-padded) + block (right-padded)`` (`cllm.modeling.forwards`), so rows of all kinds
stack into one forward. Masks depend on tokens only, so every process can count the positions
of the whole global batch without talking (`Counts`: the normalisers of the loss terms).
Nothing here runs a model but `make_rollouts`, which decodes with the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from cllm.core.errors import UserError
from cllm.core.seeds import derived_seed
from cllm.data.corpus import load_corpus
from cllm.data.tokenizer import token_stream
from cllm.data.trajectories import TrajectoryRecord, collate
from cllm.decoding import greedy_decode, sample_decode
from cllm.evaluation.text import ends_in_loop
from cllm.modeling import losses
from cllm.modeling.forwards import Packing, PrefixBlocks, rows_from_lists
from cllm.training.config import TrainConfig

NOISE_WINDOW = 16  # Jacobi Forcing's W: noise levels cycle over this many consecutive blocks


@dataclass
class MicroBatch:
    """B records with k sampled states each; state row i belongs to record ``owner[i]``."""

    fixed_point: PrefixBlocks  # (B) prefix + y*
    state: torch.Tensor  # (B*k, N) y^(j), the sampled non-fixed states
    next_state: torch.Tensor  # (B*k, N) y^(j+1) (the fixed point after the last non-fixed state)
    owner: torch.Tensor  # (B*k,) the record of each state row
    labels: PrefixBlocks | None  # prompt + ground truth before this block + its slice of the ground truth
    gc_mask: torch.Tensor  # (B*k, N) bool
    lc_mask: torch.Tensor  # (B*k, N) bool
    text: torch.Tensor | None = None  # (W, L + 1) text windows for the AR term (--ar-text)
    rollout: PrefixBlocks | None = None  # prompt + the model's own continuation (--rollout-prompts)
    packing: Packing | None = None  # --layout packed: the records as one sequence per prompt

    def to(self, device) -> MicroBatch:
        def move(x):
            return None if x is None else x.to(device)

        return MicroBatch(self.fixed_point.to(device), self.state.to(device), self.next_state.to(device),
                          self.owner.to(device), move(self.labels), self.gc_mask.to(device),
                          self.lc_mask.to(device), move(self.text), move(self.rollout), move(self.packing))


@dataclass
class Counts:
    """Counted positions of a global batch: the normalisers of the three loss terms."""

    gc: int = 0
    lc: int = 0
    ar: int = 0  # positions of the AR rows (labels, fixed points, text windows)
    rollout: int = 0  # the rollouts' token budget (their lengths are not known before decoding)

    @property
    def kd(self) -> int:
        return self.ar + self.rollout

    def add(self, mb: MicroBatch, config: TrainConfig, rollouts: int = 0) -> None:
        """Count `mb`'s positions; `rollouts`: how many rollouts it will carry."""
        recipe = config.recipe
        self.gc += int(mb.gc_mask.sum()) if recipe.uses_gc else 0
        self.lc += int(mb.lc_mask.sum()) if recipe.uses_lc else 0
        self.ar += int(mb.fixed_point.block_mask.sum()) if recipe.ar_on_fixed_points else 0
        self.ar += int(mb.labels.block_mask.sum()) if recipe.ar_on_labels else 0
        if mb.text is not None and recipe.uses_ar_rows:
            self.ar += mb.text.shape[0] * (mb.text.shape[1] - 1)
        self.rollout += rollouts * recipe.rollout_tokens


def _text(record: TrajectoryRecord) -> list[int]:
    return list(record.prefix_ids) + list(record.fixed_point)


def prompt_chains(records: Sequence[TrajectoryRecord]) -> list[list[TrajectoryRecord]]:
    """The records grouped into chains, the unit of `--layout packed`: the blocks of one prompt
    that continue one text (each record's prefix and fixed point a prefix of the longest one's),
    in block order. A prompt collected twice (say by two on-policy rounds) gives two chains.
    Chains come in the order of their first record."""
    by_prompt: dict[str, list[list[TrajectoryRecord]]] = {}
    order: list[list[TrajectoryRecord]] = []
    for record in sorted(records, key=lambda r: r.block_index):
        text = _text(record)
        for chain in by_prompt.setdefault(record.prompt_id, []):
            longest = _text(chain[-1])
            if all(r.block_index != record.block_index for r in chain) and longest[: len(text)] == text[: len(longest)]:
                chain.append(record)
                break
        else:
            chain = [record]
            by_prompt[record.prompt_id].append(chain)
            order.append(chain)
    first = {id(r): i for i, r in enumerate(records)}
    return sorted(order, key=lambda chain: min(first[id(r)] for r in chain))


def pack(records: Sequence[TrajectoryRecord], pad_id: int) -> Packing:
    """`Packing` of `records` (record i keeps index i): one sequence per chain, its clean text the
    longest record's prefix and fixed point."""
    chains = prompt_chains(records)
    index = {id(r): i for i, r in enumerate(records)}
    texts = [max((_text(r) for r in chain), key=len) for chain in chains]
    clean = torch.full((len(texts), max(map(len, texts))), pad_id, dtype=torch.long)
    sequence = torch.zeros(len(records), dtype=torch.long)
    start = torch.zeros(len(records), dtype=torch.long)
    for s, (chain, text) in enumerate(zip(chains, texts, strict=True)):
        clean[s, : len(text)] = torch.tensor(text)
        for r in chain:
            sequence[index[id(r)]], start[index[id(r)]] = s, len(r.prefix_ids)
    return Packing(clean, torch.tensor([len(t) for t in texts]), sequence, start)


def label_rows(records: Sequence[TrajectoryRecord], block_size: int, pad_id: int) -> PrefixBlocks:
    """The AR rows on the ground truth: record k of a prompt counts labels[k*n : (k+1)*n], after
    the prompt and the labels before them, so each label token (within the trajectories' token
    budget) counts once per epoch however many blocks its prompt has."""
    prefixes, blocks = [], []
    for r in records:
        labels, start = list(r.labels or []), r.block_index * block_size
        prefixes.append(list(r.prefix_ids[: r.prompt_len]) + labels[:start])
        blocks.append(labels[start : start + block_size])
    return rows_from_lists(prefixes, blocks, pad_id)


def pick_states(draws: torch.Tensor, num_states: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k distinct non-fixed states per record, uniformly: the k lowest `draws` (B, S) among
    indices ``< num_states - 1``. Returns indices (B, k) and whether each pick exists (B, k)
    (a record with m < k non-fixed states has k - m picks that count nothing)."""
    S = draws.shape[1]
    eligible = torch.arange(S)[None, :] < (num_states - 1)[:, None]  # (B, S)
    keys = torch.where(eligible, draws, torch.full_like(draws, 2.0))
    order = keys.argsort(dim=1, stable=True)
    picks = order[:, :k] if k <= S else torch.cat([order, order[:, :1].expand(-1, k - S)], 1)
    exists = torch.arange(k)[None, :] < (num_states - 1).clamp(min=0)[:, None]
    return picks, exists


def copy_positions(state: torch.Tensor, fixed_point: torch.Tensor, reach: int = 2) -> torch.Tensor:
    """(R, N) bool: positions i whose target y*_i equals a *wrong* state token at i - 1 .. i - reach.

    A Jacobi state often holds the fixed point's tokens shifted by a position or two; learning
    y*_i there can be done by copying the wrong token before it, a shortcut that also fires on
    clean text and makes the model repeat itself.
    """
    out = torch.zeros_like(state, dtype=torch.bool)
    for d in range(1, reach + 1):
        before = state[:, :-d]  # the state token d positions back
        wrong = before != fixed_point[:, :-d]
        out[:, d:] |= wrong & (before == fixed_point[:, d:])
    return out


def loop_positions(records: Sequence[TrajectoryRecord], width: int) -> torch.Tensor:
    """(B, width) bool: block positions whose token ends a loop of the generated text so far."""
    out = torch.zeros(len(records), width, dtype=torch.bool)
    for r, record in enumerate(records):
        text = list(record.prefix_ids[record.prompt_len :])
        for i, token in enumerate(record.fixed_point):
            text.append(token)
            out[r, i] = ends_in_loop(text)
    return out


def progressive_keys(states: torch.Tensor, fixed_point: torch.Tensor, valid: torch.Tensor,
                     block_index: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """Keys in [0, 1) for `pick_states` (lowest first) under the progressive schedule.

    states (B, S, N), fixed_point (B, N), valid (B, N), block_index (B,), draws (B, S). A state's
    noise is the fraction of its valid tokens that differ from the fixed point; block j aims at
    t_j = linspace(0, 1, W)[j mod W]; the key is the distance to t_j (ties broken by `draws`),
    so the states nearest to the block's noise level come first.
    """
    differs = (states != fixed_point[:, None, :]) & valid[:, None, :]  # (B, S, N)
    noise = differs.sum(-1) / valid.sum(-1, keepdim=True).clamp(min=1)  # (B, S)
    levels = torch.linspace(0, 1, NOISE_WINDOW)[block_index % NOISE_WINDOW]  # (B,)
    distance = (noise - levels[:, None]).abs()  # in [0, 1]
    return (distance + draws * 1e-3) / 1.002  # stays below the key of ineligible states (2.0)


def make_micro_batch(
    records: Sequence[TrajectoryRecord], draws: torch.Tensor, *, pad_id: int, block_size: int,
    config: TrainConfig,
) -> MicroBatch:
    """Tensors for `records`; `draws` (B, S) uniform in [0, 1) pick each record's states
    (`pick_states`; S at least the records' state count)."""
    recipe = config.recipe
    b = collate(records, pad_id=pad_id, include_augmented=config.augmented)
    k = recipe.states_per_record
    B, S = len(records), b.states.shape[1]
    if draws.shape[1] < S:
        raise ValueError(f"draws cover {draws.shape[1]} states, the records hold up to {S}")
    draws = draws[:, :S]
    if recipe.state_schedule == "progressive":
        draws = progressive_keys(b.states, b.fixed_point, b.block_mask.bool(), b.block_index, draws)
    picks, exists = pick_states(draws, b.num_states, k)  # (B, k) each
    owner = torch.arange(B).repeat_interleave(k)  # (B*k,)
    j = picks.reshape(-1)
    j_next = torch.minimum(j + 1, b.num_states[owner] - 1)
    state, next_state = b.states[owner, j], b.states[owner, j_next]  # (B*k, N) each
    # a record that starts at its fixed point, or a pick beyond its states, counts nothing
    valid = b.block_mask.bool()[owner] & exists.reshape(-1)[:, None]
    fixed = b.fixed_point[owner]
    if recipe.cut_loops:  # positions that continue a loop are no consistency target
        valid = valid & ~loop_positions(records, b.fixed_point.shape[1])[owner]
    if recipe.skip_copies:
        valid = valid & ~copy_positions(state, fixed)
    return MicroBatch(
        fixed_point=PrefixBlocks(b.prefix_ids, b.prefix_mask, b.fixed_point, b.block_mask),
        state=state, next_state=next_state, owner=owner,
        labels=label_rows(records, block_size, pad_id) if recipe.ar_on_labels else None,
        gc_mask=losses.gc_mask(state, fixed, valid, window=recipe.gc_window),
        lc_mask=losses.lc_mask(state, next_state, valid),
        packing=pack(records, pad_id) if recipe.layout == "packed" else None,
    )


def step_records(records: Sequence[TrajectoryRecord], step: int, *, batch_size: int,
                 seed: int) -> list[TrajectoryRecord]:
    """The global batch of `step`: a fresh seeded permutation per epoch, its remainder dropped."""
    per_epoch = len(records) // batch_size
    epoch, index = divmod(step, per_epoch)
    order = torch.randperm(len(records), generator=torch.Generator().manual_seed(derived_seed(seed, "epoch", epoch)))
    return [records[i] for i in order[index * batch_size : (index + 1) * batch_size].tolist()]


STDLIB_TEXT = ("stdlib", "stdlib-train")  # --ar-text names of the embedded corpus' train split


def check_text_source(name: str) -> None:
    """--ar-text names the embedded corpus or a text file."""
    if name not in STDLIB_TEXT and not Path(name).is_file():
        raise UserError(f"--ar-text {name!r} is neither 'stdlib-train' nor a text file")


def load_text_stream(name: str, tokenizer) -> torch.Tensor:
    """--ar-text as one token stream: the embedded corpus' train split, or a text file."""
    check_text_source(name)
    if name in STDLIB_TEXT:
        return token_stream(load_corpus("train"), tokenizer)
    ids = tokenizer(Path(name).read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def sample_text_windows(stream: torch.Tensor, config: TrainConfig, step: int) -> torch.Tensor:
    """(W, L + 1) windows of the text at random offsets; the step number seeds them."""
    recipe = config.recipe
    length = min(recipe.ar_text_length, len(stream) - 1)
    if length < 1:
        raise UserError("--ar-text holds fewer than 2 tokens")
    generator = torch.Generator().manual_seed(derived_seed(recipe.seed, "text", step))
    starts = torch.randint(0, len(stream) - length, (recipe.ar_text_windows,), generator=generator)
    return stream[starts[:, None] + torch.arange(length + 1)]


def rollout_prompts(records: Sequence[TrajectoryRecord]) -> list[list[int]]:
    """The distinct prompts of the records (their first block's prompt tokens), in record order."""
    seen, out = set(), []
    for r in records:
        if r.prompt_id not in seen:
            seen.add(r.prompt_id)
            out.append(list(r.prefix_ids[: r.prompt_len]))
    return out


@torch.no_grad()
def make_rollouts(model, prompts: Sequence[Sequence[int]], config: TrainConfig, seeds: Sequence[int], *,
                  eos_token_id, pad_id: int) -> PrefixBlocks:
    """Rows ``prompt + the model's own continuation`` (greedy, or sampled at the rollout
    temperature, one generator per prompt seeded by `seeds`), decoded with the KV cache."""
    recipe = config.recipe
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    rows = rows_from_lists(prompts, [[]] * len(prompts), pad_id)
    ids, mask = rows.prefix_ids.to(device), rows.prefix_mask.to(device)
    if recipe.rollout_temperature > 0:
        generators = [torch.Generator().manual_seed(seed) for seed in seeds]
        out = sample_decode(model, ids, mask, max_new_tokens=recipe.rollout_tokens, eos_token_id=eos_token_id,
                            temperature=recipe.rollout_temperature, generator=generators)
    else:
        out = greedy_decode(model, ids, mask, max_new_tokens=recipe.rollout_tokens, eos_token_id=eos_token_id)
    model.train(was_training)
    return rows_from_lists(prompts, out.new_tokens, pad_id)


def step_rollout_prompts(prompts: Sequence[Sequence[int]], step: int, config: TrainConfig) -> list[int]:
    """Indices of the step's rollout prompts: a seeded draw (the step number is the RNG state)."""
    generator = torch.Generator().manual_seed(derived_seed(config.recipe.seed, "rollout-prompts", step))
    return torch.randperm(len(prompts), generator=generator)[: config.recipe.rollout_prompts].tolist()
