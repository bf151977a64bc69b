"""A lean decoding forward for the Llama family (Llama 2/3, Mistral, Qwen2/2.5, Qwen3): what a
Jacobi step costs is mostly the framework around ~10 MFLOP of arithmetic, so the engine owns
its forward where it can, as gpt-fast and llama.cpp do.

`LeanRunner` computes the model's forward from its own weights (embeddings, norms, projections,
MLP, LM head, rotary frequencies: nothing is converted; the one copy is the packed weights
below) in a straight line per layer: one attention call per layer over a preallocated cache
(`lean_kv.LeanKV`), masks built by index arithmetic once per forward, RoPE from a table of
positions, logits only where the caller reads them, no host sync. In float32 on a CPU every
projection runs on a oneDNN-packed copy of its weights (`packed.PackedWeights`), with the bias,
residual, SiLU or the MLP's product in the same call; where that copy is not made, the
activations run feature-major so that every projection is one MKL `W @ X` GEMM, zero-padded to
16 columns when fewer tokens are fed (MKL's slow shapes); elsewhere it runs the model's modules
in transformers' layout (`LeanRunner.feature_major`).

`compiled.compile_runner(model)` compiles, on request, the whole forward of a few fed tokens
into one Inductor graph (`compiled.CompiledForward`): on a CPU its GEMM kernels stream the weights
several times faster than MKL at the few tokens a decoding step feeds, and nothing runs eagerly
between the layers. `docs/architecture.md` says when it runs.

`runner_for(model)` says whether a model can take it (and `why_not` why it cannot); the cache
adapter uses it for every decoding forward (never with gradients: training keeps transformers'
forward). It is exact: token for token the transformers model's greedy output, its logits equal
transformers' to float32 rounding (`tests/decoding/test_lean.py`, and the engine's exactness
suites run on both paths).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from cllm.runtime.lean import cpu_paths, graphs
from cllm.runtime.lean.kernels import (  # noqa: F401 (re-exported: lean.argmax, lean.packed_rows, ...)
    ARGMAX_BLOCK,
    ARGMAX_MIN_TOKENS,
    GEMM_WIDTH,
    PACKED_EXACT_ROWS,
    _linear_added,
    _pad_rows,
    _project,
    _rms_norm,
    _rms_norm_rows,
    _rotate,
    additive_mask,
    argmax,
    packed_rows,
    padded_width,
    rotate_half,
)
from cllm.runtime.lean.kv import GROWTH, LeanKV
from cllm.runtime.lean.packed import PackedWeights, packed_linear

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
ATTENTIONS = ("sdpa", "eager")

_enabled = True
_compiled_enabled = True
_packed_enabled = True
_graphs_enabled = True
_runners: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@contextmanager
def runner_enabled(enabled: bool) -> Iterator[None]:
    """Within: decoding forwards use the lean runner where supported (True), or transformers'
    forward everywhere (False). Tests run the exactness suites both ways."""
    global _enabled
    before, _enabled = _enabled, enabled
    try:
        yield
    finally:
        _enabled = before


@contextmanager
def compiled_enabled(enabled: bool) -> Iterator[None]:
    """Within: the runner's compiled forward runs where compiled (True), or its eager forward
    runs everywhere (False). `cllm bench`'s forward cost times both."""
    global _compiled_enabled
    before, _compiled_enabled = _compiled_enabled, enabled
    try:
        yield
    finally:
        _compiled_enabled = before


@contextmanager
def packed_enabled(enabled: bool) -> Iterator[None]:
    """Within: float32 CPU forwards compute their projections from oneDNN-packed weights where
    they can (True, `PackedWeights`), or with MKL's GEMM on the model's own weights (False).
    Tests run the exactness suites both ways; `cllm bench`'s forward cost times both."""
    global _packed_enabled
    before, _packed_enabled = _packed_enabled, enabled
    try:
        yield
    finally:
        _packed_enabled = before


