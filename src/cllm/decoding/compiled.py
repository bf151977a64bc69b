"""The lean runner's compiled forward: the whole decoding forward of a few fed tokens (every
layer's norms, projections, rotation, cache write, attention and MLP, then the final norm and the
LM head) as one Inductor graph, the weights frozen in and the cache buffers written in place.

Why: on a CPU, Inductor's own GEMM kernels stream the frozen weights several times faster than
MKL's GEMM at the few tokens a decoding step feeds (all of `stdlib-coder`'s GEMMs: 0.4-0.6 ms at
1-4 rows against 2.5-4), and one graph per forward leaves no eager work between the layers (each
eager operation and each call into a compiled graph costs tens of microseconds). From about 8
rows MKL and Inductor are both bound by arithmetic.

`compile_runner(model)` compiles it once, up front (tens of seconds on a 2-core CPU, every
process: Inductor does not cache graphs with frozen weights), as a graph for one batch row and,
unless told not to, one for two rows or more; each takes any count of fed tokens from two (one
token runs padded to two) and any cache length. `LeanRunner.forward` then runs it for forwards of up to
`lean.COMPILED_MAX_TOKENS` fed tokens in inference mode, while the weights are the ones compiled.
`why_not_compiled` says where it cannot run.
"""

from __future__ import annotations

import shutil
import time
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from cllm.decoding import lean
from cllm.decoding.lean import rotate_half, runner_for, why_not

COMPILE_MIN_TORCH = (2, 6)  # Inductor's CPU GEMM template with a dynamic token count
# Inductor's settings while the forward compiles: the weights frozen into the graph (packed for
# Inductor's own GEMM kernels, which at a few rows stream them several times faster than MKL's
# GEMM here), the kernels chosen by measuring them
_INDUCTOR = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP"}


