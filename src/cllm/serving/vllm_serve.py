"""`cllm serve --engine vllm`: the same settings (`ServeConfig`) mapped onto vLLM's OpenAI server,
which then takes this process's place.

Mapped: the model and the name clients use, host and port (loopback by default), the API key
(passed in VLLM_API_KEY, out of the process list), the batch cap (`--max-num-seqs`), prompt +
completion limits (`--max-model-len`, within the model's positions), the default max_tokens,
dtype, log level, tensor parallelism; the drafts (`--speculation`, `--speculative-tokens`) and
the CPU environment come from `cllm.serving.vllm`. Settings vLLM's server has no counterpart for
are named in a note when they were changed.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from cllm.models import resolve_model_path
from cllm.serving.config import ServeConfig, api_key
from cllm.serving.vllm import (
    engine_environment,
    model_positions,
    ngram_config,
    require_vllm,
    server_command,
    speculative_config,
)

# `cllm serve` settings vLLM's server has no counterpart for
UNMAPPED = ("method", "jacobi", "draft_table", "max_tokens_in_flight", "forward_width", "stream_interval", "queue_size",
            "max_body_bytes", "read_timeout", "request_timeout", "shutdown_grace", "max_connections", "header_timeout",
            "allowed_hosts", "openapi", "device")


def serving_speculation(config: ServeConfig, model: str) -> dict[str, Any] | None:
    """The speculative config vLLM starts with (None: plain decoding)."""
    k = config.speculative_tokens
    if config.speculation == "none":
        return None
    if config.speculation == "ngram":
        return ngram_config(k)
    return speculative_config(model, jacobi_tail=config.speculation == "cllm-jacobi", num_speculative_tokens=k)


def vllm_server(config: ServeConfig) -> tuple[list[str], dict[str, str], list[str]]:
    """vLLM's OpenAI server command for `config`, its environment, and notes for the user."""
    require_vllm("cllm serve --engine vllm")
    model = resolve_model_path(config.model)
    wanted = config.max_prompt_tokens + config.max_tokens_limit
    positions = model_positions(model)
    cmd = server_command(model, host=config.host, port=config.port, served_model_name=config.model_id,
                         speculative=serving_speculation(config, model), dtype=config.dtype,
                         max_num_seqs=config.max_batch_size, default_max_tokens=config.default_max_tokens,
                         max_model_len=min(wanted, positions) if positions else wanted,
                         tensor_parallel_size=config.tensor_parallel_size, log_level=config.log_level)
    env, notes = engine_environment(config.threads)
    key = api_key(config)
    if key:
        env["VLLM_API_KEY"] = key
    defaults = ServeConfig()
    changed = [f"--{n.replace('_', '-')}" for n in UNMAPPED if getattr(config, n) != getattr(defaults, n)]
    if changed:
        notes.append(f"not applied by vLLM's server: {', '.join(changed)}")
    return cmd, env, notes


def replace_process(cmd: list[str], env: dict[str, str]) -> None:
    """Replace this process with `cmd` (vLLM's server: its signals, its exit code); never returns."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(cmd[0], cmd, env)
