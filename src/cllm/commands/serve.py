"""`cllm serve`: an OpenAI-compatible HTTP server over one model (`cllm.serving.app`), until
SIGTERM or Ctrl-C. The port is bound before the model loads (a taken port fails at once); a
line on stderr says what is served where, after a warning when the port is open beyond this
machine without an API key.
"""

from __future__ import annotations

import sys

import torch

from cllm.serving.app import open_app, serve_app
from cllm.serving.config import ServeConfig, api_key, exposure_warning

Config = ServeConfig


def run(config: Config) -> int:
    """Load the model and serve it until interrupted."""
    bound = open_app(config)
    keyed = api_key(config) is not None
    warning = exposure_warning(config.host, bound.port, keyed)
    if warning:
        print(f"cllm serve: warning: {warning}", file=sys.stderr, flush=True)
    table = bound.served.draft_table
    drafts = f", draft table of {len(table):,} contexts" if table is not None else ""
    print(f"cllm serve: '{config.model_id}' on http://{config.host}:{bound.port}/v1 "
          f"(greedy: {config.method}, n = {config.engine.block_size}{drafts}; batches up to {config.max_batch_size} "
          f"requests; {torch.get_num_threads()} torch thread(s){'; API key required' if keyed else ''})",
          file=sys.stderr, flush=True)
    serve_app(bound, config)
    return 0
