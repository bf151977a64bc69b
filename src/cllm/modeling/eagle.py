"""An EAGLE draft head (Li et al. 2024, EAGLE-1 arXiv 2401.15077, EAGLE-2 arXiv 2406.16858) for
any causal LM: the module, and the names of the files it is saved in beside a checkpoint.

EAGLE drafts at the *feature* level: from the target's feature f_t at position t (its last
hidden state, the final norm's output, what the LM head reads) and the embedding of the token
after it, e(x_{t+1}), one decoder layer predicts the next feature:

    f^_{t+1} = Layer(fc([e(x_{t+1}); f_t]))          fc: 2H -> H, no bias
    logits of x_{t+2} = lm_head(f^_{t+1})            the target's own LM head, frozen

The layer is a transformers `LlamaModel` with one layer (EAGLE uses a Llama layer whatever the
target), built from the target's sizes, with EAGLE-1's two omissions: no input norm before the
layer (the fused input is not normalised) and no final norm (the layer's output is the
feature, read by the LM head as is). Embeddings and LM head are the target's, shared, never
trained or saved here. Every call of the layer goes through `cllm.runtime.hf` (`EmbedsCache`).
`cllm.decoding.rivals.eagle` decodes with a head (exactly greedy); `cllm.training.eagle`
trains and saves it (`cllm eagle`); `cllm.models.load_eagle` loads it.

The file format: a folder (default ``<checkpoint>/eagle/``) holding ``eagle_config.json``
(sizes, the base model's fingerprint, the default draft tree, what trained it) and
``eagle_head.safetensors`` with EAGLE-1's tensor names (``fc.weight``, ``layers.0.*``), plus a
``config.json`` describing the layer as a one-layer Llama, the layout of EAGLE-1 checkpoints
that vLLM's ``eagle`` speculative method reads.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import LlamaConfig, LlamaModel

from cllm.core.errors import UserError
from cllm.modeling.names import (
    EAGLE_CONFIG_FILE,
    EAGLE_DIR,  # noqa: F401 (re-exported: `cllm.models.loading` reads it here)
    EAGLE_DRAFT_CONFIG_FILE,
    EAGLE_WEIGHTS_FILE,
)
from cllm.runtime.hf import EmbedsCache, feed_embeds_uncached

CONFIG_FILE = EAGLE_CONFIG_FILE
WEIGHTS_FILE = EAGLE_WEIGHTS_FILE
DRAFT_CONFIG_FILE = EAGLE_DRAFT_CONFIG_FILE  # the layer as a one-layer Llama (EAGLE-1 / vLLM layout)
FORMAT_VERSION = 1
SIZE_KEYS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
             "vocab_size", "max_position_embeddings", "rms_norm_eps", "rope_theta")


def draft_sizes(config: Any) -> dict:
    """The one-layer Llama's sizes for a target of config `config` (any architecture): its
    hidden size and head count, its MLP width where it has one (else 4 H)."""
    hidden = int(config.hidden_size)
    heads = int(config.num_attention_heads)
    intermediate = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden
    return {"hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": heads,
            "head_dim": hidden // heads, "intermediate_size": int(intermediate),
            "vocab_size": int(config.vocab_size),
            "max_position_embeddings": int(getattr(config, "max_position_embeddings", None) or 4096),
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0}


def llama_config(sizes: dict, *, vocab_size: int | None = None) -> LlamaConfig:
    """The layer's `LlamaConfig` (one hidden layer, no biases, SiLU MLP)."""
    return LlamaConfig(num_hidden_layers=1, hidden_act="silu", attention_bias=False, mlp_bias=False,
                       tie_word_embeddings=False, pad_token_id=None, bos_token_id=None, eos_token_id=None,
                       rope_parameters={"rope_type": "default", "rope_theta": sizes["rope_theta"]},
                       **{k: sizes[k] for k in SIZE_KEYS if k not in ("vocab_size", "rope_theta")},
                       vocab_size=sizes["vocab_size"] if vocab_size is None else vocab_size)


