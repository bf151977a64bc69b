"""What differs for `cllm train` between accelerate's engines: DDP (every process holds the whole
model), FSDP and DeepSpeed ZeRO (gradients and optimizer states, and under FSDP and ZeRO-3 the
weights too, split over the processes).

The loop is the same under all of them (`cllm.training.skeleton`, `cllm.training.consistency`):
this module says which options an engine allows, which mixed precision accelerate is told, which
DeepSpeed values train fills in, and how
the engines that split the optimizer state checkpoint (accelerate's `save_state`, every process
writing its part). It knows nothing of losses or data. The test suite runs DDP (2 gloo CPU
processes) and the `save_state` checkpoints (one process); FSDP and DeepSpeed need GPUs.
"""

from __future__ import annotations

import pickle
import shutil
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from accelerate.utils import DistributedType, load

from cllm.core.errors import UserError, first_line
from cllm.core.runs import save_checkpoint


@dataclass(frozen=True)
class Engine:
    name: Literal["single", "ddp", "fsdp", "deepspeed"]
    zero_stage: int = 0  # DeepSpeed's ZeRO stage
    accelerate_checkpoints: bool = False  # the optimizer state is split: accelerate's save_state

    @property
    def splits_weights(self) -> bool:
        """No process holds the whole model between forwards (FSDP, ZeRO-3)."""
        return self.name == "fsdp" or (self.name == "deepspeed" and self.zero_stage >= 3)

    @property
    def label(self) -> str:
        return "FSDP" if self.name == "fsdp" else f"DeepSpeed ZeRO-{self.zero_stage}"


def engine_of(accelerator) -> Engine:
    kind = accelerator.distributed_type
    if kind == DistributedType.FSDP:
        return Engine("fsdp", accelerate_checkpoints=True)
    if kind == DistributedType.DEEPSPEED:
        return Engine("deepspeed", accelerator.state.deepspeed_plugin.zero_stage, accelerate_checkpoints=True)
    return Engine("single" if accelerator.num_processes == 1 else "ddp")


def check_engine(engine: Engine, *, eval_count: int, lora: bool, model_rollouts: bool) -> None:
    """Refuse what needs the whole model on one process when no process holds it: the
    evaluation and the on-policy rollouts by the model being trained decode on their own, and
    the LoRA export merges the adapter on the main process."""
    if not engine.splits_weights:
        return
    problems = []
    if eval_count:
        problems.append("--eval-count 0 (evaluate OUT afterwards, e.g. with cllm bench)")
    if model_rollouts:
        problems.append("no --rollout-prompts with --rollout-policy model")
    if lora:
        problems.append("no --lora (LoRA runs under DDP or ZeRO-2: see docs/scale.md)")
    if problems:
        raise UserError(f"under {engine.label} every process holds only a part of the weights: use "
                        + "; ".join(problems))


def mixed_precision(dtype: str, env: Mapping[str, str]) -> str:
    """The mixed precision accelerate is told, from --dtype and the launcher's environment.

    Under FSDP and DeepSpeed it is bf16 with `--dtype bfloat16` (their own bf16: FSDP's mixed
    precision policy, DeepSpeed's bf16 weights), else no; under DDP and in one process always no:
    train's own autocast does bf16 there, and accelerate's state, set once per process, would
    refuse a second `train` in the same process with another dtype. What `accelerate launch` asked
    for (ACCELERATE_MIXED_PRECISION, from its config's `mixed_precision`) must agree with --dtype
    rather than be silently overridden; "no" is its default and says nothing.
    """
    launched = env.get("ACCELERATE_MIXED_PRECISION", "no")
    wanted = "bf16" if dtype == "bfloat16" else "no"
    if launched not in ("", "no", wanted):
        hint = "pass --dtype bfloat16" if launched == "bf16" else "cllm train trains in float32 or bf16"
        raise UserError(f"accelerate was launched with mixed precision {launched!r} but --dtype is {dtype}: {hint}")
    sharded = any(env.get(f"ACCELERATE_USE_{name}", "").lower() in ("1", "true", "yes")
                  for name in ("FSDP", "DEEPSPEED"))
    return wanted if sharded else "no"