def why_not(model: torch.nn.Module) -> str | None:
    """Why the lean runner cannot run `model` (None: it can)."""
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED:
        return f"architecture {kind!r} is not one the runner knows ({', '.join(SUPPORTED)})"
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")) \
            or getattr(model, "lm_head", None) is None:
        return "the model is not laid out as transformers' *ForCausalLM (wrapped, e.g. by peft?)"
    attention = getattr(config, "_attn_implementation", "sdpa")
    if attention not in ATTENTIONS:
        return f"attention implementation {attention!r} (the runner computes sdpa's)"
    window = getattr(config, "sliding_window", None)
    sliding = getattr(config, "use_sliding_window", window is not None)
    if window is not None and sliding and window < getattr(config, "max_position_embeddings", 0):
        return f"sliding-window attention ({window} tokens)"
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()):
        return "layers other than full attention"
    for layer in inner.layers:
        attn = getattr(layer, "self_attn", None)
        if attn is None or not all(hasattr(attn, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return "a decoder layer without separate q/k/v/o projections"
        if not all(hasattr(layer.mlp, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            return "an MLP other than the gated (SwiGLU) one"
        norms = [layer.input_layernorm, layer.post_attention_layernorm, *(
            [attn.q_norm, attn.k_norm] if hasattr(attn, "q_norm") else [])]
        if not all(hasattr(n, "variance_epsilon") and getattr(n, "weight", None) is not None for n in norms):
            return "a norm other than the Llama-family RMSNorm"
    return None


WARM_MAX_BYTES = 256 * 2**20  # larger packed models build their kernels in their first forwards


def prepare(model: torch.nn.Module) -> None:
    """Ready `model`'s decoding forward before its first request (`load_for_decoding`, `cllm
    serve`): its runner, and on a CPU in float32 its packed weights with oneDNN's kernels built
    for every width a decoding step feeds (1 to `PACKED_EXACT_ROWS` tokens) and the plan of which
    float32 forward is fastest here at each width (`cpu_paths.measure`); about 0.5 s for
    `stdlib-coder`, both skipped over `WARM_MAX_BYTES` (the packed weights then serve every
    width). Where the runner does not run, nothing."""
    runner = runner_for(model)
    if runner is None or not runner.feature_major(model.get_input_embeddings().weight):
        return
    if PackedWeights.size(model) > WARM_MAX_BYTES:
        return
    with torch.inference_mode():
        packed = runner._packed()
        if packed is not None:
            packed.warm(range(1, PACKED_EXACT_ROWS + 1))
        if packed is not None:
            runner.head_plan = cpu_paths.measure_head(runner.lm_head, packed)
        paths = [p for p in cpu_paths.PATHS if p != "packed" or packed is not None]
        runner.plan = cpu_paths.measure(runner, paths)


@contextmanager
def graphs_enabled(enabled: bool) -> Iterator[None]:
    """Within: forwards on a GPU are replayed from CUDA graphs where they can be (True,
    `graphs.GraphSet`), or run eagerly (False). `cllm profile` times both."""
    global _graphs_enabled
    before, _graphs_enabled = _graphs_enabled, enabled
    try:
        yield
    finally:
        _graphs_enabled = before


def runner_for(model: torch.nn.Module) -> LeanRunner | None:
    """The model's runner (built once per model), or None when it cannot take one, when the lean
    path is switched off, or when the model is in training mode."""
    if not _enabled or model.training:
        return None
    if model not in _runners:
        _runners[model] = LeanRunner(model) if why_not(model) is None else None
    return _runners[model]


def compiled(model: torch.nn.Module) -> Any:
    """The model's compiled forward (`compiled.compile_runner`) while its weights are the ones
    compiled, else None."""
    runner = _runners.get(model)
    forward = runner.compiled if runner is not None else None
    return forward if forward is not None and forward.current() else None


def describe(model: torch.nn.Module) -> str:
    """Which forward decodes `model`, and why, in a line (`cllm generate -v`)."""
    reason = why_not(model)
    if reason is None:
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        forward = compiled(model)
        if forward is not None:
            return (f"lean runner ({model.config.model_type}, {dtype}; compiled forward up to "
                    f"{COMPILED_MAX_TOKENS} fed tokens, {forward.origin})")
        weight = model.get_input_embeddings().weight
        if not LeanRunner.feature_major(weight):
            if weight.device.type != "cuda":
                return f"lean runner ({model.config.model_type}, {dtype})"
            runner = runner_for(model)
            unfit = graphs.why_not_graphs(runner, weight) if runner is not None else "the runner is off"
            if not _graphs_enabled or unfit is not None:
                return (f"lean runner ({model.config.model_type}, {dtype}; eager, no CUDA graphs: "
                        f"{unfit or 'switched off'})")
            return (f"lean runner ({model.config.model_type}, {dtype}; CUDA graphs up to "
                    f"{graphs.MAX_TOKENS} fed tokens)")
        unpacked = PackedWeights.why_not(model) if _packed_enabled else "packed weights switched off"
        legend = {"packed": f"oneDNN-packed weights ({PackedWeights.size(model) / 2**20:.0f} MiB beside the model's)",
                  "gemm": "MKL's GEMM on the model's weights, feature-major",
                  "rows": "the model's weights, token-major"}
        if (forced := cpu_paths.forced_path()) in ("gemm", "rows"):
            return f"lean runner ({model.config.model_type}, {dtype}; {legend[forced]}, forced)"
        runner = _runners.get(model)
        if runner is not None and runner.plan is not None:
            used = ", ".join(f"{p} = {legend[p]}" for p in cpu_paths.PATHS if p in runner.plan.paths)
            return (f"lean runner ({model.config.model_type}, {dtype}; the forward measured fastest here: "
                    f"{runner.plan.describe()}; {used})")
        if unpacked is None:
            return (f"lean runner ({model.config.model_type}, {dtype}; oneDNN-packed weights, "
                    f"{PackedWeights.size(model) / 2**20:.0f} MiB beside the model's)")
        return f"lean runner ({model.config.model_type}, {dtype}; MKL's GEMM: {unpacked})"
    return f"transformers' forward: {reason}"


# ---------------------------------------------------------------------------------------------
# The forward


@dataclass
class LeanOutput:
    logits: torch.Tensor  # (B, L, V), or (B, 1, V) for the last position only
    hidden: torch.Tensor | None = None  # (B, L, H): the final norm's output (what the LM head reads)


COMPILED_MAX_TOKENS = 24  # fed tokens (B * L, one a row counting two) up to which the compiled forward runs;
# wider: eager (as fast)
class LeanRunner:
    """The decoding forward of one model (see the module docstring); state is the model's modules.

    In float32 on a CPU the projections run on packed weights (`_packed_forward`), or, where
    they are not packed, feature-major, (features, B * L): every projection is then `W @ X`, the
    weight the tall operand, which MKL computes faster than transformers' `X @ W^T` at the few
    tokens a decoding step feeds (`cllm bench`'s `forward_cost`); attention runs on (B, heads,
    L, D) either way. Elsewhere the layers run in transformers' layout."""

    def __init__(self, model: torch.nn.Module) -> None:
        config, inner = model.config, model.model
        self.model = weakref.ref(model)
        self.embed, self.layers, self.norm, self.rotary = inner.embed_tokens, inner.layers, inner.norm, inner.rotary_emb
        self.lm_head = model.lm_head
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.qk_norm = hasattr(self.layers[0].self_attn, "q_norm")
        self.silu = getattr(config, "hidden_act", None) in ("silu", "swish")  # transformers' SiLU: F.silu
        self.scale = self.head_dim**-0.5
        # RoPE variants whose frequencies follow the sequence length are computed per forward;
        # the others come from a table of every position so far (the module's own values)
        self.rope_table: tuple[torch.Tensor, torch.Tensor] | None = None
        self.dynamic_rope = getattr(self.rotary, "rope_type", "default") in ("dynamic", "longrope")
        self.compiled: Any = None  # a `compiled.CompiledForward`, set by `compiled.compile_runner`
        self.packed: PackedWeights | None = None  # built at the first float32 CPU forward that can use it
        self.plan: cpu_paths.Plan | None = None  # the float32 CPU forward to take at each width, as measured
        self.head_plan: cpu_paths.Plan | None = None  # a "rows" forward's LM-head kernel at each width, as measured
        self._unpacked: str | None | bool = False  # why this model's weights are not packed (False: not asked yet)
        self.spares = graphs.Spares()  # freed caches' buffers and their CUDA graphs
        self.graphs_failed: str | None = None  # why forwards stopped replaying CUDA graphs (a capture failed)
        # where each weight lives (module, name), found once: a CUDA graph reads the weights' addresses
        self._weight_slots = [(m, name) for m in model.modules() for name, _ in m.named_parameters(recurse=False)]

    def new_cache(self, batch: int, capacity: int) -> LeanKV:
        """An empty cache for `batch` rows with room for `capacity` slots and more; where forwards
        replay CUDA graphs, on buffers (and their graphs) a freed cache left, when one fits."""
        weight = self.embed.weight
        shape = (len(self.layers), batch, self.kv_heads, self.head_dim)
        if not (_graphs_enabled and graphs.why_not_graphs(self, weight) is None):
            kv = LeanKV(*shape, capacity + GROWTH, weight.dtype, weight.device)
            kv.runner = self
            return kv
        capacity = graphs.capacity_for(capacity + GROWTH)
        spare = self.spares.take(batch, capacity)
        kv = LeanKV(*shape, capacity, weight.dtype, weight.device, buffers=spare[0] if spare else None)
        kv.runner, kv.graphs = self, spare[1] if spare else graphs.GraphSet()
        self.spares.keep_when_freed(kv)
        return kv

    def forward(self, kv: LeanKV, input_ids: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None, *, last_only: bool = False,
                hidden: bool = False) -> LeanOutput:
        """One forward over (B, L) new tokens at `position_ids`, appended to `kv`.
        `attention_mask`: None (every cached entry visible, causal among the new tokens), (B, S + L)
        key validity (causal among the new tokens), or a full (B, 1, L, S + L) mask."""
        inputs = dict(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, cache=kv)
        self._run_hooks("_forward_pre_hooks", inputs)
        B, L = input_ids.shape
        allowed = self._mask(attention_mask, B, L, kv.get_seq_length(), input_ids.device)
        if self._graphed(kv, B, L) and (replayed := kv.graphs.forward(self, kv, input_ids, position_ids, allowed)):
            logits, x = replayed
            if last_only:
                logits, x = logits[:, -1:], x[:, -1:]
            out = LeanOutput(logits, x if hidden else None)
            self._run_hooks("_forward_hooks", inputs, out)
            return out
        embedded = self.embed(input_ids)  # (B, L, H)
        if (self.compiled is not None and _compiled_enabled and self.compiled.takes(B, L)
                and torch.is_inference_mode_enabled() and self.compiled.current()):
            logits, x = self.compiled(self, kv, embedded, position_ids, allowed, last_only)
        elif self.feature_major(embedded):
            logits, x = self._cpu_forward(kv, embedded, position_ids, allowed, last_only)
        else:
            self.packed = None  # the model moved to another dtype or device: the copy is of no use
            logits, x = self.layer_stack(kv, embedded, *self.rotary(embedded, position_ids), allowed, last_only)
        out = LeanOutput(logits, x if hidden else None)
        self._run_hooks("_forward_hooks", inputs, out)
        return out

    def _graphed(self, kv: LeanKV, rows: int, tokens: int) -> bool:
        """Whether this forward is replayed from a CUDA graph of the cache's (`graphs.GraphSet`)."""
        if not (_graphs_enabled and torch.is_inference_mode_enabled()) or self.compiled is not None:
            return False
        if graphs.why_not_graphs(self, self.embed.weight) is not None:
            return False
        if kv.graphs is None:
            kv.graphs = graphs.GraphSet()
        return kv.graphs.takes(rows, tokens)

    def weight_addresses(self) -> tuple[int, ...]:
        """Where each of the model's weights is now (a CUDA graph reads them there)."""
        return tuple(m._parameters[name].data_ptr() for m, name in self._weight_slots)

    def _packed(self) -> PackedWeights | None:
        """The packed weights a float32 CPU forward computes with (packed again when the model's
        changed), or None where `PackedWeights.why_not`."""
        if self._unpacked is False:
            self._unpacked = PackedWeights.why_not(self.model())
        if not _packed_enabled or self._unpacked is not None:
            return None  # a copy made earlier is kept: switching back does not pack again
        if self.packed is None or not self.packed.current():
            self.packed = PackedWeights(self.model())
        return self.packed

    @staticmethod
    def feature_major(x: torch.Tensor) -> bool:
        """Whether a forward on x runs feature-major: float32 on a CPU, where it was measured faster.
        Elsewhere the projections keep transformers' orientation, so that in reduced precision the
        output stays bit for bit the same-dtype transformers forward's (a GEMM's rounding depends
        on its orientation, and bfloat16 rounding flips near-tied tokens)."""
        return x.dtype == torch.float32 and x.device.type == "cpu"

    def _rope(self, embedded: torch.Tensor, position_ids: torch.Tensor,
              slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and rotate_half-signed sin at `position_ids`, feature-major (D, B, L). A position
        never exceeds its cache slot, so the table covers `slots` (cached + fed) positions."""
        B, L = position_ids.shape
        if self.dynamic_rope:
            cos, sin = (t.permute(2, 0, 1) for t in self.rotary(embedded, position_ids))
        else:
            flat = position_ids.reshape(-1)
            cos, sin = (t.index_select(1, flat).view(-1, B, L) for t in self._rope_table(embedded, slots))
        half = cos.shape[0] // 2
        return cos.contiguous(), torch.cat((-sin[:half], sin[half:]))

    def _rope_table(self, embedded: torch.Tensor, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (D, positions) of at least `slots` positions (the rotary module's values)."""
        if self.rope_table is None or self.rope_table[0].shape[1] < slots:
            size = max(slots, 2 * (0 if self.rope_table is None else self.rope_table[0].shape[1]), GROWTH)
            positions = torch.arange(size, device=embedded.device)[None]
            self.rope_table = tuple(t[0].t().contiguous() for t in self.rotary(embedded, positions))
        return self.rope_table

    def rope_tokens(self, embedded: torch.Tensor, position_ids: torch.Tensor,
                    slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at `position_ids`, token-major (B * L, D)."""
        if self.dynamic_rope:
            return tuple(t.reshape(-1, t.shape[-1]) for t in self.rotary(embedded, position_ids))
        flat = position_ids.reshape(-1)
        return tuple(t.index_select(1, flat).t().contiguous() for t in self._rope_table(embedded, slots))

    def cpu_path(self, tokens: int) -> str:
        """Which float32 CPU forward computes `tokens` fed tokens (`cpu_paths`): the one forced,
        else the plan's, else the packed weights'; "gemm" where the weights are not packed."""
        path = cpu_paths.forced_path() or (self.plan.path(tokens) if self.plan is not None else "packed")
        return "gemm" if path == "packed" and self._packed() is None else path

    def _cpu_forward(self, kv: LeanKV, embedded: torch.Tensor, position_ids: torch.Tensor,
                     allowed: torch.Tensor | None, last_only: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """A float32 CPU forward on the path `cpu_path` names."""
        B, L, _ = embedded.shape
        path = self.cpu_path(B * L)
        if path == "packed":
            return self._packed_forward(self.packed, kv, embedded, position_ids, allowed, last_only)
        if path == "gemm":
            return self._feature_major(kv, embedded, position_ids, allowed, last_only)
        return self._rows_forward(kv, embedded, position_ids, allowed, last_only)

    def _feature_major(self, kv: LeanKV, embedded: torch.Tensor, position_ids: torch.Tensor,
                       allowed: torch.Tensor | None, last_only: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits (B, L', V) and the final norm's output (B, L', H), activations (features, B * L)
        zero-padded to `padded_width(B * L)` columns (a GEMM of a few columns is MKL's slow case;
        the padding columns never reach attention or the output)."""
        B, L, _ = embedded.shape
        D, M = self.head_dim, B * L
        P = padded_width(M)
        cos, sin = self._rope(embedded, position_ids, kv.get_seq_length() + L)  # (D, B, L)
        allowed = additive_mask(allowed, embedded)
        gqa = self.kv_heads != self.heads
        x = F.pad(embedded.view(M, -1).t(), (0, P - M))  # (H, P): feature-major
        attended = x.new_zeros(self.heads * D, P)  # attention's output, padded: its columns past M stay 0
        attended_view = attended[:, :M].view(self.heads, D, B, L)
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            h = _rms_norm(layer.input_layernorm, x, 0)
            q = _project(attn.q_proj, h)[:, :M].view(-1, D, B, L)  # (heads, D, B, L)
            k = _project(attn.k_proj, h)[:, :M].view(-1, D, B, L)
            v = _project(attn.v_proj, h)[:, :M].view(-1, D, B, L)
            if self.qk_norm:  # Qwen3: RMSNorm per head before the rotation
                q, k = _rms_norm(attn.q_norm, q, 1), _rms_norm(attn.k_norm, k, 1)
            q = _rotate(q, cos, sin).permute(2, 0, 3, 1).contiguous()  # (B, heads, L, D)
            k = _rotate(k, cos, sin).permute(2, 0, 3, 1)
            keys, values = kv.append(i, k, v.permute(2, 0, 3, 1))  # (B, H_kv, S + L, D)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed, scale=self.scale,
                                                 enable_gqa=gqa)  # (B, heads, L, D)
            attended_view.copy_(out.permute(1, 3, 0, 2))
            x = _project(attn.o_proj, attended, residual=x)
            h = _rms_norm(layer.post_attention_layernorm, x, 0)
            x = _project(mlp.down_proj, mlp.act_fn(_project(mlp.gate_proj, h)) * _project(mlp.up_proj, h), residual=x)
        x = _rms_norm(self.norm, x, 0)
        if last_only:
            x = x[:, :M].view(-1, B, L)[:, :, -1]  # (H, B)
            M, L = B, 1
            x = F.pad(x, (0, padded_width(M) - M))
        logits = _project(self.lm_head, x)[:, :M]  # (V, B * L')
        return logits.t().view(B, L, -1), x[:, :M].t().view(B, L, -1)

    def _packed_forward(self, packed: PackedWeights, kv: LeanKV, embedded: torch.Tensor,
                        position_ids: torch.Tensor, allowed: torch.Tensor | None,
                        last_only: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits (B, L', V) and the final norm's output (B, L', H) from the packed weights,
        activations token-major (B * L, features) zero-padded to `packed_rows(B * L)` rows (the
        padding rows never reach attention or the output)."""
        B, L, _ = embedded.shape
        D, M = self.head_dim, B * L
        P = packed_rows(M)
        heads, kv_heads = self.heads, self.kv_heads
        rope = self._rope_heads(embedded, position_ids, kv.get_seq_length() + L)
        allowed = additive_mask(allowed, embedded)
        x = _pad_rows(embedded.view(M, -1), P)
        for i, (layer, weights) in enumerate(zip(self.layers, packed.layers, strict=True)):
            attn = layer.self_attn
            h = _rms_norm_rows(layer.input_layernorm, x)
            qkv = packed_linear(h, weights["qkv"])[:M].view(B, L, heads + 2 * kv_heads, D).transpose(1, 2)
            q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
            out = self._attend(kv, i, attn, q, k, v, rope, allowed)
            x = packed_linear(_pad_rows(out.transpose(1, 2).reshape(M, -1), P), weights["o"], other=x, then="add")
            h = _rms_norm_rows(layer.post_attention_layernorm, x)
            if packed.silu:
                gate = packed_linear(h, weights["gate"], then="swish")
            else:
                gate = layer.mlp.act_fn(packed_linear(h, weights["gate"]))
            x = packed_linear(packed_linear(h, weights["up"], other=gate, then="mul"), weights["down"],
                               other=x, then="add")
        x = _rms_norm_rows(self.norm, x)[:M].view(B, L, -1)
        if last_only:
            x = x[:, -1:]
        rows = x.shape[0] * x.shape[1]
        logits = packed_linear(_pad_rows(x.reshape(rows, -1), packed_rows(rows)), packed.head)[:rows]
        return logits.view(*x.shape[:2], -1), x

    def _rope_heads(self, embedded: torch.Tensor, position_ids: torch.Tensor,
                    slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and rotate_half-signed sin at `position_ids`, (B, 1, L, D): for token-major heads."""
        B, L = position_ids.shape
        cos, sin = (t.view(B, L, 1, -1).transpose(1, 2) for t in self.rope_tokens(embedded, position_ids, slots))
        half = cos.shape[-1] // 2
        return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)

    def _attend(self, kv: LeanKV, i: int, attn: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor], allowed: torch.Tensor | None) -> torch.Tensor:
        """Layer i's attention of token-major heads q, k, v (B, heads, L, D): Qwen3's per-head
        norms, the rotation, the new keys and values appended to `kv`; (B, heads, L, D)."""
        if self.qk_norm:  # Qwen3: RMSNorm per head before the rotation
            q, k = _rms_norm_rows(attn.q_norm, q), _rms_norm_rows(attn.k_norm, k)
        cos, sin = rope
        half = cos.shape[-1] // 2
        q = torch.addcmul(q * cos, torch.cat((q[..., half:], q[..., :half]), dim=-1), sin)
        k = torch.addcmul(k * cos, torch.cat((k[..., half:], k[..., :half]), dim=-1), sin)
        keys, values = kv.append(i, k, v)  # (B, H_kv, S + L, D)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed, scale=self.scale,
                                              enable_gqa=self.kv_heads != self.heads)

    def _rows_forward(self, kv: LeanKV, embedded: torch.Tensor, position_ids: torch.Tensor,
                      allowed: torch.Tensor | None, last_only: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits (B, L', V) and the final norm's output (B, L', H) token-major, (B * L, features),
        on the model's own weights (`X @ W^T`, MKL's GEMM as transformers runs it): its layers'
        arithmetic in fewer calls than their modules make (RMSNorm in one, rotate_half's sign
        folded into sin, the residuals added by the GEMMs)."""
        B, L, _ = embedded.shape
        D, M = self.head_dim, B * L
        rope = self._rope_heads(embedded, position_ids, kv.get_seq_length() + L)
        allowed = additive_mask(allowed, embedded)
        x = embedded.view(M, -1)
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            h = _rms_norm_rows(layer.input_layernorm, x)
            q, k, v = (F.linear(h, p.weight, p.bias).view(B, L, -1, D).transpose(1, 2)
                       for p in (attn.q_proj, attn.k_proj, attn.v_proj))
            out = self._attend(kv, i, attn, q, k, v, rope, allowed)
            x = _linear_added(attn.o_proj, out.transpose(1, 2).reshape(M, -1), x)
            h = _rms_norm_rows(layer.post_attention_layernorm, x)
            gate = F.linear(h, mlp.gate_proj.weight, mlp.gate_proj.bias)
            gate = F.silu(gate, inplace=True) if self.silu else mlp.act_fn(gate)
            x = _linear_added(mlp.down_proj, gate.mul_(F.linear(h, mlp.up_proj.weight, mlp.up_proj.bias)), x)
        x = _rms_norm_rows(self.norm, x).view(B, L, -1)
        if last_only:
            x = x[:, -1:]
        rows = x.shape[0] * x.shape[1]
        packed = self.packed
        if self.head_plan is not None and self.head_plan.path(rows) == "packed" and packed is not None \
                and _packed_enabled and packed.head_current():
            logits = packed_linear(_pad_rows(x.reshape(rows, -1), packed_rows(rows)), packed.head)[:rows]
            return logits.view(*x.shape[:2], -1), x
        return F.linear(x, self.lm_head.weight, self.lm_head.bias), x

    def layer_stack(self, kv: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    allowed: torch.Tensor | None, last_only: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The same in transformers' layout (B, L, features), through the model's own modules: x the
        embedded tokens, cos and sin (B, L, D) at their positions; each layer's new keys and values
        go to `kv.append` (a `LeanKV`, or a CUDA graph's `graphs._Slots`), which returns every slot
        the attention reads."""
        B, L, _ = x.shape
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, L, D)
        gqa = self.kv_heads != self.heads
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(B, L, -1, self.head_dim)
            k = attn.k_proj(h).view(B, L, -1, self.head_dim)
            v = attn.v_proj(h).view(B, L, -1, self.head_dim).transpose(1, 2)
            if self.qk_norm:  # Qwen3: RMSNorm per head before the rotation
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, heads, L, D)
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
            keys, values = kv.append(i, k, v)  # (B, H_kv, S + L, D)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed, scale=self.scale,
                                                 enable_gqa=gqa)  # (B, heads, L, D)
            x = x + attn.o_proj(out.transpose(1, 2).reshape(B, L, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        x = self.norm(x)
        if last_only:
            x = x[:, -1:]
        return self.lm_head(x), x

    def _run_hooks(self, kind: str, kwargs: dict, *output: LeanOutput) -> None:
        """The model's forward pre-hooks and hooks see every decoding forward, whichever code
        computes it (a bench counting forwards, a test reading logits): called as torch calls
        them, with the transformers-style keywords (no positional arguments) and, after the
        forward, an output with `.logits`. Their return values are ignored."""
        model = self.model()
        hooks = getattr(model, kind, None)
        if not hooks:
            return
        with_kwargs = getattr(model, f"{kind}_with_kwargs", {})
        for key, hook in list(hooks.items()):
            if with_kwargs.get(key):
                hook(model, (), kwargs, *output)
            else:
                hook(model, (), *output)

    @staticmethod
    def _mask(mask: torch.Tensor | None, B: int, L: int, S: int, device: torch.device) -> torch.Tensor | None:
        """The (B or 1, 1, L, S + L) boolean mask of a forward of L new tokens after S cached
        slots; every query sees itself, so no row is fully masked (a left pad's output is
        garbage nobody reads, never NaN)."""
        if mask is None and L == 1:
            return None  # one new token sees every slot: no mask at all (the fastest kernel)
        own = torch.arange(S, S + L, device=device)[:, None]  # (L, 1): each query's own slot
        slots = torch.arange(S + L, device=device)[None, :]  # (1, S + L)
        if mask is None or mask.dim() == 2:
            allowed = (slots <= own)[None, None]  # causal among the new tokens: (1, 1, L, S + L)
            if mask is not None:
                allowed = allowed & mask.to(device).bool()[:, None, None, :]
        else:
            allowed = mask.to(device)
            allowed = allowed if allowed.dtype == torch.bool else allowed == 0  # an additive mask: 0 = allowed
        return allowed | (slots == own)[None, None]
