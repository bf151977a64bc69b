"""The objective of one micro-batch: ``consistency + ar_weight * AR + kd_weight * KD``, each a
sum over its counted positions divided by its global count (so accumulation and processes give
exactly the gradient of the whole batch), and the frozen teacher the KD term and
``--consistency-teacher target`` read their targets from. The losses themselves are pure
functions in `cllm.modeling.losses`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cllm.modeling import losses
from cllm.modeling.forwards import BlockGroup, PrefixBlocks, forward_blocks, forward_packed, forward_shared_prefix
from cllm.models import load_model
from cllm.training.batches import Counts, MicroBatch
from cllm.training.config import Recipe, TrainConfig


@dataclass
class StepLosses:
    gc: torch.Tensor
    lc: torch.Tensor
    ar: torch.Tensor
    kd: torch.Tensor
    total: torch.Tensor


class FrozenTeacher:
    """The frozen target whose logits the distillation term and `--consistency-teacher target`
    learn: a second copy of the model (eval mode, no gradients), or, when LoRA trains the model
    being distilled from itself, the same weights with the adapter disabled (no second copy)."""

    def __init__(self, copy=None, peft_model=None):
        if (copy is None) == (peft_model is None):
            raise ValueError("a teacher is a copy or a LoRA model, not both")
        self.copy, self.peft_model = copy, peft_model

    @torch.no_grad()
    def __call__(self, fn):
        """fn(model) -> logits (or anything), run on the teacher without gradients."""
        if self.copy is not None:
            return fn(self.copy)
        with self.peft_model.disable_adapter():
            return fn(self.peft_model.get_base_model())


def micro_batch_loss(model, mb: MicroBatch, counts: Counts, config: TrainConfig, pad_id: int,
                     *, logits_to_keep: bool = True, teacher: FrozenTeacher | None = None) -> StepLosses:
    """This micro-batch's share of ``consistency + ar_weight * ar + kd_weight * kd`` for the global
    batch (each term a sum over its counted positions divided by its global count)."""
    recipe = config.recipe
    device = next(model.parameters()).device
    mb = mb.to(device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=recipe.dtype == "bfloat16"):
        student = _student_logits(model, mb, recipe, logits_to_keep)  # 1., 2.
        frozen = _teacher_logits(teacher, mb, recipe, student, logits_to_keep) if teacher is not None else {}  # 3.
    return _terms(mb, counts, recipe, student, frozen)  # 4.


def _student_logits(model, mb: MicroBatch, recipe: Recipe, logits_to_keep: bool) -> dict[str, torch.Tensor]:
    """The logits of the model being trained, by row kind: "state", "fixed_point", "next_state",
    "labels", "text", "rollout" (those the recipe uses)."""
    fp = mb.fixed_point
    records = torch.arange(len(fp), device=mb.owner.device)
    target_teacher = recipe.consistency_teacher == "target"
    # 1. one forward over the records' prefixes (with gradients), then the blocks that continue
    #    them: the states (with), the fixed point (with when AR learns it, a stop-gradient GC
    #    target when the model is its own teacher), the next states (stop-gradient, LC)
    groups = {"state": BlockGroup(mb.state, fp.block_mask[mb.owner], mb.owner, grad=True)}
    if recipe.ar_on_fixed_points or (recipe.uses_gc and not target_teacher):
        groups["fixed_point"] = BlockGroup(fp.block_ids, fp.block_mask, records, grad=recipe.ar_on_fixed_points)
    if recipe.uses_lc and not target_teacher:
        groups["next_state"] = BlockGroup(mb.next_state, fp.block_mask[mb.owner], mb.owner, grad=False)
    if mb.packing is None:
        logits = forward_shared_prefix(model, fp.prefix_ids, fp.prefix_mask, list(groups.values()),
                                       logits_to_keep=logits_to_keep)
        student = dict(zip(groups, logits, strict=True))
    else:  # --layout packed: the fixed points are the clean text every state block reads
        fixed_point = groups.pop("fixed_point", None)
        clean, logits = forward_packed(model, mb.packing, fp.width, list(groups.values()),
                                       logits_to_keep=logits_to_keep)
        student = dict(zip(groups, logits, strict=True))
        if fixed_point is not None:
            student["fixed_point"] = clean if fixed_point.grad else clean.detach()
    # 2. the AR rows on the ground truth have prefixes of their own; text windows and rollouts too
    if recipe.ar_on_labels:
        student["labels"] = forward_blocks(model, mb.labels, logits_to_keep=logits_to_keep)
    if mb.text is not None and len(mb.text) and recipe.uses_ar_rows:
        student["text"] = model(input_ids=mb.text[:, :-1], use_cache=False).logits
    if mb.rollout is not None:
        student["rollout"] = forward_blocks(model, mb.rollout, logits_to_keep=logits_to_keep)
    return student


def _teacher_logits(teacher: FrozenTeacher, mb: MicroBatch, recipe: Recipe, student: dict,
                    logits_to_keep: bool) -> dict[str, torch.Tensor]:
    """3. The frozen teacher's logits on the rows whose targets it gives (no gradients)."""
    fp, frozen = mb.fixed_point, {}
    target_teacher, kd = recipe.consistency_teacher == "target", recipe.kd_weight > 0

    def blocks(rows):
        return teacher(lambda m: forward_blocks(m, rows, logits_to_keep=logits_to_keep))

    if (recipe.uses_gc and target_teacher) or (kd and recipe.ar_on_fixed_points):
        if mb.packing is None:
            frozen["fixed_point"] = blocks(fp)
        else:  # one causal forward over each prompt's clean text
            frozen["fixed_point"] = teacher(lambda m: forward_packed(m, mb.packing, fp.width, [],
                                                                     logits_to_keep=logits_to_keep)[0])
    if recipe.uses_lc and target_teacher:
        o = mb.owner
        frozen["next_state"] = blocks(PrefixBlocks(fp.prefix_ids[o], fp.prefix_mask[o], mb.next_state,
                                                   fp.block_mask[o]))
    if kd:
        for name in ("labels", "rollout"):
            if name in student:
                frozen[name] = blocks(mb.rollout if name == "rollout" else mb.labels)
        if "text" in student:
            frozen["text"] = teacher(lambda m: m(input_ids=mb.text[:, :-1], use_cache=False).logits)
    return frozen


