"""The lean runner's compiled segments: what lies between two attentions (a layer's output
projection, residual and MLP, then the next layer's norm, q/k/v and rotation), and the final
norm with the LM head, compiled by Inductor with the weights frozen in. On a CPU its GEMM kernels
stream the weights several times faster than MKL at the few tokens a decoding step feeds (all of
`stdlib-coder`'s GEMMs: 0.4-0.6 ms at 1-4 rows against 2.5-4); from about 8 rows both are bound
by arithmetic. `compile_runner(model)` compiles them once, up front (tens of seconds on a 2-core
CPU, every process: Inductor does not cache graphs with frozen weights); `LeanRunner.forward`
then runs them for forwards of up to `lean.COMPILED_MAX_TOKENS` fed tokens in inference mode,
while the weights are the ones compiled. `why_not_compiled` says where they cannot run.
"""

from __future__ import annotations

import shutil
import time
import types
from collections.abc import Callable
from typing import Any

import torch

from cllm.decoding import lean
from cllm.decoding.lean import rotate_half, runner_for, why_not

COMPILE_MIN_TORCH = (2, 6)  # Inductor's CPU GEMM template with a dynamic token count
# Inductor's settings while the segments compile: the weights frozen into the graphs (packed for
# Inductor's own GEMM kernels, which at a few rows stream them several times faster than MKL's
# GEMM here), the kernels chosen by measuring them
_INDUCTOR = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP"}


class _Segment(torch.nn.Module):
    """What runs between two attentions, token-major (M, features): layer `post`'s output
    projection, residual and MLP, then layer `pre`'s input norm, q/k/v projections (Qwen3's
    per-head norms) and rotation. The first segment has no `post`, the last no `pre`."""

    def __init__(self, runner: lean.LeanRunner, post: torch.nn.Module | None, pre: torch.nn.Module | None) -> None:
        super().__init__()
        self.post, self.pre = post, pre  # the model's own layers
        self.head_dim, self.qk_norm = runner.head_dim, runner.qk_norm

    def forward(self, x: torch.Tensor, attended: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.post is not None:
            x = x + self.post.self_attn.o_proj(attended)
            x = x + self.post.mlp(self.post.post_attention_layernorm(x))
        if self.pre is None:
            return x, None, None, None
        attn, M, D = self.pre.self_attn, x.shape[0], self.head_dim
        h = self.pre.input_layernorm(x)
        q, k = attn.q_proj(h).view(M, -1, D), attn.k_proj(h).view(M, -1, D)
        if self.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        cos, sin = cos[:, None], sin[:, None]
        return x, q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, attn.v_proj(h)


class _Head(torch.nn.Module):
    """The final norm and the LM head, token-major: (logits, normed)."""

    def __init__(self, norm: torch.nn.Module, lm_head: torch.nn.Module) -> None:
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.norm(x)
        return self.lm_head(x), x


def _own_code(module: torch.nn.Module) -> Callable[..., Any]:
    """A function calling `module` with a code object of its own: Dynamo keeps its compiled
    graphs per code object, so each segment's graph is then the only one its calls look up
    (and no guard has to tell the segments apart)."""

    def call(*args: torch.Tensor | None) -> Any:
        return module(*args)

    return types.FunctionType(call.__code__.replace(), call.__globals__, "call", None, call.__closure__)


class CompiledSegments:
    """A runner's segments (`_Segment`, `_Head`) compiled by Inductor for any count of rows from
    two, with the weights frozen in: they run while the model's weights are the ones compiled
    (`current`); once a weight changes (training, `.to()`), the runner's eager forward runs."""

    def __init__(self, runner: lean.LeanRunner, model: torch.nn.Module) -> None:
        layers = list(runner.layers)
        pairs = zip([None, *layers], [*layers, None])
        self.segments = [torch.compile(_own_code(_Segment(runner, post, pre))) for post, pre in pairs]
        self.head = torch.compile(_own_code(_Head(runner.norm, runner.lm_head)))
        self._parameters = list(model.parameters())
        self._stamp = self._weights()
        self.seconds = 0.0  # what compiling took

    def _weights(self) -> tuple[tuple[int, int], ...]:
        return tuple((p.data_ptr(), p._version) for p in self._parameters)

    def current(self) -> bool:
        """Whether the weights are still the ones compiled in."""
        return self._weights() == self._stamp

    def warm_up(self, runner: lean.LeanRunner) -> None:
        """Compile every graph now, the row count marked dynamic (one graph per segment serves
        every count from two), so that no forward compiles, and none fails half way through its
        layers."""
        weight, M = runner.embed.weight, 2
        start = time.perf_counter()
        with torch.inference_mode(), torch._inductor.config.patch(_INDUCTOR):
            x = weight.new_zeros(M, weight.shape[1])
            attended = weight.new_zeros(M, runner.heads * runner.head_dim)
            cos, sin = weight.new_ones(M, runner.head_dim), weight.new_zeros(M, runner.head_dim)
            for t in (x, attended, cos, sin):
                torch._dynamo.mark_dynamic(t, 0)
            for i, segment in enumerate(self.segments):
                segment(x, None if i == 0 else attended, cos, sin)
            self.head(x)
        self.seconds = time.perf_counter() - start


def why_not_compiled(model: torch.nn.Module) -> str | None:
    """Why the runner's segments cannot be compiled for `model` (None: they can)."""
    reason = why_not(model)
    if reason is not None:
        return reason
    weight = next(model.parameters())
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        dtype = str(weight.dtype).removeprefix("torch.")
        return (f"compiled segments run float32 on a CPU only (measured faster there), "
                f"not {dtype} on {weight.device.type}")
    release = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2] if p.isdigit())
    if release < COMPILE_MIN_TORCH:
        return f"compiled segments need torch >= {'.'.join(map(str, COMPILE_MIN_TORCH))} (this is {torch.__version__})"
    if not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        return "no C++ compiler on PATH (Inductor builds its kernels with one)"
    return None


def compile_runner(model: torch.nn.Module) -> str | None:
    """Compile the runner's segments for `model` now (15-45 s on a 2-core CPU): its forwards of up
    to `lean.COMPILED_MAX_TOKENS` fed tokens then run them. Returns None when done (or already
    done for these weights), else why not; the eager runner then stays."""
    reason = why_not_compiled(model)
    runner = runner_for(model) if reason is None else None
    if reason is None and runner is None:
        reason = "the lean runner is off (training mode, or switched off)"
    if reason is not None:
        return reason
    if runner.compiled is not None and runner.compiled.current():
        return None
    compiled = CompiledSegments(runner, model)
    try:
        compiled.warm_up(runner)
    except Exception as exc:  # Inductor's failures are many and deep: the eager runner stays
        text = str(exc).strip()
        return f"compiling failed: {text.splitlines()[0] if text else type(exc).__name__}"
    runner.compiled = compiled
    return None