class _Forward(torch.nn.Module):
    """The runner's forward as one graph, token-major: x (B * L, hidden) embedded tokens, cos and
    sin (B * L, D) at their positions, an additive mask (B, L, T) over the first T cache slots,
    cache rows `rows` (B,) and slots `slots` (L,) where the new keys and values go (written in
    place into `keys[i]` / `values[i]`, (R, H_kv, C, D) each). Returns (logits, normed), token-major.

    Attention is written as products and sums rather than matrix products, so that Inductor
    generates it (its CPU GEMM template takes constant weights only)."""

    def __init__(self, runner: lean.LeanRunner) -> None:
        super().__init__()
        self.layers, self.norm, self.lm_head = runner.layers, runner.norm, runner.lm_head  # the model's own
        self.head_dim, self.heads, self.kv_heads = runner.head_dim, runner.heads, runner.kv_heads
        self.qk_norm, self.scale = runner.qk_norm, runner.scale

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                rows: torch.Tensor, slots: torch.Tensor, keys: list[torch.Tensor],
                values: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        B, L, T = mask.shape
        D, H_kv = self.head_dim, self.kv_heads
        group = self.heads // H_kv
        cos, sin = cos[:, None], sin[:, None]
        heads = torch.arange(H_kv, device=x.device)
        where = (rows[:, None, None], heads[None, :, None], slots[None, None, :])  # (B, H_kv, L)
        mask = mask[:, None, None]  # (B, 1, 1, L, T)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q, k = attn.q_proj(h).view(B * L, -1, D), attn.k_proj(h).view(B * L, -1, D)
            if self.qk_norm:  # Qwen3: RMSNorm per head before the rotation
                q, k = attn.q_norm(q), attn.k_norm(k)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            keys[i].index_put_(where, k.view(B, L, H_kv, D).transpose(1, 2))
            values[i].index_put_(where, attn.v_proj(h).view(B, L, H_kv, D).transpose(1, 2))
            K, V = keys[i][:B, :, None, :T], values[i][:B, :, None, :T]  # (B, H_kv, 1, T, D)
            q = q.view(B, L, H_kv, group, D).permute(0, 2, 3, 1, 4)  # (B, H_kv, group, L, D)
            scores = (q[..., None, :] * K[:, :, :, None]).sum(-1) * self.scale + mask  # (B, H_kv, group, L, T)
            weights = torch.softmax(scores, dim=-1)
            out = (weights[..., None] * V[:, :, :, None]).sum(-2)  # (B, H_kv, group, L, D)
            x = x + attn.o_proj(out.permute(0, 3, 1, 2, 4).reshape(B * L, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        x = self.norm(x)
        return self.lm_head(x), x


def _own_code(module: torch.nn.Module) -> Callable[..., Any]:
    """A function calling `module` with a code object of its own: Dynamo keeps its compiled
    graphs per code object, so each variant's graph is then the only one its calls look up (and
    no guard has to tell the variants apart)."""

    def call(*args: Any) -> Any:
        return module(*args)

    return types.FunctionType(call.__code__.replace(), call.__globals__, "call", None, call.__closure__)


class CompiledForward:
    """A runner's forward (`_Forward`) compiled by Inductor with the weights frozen in, for one
    batch row (`one_row`) and, when asked, for two or more (`rows`; else None, and batches run
    eagerly): it runs while the model's weights are the ones compiled (`current`); once a weight
    changes (training, `.to()`), the runner's eager forward runs."""

    def __init__(self, runner: lean.LeanRunner, model: torch.nn.Module, batches: bool) -> None:
        self.one_row = torch.compile(_own_code(_Forward(runner)))
        self.rows = torch.compile(_own_code(_Forward(runner))) if batches else None
        self.layers = len(runner.layers)
        self._parameters = list(model.parameters())
        self._stamp = self._weights()
        self.seconds = 0.0  # what compiling took

    def _weights(self) -> tuple[tuple[int, int], ...]:
        return tuple((p.data_ptr(), p._version) for p in self._parameters)

    def current(self) -> bool:
        """Whether the weights are still the ones compiled in."""
        return self._weights() == self._stamp

    def takes(self, rows: int, tokens: int) -> bool:
        """Whether a forward of `tokens` fed tokens per row over `rows` batch rows runs here: a
        graph for that many rows was compiled, and it feeds at most `lean.COMPILED_MAX_TOKENS` (one
        token a row runs as two)."""
        return (rows == 1 or self.rows is not None) and rows * max(tokens, 2) <= lean.COMPILED_MAX_TOKENS

    def warm_up(self, runner: lean.LeanRunner) -> None:
        """Compile the variants now, every size but the batch row count of `one_row` marked
        dynamic (from two: Dynamo specializes sizes 0 and 1), so that no forward compiles."""
        weight = runner.embed.weight
        D, L, T, C = runner.head_dim, 2, 3, 4
        start = time.perf_counter()
        with torch.inference_mode(), torch._inductor.config.patch(_INDUCTOR):
            for graph, B in ((self.one_row, 1), (self.rows, 2)):
                if graph is None:
                    continue
                buffers = [weight.new_zeros(2, runner.kv_heads, C, D) for _ in range(2 * self.layers)]
                x, mask = weight.new_zeros(B * L, weight.shape[1]), weight.new_zeros(B, L, T)
                cos, sin = weight.new_ones(B * L, D), weight.new_zeros(B * L, D)
                rows, slots = torch.arange(B, device=weight.device), torch.arange(T - L, T, device=weight.device)
                for t in (x, cos, sin, slots):
                    torch._dynamo.mark_dynamic(t, 0)
                torch._dynamo.mark_dynamic(mask, 1)
                torch._dynamo.mark_dynamic(mask, 2)
                for t in buffers:
                    torch._dynamo.mark_dynamic(t, 0)
                    torch._dynamo.mark_dynamic(t, 2)
                if B > 1:
                    torch._dynamo.mark_dynamic(mask, 0)
                    torch._dynamo.mark_dynamic(rows, 0)
                graph(x, cos, sin, mask, rows, slots, buffers[: self.layers], buffers[self.layers :])
        self.seconds = time.perf_counter() - start

    def __call__(self, runner: lean.LeanRunner, kv: lean.LeanKV, embedded: torch.Tensor,
                 position_ids: torch.Tensor, allowed: torch.Tensor | None,
                 last_only: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward of `LeanRunner.forward` (same arguments, `allowed` its boolean mask or None):
        logits (B, L', V) and the final norm's output (B, L', hidden). One fed token per row runs
        padded to two: the second, at the same position, sees only its own slot, one past the
        cache's new length (so nothing reads it), and its outputs are dropped."""
        B, L, H = embedded.shape
        S = kv.get_seq_length()
        cos, sin = runner.rope_tokens(embedded, position_ids, S + L)  # (B * L, D)
        allowed = embedded.new_ones(B, L, S + L, dtype=torch.bool) if allowed is None \
            else allowed.expand(B, 1, L, S + L)[:, 0]
        if L == 1:
            embedded, cos, sin = (t.view(B, 1, -1).expand(B, 2, -1) for t in (embedded, cos, sin))
            allowed = F.pad(allowed, (0, 1, 0, 1))
            allowed[:, 1, S + 1] = True
        width = allowed.shape[1]
        mask = lean.additive_mask(allowed, embedded)
        kv.reserve(max(B, 2), S + width)  # the new slots, and two rows (the graphs take two and more)
        x, cos, sin = (t.reshape(B * width, -1).contiguous() for t in (embedded, cos, sin))
        rows = torch.arange(B, device=x.device)
        slots = torch.arange(S, S + width, device=x.device)
        graph = self.one_row if B == 1 else self.rows
        # Dynamo's guards are skipped (each variant has one graph): what they would check holds
        # here, contiguous float32 CPU inputs, two or more fed tokens, inference mode, the weights
        # compiled, and (for `one_row`) one batch row
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            logits, x = graph(x, cos, sin, mask, rows, slots, kv.buffers[0], kv.buffers[1])
        kv.extend(L)
        logits, x = logits.view(B, width, -1)[:, :L], x.view(B, width, -1)[:, :L]
        return (logits[:, -1:], x[:, -1:]) if last_only else (logits, x)


def why_not_compiled(model: torch.nn.Module) -> str | None:
    """Why the runner's forward cannot be compiled for `model` (None: it can)."""
    reason = why_not(model)
    if reason is not None:
        return reason
    weight = next(model.parameters())
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        dtype = str(weight.dtype).removeprefix("torch.")
        return (f"the compiled forward runs float32 on a CPU only (measured faster there), "
                f"not {dtype} on {weight.device.type}")
    release = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2] if p.isdigit())
    if release < COMPILE_MIN_TORCH:
        needed = ".".join(map(str, COMPILE_MIN_TORCH))
        return f"the compiled forward needs torch >= {needed} (this is {torch.__version__})"
    if not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        return "no C++ compiler on PATH (Inductor builds its kernels with one)"
    return None


def compile_runner(model: torch.nn.Module, *, batches: bool = True) -> str | None:
    """Compile the runner's forward for `model` now (tens of seconds on a 2-core CPU, half of it
    without `batches`): its forwards of up to `lean.COMPILED_MAX_TOKENS` fed tokens then run it.
    `batches`: also compile the graph for two batch rows or more (a server's batches); without
    it, they run eagerly. Returns None when done (or already done for these weights), else why
    not; the eager runner then stays."""
    reason = why_not_compiled(model)
    runner = runner_for(model) if reason is None else None
    if reason is None and runner is None:
        reason = "the lean runner is off (training mode, or switched off)"
    if reason is not None:
        return reason
    if runner.compiled is not None and runner.compiled.current() and (runner.compiled.rows is not None or not batches):
        return None
    compiled = CompiledForward(runner, model, batches)
    try:
        compiled.warm_up(runner)
    except Exception as exc:  # Inductor's failures are many and deep: the eager runner stays
        text = str(exc).strip()
        return f"compiling failed: {text.splitlines()[0] if text else type(exc).__name__}"
    runner.compiled = compiled
    return None
