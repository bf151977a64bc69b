"""The lean runner's decoder layer, written once (`decoder_layers`), and the operations it is
computed with, chosen per forward (`cllm.runtime.lean.runner`):

- `ModuleOps`: the model's own modules in transformers' layout (B, L, features): on a GPU, in
  reduced precision (bit for bit the same-dtype transformers forward), inside a CUDA graph and
  inside the compiled forward;
- `RowsOps`: float32 on a CPU, token-major (B * L, features) on the model's own weights, the
  Llama-family arithmetic in fewer calls than the modules make (RMSNorm in one, rotate_half's
  sign folded into sin, the residuals added by the GEMMs);
- `PackedOps`: the same on oneDNN-packed copies of the weights (`packed.PackedWeights`), the
  bias, residual, SiLU and the MLP's product in the projection's own call, rows zero-padded to
  a few widths (`kernels.packed_rows`);
- `GemmOps`: feature-major (features, B * L), every projection one MKL `W @ X` GEMM with the
  residual added by it, columns zero-padded to 16 (`kernels.padded_width`).

Each computes a layer's steps in its own layout and hands attention its queries, keys and values
as (B, heads, L, D); the attention (`Appended`: the new entries appended to the cache, then SDPA;
the compiled forward's own, `compiled.Indexed`) is chosen apart from them. Every combination is
exact: token for token transformers' greedy output (`tests/runtime/test_lean.py`).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F

from cllm.runtime.lean.kernels import (
    _linear_added,
    _pad_rows,
    _project,
    _rms_norm,
    _rms_norm_rows,
    _rotate,
    additive_mask,
    packed_rows,
    padded_width,
    rotate_half,
)
from cllm.runtime.lean.packed import PackedWeights, packed_linear


class Attention(Protocol):
    def __call__(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Layer i's attention output (B, heads, L, D) for queries (B, heads, L, D) and the new
        keys and values (B, kv_heads, L, D), which it stores."""
        ...


class Appended:
    """Attention over a cache that `append`s each layer's new entries and returns every slot in
    use (a `kv.LeanKV`, or a CUDA graph's static slots), masked by `mask` (boolean or additive,
    broadcast to (B, 1, L, S + L); None: every slot)."""

    def __init__(self, kv: Any, mask: torch.Tensor | None, scale: float, gqa: bool) -> None:
        self.kv, self.mask, self.scale, self.gqa = kv, mask, scale, gqa

    def __call__(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys, values = self.kv.append(i, k, v)  # (B, kv_heads, S + L, D)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=self.mask, scale=self.scale,
                                              enable_gqa=self.gqa)


def decoder_layers(ops: Any, layers: Any, x: torch.Tensor, attention: Attention) -> torch.Tensor:
    """The Llama-family decoder layers over `x` (in `ops`' layout): per layer, RMSNorm, the
    q / k / v projections (Qwen3: a per-head RMSNorm of q and k) and RoPE, attention, the output
    projection added to the residual, then RMSNorm and the gated MLP added to it."""
    for i, layer in enumerate(layers):
        q, k, v = ops.qkv(layer.self_attn, ops.norm(layer.input_layernorm, x))  # (B, heads, L, D) each
        x = ops.attended(layer.self_attn, attention(i, q, k, v), x)
        x = ops.mlp(layer.mlp, ops.norm(layer.post_attention_layernorm, x), x)
    return x