def _terms(mb: MicroBatch, counts: Counts, recipe: Recipe, student: dict, frozen: dict) -> StepLosses:
    """4. The terms, each normalised by its global count, and their weighted sum."""
    fp = mb.fixed_point
    zero = student["state"].new_zeros(())
    gc = lc = ar = kd_term = zero
    gc_teacher = frozen if recipe.consistency_teacher == "target" else student
    if recipe.uses_gc:
        gc = losses.gc_loss(student["state"], gc_teacher["fixed_point"][mb.owner], mb.gc_mask,
                            distance=recipe.distance, normalizer=max(counts.gc, 1))
    if recipe.uses_lc:
        lc = losses.lc_loss(student["state"], gc_teacher["next_state"], mb.lc_mask,
                            distance=recipe.distance, normalizer=max(counts.lc, 1))
    # the AR rows: (logits name, targets, counted positions)
    ar_rows = []
    if recipe.ar_on_fixed_points:
        ar_rows.append(("fixed_point", fp.block_ids, fp.block_mask.bool()))
    if recipe.ar_on_labels:
        ar_rows.append(("labels", mb.labels.block_ids, mb.labels.block_mask.bool()))
    if "text" in student:
        target = mb.text[:, 1:]
        ar_rows.append(("text", target, torch.ones_like(target, dtype=torch.bool)))
    for name, targets, mask in ar_rows:
        if recipe.ar_weight > 0:
            ar = ar + losses.ar_loss(student[name], targets, mask, label_smoothing=recipe.label_smoothing,
                                     normalizer=max(counts.ar, 1))
        if recipe.kd_weight > 0:
            kd_term = kd_term + losses.distill_loss(frozen[name], student[name], mask, distance=recipe.kd_distance,
                                                    normalizer=max(counts.kd, 1))
    if "rollout" in student:
        kd_term = kd_term + losses.distill_loss(frozen["rollout"], student["rollout"], mb.rollout.block_mask.bool(),
                                                distance=recipe.kd_distance, normalizer=max(counts.kd, 1))
    total = gc + lc + recipe.ar_weight * ar + recipe.kd_weight * kd_term
    return StepLosses(gc, lc, ar, kd_term, total)


def load_teacher(config: TrainConfig, model, device) -> FrozenTeacher | None:
    """The frozen teacher, when a term needs one (see `FrozenTeacher`; its tokenizer was checked
    by `cllm.training.run.check_inputs`)."""
    if not config.recipe.needs_teacher:
        return None
    name = config.teacher or config.model
    if config.recipe.lora and name == config.model:
        return FrozenTeacher(peft_model=model)
    copy = load_model(name, dtype="float32").to(device).eval()
    copy.requires_grad_(False)
    return FrozenTeacher(copy=copy)
