"""vLLM as a deployment engine: our drafting inside vLLM's speculative decoding, and how vLLM is
started here.

vLLM verifies one linear draft per request and step (its `custom_class` speculative method).
`CllmProposer` drafts it with the engine's own drafters (`cllm.decoding.jacobi.drafters`,
`chained`), not a copy of them: the request's n-gram pool (prompt + output so far,
`PoolDrafter`), continued by the model's draft table (`TableDrafter`, as `cllm drafts` saved it
in the model's folder). `CllmJacobiProposer` adds the Jacobi tail (`CarriedDrafts`) last: the
target's own predictions after the first rejected draft, what Jacobi decoding feeds next, read
from the verifying forward by a hook on the model's logits processor. That is a vLLM internal
(the logits of every verified position, row by row): it is checked against the vLLM release it
was written for and refused on another. Every draft is verified by vLLM, so the output is
greedy's whatever is drafted: drafting only moves speed.

vLLM passes no request ids and moves rows within its batch between steps, so nothing is kept
per row: what a request drafted at its last step is found by its context then (the prompt and
output before this step's tokens), and the tail is used only where the forward's predictions
agree with the tokens the step kept.

What vLLM's CPU build needs to run well here (thread binding, preloaded OpenMP and tcmalloc, KV
cache space: `engine_environment`) and how its OpenAI server is started (`server_command`) live
here alone; the bench, `cllm serve --engine vllm` (`cllm.serving.vllm_serve`) and the tests use
them.
vLLM itself is imported lazily: this module loads, and its logic is tested, without it.
"""

from __future__ import annotations

import ctypes.util
import importlib.util
import json
import logging
import os
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from cllm.core.errors import UserError
from cllm.decoding import RECOMMENDED_CONFIG
from cllm.decoding.draft_table import DraftTable
from cllm.decoding.jacobi.drafters import CarriedDrafts, DraftContext, Drafter, PoolDrafter, TableDrafter, chained
from cllm.models import load_draft_table, resolve_model_path
from cllm.serving.config import DEFAULT_SPECULATIVE_TOKENS

log = logging.getLogger(__name__)

