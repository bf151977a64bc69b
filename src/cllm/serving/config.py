"""`cllm serve`'s settings (`ServeConfig`, checked on construction) and what they imply for
who can reach the server: whether a host is loopback, the warning for an open port without a
key, the API key in force; and `cllm export`'s (`ExportConfig`). No torch here: a command's
`--help` reads its config before anything heavy loads.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from cllm.core.config import is_off, retune
from cllm.core.errors import UserError
from cllm.core.options import MACHINE, Device, Dtype, Force, Model, Threads
from cllm.decoding.settings import RECOMMENDED_CONFIG, JacobiConfig
from cllm.runtime.choices import GGUF_OUT_TYPES, QUANT_TYPES
from cllm.serving.options import Decoder, Heads, Runtime

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
API_KEY_ENV = "CLLM_API_KEY"
# k, tokens drafted per step: 8 made vLLM's fastest configuration (benchmarks/README.md, "Deployment
# engines"); `cllm bench --methods vllm_cllm --vllm-tokens K` measures others
DEFAULT_SPECULATIVE_TOKENS = 8


@dataclass
class ServeConfig(Model, Decoder, Heads, Dtype, Device, Runtime):
    """`cllm serve`'s settings: the groups it shares with generate and chat, then the server's own."""

    host: str = field(default="127.0.0.1", metadata={"help": "address to bind (loopback by default; beyond it, set "
        "--api-key)"})
    port: int = field(default=8000, metadata={"help": "TCP port"})
    served_model_name: str | None = field(default=None, metadata={"help": "the model id clients use (default: the "
        "model dir's name)"})
    engine: Literal["cllm", "vllm"] = field(default="cllm", metadata={"help": "cllm: this package's server and Jacobi "
        "engine; vllm: vLLM's OpenAI server drafting with our proposer (cllm.serving.vllm; needs vLLM: make vllm, or "
        "pip install 'cllm[vllm]')"})
    jacobi: JacobiConfig = field(default_factory=lambda: RECOMMENDED_CONFIG, metadata={"help": "the Jacobi engine's "
        "settings (flags --block-size, --recycle, ...)"})
    default_max_tokens: int = field(default=128, metadata={"help": "max_tokens when a request gives none (capped by "
        "--max-tokens-limit)"})
    max_tokens_limit: int = field(default=1024, metadata={"help": "largest max_tokens a request may ask for"})
    max_prompt_tokens: int = field(default=2048, metadata={"help": "longest prompt accepted, in tokens"})
    max_batch_size: int = field(default=64, metadata={"help": "requests decoded together at most (continuous "
        "batching; on llama.cpp 16 at most, a KV stream each); more wait in the queue"})
    max_tokens_in_flight: int = field(default=65536, metadata={"help": "prompt + max_tokens summed over the batch at "
        "most (bounds the KV cache); a request alone always runs"})
    forward_width: int = field(default=64, metadata={"help": "Jacobi with recycling, batched: tokens a forward feeds "
        "over the whole batch, roughly; each request's drafts shrink to its share as the batch grows (speed only; 0: "
        "each keeps --recycle-budget)"})
    stream_interval: float = field(default=0.05, metadata={"help": "streamed requests: a request's new text goes "
        "out at most once per this many seconds, the first at once, the last with the request's end (0: a chunk per "
        "decoding step). Each chunk costs the server and its client CPU time that the forward shares on a small CPU "
        "(docs/serving.md)"})
    queue_size: int = field(default=256, metadata={"help": "requests waiting beyond this get 503"})
    max_body_bytes: int = field(default=1 << 20, metadata={"help": "larger request bodies get 413, checked before the "
        "body is read"})
    read_timeout: float = field(default=30.0, metadata={"help": "seconds a request body may take to arrive (408)"})
    request_timeout: float = field(default=600.0, metadata={"help": "seconds a request may wait and decode in all "
        "(504); 0: no limit"})
    shutdown_grace: float = field(default=10.0, metadata={"help": "seconds running requests get to finish on SIGTERM / "
        "Ctrl-C"})
    max_connections: int = field(default=1024, metadata={"help": "open connections at most: a newcomer beyond it "
        "closes the connection idle the longest (never one whose request runs)"})
    header_timeout: float = field(default=10.0, metadata={"help": "seconds a client has, from connecting or from its "
        "previous response, to send a whole request head (slow clients are closed)"})
    api_key: str | None = field(default=None, repr=False, metadata={"help": "bearer token every /v1 request must send "
        f"(default: the {API_KEY_ENV} environment variable, which keeps it out of the process list; unset: no check)"})
    allowed_hosts: list[str] = field(default_factory=list, metadata={"help": "Host header values accepted, e.g. "
        "example.org,10.0.0.5, or * for any (default: the loopback names when bound to loopback, the bound address "
        "otherwise, any when bound to all addresses); other Hosts get 400, which stops DNS rebinding"})
    openapi: bool = field(default=False, metadata={"help": "serve the API's schema at /openapi.json (behind the API "
        "key when there is one); no /docs page (it would load JavaScript from a CDN)"})
    threads: int = field(default=0, metadata={"section": MACHINE, "help": "torch CPU threads (0: one per core the "
        "load average leaves free at start, at least 1: on a shared CPU, threads that wait on each other slow every "
        "request down many times, docs/serving.md; --engine vllm on a CPU: the cores vLLM binds its threads to, 0: "
        "all)"})
    log_level: str = field(default="info", metadata={"help": "uvicorn log level"})
    speculation: Literal["cllm", "cllm-jacobi", "ngram", "none"] = field(default="cllm", metadata={"help": "--engine "
        "vllm: what drafts the tokens vLLM verifies: cllm (our proposer: the request's n-grams + the model's draft "
        "table), cllm-jacobi (+ the Jacobi tail; vLLM 0.32), ngram (vLLM's prompt lookup), none (plain decoding)"})
    speculative_tokens: int = field(default=DEFAULT_SPECULATIVE_TOKENS, metadata={"help": "--engine vllm: tokens "
        "drafted per step at most (k)"})
    tensor_parallel_size: int = field(default=1, metadata={"help": "--engine vllm: GPUs the model is split across "
        "(vLLM's --tensor-parallel-size)"})

    def __post_init__(self):
        super().__post_init__()
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        for name in ("default_max_tokens", "max_tokens_limit", "max_prompt_tokens", "queue_size",
                     "max_batch_size", "max_tokens_in_flight", "max_body_bytes", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("read_timeout", "request_timeout", "shutdown_grace", "header_timeout", "stream_interval"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.read_timeout == 0 or self.header_timeout == 0:
            raise ValueError("--read-timeout and --header-timeout must be > 0")
        if self.threads < 0 or self.forward_width < 0:
            raise ValueError("--threads and --forward-width must be >= 0")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if self.engine not in ("cllm", "vllm"):
            raise ValueError(f"--engine must be cllm or vllm, got {self.engine!r}")
        if self.speculation not in ("cllm", "cllm-jacobi", "ngram", "none"):
            raise ValueError(f"--speculation must be cllm, cllm-jacobi, ngram or none, got {self.speculation!r}")
        if self.speculative_tokens < 1 or self.tensor_parallel_size < 1:
            raise ValueError("--speculative-tokens and --tensor-parallel-size must be >= 1")
        if self.engine == "cllm" and self.tensor_parallel_size != 1:
            raise ValueError("--tensor-parallel-size needs --engine vllm (the cllm engine runs on one device)")
        for name in ("medusa", "eagle"):  # refused here, before the model loads
            if not is_off(getattr(self, name)):
                raise ValueError(f"--{name}: heads are decoded by cllm generate / cllm chat, not served (serve "
                                 f"batches rows on the Jacobi engine); drop --{name}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key must not be empty")

    @property
    def model_id(self) -> str:
        return self.served_model_name or Path(self.model.rstrip("/")).name or self.model


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, port: int, keyed: bool) -> str | None:
    """What to say when the server can be reached from other machines without a key."""
    if keyed or is_loopback(host):
        return None
    return (f"listening on {host}, beyond this machine, without an API key: anyone who can reach "
            f"port {port} can use the model (set {API_KEY_ENV} or --api-key)")


LOOPBACK_NAMES = ["localhost", "127.0.0.1", "::1", "[::1]"]


def allowed_hosts(cfg: ServeConfig) -> list[str]:
    """The Host header values the server accepts: `--allowed-hosts`, else the loopback names on
    a loopback address, the bound address itself on another one, anything on all addresses
    (0.0.0.0, ::). Checking it stops a web page that rebinds a name to 127.0.0.1 from using
    the model in the browser's name."""
    if cfg.allowed_hosts:
        return list(cfg.allowed_hosts)
    if is_loopback(cfg.host):
        return LOOPBACK_NAMES
    if cfg.host in ("0.0.0.0", "::", ""):
        return ["*"]
    return [cfg.host, f"[{cfg.host}]"] if ":" in cfg.host else [cfg.host]


