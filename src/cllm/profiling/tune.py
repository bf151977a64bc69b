"""Decode defaults for one model on this machine, from its measured step cost (`cllm tune`).

The CLI's RECOMMENDED setting (block size 4, at most 24 fed tokens per forward) is the fastest
measured on the 2-core development CPU, where a 32-token step costs two 1-token steps; on a GPU
a wide step costs about a narrow one and a larger block and budget pay. `cllm tune` times the
model's causal step at k = 1, 2, 4, ..., 64 fed tokens (`cllm.profiling.steptime`, a few seconds), picks
the block size and fed-token budget by `cllm.profiling.costs.choose_defaults`, and writes them
as `decode_defaults.json` beside the checkpoint, with the measurements and the rule.
`cllm.models.load_for_decoding` then decodes with them on a device of the same type.

    cllm tune --model runs/my-cllm
    cllm tune --model runs/my-cllm --device cuda --force
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from cllm.core.errors import UserError
from cllm.core.machine import machine_info, resolve_device
from cllm.core.outputs import Input, check_new_file, replacing, write_failures
from cllm.models import DECODE_DEFAULTS, DECODE_DEFAULTS_LLAMACPP, load_for_decoding, load_model, resolve_model_path
from cllm.models.fast import file_identity
from cllm.models.gguf import is_gguf, side_folder
from cllm.profiling.config import TuneConfig
from cllm.profiling.costs import (
    Defaults,
    choose_defaults,
)
from cllm.profiling.steptime import time_steps, write_json
from cllm.runtime import position_limit

log = logging.getLogger(__name__)


def defaults_record(defaults: Defaults, ks: list[int], times_ms: list[float], *, device: str, dtype: str,
                    rule: dict[str, Any], model: str, machine: dict[str, Any]) -> dict[str, Any]:
    """The JSON written beside the checkpoint: the settings first, then how they were chosen."""
    return {
        "settings": {"block_size": defaults.block_size, "recycle_budget": defaults.recycle_budget},
        "why": defaults.why,
        "device": device, "dtype": dtype, "model": model,
        "measured": {"k": ks, "t_ms": [round(t, 4) for t in times_ms],
                     "ratio": [round(t / times_ms[0], 4) for t in times_ms]},
        "rule": rule, "machine": machine,
    }


def defaults_file(config: TuneConfig) -> Path:
    """Where `tune` writes: --out, else decode_defaults.json in the model's own folder (a GGUF
    file: its side folder, `cllm.models.gguf.side_folder`); checked before anything is timed
    (`cllm.core.outputs`: a new file, or any with --force, never one of the model's own files
    nor a place that cannot be written)."""
    if is_gguf(config.model):
        file = Path(config.model).expanduser()
        if not file.is_file():
            raise UserError(f"--model {config.model}: no GGUF file there")
        return check_new_file(defaults_path(config), force=config.force, what="defaults file",
                              inputs=[Input("--model", file)])
    path = Path(resolve_model_path(config.model))
    if not path.is_dir():
        raise UserError(f"--model {config.model}: tune needs a local checkpoint folder to write beside")
    return check_new_file(defaults_path(config), force=config.force, what="defaults file",
                          inputs=[Input("--model", path, owned=(DECODE_DEFAULTS, DECODE_DEFAULTS_LLAMACPP))])


def defaults_path(config: TuneConfig) -> Path:
    """--out, else the defaults file of the runtime tuned for in the model's own folder."""
    if is_gguf(config.model):
        return Path(config.out) if config.out else side_folder(config.model) / DECODE_DEFAULTS_LLAMACPP
    name = DECODE_DEFAULTS_LLAMACPP if config.runtime == "llamacpp" else DECODE_DEFAULTS
    return Path(config.out) if config.out else Path(resolve_model_path(config.model)) / name


def tune(config: TuneConfig) -> dict[str, Any]:
    """Time the model's step at every k, choose the defaults, write them (`defaults_file`);
    returns the record written."""
    out = defaults_file(config)
    gguf_file = is_gguf(config.model)
    path = Path(config.model).expanduser() if gguf_file else Path(resolve_model_path(config.model))
    device = resolve_device(config.device)
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    if gguf_file or config.runtime == "llamacpp":
        device = torch.device("cpu")
        runtime = load_for_decoding(path, runtime="llamacpp", dtype=config.dtype, threads=config.threads).model
        threads = runtime.threads
    else:
        runtime = load_model(path, dtype=config.dtype, device=device)
        threads = torch.get_num_threads()
    limit = position_limit(runtime) or config.prefix + config.k[-1]
    prefix = min(config.prefix, limit - config.k[-1])
    if prefix < 1:
        raise UserError(f"the model's position limit {limit} leaves no room for k = {config.k[-1]}: lower --k")
    log.info("timing %s at k = %s after %d cached tokens (%s, %s, %s, %d thread(s), %d rounds)", path.name,
             ", ".join(map(str, config.k)), prefix, config.runtime, device, config.dtype, threads, config.repeats)
    times = time_steps(runtime, config.k, prefix=prefix, rounds=config.repeats, tree=False)
    times_ms = [1e3 * min(times.causal[k]) for k in config.k]
    rule = {"block_max_cost": config.block_max_cost, "budget_max_cost": config.budget_max_cost,
            "max_block": config.max_block}
    chosen = choose_defaults(config.k, [t / times_ms[0] for t in times_ms], **rule)
    record = defaults_record(chosen, config.k, times_ms, device=device.type, dtype=config.dtype, rule=rule,
                             model=str(path), machine={**machine_info(device), "prefix": prefix, "threads": threads})
    if gguf_file or config.runtime == "llamacpp":
        record["runtime"] = "llamacpp"
    if gguf_file:  # the file these settings were measured on: a changed file is not given them
        record["file"] = file_identity(path)
        out.parent.mkdir(parents=True, exist_ok=True)
    with write_failures(out), replacing(out) as tmp:
        write_json(record, tmp)
    return record