class EagleHead(nn.Module):
    """``head(features (B, T, H), next_tokens (B, T)) -> predicted next features (B, T, H)``.

    Build with `EagleHead.for_model(model)`. `tree`, when set, holds the default draft tree of
    `eagle_decode` (``{"nodes", "depth", "top_k"}``); `meta` is what else `save_eagle` writes.
    """

    def __init__(self, embed: nn.Module, lm_head: nn.Module, sizes: dict) -> None:
        super().__init__()
        self.sizes = dict(sizes)
        H = self.hidden_size = sizes["hidden_size"]
        self.vocab_size = sizes["vocab_size"]
        self.fc = nn.Linear(2 * H, H, bias=False)
        # vocab_size=1: the body's own embedding table is never used (inputs_embeds are given)
        self.body = LlamaModel(llama_config(sizes, vocab_size=1))
        self.body.embed_tokens.requires_grad_(False)
        nn.init.zeros_(self.body.embed_tokens.weight)  # never read; zero so every copy is the same
        self.body.layers[0].input_layernorm = nn.Identity()  # EAGLE-1: no norm on the fused input
        self.body.norm = nn.Identity()  # ... and none after the layer: its output is the feature
        # the target's embeddings and LM head: a tuple keeps them out of parameters and state dict
        self._shared = (embed, lm_head)
        self.tree: dict | None = None
        self.meta: dict[str, Any] = {}
        weight = lm_head.weight
        self.to(device=weight.device, dtype=weight.dtype)

    @classmethod
    def for_model(cls, model: nn.Module) -> EagleHead:
        embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
        if lm_head is None or getattr(lm_head, "weight", None) is None or embed is None:
            raise UserError(f"{type(model).__name__} has no input or output embedding for an EAGLE head to share")
        return cls(embed, lm_head, draft_sizes(model.config))

    @property
    def lm_head(self) -> nn.Module:
        return self._shared[1]

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The target's input embeddings of `tokens` (B, L) -> (B, L, H)."""
        return self._shared[0](tokens)

    def fuse(self, features: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """The layer's input: fc([e(x_{t+1}); f_t]) (B, L, H), embeddings first as in EAGLE-1."""
        return self.fc(torch.cat([self.embed(next_tokens), features.to(self.fc.weight.dtype)], dim=-1))

    def forward(self, features: torch.Tensor, next_tokens: torch.Tensor,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Teacher-forced, no cache (training): f^_{t+1} for every t (B, T, H), causal."""
        if position_ids is None:
            position_ids = torch.arange(features.shape[1], device=features.device)[None].expand(features.shape[0], -1)
        return feed_embeds_uncached(self.body, self.fuse(features, next_tokens), position_ids)

    def new_cache(self) -> EmbedsCache:
        """An empty cache of the layer's, for one row being decoded."""
        return EmbedsCache()

    def step(self, cache: EmbedsCache, features: torch.Tensor, next_tokens: torch.Tensor, position_ids: torch.Tensor,
             allowed: torch.Tensor | None = None) -> torch.Tensor:
        """Decoding: the same over new positions appended to `cache` (1, L, H); `allowed`
        (1, L, S + L) lays them out as a tree (None: causal)."""
        return cache.feed(self.body, self.fuse(features, next_tokens), position_ids, allowed)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        return self.lm_head(features)

    def parameters_added(self) -> int:
        """The head's own parameters (shared embeddings and LM head are the model's)."""
        return sum(p.numel() for name, p in self.named_parameters() if not name.startswith("body.embed_tokens"))

    def saved_state(self) -> dict[str, torch.Tensor]:
        """The weights under EAGLE-1's names: ``fc.weight``, ``layers.0.*`` (no embeddings)."""
        state = {}
        for name, tensor in self.state_dict().items():
            if name.startswith("body.embed_tokens"):
                continue
            state[name.removeprefix("body.")] = tensor.detach().to("cpu").contiguous()
        return state

    def load_saved_state(self, state: dict[str, torch.Tensor]) -> None:
        own = {("" if k.startswith("fc.") else "body.") + k: v for k, v in state.items()}
        own["body.embed_tokens.weight"] = self.body.embed_tokens.weight.detach().clone()
        self.load_state_dict(own)

    def draft_config(self) -> dict:
        """`config.json` of the layer as a one-layer Llama draft model (EAGLE-1 / vLLM layout)."""
        record = llama_config(self.sizes).to_diff_dict()
        dtype = str(self.fc.weight.dtype).removeprefix("torch.")
        # the rope base under its 4.x name too, and the dtype under both names, for older readers
        return {"architectures": ["LlamaForCausalLM"], **record, "rope_theta": self.sizes["rope_theta"],
                "dtype": dtype, "torch_dtype": dtype}
