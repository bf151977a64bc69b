"""`cllm serve`: an OpenAI-compatible HTTP server over one model (`cllm.serving.app`), until
SIGTERM or Ctrl-C. The port is bound before the model loads (a taken port fails at once); a
line on stderr says what is served where, after a warning when the port is open beyond this
machine without an API key. `--engine vllm`: vLLM's OpenAI server, drafting with our proposer,
takes this process's place (`cllm.serving.vllm_serve`).
"""

from __future__ import annotations

import logging
import sys

import torch

from cllm.core.progress import echo_log
from cllm.runtime.lean import compiled
from cllm.serving.app import open_app, serve_app
from cllm.serving.config import ServeConfig, api_key, exposure_warning
from cllm.serving.vllm_serve import replace_process, vllm_server

Config = ServeConfig


def run(config: Config) -> int:
    """Load the model and serve it until interrupted."""
    if config.engine == "vllm":
        return _serve_vllm(config)
    if config.compile:
        print(f"cllm serve: --compile: {compiled.where_note()}", file=sys.stderr, flush=True)
    bound = open_app(config)
    keyed = _warn_if_exposed(config, bound.port)
    table = bound.served.draft_table
    drafts = f", draft table of {len(table):,} contexts" if table is not None else ""
    batch = bound.max_batch_size  # the runtime may hold fewer rows than --max-batch-size asks for
    held = f" (the runtime holds {batch} rows)" if batch < config.max_batch_size else ""
    print(f"cllm serve: '{config.model_id}' on http://{config.host}:{bound.port}/v1 "
          f"(greedy: {config.method}, n = {config.jacobi.block_size}{drafts}; batches up to {batch} "
          f"requests{held}; {torch.get_num_threads()} torch thread(s){'; API key required' if keyed else ''})",
          file=sys.stderr, flush=True)
    if bound.served.not_compiled:
        print(f"cllm serve: note: --compile: {bound.served.not_compiled}; the eager forward decodes", file=sys.stderr,
              flush=True)
    print(f"cllm serve: forward: {bound.served.model.describe()}", file=sys.stderr, flush=True)
    # what the server logs (each refused request, a failed decode) at --log-level and above
    with echo_log("cllm.serving", "cllm serve: "):
        logging.getLogger("cllm.serving").setLevel(config.log_level.upper() if config.log_level != "trace" else "DEBUG")
        serve_app(bound, config)
    return 0


def _serve_vllm(config: Config) -> int:
    """vLLM's OpenAI server, drafting with our proposer, in this process's place."""
    cmd, env, notes = vllm_server(config)  # refuses first: no vLLM here, no such model
    keyed = _warn_if_exposed(config, config.port)
    for note in notes:
        print(f"cllm serve: note: {note}", file=sys.stderr, flush=True)
    print(f"cllm serve: '{config.model_id}' through vLLM on http://{config.host}:{config.port}/v1 (drafts: "
          f"{config.speculation}, k = {config.speculative_tokens}; batches up to {config.max_batch_size} requests"
          f"{'; API key required' if keyed else ''})", file=sys.stderr, flush=True)
    replace_process(cmd, env)  # vLLM's server from here on: its signals, its exit code
    return 0


def _warn_if_exposed(config: Config, port: int) -> bool:
    """Warn when the port is open beyond this machine without an API key; whether a key is set."""
    keyed = api_key(config) is not None
    warning = exposure_warning(config.host, port, keyed)
    if warning:
        print(f"cllm serve: warning: {warning}", file=sys.stderr, flush=True)
    return keyed