def fill_deepspeed_config(ds_config: dict, *, micro_batch: int, accumulation: int, grad_clip: float) -> None:
    """Set the DeepSpeed values `cllm train` decides where the config says "auto" (or nothing);
    a number that contradicts them is an error. micro_batch: records per forward;
    accumulation: micro-batches per process and optimizer step."""
    wanted = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": accumulation,
              "gradient_clipping": grad_clip}
    for key, value in wanted.items():
        have = ds_config.get(key, "auto")
        if have == "auto":
            ds_config[key] = value
        elif have != value:
            raise UserError(f"the DeepSpeed config sets {key} = {have!r} where cllm train needs {value!r} (from "
                            "--batch-size, --micro-batch-size, --grad-clip and the process count): write \"auto\"")
    if ds_config.get("optimizer") or ds_config.get("scheduler"):
        raise UserError("the DeepSpeed config names an optimizer or scheduler: cllm train brings its own "
                        "(AdamW, warm-up + cosine); remove them")


# ---------------------------------------------------------------------------------------------
# Checkpoints of the engines that split the optimizer state


def save_accelerate_state(accelerator, folder: Path, step: int, meta: dict, meta_path: Path) -> None:
    """Every process: accelerate writes the model, optimizer (each process its part) and the
    registered scheduler into a new ``state-<step>`` folder; then the main process writes `meta`
    naming it (the commit point: a crash before leaves the previous checkpoint whole) and
    removes the older folders."""
    name = f"state-{step:08d}"
    accelerator.save_state(str(folder / name))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        save_checkpoint(meta_path, {**meta, "accelerate_state": name, "processes": accelerator.num_processes})
        for old in folder.glob("state-*"):
            if old.name != name:
                shutil.rmtree(old)
    accelerator.wait_for_everyone()


def load_accelerate_state(accelerator, folder: Path, meta: dict) -> None:
    """Every process: load what `save_accelerate_state` wrote (each process its part, so the
    process count must be the same)."""
    name = meta.get("accelerate_state")
    if name is None or not (folder / name).is_dir():
        raise UserError(f"{folder.parent} holds a checkpoint of another engine (no accelerate state): "
                        "resume with the engine it was written with, or --resume false")
    if meta["processes"] != accelerator.num_processes:
        raise UserError(f"{folder.parent} was checkpointed by {meta['processes']} processes: resume with as "
                        "many, or --resume false")
    check_state_files(folder / name)
    accelerator.load_state(str(folder / name))


# Where torch.distributed.checkpoint's `.metadata` (a plain pickle) may take its classes from:
# its own metadata records, torch's dtypes and sizes, paths. Nothing that runs code when called.
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_DCP_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                ("pathlib", "WindowsPath"), ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        found = super().find_class(module, name) if module in _DCP_MODULES or module == "torch" else None
        if (module in _DCP_MODULES and isinstance(found, type)) or (module, name) in _DCP_GLOBALS or \
                isinstance(found, torch.dtype):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


def check_state_files(folder: Path) -> None:
    """Read every pickled file of an accelerate state folder so that nothing in it can run code,
    before accelerate loads it (accelerate unpickles the scheduler's state, and
    torch.distributed.checkpoint its `.metadata`, with Python's unrestricted unpickler): torch's
    weights-only unpickler, with the numpy types of accelerate's RNG state; for a `.metadata`,
    only torch.distributed.checkpoint's own record classes. A file that needs more is refused in
    one line. (DeepSpeed's engine reads its own files itself.)"""
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        try:
            if zipfile.is_zipfile(file):  # torch.save's format
                load(file, map_location="cpu", weights_only=True, mmap=True)  # + numpy's RNG state
            elif file.name.endswith(".metadata"):
                with open(file, "rb") as fh:
                    _MetadataUnpickler(fh).load()
            elif file.suffix in (".pkl", ".bin", ".pt", ".pth"):
                raise pickle.UnpicklingError("not in torch.save's format")
        except Exception as exc:  # noqa: BLE001 - a refused or a damaged file: one line naming it
            raise UserError(f"{file} is not a checkpoint file cllm's run wrote ({first_line(exc)}): refusing to "
                            f"load it; delete {folder.parent} to start the run over") from None
