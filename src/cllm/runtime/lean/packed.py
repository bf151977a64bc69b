"""oneDNN-packed weights for the lean runner's float32 CPU forward (`cllm.runtime.lean.runner`):
`PackedWeights` holds the copies, `packed_linear` computes a projection from one (its bias and a
residual, SiLU or product in the same call). The kernels are torch's own oneDNN inner products
(the ones Inductor uses for frozen linears); `packing_available` checks once that this torch has
them and that they compute what `F.linear` does, else the runner computes on the plain weights.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache

import torch
import torch.nn.functional as F


class PackedWeights:
    """oneDNN's blocked copies of one model's projection and LM-head weights (float32 on a CPU):
    its inner-product kernels read that layout faster than MKL's GEMM reads the plain one, at
    every width a decoding step feeds (1 to 320 tokens measured), and they add the bias, the
    residual, SiLU and the MLP's product in the same pass. q, k and v are packed as one
    projection. A copy: the model's own weights stay as they are for training and transformers'
    forward, so it costs their size again (`MAX_BYTES` at most). Stale once a weight is replaced
    or changed in place (`current`): the runner packs again."""

    WIDTH = 16  # oneDNN's batch-size hint for the packed layout (any width computes on it)
    MAX_BYTES = 2 * 2**30  # larger models compute on their own weights

    def __init__(self, model: torch.nn.Module) -> None:
        pack = torch.ops.mkldnn._reorder_linear_weight
        self.layers = []
        self._linears: list[torch.nn.Module] = []  # where the packed weights come from
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
            biases = [p.bias if p.bias is not None else p.weight.new_zeros(p.out_features) for p in qkv]
            self.layers.append({
                "qkv": (pack(torch.cat([p.weight for p in qkv]), self.WIDTH),
                        None if all(p.bias is None for p in qkv) else torch.cat(biases)),
                **{name: (pack(linear.weight, self.WIDTH), linear.bias) for name, linear in (
                    ("o", attn.o_proj), ("gate", mlp.gate_proj), ("up", mlp.up_proj), ("down", mlp.down_proj))}})
            self._linears += [*qkv, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        head = model.lm_head
        self.head = (pack(head.weight, self.WIDTH), head.bias)
        self.silu = getattr(model.config, "hidden_act", None) in ("silu", "swish")  # transformers' SiLU
        self._linears.append(head)
        self._stamp = self._weights()
        first = model.model.layers[0]
        self._features = (head.in_features, first.self_attn.o_proj.in_features, first.mlp.gate_proj.out_features)

    def warm(self, widths: Iterable[int]) -> None:
        """Build oneDNN's kernels for forwards of each of `widths` rows now, not in the first
        request: every call a forward makes, once, on
        the first layer and the LM head (layers of the same shapes share the kernels)."""
        hidden, attended, inner = self._features
        weights = self.layers[0]
        for rows in widths:
            x, a, u = (torch.zeros(rows, n, dtype=torch.float32) for n in (hidden, attended, inner))
            packed_linear(x, weights["qkv"])
            packed_linear(a, weights["o"], other=x, then="add")
            gate = packed_linear(x, weights["gate"], then="swish" if self.silu else "none")
            packed_linear(x, weights["up"], other=gate, then="mul")
            packed_linear(u, weights["down"], other=x, then="add")
            packed_linear(x, self.head)

    def _weights(self) -> tuple[tuple[int, int], ...]:
        """Where each weight and bias packed is now and how often it was changed in place (a
        weight replaced, or changed by an optimizer step, changes this)."""
        return tuple((t.data_ptr(), t._version) for m in self._linears for t in (m.weight, m.bias) if t is not None)

    def current(self) -> bool:
        """Whether the model's weights are still the ones packed."""
        return self._weights() == self._stamp

    def head_current(self) -> bool:
        """Whether the LM head's weights are still the ones packed: `current` for the head alone,
        for a forward that computes only its logits on the packed copy."""
        stamp = self._head_stamp()
        return self._stamp[-len(stamp):] == stamp

    def _head_stamp(self) -> tuple[tuple[int, int], ...]:
        head = self._linears[-1]
        return tuple((t.data_ptr(), t._version) for t in (head.weight, head.bias) if t is not None)

    @staticmethod
    def size(model: torch.nn.Module) -> int:
        """Bytes of the packed copy: the projections' and the LM head's weights."""
        return sum(m.weight.numel() * m.weight.element_size() for m in model.modules()
                   if isinstance(m, torch.nn.Linear))

    @staticmethod
    def why_not(model: torch.nn.Module) -> str | None:
        """Why a float32 CPU forward of `model` cannot compute on packed weights (None: it can)."""
        if not packing_available():
            return "this torch has no oneDNN linear kernels"
        size = PackedWeights.size(model)
        if size > PackedWeights.MAX_BYTES:
            return (f"a packed copy would take {size / 2**30:.1f} GiB more "
                    f"(at most {PackedWeights.MAX_BYTES / 2**30:.0f} GiB)")
        return None


@cache
def packing_available() -> bool:
    """Whether this torch has the oneDNN linear kernels `PackedWeights` computes with, and they
    give F.linear's result on a small case (an op whose meaning changed is not used)."""
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        g = torch.Generator().manual_seed(0)
        x, w, b, other = (torch.randn(*shape, generator=g) for shape in ((3, 8), (5, 8), (5,), (3, 5)))
        packed = torch.ops.mkldnn._reorder_linear_weight(w, PackedWeights.WIDTH)
        want = F.linear(x, w, b)
        got = (torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], ""),
               torch.ops.mkldnn._linear_pointwise(x, packed, b, "swish", [], ""),
               torch.ops.mkldnn._linear_pointwise.binary(x, other, packed, b, "add"),
               torch.ops.mkldnn._linear_pointwise.binary(x, other, packed, b, "mul"))
        return all(torch.allclose(a, e, rtol=1e-4, atol=1e-5) for a, e in zip(
            got, (want, F.silu(want), want + other, want * other), strict=True))
    except (AttributeError, RuntimeError, TypeError):
        return False


def packed_linear(x: torch.Tensor, weight: tuple[torch.Tensor, torch.Tensor | None], *,
                  other: torch.Tensor | None = None, then: str = "none") -> torch.Tensor:
    """x (M, in) through a packed projection (weight, bias): (M, out); then "swish" applies
    SiLU, "add" adds `other` (a residual), "mul" multiplies by it, in the same pass."""
    packed, bias = weight
    if other is None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, then, [], "")
    return torch.ops.mkldnn._linear_pointwise.binary(x, other, packed, bias, then)