VLLM_SERIES = "0.32."  # the vLLM releases whose logits layout the Jacobi tail's hook was checked on
NGRAM_SIZES = (1, 3)  # vLLM's n-gram method: shortest and longest match (as our prompt lookup guess)
KV_CACHE_GIB = 1  # VLLM_CPU_KVCACHE_SPACE: 131k tokens of the shipped model; a larger model wants more
INSTALL_HINT = "run `make vllm` and use .venv-vllm/bin/cllm, or `pip install 'cllm[vllm]'` on a CUDA machine"
TCMALLOC_DIR = "tcmalloc"  # where `make vllm` unpacks Debian's libtcmalloc-minimal4 when the system has none
SERVER_MODULE = "vllm.entrypoints.openai.api_server"  # `vllm serve` looks up the package name `vllm`:
# the CPU build is `vllm-cpu`, so the module is started instead


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def model_positions(model: str | os.PathLike) -> int | None:
    """A model folder's position limit (its config.json's max_position_embeddings), if it states one."""
    try:
        return json.loads((Path(model) / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return None


def require_vllm(what: str) -> None:
    """A one-line UserError when vLLM is not importable here."""
    if not vllm_installed():
        raise UserError(f"{what} needs vLLM, which is not installed in this environment ({sys.prefix}): "
                        f"{INSTALL_HINT}")


# ----------------------------------------------------------------------------------------------
# Drafting


def vllm_drafters(table: DraftTable | None, *, jacobi_tail: bool = False) -> tuple[Drafter, ...]:
    """The chain one request's draft is made of, each link continuing the ones before it: the
    n-gram pool (a match of 2+ tokens, as the engine's recycling; a 2-token match drafts half as
    far), the draft table, then, optionally, the Jacobi tail where they leave room. The tail
    comes last: first, it displaced better drafts (the shipped CLLM, 6 HumanEval prompts, k = 8:
    2.7 tokens per step without it, 1.05 with it first, 2.7 last; its plain Jacobi makes 1.1 per
    forward)."""
    pool = PoolDrafter(most=1, min_ngram=RECOMMENDED_CONFIG.recycle_min_ngram, spare=0)
    tail = (CarriedDrafts(),) if jacobi_tail else ()
    return (pool, *((TableDrafter(table),) if table is not None else ()), *tail)


def jacobi_tail(predicted: Sequence[int], drafted: Sequence[int], sampled: Sequence[int]) -> list[int]:
    """The Jacobi tail of one verified draft.

    predicted: (len(drafted) + 1,) the target's argmax after the context + drafted[:j], j = 0..
    sampled: the tokens the step kept (the accepted drafts, then the target's own token).
    Past the first rejected draft, the target predicted from a wrong token: the next Jacobi state
    of those positions. [] when every draft was accepted, or when `predicted` disagrees with
    `sampled` (not greedy, or not this request's forward)."""
    accepted = len(sampled) - 1
    if len(predicted) != len(drafted) + 1 or list(predicted[: accepted + 1]) != list(sampled):
        return []
    return list(predicted[accepted + 1 :])


@dataclass
class _Row:
    history: list[int]  # prompt + output so far, this step's tokens included
    sampled: list[int]  # this step's tokens
    drafted: list[int]  # what the request drafted at its previous step ([] when unknown)


class CllmProposer:
    """vLLM's `custom_class` speculative proposer: per request, the n-gram pool of its own
    prompt and output, continued by the model's draft table (`vllm_drafters`); at most k
    tokens (`num_speculative_tokens`). vLLM builds it as `CllmProposer(vllm_config)` and calls
    `load_model(model)` then `propose(...)` after every step."""

    jacobi_tail: ClassVar[bool] = False

    def __init__(self, vllm_config: Any) -> None:
        spec, model = vllm_config.speculative_config, vllm_config.model_config
        self.k = int(spec.num_speculative_tokens)
        self.max_model_len = int(model.max_model_len)
        self.table = load_draft_table(model.model)
        self.chain = vllm_drafters(self.table, jacobi_tail=self.jacobi_tail)
        self.counts: Counter[str] = Counter()  # drafted tokens per source, steps, tails skipped
        self._drafted: dict[tuple[int, ...], list[int]] = {}  # context -> what was drafted after it, last step
        self._predicted: torch.Tensor | None = None  # (P,) argmax at every verified position of the last forward
        self._hook = None
        table = f"draft table of {len(self.table):,} contexts" if self.table is not None else "no draft table"
        log.info("cllm proposer: k = %d, %s, Jacobi tail %s", self.k, table, "on" if self.jacobi_tail else "off")

    def load_model(self, target_model: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        if self.jacobi_tail:
            self._hook = hook_logits(target_model, self._capture)

    def _capture(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._predicted = output.argmax(dim=-1) if isinstance(output, torch.Tensor) else None

    def propose(self, sampled_token_ids: Sequence[Sequence[int]], num_tokens_no_spec: Sequence[int],
                token_ids_cpu: Any, slot_mappings: Any = None, **kwargs: Any) -> list[list[int]]:
        """Per batch row, its draft (at most k tokens; [] for a row mid-prefill)."""
        rows = [self._row(i, list(s), int(num_tokens_no_spec[i]), token_ids_cpu)
                for i, s in enumerate(sampled_token_ids)]
        tails = self._tails(rows)
        drafts, drafted = [], {}
        for row, tail in zip(rows, tails, strict=True):
            draft = self._row_draft(row, tail)
            drafts.append(draft)
            if draft:
                drafted[tuple(row.history)] = draft
        self._drafted = drafted  # only the last step's: a request not scheduled at a step loses its tail once
        self.counts["steps"] += 1
        return drafts

    def _row_draft(self, row: _Row | None, tail: Sequence[int]) -> list[int]:
        """One row's draft; a row whose drafting fails drafts nothing (vLLM then decodes it
        plainly) and fails no other request of the batch."""
        if row is None:
            return []
        try:
            return self.draft(row.history, tail)
        except Exception:  # noqa: BLE001 - drafting is speed only: never fail the batch for it
            if not self.counts["rows_failed"]:
                log.exception("cllm proposer: drafting failed for a request; it decodes without drafts")
            self.counts["rows_failed"] += 1
            return []

    def draft(self, history: list[int], tail: Sequence[int] = ()) -> list[int]:
        """What follows `history` (the Jacobi tail, when known, as the last link)."""
        width = min(self.k, self.max_model_len - len(history))
        if width <= 0:
            return []
        tokens, sources = chained(self.chain, DraftContext(history, carried=tail), width)
        self.counts.update(sources)
        return tokens

    def _row(self, i: int, sampled: list[int], n: int, token_ids_cpu: Any) -> _Row | None:
        if not sampled:  # mid-prefill (or discarded): nothing to draft from yet
            return None
        history = token_ids_cpu[i, :n].tolist()
        if history[n - len(sampled) :] != sampled:  # not the layout this was written for: draft nothing
            self.counts["rows_skipped"] += 1
            return None
        return _Row(history, sampled, self._drafted.get(tuple(history[: n - len(sampled)]), []))

    def _tails(self, rows: list[_Row | None]) -> list[list[int]]:
        """Per row, the Jacobi tail its last forward computed: that forward's predictions, one
        run of len(drafted) + 1 per row in batch order; none at all when the count disagrees."""
        predicted, self._predicted = self._predicted, None
        sizes = [len(r.drafted) + 1 if r is not None else 1 for r in rows]
        if predicted is None or predicted.numel() != sum(sizes):
            if predicted is not None:
                self.counts["tails_skipped"] += 1
            return [[] for _ in rows]
        flat, start, tails = predicted.tolist(), 0, []
        for row, size in zip(rows, sizes, strict=True):
            tails.append(jacobi_tail(flat[start : start + size], row.drafted, row.sampled) if row else [])
            start += size
        return tails


class CllmJacobiProposer(CllmProposer):
    """`CllmProposer` with the Jacobi tail after the n-grams and the table: the target's
    predictions after the first rejected draft (what a CLLM is trained to get right)."""

    jacobi_tail: ClassVar[bool] = True


def hook_logits(model: torch.nn.Module, hook: Any) -> Any:
    """A forward hook on `model.logits_processor`, whose output holds, for the vLLM releases of
    `VLLM_SERIES`, the logits of every verified position: per batch row, its drafts + 1."""
    import vllm  # heavy and optional: imported only when the tail is asked for

    if not vllm.__version__.startswith(VLLM_SERIES):
        raise UserError(f"the Jacobi tail reads vLLM {VLLM_SERIES}x internals (the logits of every verified "
                        f"position); this is vLLM {vllm.__version__}: draft without it (CllmProposer) or install "
                        f"vLLM {VLLM_SERIES}x")
    processor = getattr(model, "logits_processor", None)
    if not isinstance(processor, torch.nn.Module):
        raise UserError(f"the Jacobi tail hooks the model's logits_processor, which {type(model).__name__} has "
                        f"not in vLLM {vllm.__version__}: draft without it (CllmProposer)")
    return processor.register_forward_hook(hook)


def speculative_config(model_dir: str | os.PathLike, *, jacobi_tail: bool = False, **overrides: Any) -> dict[str, Any]:
    """What to pass as vLLM's `speculative_config` (`LLM(..., speculative_config=...)`, or the
    server's `--speculative-config` as JSON) to draft with our proposer.

    Args:
        model_dir: the model vLLM is given (the same folder): its draft table (`cllm drafts`)
            is read from it; a damaged one, or one built for another tokenizer, is refused here.
        jacobi_tail: the Jacobi tail fills what the n-grams and the table leave
            (`CllmJacobiProposer`; vLLM 0.32 only).
        overrides: vLLM's speculative settings, e.g. `num_speculative_tokens=16`.
    """
    load_draft_table(resolve_model_path(model_dir))
    cls = CllmJacobiProposer if jacobi_tail else CllmProposer
    return {"method": "custom_class", "model": f"{cls.__module__}.{cls.__qualname__}",
            "num_speculative_tokens": DEFAULT_SPECULATIVE_TOKENS, **overrides}


def ngram_config(k: int, sizes: Sequence[int] = NGRAM_SIZES) -> dict[str, Any]:
    """vLLM's own n-gram speculation (prompt lookup), k tokens matched on `sizes` (min, max)."""
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": min(sizes),
            "prompt_lookup_max": max(sizes)}


def suffix_config(k: int, cached_requests: int | None = None) -> dict[str, Any]:
    """vLLM's suffix decoding (arctic-inference), drafting up to k tokens; `cached_requests`:
    past responses its global tree keeps (0: none, the request's own prompt and output only;
    None: vLLM's default)."""
    extra = {} if cached_requests is None else {"suffix_decoding_max_cached_requests": cached_requests}
    return {"method": "suffix", "num_speculative_tokens": k, **extra}


# ----------------------------------------------------------------------------------------------
# Running vLLM here


def tcmalloc() -> str | None:
    """The system's tcmalloc (Debian: libtcmalloc-minimal4), else the copy `make vllm` unpacks
    into the venv (`TCMALLOC_DIR`), or None."""
    found = ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")
    if found:
        return found
    unpacked = sorted((Path(sys.prefix) / TCMALLOC_DIR).glob("usr/lib/*/libtcmalloc_minimal.so*"))
    return str(unpacked[0]) if unpacked else None


def engine_environment(threads: int = 0, *, environ: Mapping[str, str] | None = None,
                       cuda: bool | None = None) -> tuple[dict[str, str], list[str]]:
    """The environment to start vLLM in, and what to tell the user about it.

    On the CPU build: its OpenMP threads bound to `threads` cores (0: every core this process
    may use), none reserved (at 2 threads the reserved core was missed most), the venv's Intel
    OpenMP and the system's tcmalloc preloaded (plain decoding went from 102 to 378 tok/s
    here), `KV_CACHE_GIB` of KV cache. With CUDA, nothing. Settings already in `environ` (the
    process's by default) are kept: the user's win."""
    env = dict(os.environ if environ is None else environ)
    if torch.cuda.is_available() if cuda is None else cuda:
        return env, []
    cores = sorted(os.sched_getaffinity(0))
    notes = []
    if threads > len(cores):
        notes.append(f"{threads} threads asked, {len(cores)} cores available: using {len(cores)}")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores[: threads or len(cores)])))
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(KV_CACHE_GIB))
    preload = [p for p in env.get("LD_PRELOAD", "").split(":") if p]
    malloc = tcmalloc()
    if malloc is None:
        notes.append("tcmalloc not found: vLLM runs slower without it (Debian: apt-get install libtcmalloc-minimal4)")
    iomp = Path(sys.prefix) / "lib" / "libiomp5.so"  # the intel-openmp wheel vLLM's CPU build brings
    for lib in (malloc, str(iomp) if iomp.is_file() else None):
        if lib and not any(Path(p).name == Path(lib).name for p in preload):
            preload.append(lib)
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env, notes


def server_command(model: str, *, host: str = "127.0.0.1", port: int = 8000, served_model_name: str | None = None,
                   speculative: Mapping[str, Any] | None = None, dtype: str = "float32",
                   max_num_seqs: int | None = None, max_model_len: int | None = None,
                   default_max_tokens: int | None = None, tensor_parallel_size: int = 1,
                   log_level: str = "info") -> list[str]:
    """vLLM's OpenAI server on `model` (a folder), started as a module of this interpreter."""
    cmd = [sys.executable, "-m", SERVER_MODULE, "--model", model, "--host", host, "--port", str(port),
           "--dtype", dtype, "--tensor-parallel-size", str(tensor_parallel_size), "--uvicorn-log-level", log_level]
    if served_model_name:
        cmd += ["--served-model-name", served_model_name]
    if speculative:
        cmd += ["--speculative-config", json.dumps(dict(speculative))]
    if max_num_seqs:
        cmd += ["--max-num-seqs", str(max_num_seqs)]
    if max_model_len:
        cmd += ["--max-model-len", str(max_model_len)]
    if default_max_tokens:  # a request without max_tokens gets this many, as `cllm serve` does
        cmd += ["--override-generation-config", json.dumps({"max_new_tokens": default_max_tokens})]
    return cmd
