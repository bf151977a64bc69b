"""The small tensor routines of the lean runner's forwards (`cllm.runtime.lean.ops`): projections
in the feature-major and token-major layouts, the Llama-family RMSNorm, masks, rotary helpers,
and the widths packed and padded forwards run on."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _project(linear: torch.nn.Linear, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """linear(x) (+ residual) for feature-major x (in, M): W @ x (+ b), (out, M), the residual
    added by the GEMM itself. The weight is the tall operand: on a CPU, MKL runs this faster
    than x @ W^T when M (the fed tokens) is small, and it needs no copy of the weight."""
    if residual is None:
        y = torch.mm(linear.weight, x)
    else:
        y = torch.addmm(residual, linear.weight, x)
    return y if linear.bias is None else y.add_(linear.bias[:, None])


def _linear_added(linear: torch.nn.Linear, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + linear(x) for token-major x (M, in), the residual added by the GEMM itself."""
    y = torch.addmm(residual, x, linear.weight.t())
    return y if linear.bias is None else y.add_(linear.bias)


def _rms_norm(norm: torch.nn.Module, x: torch.Tensor, dim: int) -> torch.Tensor:
    """The Llama-family RMSNorm of x over `dim` (transformers' arithmetic: float32 statistics,
    the weight applied in the input's dtype)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(dim, keepdim=True) + norm.variance_epsilon)
    shape = [1] * x.dim()
    shape[dim] = -1
    return norm.weight.view(shape) * h.to(x.dtype)


def _rms_norm_rows(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`_rms_norm` of float32 x over its last dimension, through `F.rms_norm` where torch has it
    (>= 2.4): transformers' arithmetic in one call from Python."""
    if _FUSED_RMS_NORM:
        return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)
    return _rms_norm(norm, x, -1)


_FUSED_RMS_NORM = hasattr(F, "rms_norm")


def additive_mask(allowed: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    """A boolean mask as an additive one (0 / -inf) in `like`'s dtype, made once per forward:
    SDPA would convert a boolean mask in every layer."""
    return None if allowed is None else like.new_zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' rotate_half: (-x2, x1) of the halves of the last dimension."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of feature-major heads x (heads, D, B, L): x cos + rotate_half(x) sin,
    with rotate_half's sign folded into `signed_sin` (D, B, L); cos (D, B, L)."""
    half = x.shape[1] // 2
    return torch.addcmul(x * cos, torch.cat((x[:, half:], x[:, :half]), dim=1), signed_sin)

GEMM_WIDTH = 16  # the fewest columns a feature-major GEMM runs on (more than one token fed)


def padded_width(tokens: int) -> int:
    """Columns the feature-major GEMMs run on for `tokens` fed tokens: at 2-15 columns MKL's GEMM
    is slower than at 16 (up to 2-3x on the CPUs measured), so those run zero-padded to 16."""
    return tokens if tokens == 1 else max(tokens, GEMM_WIDTH)


PACKED_EXACT_ROWS = 32  # up to this many fed tokens, a packed forward runs on exactly that many rows


def packed_rows(tokens: int) -> int:
    """Rows a packed forward of `tokens` fed tokens runs on. oneDNN builds its kernels for each
    width it meets (a cost paid the first time) and keeps a bounded number, so
    wider forwards (prefills, batches) run zero-padded to one of a few widths: a multiple of 16
    up to 256 tokens, of 64 up to 1,024, of 256 beyond."""
    if tokens <= PACKED_EXACT_ROWS:
        return tokens
    step = 16 if tokens <= 256 else 64 if tokens <= 1024 else 256
    return -(-tokens // step) * step


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x (M, features) with zero rows appended up to `rows`."""
    return x if x.shape[0] == rows else F.pad(x, (0, 0, 0, rows - x.shape[0]))