def api_key(cfg: ServeConfig) -> str | None:
    """The bearer token every /v1 request must send: `--api-key`, else the CLLM_API_KEY
    environment variable; None: no check."""
    return cfg.api_key or os.environ.get(API_KEY_ENV) or None


@dataclass
@retune(model="stdlib-coder-cllm")
class ExportConfig(Model, Force, Threads):
    """`cllm export`'s settings: a Llama or Qwen2 checkpoint with a byte-level BPE tokenizer to GGUF."""

    gguf: str | None = field(default=None, metadata={"help": "GGUF file to write (llama.cpp's model format; "
        "required); its side folder OUT.cllm/ gets the tokenizer, draft table and tuned setting"})
    out_type: str = field(default="f32", metadata={"help": "weight type: f32, f16 or bf16 (norms stay f32)"})
    quantize: str | None = field(default=None, metadata={"help": "quantize with llama.cpp's own quantizer: "
        f"{', '.join(QUANT_TYPES)} (needs llama-cpp-python)"})
    lookup_cache: str | None = field(default=None, metadata={"help": "also write the model's draft table (cllm "
        "drafts) as llama.cpp's static n-gram cache (llama-lookup, or llama-server --spec-type ngram-cache, "
        "with --lookup-cache-static FILE)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.gguf:
            raise UserError("--gguf OUT.gguf is required: the file to write")
        if self.out_type not in GGUF_OUT_TYPES:
            raise UserError(f"--out-type must be one of {', '.join(GGUF_OUT_TYPES)}, got {self.out_type!r}")
        if self.quantize is not None and self.quantize.lower() not in QUANT_TYPES:
            raise UserError(f"--quantize must be one of {', '.join(QUANT_TYPES)}, got {self.quantize!r}")
        if self.quantize is not None:
            self.quantize = self.quantize.lower()
