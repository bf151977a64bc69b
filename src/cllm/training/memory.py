"""How much GPU memory `cllm train` needs per process, by model size: a plan on paper, not a
measurement. `python -m cllm.training.memory` prints the tables of docs/scale.md.

Model states, in bytes per parameter, as `cllm train` holds them:

- DDP (and one process): the model is loaded in float32 and stays float32 (`--dtype bfloat16`
  only autocasts the forwards), so weights 4, gradients 4, AdamW's two moments 8; with bf16,
  autocast's bf16 copies of the weights, kept for backward, add 2.
- FSDP FULL_SHARD with bf16 mixed precision: the float32 weights, gradients and moments are
  split over the N processes (16 / N); a layer's bf16 weights are gathered only while it runs.
- DeepSpeed ZeRO with bf16 (Rajbhandari et al. 2020, "K = 12"): bf16 weights 2, bf16
  gradients 2, float32 master weights + moments 12. ZeRO-2 splits the gradients and the 12,
  ZeRO-3 all 16.
- LoRA (DDP): the frozen base weights 4 (+ 2 with bf16), the adapter's parameters 16 each.
- QLoRA (not supported by `cllm train`, for comparison): a 4-bit NF4 base with double
  quantisation, about 0.516 bytes per parameter, the adapter 16 per parameter.

Activations are a rough formula (Korthikanti et al. 2022, eq. 2, with flash attention so no
s^2 term): 34 h bytes per token and layer in 16 bits; with gradient checkpointing each layer
keeps only its input (2 h bytes per token) and one layer at a time is recomputed. The logits
come on top: the losses hold about four float32 copies (the model's logits, its target's, their
log-softmaxes), 16 V bytes per token. Nothing here allocates or imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from cllm.modeling.shapes import LLAMA_SHAPES

GB = 1e9
Setup = Literal["ddp", "fsdp", "zero2", "zero3", "lora", "qlora"]
SETUPS: tuple[Setup, ...] = ("ddp", "fsdp", "zero2", "zero3", "lora", "qlora")
NF4_BYTES = 0.516  # 4 bits + a float32 absmax per 64 weights, itself quantised (QLoRA's double quantisation)


@dataclass(frozen=True)
class Shape:
    """A Llama-architecture model: what the parameter count and activations depend on."""

    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool

    @property
    def kv_dim(self) -> int:
        return self.hidden // self.heads * self.kv_heads

    def params(self) -> int:
        """Embeddings (and an untied head), per layer q/k/v/o, gate/up/down and two RMSNorms, a final norm."""
        h, i = self.hidden, self.intermediate
        attention = 2 * h * h + 2 * h * self.kv_dim
        per_layer = attention + 3 * h * i + 2 * h
        return self.vocab * h * (1 if self.tied else 2) + self.layers * per_layer + h

    def lora_params(self, r: int) -> int:
        """LoRA on every linear layer but the head (peft's all-linear): r (d_in + d_out) each."""
        h, i, kv = self.hidden, self.intermediate, self.kv_dim
        per_layer = 2 * (h + h) + 2 * (h + kv) + 3 * (h + i)  # q, o; k, v; gate, up, down
        return self.layers * r * per_layer


# The sizes of docs/scale.md: Llama-3.2-1B / 3B (grouped-query attention, 128k vocabulary, tied
# embeddings), Llama-2-7B / 13B.
SHAPES = {name.upper(): Shape(name.upper(), layers=c["num_hidden_layers"], hidden=c["hidden_size"],
                              intermediate=c["intermediate_size"], heads=c["num_attention_heads"],
                              kv_heads=c["num_key_value_heads"], vocab=c["vocab_size"], tied=c["tie_word_embeddings"])
          for name, c in LLAMA_SHAPES.items() if name != "small"}


@dataclass(frozen=True)
class StateMemory:
    """Bytes per process of the model states (no activations)."""

    weights: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer


def training_memory(params: int, setup: Setup = "ddp", *, processes: int = 1, bf16: bool = True,
                    trainable: int | None = None) -> StateMemory:
    """Bytes per process of weights, gradients and optimizer states (see the module docstring).

    Args:
        params: parameters of the model.
        setup: ddp (also one process), fsdp (FULL_SHARD), zero2, zero3, lora (on DDP), qlora.
        processes: N, the processes the sharded setups split over.
        bf16: `--dtype bfloat16` (the sharded setups are counted with bf16 mixed precision only).
        trainable: the adapter's parameters (lora, qlora).
    """
    n = processes
    if setup in ("lora", "qlora") and trainable is None:
        raise ValueError(f"{setup} needs the adapter's parameter count (trainable)")
    if setup == "ddp":
        return StateMemory(weights=params * (6 if bf16 else 4), grads=params * 4, optimizer=params * 8)
    if setup == "fsdp":
        return StateMemory(weights=params * 4 / n, grads=params * 4 / n, optimizer=params * 8 / n)
    if setup == "zero2":
        return StateMemory(weights=params * 2, grads=params * 2 / n, optimizer=params * 12 / n)
    if setup == "zero3":
        return StateMemory(weights=params * 2 / n, grads=params * 2 / n, optimizer=params * 12 / n)
    if setup == "lora":
        return StateMemory(weights=params * (6 if bf16 else 4) + trainable * 4, grads=trainable * 4,
                           optimizer=trainable * 8)
    if setup == "qlora":
        return StateMemory(weights=params * NF4_BYTES + trainable * 4, grads=trainable * 4, optimizer=trainable * 8)
    raise ValueError(f"unknown setup {setup!r}: one of {', '.join(SETUPS)}")


def activation_bytes(shape: Shape, tokens: int, *, checkpointing: bool) -> float:
    """Activations kept for backward over `tokens` tokens (a micro-batch's rows together), 16-bit:
    34 h bytes per token and layer; with checkpointing 2 h per token and layer plus one layer's 34 h."""
    one_layer = 34 * shape.hidden * tokens
    if checkpointing:
        return shape.layers * 2 * shape.hidden * tokens + one_layer
    return shape.layers * one_layer


def logit_bytes(shape: Shape, tokens: int) -> float:
    """The losses' float32 logits: the model's and its target's, with their log-softmaxes."""
    return 16 * shape.vocab * tokens


def tables(*, processes: int = 8, lora_r: int = 16, tokens: int = 1024) -> str:
    """The two Markdown tables of docs/scale.md."""
    cols = ["DDP", f"FSDP x{processes}", f"ZeRO-2 x{processes}", f"ZeRO-3 x{processes}",
            f"LoRA r={lora_r}", f"QLoRA r={lora_r} (not in train)"]
    lines = ["| model | params | DDP: weights (+ bf16 copies) / grads / AdamW | " + " | ".join(cols) + " |",
             "|---|---|---|" + "---|" * len(cols)]
    for shape in SHAPES.values():
        p, lora = shape.params(), shape.lora_params(lora_r)
        ddp = training_memory(p, "ddp")
        cells = [training_memory(p, s, processes=processes, trainable=lora).total / GB for s in SETUPS]
        lines.append(f"| {shape.name} | {p / 1e9:.2f} B | {ddp.weights / GB:.1f} / {ddp.grads / GB:.1f} / "
                     f"{ddp.optimizer / GB:.1f} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    lines += ["", f"| model | activations per {tokens} tokens | with gradient checkpointing | "
              f"logits per {tokens} tokens |", "|---|---|---|---|"]
    for shape in SHAPES.values():
        lines.append(f"| {shape.name} | {activation_bytes(shape, tokens, checkpointing=False) / GB:.2f} | "
                     f"{activation_bytes(shape, tokens, checkpointing=True) / GB:.2f} | "
                     f"{logit_bytes(shape, tokens) / GB:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(f"GB (1e9 bytes) per process; bf16 autocast / mixed precision; AdamW.\n\n{tables()}")