class _Shape:
    """What every layout knows of the forward it computes: the model's head sizes, the fed batch
    (B rows of L tokens), its rotary values in the layout's own form."""

    def __init__(self, runner: Any, B: int, L: int, rope: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.heads, self.kv_heads, self.D = runner.heads, runner.kv_heads, runner.head_dim
        self.qk_norm, self.silu = runner.qk_norm, runner.silu
        self.B, self.L, self.M = B, L, B * L
        self.cos, self.sin = rope

    def _qk_norm(self, attn: torch.nn.Module, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Qwen3's RMSNorm per head of token-major heads (B, heads, L, D), before the rotation."""
        if not self.qk_norm:
            return q, k
        return _rms_norm_rows(attn.q_norm, q), _rms_norm_rows(attn.k_norm, k)

    def _rotate_rows(self, x: torch.Tensor) -> torch.Tensor:
        """RoPE of token-major heads (B, heads, L, D): cos (B, 1, L, D), sin with rotate_half's
        sign folded in."""
        half = x.shape[-1] // 2
        return torch.addcmul(x * self.cos, torch.cat((x[..., half:], x[..., :half]), dim=-1), self.sin)


class ModuleOps(_Shape):
    """The model's modules, (B, L, features); `rope` the rotary module's cos and sin (B, L, D)."""

    def __init__(self, runner: Any, B: int, L: int, rope: tuple[torch.Tensor, torch.Tensor]) -> None:
        super().__init__(runner, B, L, (rope[0].unsqueeze(1), rope[1].unsqueeze(1)))  # (B, 1, L, D)

    def begin(self, embedded: torch.Tensor) -> torch.Tensor:
        return embedded

    def norm(self, norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return norm(x)

    def qkv(self, attn: torch.nn.Module, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, L, D = self.B, self.L, self.D
        q, k = attn.q_proj(h).view(B, L, -1, D), attn.k_proj(h).view(B, L, -1, D)
        v = attn.v_proj(h).view(B, L, -1, D).transpose(1, 2)
        if self.qk_norm:  # Qwen3: RMSNorm per head before the rotation
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, heads, L, D)
        return q * self.cos + rotate_half(q) * self.sin, k * self.cos + rotate_half(k) * self.sin, v

    def attended(self, attn: torch.nn.Module, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x + attn.o_proj(out.transpose(1, 2).reshape(self.B, self.L, -1))

    def mlp(self, mlp: torch.nn.Module, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x + mlp(h)

    def final(self, runner: Any, x: torch.Tensor, last_only: bool) -> tuple[torch.Tensor, torch.Tensor]:
        x = runner.norm(x)
        if last_only:
            x = x[:, -1:]
        return runner.lm_head(x), x


class RowsOps(_Shape):
    """Token-major (B * L, features) on the model's own weights (`X @ W^T`, as transformers)."""

    def begin(self, embedded: torch.Tensor) -> torch.Tensor:
        return embedded.view(self.M, -1)

    def norm(self, norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm_rows(norm, x)

    def qkv(self, attn: torch.nn.Module, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, L, D = self.B, self.L, self.D
        q, k, v = (F.linear(h, p.weight, p.bias).view(B, L, -1, D).transpose(1, 2)
                   for p in (attn.q_proj, attn.k_proj, attn.v_proj))
        q, k = self._qk_norm(attn, q, k)
        return self._rotate_rows(q), self._rotate_rows(k), v

    def attended(self, attn: torch.nn.Module, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return _linear_added(attn.o_proj, out.transpose(1, 2).reshape(self.M, -1), x)

    def mlp(self, mlp: torch.nn.Module, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        gate = F.linear(h, mlp.gate_proj.weight, mlp.gate_proj.bias)
        gate = F.silu(gate, inplace=True) if self.silu else mlp.act_fn(gate)
        return _linear_added(mlp.down_proj, gate.mul_(F.linear(h, mlp.up_proj.weight, mlp.up_proj.bias)), x)

    def final(self, runner: Any, x: torch.Tensor, last_only: bool) -> tuple[torch.Tensor, torch.Tensor]:
        x = _rms_norm_rows(runner.norm, x).view(self.B, self.L, -1)
        if last_only:
            x = x[:, -1:]
        rows = x.shape[0] * x.shape[1]
        packed = runner.packed_head(rows)  # the LM head on its packed copy where measured faster
        if packed is not None:
            logits = packed_linear(_pad_rows(x.reshape(rows, -1), packed_rows(rows)), packed.head)[:rows]
            return logits.view(*x.shape[:2], -1), x
        return F.linear(x, runner.lm_head.weight, runner.lm_head.bias), x


class PackedOps(RowsOps):
    """Token-major on the packed weights, activations zero-padded to `packed_rows(B * L)` rows
    (the padding rows never reach attention or the output)."""

    def __init__(self, runner: Any, B: int, L: int, rope: tuple[torch.Tensor, torch.Tensor],
                 packed: PackedWeights) -> None:
        super().__init__(runner, B, L, rope)
        self.packed, self.P = packed, packed_rows(self.M)
        self.layer = 0  # the packed weights are per layer: `qkv` opens each layer's

    def begin(self, embedded: torch.Tensor) -> torch.Tensor:
        self.layer = -1
        return _pad_rows(embedded.view(self.M, -1), self.P)

    def qkv(self, attn: torch.nn.Module, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.layer += 1
        B, L, D, heads, kv_heads = self.B, self.L, self.D, self.heads, self.kv_heads
        qkv = packed_linear(h, self.packed.layers[self.layer]["qkv"])[: self.M].view(B, L, heads + 2 * kv_heads, D)
        qkv = qkv.transpose(1, 2)
        q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
        q, k = self._qk_norm(attn, q, k)
        return self._rotate_rows(q), self._rotate_rows(k), v

    def attended(self, attn: torch.nn.Module, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(_pad_rows(out.transpose(1, 2).reshape(self.M, -1), self.P),
                             self.packed.layers[self.layer]["o"], other=x, then="add")

    def mlp(self, mlp: torch.nn.Module, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        weights = self.packed.layers[self.layer]
        if self.packed.silu:
            gate = packed_linear(h, weights["gate"], then="swish")
        else:
            gate = mlp.act_fn(packed_linear(h, weights["gate"]))
        return packed_linear(packed_linear(h, weights["up"], other=gate, then="mul"), weights["down"], other=x,
                             then="add")

    def final(self, runner: Any, x: torch.Tensor, last_only: bool) -> tuple[torch.Tensor, torch.Tensor]:
        x = _rms_norm_rows(runner.norm, x)[: self.M].view(self.B, self.L, -1)
        if last_only:
            x = x[:, -1:]
        rows = x.shape[0] * x.shape[1]
        logits = packed_linear(_pad_rows(x.reshape(rows, -1), packed_rows(rows)), self.packed.head)[:rows]
        return logits.view(*x.shape[:2], -1), x


class GemmOps(_Shape):
    """Feature-major (features, B * L), zero-padded to `padded_width(B * L)` columns (a GEMM of a
    few columns is MKL's slow case; the padding columns never reach attention or the output);
    `rope` cos and signed sin (D, B, L)."""

    def __init__(self, runner: Any, B: int, L: int, rope: tuple[torch.Tensor, torch.Tensor]) -> None:
        super().__init__(runner, B, L, rope)
        self.P = padded_width(self.M)
        self._attended: torch.Tensor | None = None

    def begin(self, embedded: torch.Tensor) -> torch.Tensor:
        x = F.pad(embedded.view(self.M, -1).t(), (0, self.P - self.M))  # (H, P)
        self._attended = x.new_zeros(self.heads * self.D, self.P)  # its columns past M stay 0
        return x

    def norm(self, norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm(norm, x, 0)

    def qkv(self, attn: torch.nn.Module, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, L, D, M = self.B, self.L, self.D, self.M
        q = _project(attn.q_proj, h)[:, :M].view(-1, D, B, L)  # (heads, D, B, L)
        k = _project(attn.k_proj, h)[:, :M].view(-1, D, B, L)
        v = _project(attn.v_proj, h)[:, :M].view(-1, D, B, L)
        if self.qk_norm:  # Qwen3: RMSNorm per head before the rotation
            q, k = _rms_norm(attn.q_norm, q, 1), _rms_norm(attn.k_norm, k, 1)
        q = _rotate(q, self.cos, self.sin).permute(2, 0, 3, 1).contiguous()  # (B, heads, L, D)
        k = _rotate(k, self.cos, self.sin).permute(2, 0, 3, 1)
        return q, k, v.permute(2, 0, 3, 1)

    def attended(self, attn: torch.nn.Module, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        self._attended[:, : self.M].view(self.heads, self.D, self.B, self.L).copy_(out.permute(1, 3, 0, 2))
        return _project(attn.o_proj, self._attended, residual=x)

    def mlp(self, mlp: torch.nn.Module, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return _project(mlp.down_proj, mlp.act_fn(_project(mlp.gate_proj, h)) * _project(mlp.up_proj, h), residual=x)

    def final(self, runner: Any, x: torch.Tensor, last_only: bool) -> tuple[torch.Tensor, torch.Tensor]:
        B, L, M = self.B, self.L, self.M
        x = _rms_norm(runner.norm, x, 0)
        if last_only:
            x = x[:, :M].view(-1, B, L)[:, :, -1]  # (H, B)
            M, L = B, 1
            x = F.pad(x, (0, padded_width(M) - M))
        logits = _project(runner.lm_head, x)[:, :M]  # (V, B * L')
        return logits.t().view(B, L, -1), x[:, :M].t().view(B, L, -1)


def sdpa_mask(ops: Any, allowed: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    """The mask SDPA takes in `ops`' forward: boolean for the modules (as transformers gives it),
    additive (0 / -inf, made once per forward: SDPA would convert a boolean one in every layer)
    for the CPU layouts."""
    return allowed if isinstance(ops, ModuleOps) else additive_mask(allowed, like)
