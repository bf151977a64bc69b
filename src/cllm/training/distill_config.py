"""`cllm distill`'s settings (`DistillConfig`) and its default recipe, apart from the run code
(`cllm.training.distill`) so that the CLI parses them without importing torch. The recipe's
provenance: `cllm.training.distill`'s docstring.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from cllm.core.config import Section, retune
from cllm.core.errors import UserError
from cllm.core.options import EVALUATION, MACHINE, Model, PromptSet, RunFolder
from cllm.training.config import CollectConfig, DraftsConfig, Recipe, TrainConfig, WithRecipe
from cllm.training.options import DRAFT_TABLE, ROUNDS, Collection

# row r7 of benchmarks/distill_ablations.md (see above); the rest is `Recipe`'s defaults
DISTILL_RECIPE = Recipe(distance="argmax", states_per_record=8, ar_weight=0.0, ar_target="fixed_points",
                        ar_text="stdlib-train", ar_text_windows=4, label_smoothing=0.0, kd_weight=10.0,
                        consistency_teacher="target", rollout_prompts=6, skip_copies=True)


@dataclass
@retune(out="runs/distill", max_prompts=2560, drop_loops=True, recipe=DISTILL_RECIPE)
class DistillConfig(Model, PromptSet, RunFolder, Collection, WithRecipe):
    SECTION: ClassVar[Section] = ROUNDS
    rounds: int = field(default=1, metadata={"help": "collect + train rounds: round k >= 2 re-collects the "
        "trajectories with round k-1's CLLM (on-policy) and trains it further"})
    accumulate: bool = field(default=True, metadata={"help": "round k trains on the trajectories of rounds 1..k "
        "(earlier data kept, never replaced); false: round k's alone"})
    round_block_sizes: list[int] | None = field(default=None, metadata={"help": "block size of each round's "
        "trajectories, e.g. 16,32 (Jacobi Forcing: n = 16, then 32 collected with round 1's CLLM); the last one "
        "repeats for later rounds (default: --block-size every round); a round keeps only the earlier trajectories of "
        "its own block size"})
    drafts_prompts: int = field(default=2400, metadata={"section": DRAFT_TABLE, "help": "the CLLM's draft table (cllm "
        "drafts) from its greedy completions of this many --prompts (0: no table)"})
    drafts_max_new_tokens: int = field(default=128, metadata={"section": DRAFT_TABLE, "help": "greedy tokens per "
        "prompt for the draft table"})
    train_eval_count: int = field(default=16, metadata={"section": EVALUATION, "help": "held-out prompts evaluated "
        "during training"})
    eval_count: int = field(default=32, metadata={"section": EVALUATION, "help": "held-out prompts in the final "
        "evaluation"})
    eval_block_sizes: list[int] = field(default_factory=lambda: [16, 32], metadata={"section": EVALUATION, "help":
        "Jacobi block sizes of the final evaluation"})
    collect_batch_size: int = field(default=8, metadata={"section": MACHINE, "help": "prompts per forward in "
        "collection"})

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("collect_batch_size", "eval_count", "rounds", "drafts_max_new_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise UserError(f"{name.replace('_', '-')} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("eval_block_sizes", "round_block_sizes"):
            sizes = getattr(self, name)
            if sizes is None and name == "round_block_sizes":  # --block-size every round
                continue
            if not sizes or any(not isinstance(n, int) or n < 1 for n in sizes):
                raise UserError(f"{name.replace('_', '-')} must be positive integers, got {sizes!r}")
        if not isinstance(self.drafts_prompts, int) or self.drafts_prompts < 0:
            raise UserError(f"drafts-prompts must be an integer >= 0, got {self.drafts_prompts!r}")
        self.train_config()  # validates the training options

    def round_model(self, round_: int) -> str:
        """What round `round_` starts from: the target, then the previous round's CLLM."""
        return self.model if round_ == 1 else str(self.round_dir(round_ - 1, "model"))

    def round_block_size(self, round_: int) -> int:
        """The Jacobi block size of round `round_`'s trajectories."""
        sizes = self.round_block_sizes or [self.block_size]
        return sizes[min(round_, len(sizes)) - 1]

    def round_dir(self, round_: int, kind: str) -> Path:
        """OUT/trajectories and OUT/model for round 1, OUT/{kind}-round{k} after."""
        return Path(self.out) / (kind if round_ == 1 else f"{kind}-round{round_}")

    def collect_config(self, round_: int = 1, *, limit: int | None = None) -> CollectConfig:
        """Round `round_`'s collection; `limit`: the first prompts of --prompts it may use (the
        rest held out for evaluation)."""
        return CollectConfig(model=self.round_model(round_), prompts=self.prompts,
                             out=str(self.round_dir(round_, "trajectories")),
                             block_size=self.round_block_size(round_), max_new_tokens=self.max_new_tokens,
                             max_prompts=_first(self.max_prompts, limit), guess=self.guess, seed=self.recipe.seed,
                             batch_size=self.collect_batch_size, drop_loops=self.drop_loops and round_ >= 2)

    def train_config(self, round_: int = 1, *, eval_prompts: str | None = None) -> TrainConfig:
        """Round `round_`'s training: the recipe on the trajectories of its block size so far,
        evaluated on `eval_prompts` (default: --eval-prompts)."""
        first = 1 if self.accumulate else round_
        n = self.round_block_size(round_)
        data = ",".join(str(self.round_dir(r, "trajectories")) for r in range(first, round_ + 1)
                        if self.round_block_size(r) == n)
        recipe = dataclasses.replace(self.recipe, cut_loops=self.recipe.cut_loops and round_ > 1,
                                     eval_prompts=eval_prompts or self.recipe.eval_prompts)
        return TrainConfig(
            model=self.round_model(round_), data=data, out=str(self.round_dir(round_, "model")), recipe=recipe,
            teacher=self.model if round_ > 1 and (recipe.needs_teacher or self.accumulate) else None,
            eval_count=self.train_eval_count, eval_block_size=max(self.eval_block_sizes),
        )

    def drafts_config(self, model_dir: Path, *, limit: int | None = None) -> DraftsConfig:
        """The CLLM's draft table, from the first --drafts-prompts of --prompts (at most `limit`)."""
        return DraftsConfig(model=str(model_dir), prompts=self.prompts, max_prompts=_first(self.drafts_prompts, limit),
                            max_new_tokens=self.drafts_max_new_tokens, batch_size=self.collect_batch_size,
                            force=True)  # the CLLM is this run's own: its table is rebuilt when out of date

    def eval_settings(self, prompts: str) -> dict:
        """What the final evaluation of `prompts` depends on (a rerun with the same reuses it)."""
        recipe = self.recipe
        return {"prompts": prompts, "count": self.eval_count, "block_sizes": list(self.eval_block_sizes),
                "max_new_tokens": recipe.eval_max_new_tokens, "seed": recipe.seed}


def _first(*limits: int | None) -> int | None:
    """The smallest of the limits given (None: no limit)."""
    given = [n for n in limits if n is not None]
    return min(given) if given else None
