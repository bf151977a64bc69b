"""A lean decoding forward for the Llama family (Llama 2/3, Mistral, Qwen2/2.5, Qwen3): what a
Jacobi step costs is mostly the framework around ~10 MFLOP of arithmetic, so the engine owns
its forward where it can, as gpt-fast and llama.cpp do.

`LeanRunner` computes the model's forward from its own weights (embeddings, norms, projections,
MLP, LM head, rotary frequencies: nothing is converted; the one copy is the packed weights) in
a straight line: the decoder layer written once (`ops.decoder_layers`), one attention call per
layer over a preallocated cache (`kv.LeanKV`), masks built by index arithmetic once per forward,
RoPE from a table of positions, logits only where the caller reads them, no host sync. Which
operations compute a forward is chosen per forward (`ops`):

- float32 on a CPU: the fastest of three layouts at the forward's width, as measured when the
  model is readied (`prepare`, `cpu_paths.measure`): oneDNN-packed weights ("packed",
  `ops.PackedOps`), MKL's `W @ X` feature-major ("gemm", `ops.GemmOps`) or token-major on the
  model's own weights ("rows", `ops.RowsOps`);
- elsewhere (a GPU, reduced precision) the model's modules in transformers' layout
  (`ops.ModuleOps`), replayed from CUDA graphs on a GPU (`graphs`);
- a forward of a few fed tokens from the compiled graph, when one was built
  (`compiled.compile_runner`): on a CPU its GEMM kernels stream the weights several times faster
  than MKL at those widths, and nothing runs eagerly between the layers.

The runner's options (`packed`, `graphs`, `path`) are its own arguments: `cllm.runtime.lean`'s
`LeanRuntime` takes them. It is exact: token for token the transformers model's greedy output,
its logits equal transformers' to float32 rounding (`tests/runtime/test_lean.py`, and the
engine's exactness suites run on every path).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from cllm.runtime.lean import cpu_paths
from cllm.runtime.lean import graphs as cuda_graphs
from cllm.runtime.lean.kernels import PACKED_EXACT_ROWS
from cllm.runtime.lean.kv import GROWTH, LeanKV
from cllm.runtime.lean.ops import Appended, GemmOps, ModuleOps, PackedOps, RowsOps, decoder_layers, sdpa_mask
from cllm.runtime.lean.packed import PackedWeights

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
ATTENTIONS = ("sdpa", "eager")
# A model whose packed weights pass this is readied on fewer widths (`prepare`): building oneDNN's
# kernels and timing the paths at every width would cost seconds per forward timed
WARM_MAX_BYTES = 256 * 2**20
LARGE_WIDTHS = (1, 8, 32)  # the widths a larger model's paths are timed at, one round
COMPILED_MAX_TOKENS = 24  # fed tokens (B * L, a row of one counting two) up to which the compiled forward runs


def why_not(model: torch.nn.Module) -> str | None:
    """Why the lean runner cannot run `model` (None: it can)."""
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED:
        return f"architecture {kind!r} is not one the lean runtime knows ({', '.join(SUPPORTED)})"
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


@dataclass
class LeanOutput:
    logits: torch.Tensor  # (B, L, V), or (B, 1, V) for the last position only
    hidden: torch.Tensor | None = None  # (B, L, H): the final norm's output (what the LM head reads)


class LeanRunner:
    """The decoding forward of one model (module docstring); its state is the model's modules
    and what was built for them (packed weights, plans, the compiled forward, CUDA graphs).

    Args:
        packed: float32 CPU forwards may compute on oneDNN-packed weights.
        graphs: forwards on a GPU replay CUDA graphs where they can.
        path: every float32 CPU forward takes this layout ("packed", "gemm", "rows"), not the
            measured plan's (tests run the exactness suites on each).
        weak: refer to the model weakly (the runner then works while the model lives)."""

    def __init__(self, model: torch.nn.Module, *, packed: bool = True, graphs: bool = True,
                 path: str | None = None, weak: bool = False) -> None:
        if path is not None and path not in cpu_paths.PATHS:
            raise ValueError(f"unknown CPU forward {path!r} (one of {', '.join(cpu_paths.PATHS)})")
        config, inner = model.config, model.model
        # `weak`: a model's own "auto" runtime (`cllm.runtime.as_runtime`) must not keep it alive
        self.model = weakref.ref(model) if weak else (lambda: model)
        self.use_packed, self.use_graphs, self.path = packed, graphs, path
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
        self.plan: cpu_paths.Plan | None = None  # the float32 CPU layout to take at each width, as measured
        self.head_plan: cpu_paths.Plan | None = None  # a "rows" forward's LM-head kernel at each width
        self._unpacked: str | None | bool = False  # why this model's weights are not packed (False: not asked yet)
        self.spares = cuda_graphs.Spares()  # freed caches' buffers and their CUDA graphs
        self.graphs_failed: str | None = None  # why forwards stopped replaying CUDA graphs (a capture failed)
        # where each weight lives (module, name), found once: a CUDA graph reads the weights' addresses
        self._weight_slots = [(m, name) for m in model.modules() for name, _ in m.named_parameters(recurse=False)]

    # -- readying

    def prepare(self) -> None:
        """Ready a float32 CPU forward before the first request: the packed weights, with oneDNN's
        kernels built for every width a decoding step feeds (1 to `PACKED_EXACT_ROWS` tokens), and
        the plan of which layout is fastest here at each width (`cpu_paths.measure`). A model
        whose packed weights pass `WARM_MAX_BYTES` is readied at `LARGE_WIDTHS` only, in one
        timed round (its forwards cost tens of milliseconds each)."""
        if not self.feature_major(self.embed.weight):
            return
        large = PackedWeights.size(self.model()) > WARM_MAX_BYTES
        widths = LARGE_WIDTHS if large else cpu_paths.WIDTHS
        with torch.inference_mode():
            packed = self._packed()
            if packed is not None:
                packed.warm(LARGE_WIDTHS if large else range(1, PACKED_EXACT_ROWS + 1))
                self.head_plan = cpu_paths.measure_head(self.lm_head, packed, widths=widths, rounds=1 if large else
                                                        cpu_paths.ROUNDS)
            paths = [p for p in cpu_paths.PATHS if p != "packed" or packed is not None]
            self.plan = cpu_paths.measure(self, paths, widths=widths, rounds=1 if large else cpu_paths.ROUNDS)

    def new_cache(self, batch: int, capacity: int) -> LeanKV:
        """An empty cache for `batch` rows with room for `capacity` slots and more; where forwards
        replay CUDA graphs, on buffers (and their graphs) a freed cache left, when one fits."""
        weight = self.embed.weight
        shape = (len(self.layers), batch, self.kv_heads, self.head_dim)
        if self.why_not_graphs() is not None:
            return LeanKV(*shape, capacity + GROWTH, weight.dtype, weight.device)
        capacity = cuda_graphs.capacity_for(capacity + GROWTH)
        spare = self.spares.take(batch, capacity)
        kv = LeanKV(*shape, capacity, weight.dtype, weight.device, buffers=spare[0] if spare else None)
        kv.graphs = spare[1] if spare else cuda_graphs.GraphSet()
        self.spares.keep_when_freed(kv)
        return kv

    # -- the forward

    def forward(self, kv: LeanKV, input_ids: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None, *, last_only: bool = False,
                hidden: bool = False) -> LeanOutput:
        """One forward over (B, L) new tokens at `position_ids`, appended to `kv`.
        `attention_mask`: None (every cached entry visible, causal among the new tokens), (B, S + L)
        key validity (causal among the new tokens), or a full boolean (B, 1, L, S + L) mask."""
        B, L = input_ids.shape
        allowed = self._mask(attention_mask, B, L, kv.get_seq_length(), input_ids.device)
        if self._graphed(kv, B, L) and (replayed := kv.graphs.forward(self, kv, input_ids, position_ids, allowed)):
            logits, x = replayed
            if last_only:
                logits, x = logits[:, -1:], x[:, -1:]
            return LeanOutput(logits, x if hidden else None)
        embedded = self.embed(input_ids)  # (B, L, H)
        if (self.compiled is not None and self.compiled.takes(B, L) and torch.is_inference_mode_enabled()
                and self.compiled.current()):
            logits, x = self.compiled(self, kv, embedded, position_ids, allowed, last_only)
        else:
            ops = self.ops(embedded, position_ids, kv.get_seq_length() + L)
            logits, x = self.layer_stack(ops, Appended(kv, sdpa_mask(ops, allowed, embedded), self.scale,
                                                       self.kv_heads != self.heads), embedded, last_only)
        return LeanOutput(logits, x if hidden else None)

    def layer_stack(self, ops: Any, attention: Any, embedded: torch.Tensor,
                    last_only: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits (B, L', V) and the final norm's output (B, L', H) of the embedded tokens, computed
        with `ops`, the layers' attention `attention`."""
        x = decoder_layers(ops, self.layers, ops.begin(embedded), attention)
        return ops.final(self, x, last_only)

    def ops(self, embedded: torch.Tensor, position_ids: torch.Tensor, slots: int) -> Any:
        """The operations a forward of these tokens is computed with (`cllm.runtime.lean.ops`)."""
        B, L = position_ids.shape
        if not self.feature_major(embedded):
            self.packed = None  # the model moved to another dtype or device: the copy is of no use
            return ModuleOps(self, B, L, self.rope_module(embedded, position_ids))
        path = self.cpu_path(B * L)
        if path == "gemm":
            return GemmOps(self, B, L, self._rope_features(embedded, position_ids, slots))
        rope = self._rope_heads(embedded, position_ids, slots)
        return PackedOps(self, B, L, rope, self.packed) if path == "packed" else RowsOps(self, B, L, rope)

    def cpu_path(self, tokens: int) -> str:
        """Which float32 CPU layout computes `tokens` fed tokens (`cpu_paths`): the one the
        runner was given, else the plan's, else the packed weights'; "gemm" where the weights
        are not packed."""
        path = self.path or (self.plan.path(tokens) if self.plan is not None else "packed")
        return "gemm" if path == "packed" and self._packed() is None else path

    def packed_head(self, rows: int) -> PackedWeights | None:
        """The packed weights a "rows" forward of `rows` logits computes its LM head on, where
        `measure_head` found the packed copy faster at that width; else None."""
        packed = self.packed
        if self.head_plan is None or self.head_plan.path(rows) != "packed" or packed is None or not self.use_packed:
            return None
        return packed if packed.head_current() else None

    @staticmethod
    def feature_major(x: torch.Tensor) -> bool:
        """Whether a forward on x runs one of the CPU layouts: float32 on a CPU, where they were
        measured faster. Elsewhere the modules keep transformers' orientation, so that in reduced
        precision the output stays bit for bit the same-dtype transformers forward's (a GEMM's
        rounding depends on its orientation, and bfloat16 rounding flips near-tied tokens)."""
        return x.dtype == torch.float32 and x.device.type == "cpu"

    def _packed(self) -> PackedWeights | None:
        """The packed weights a float32 CPU forward computes with (packed again when the model's
        changed), or None where `PackedWeights.why_not` or the runner was told not to."""
        if self._unpacked is False:
            self._unpacked = PackedWeights.why_not(self.model())
        if not self.use_packed or self._unpacked is not None:
            return None
        if self.packed is None or not self.packed.current():
            self.packed = PackedWeights(self.model())
        return self.packed

    # -- CUDA graphs

    def why_not_graphs(self) -> str | None:
        """Why this runner's forwards are not replayed from CUDA graphs (None: they are)."""
        if not self.use_graphs:
            return "switched off"
        if self.compiled is not None:
            return "the compiled forward runs instead"
        return cuda_graphs.why_not_graphs(self, self.embed.weight)

    def _graphed(self, kv: LeanKV, rows: int, tokens: int) -> bool:
        """Whether this forward is replayed from a CUDA graph of the cache's (`graphs.GraphSet`)."""
        if not torch.is_inference_mode_enabled() or self.why_not_graphs() is not None:
            return False
        if kv.graphs is None:
            kv.graphs = cuda_graphs.GraphSet()
        return kv.graphs.takes(rows, tokens)

    def weight_addresses(self) -> tuple[int, ...]:
        """Where each of the model's weights is now (a CUDA graph reads them there)."""
        return tuple(m._parameters[name].data_ptr() for m, name in self._weight_slots)

    # -- rotary values

    def rope_module(self, embedded: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (B, L, D) at `position_ids`, as the rotary module computes them."""
        return self.rotary(embedded, position_ids)

    def _rope_features(self, embedded: torch.Tensor, position_ids: torch.Tensor,
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

    def _rope_heads(self, embedded: torch.Tensor, position_ids: torch.Tensor,
                    slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and rotate_half-signed sin at `position_ids`, (B, 1, L, D): for token-major heads."""
        B, L = position_ids.shape
        cos, sin = (t.view(B, L, 1, -1).transpose(1, 2) for t in self.rope_tokens(embedded, position_ids, slots))
        half = cos.shape[-1] // 2
        return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)

    @staticmethod
    def _mask(mask: torch.Tensor | None, B: int, L: int, S: int, device: torch.device) -> torch.Tensor | None:
        """The (B or 1, 1, L, S + L) boolean mask of a forward of L new tokens after S cached
        slots; every query sees itself, so no row is fully masked (a pad's output is garbage
        nobody reads, never NaN)."""
        if mask is None and L == 1:
            return None  # one new token sees every slot: no mask at all (the fastest kernel)
        own = torch.arange(S, S + L, device=device)[:, None]  # (L, 1): each query's own slot
        slots = torch.arange(S + L, device=device)[None, :]  # (1, S + L)
        if mask is None or mask.dim() == 2:
            allowed = (slots <= own)[None, None]  # causal among the new tokens: (1, 1, L, S + L)
            if mask is not None:
                allowed = allowed & mask.to(device).bool()[:, None, None, :]
        else:
            allowed = mask.to(device).bool()
        return allowed | (slots == own)[None, None]

    # -- in words

    def describe(self) -> str:
        """Which forward decodes the model, in a line (`cllm generate -v`)."""
        model = self.model()
        kind, weight = model.config.model_type, self.embed.weight
        dtype = str(weight.dtype).removeprefix("torch.")
        if self.compiled is not None and self.compiled.current():
            return (f"lean ({kind}, {dtype}; compiled forward up to {COMPILED_MAX_TOKENS} fed tokens, "
                    f"{self.compiled.origin})")
        if not self.feature_major(weight):
            if weight.device.type != "cuda":
                return f"lean ({kind}, {dtype}; the model's modules)"
            unfit = self.why_not_graphs()
            if unfit is not None:
                return f"lean ({kind}, {dtype}; eager, no CUDA graphs: {unfit})"
            return f"lean ({kind}, {dtype}; CUDA graphs up to {cuda_graphs.MAX_TOKENS} fed tokens)"
        legend = {"packed": f"oneDNN-packed weights ({PackedWeights.size(model) / 2**20:.0f} MiB beside the model's)",
                  "gemm": "MKL's GEMM on the model's weights, feature-major",
                  "rows": "the model's weights, token-major"}
        if self.path is not None:
            return f"lean ({kind}, {dtype}; {legend[self.cpu_path(1)]}, as asked)"
        if self.plan is not None:
            used = ", ".join(f"{p} = {legend[p]}" for p in cpu_paths.PATHS if p in self.plan.paths)
            return f"lean ({kind}, {dtype}; the layout measured fastest here: {self.plan.describe()}; {used})"
        unpacked = PackedWeights.why_not(model) if self.use_packed else "packed weights switched off"
        if unpacked is None:
            return f"lean ({kind}, {dtype}; {legend['packed']})"
        return f"lean ({kind}, {dtype}; MKL's GEMM: {unpacked})"
