"""The one adapter between cllm and transformers' models and KV cache, and the runtime built on
it: `TransformersRuntime`, any transformers causal LM (`*ForCausalLM`) decoding through its own
forward (the reference every other runtime is tested against).

The cache API moved between transformers 4.x and 5.x (`past_key_values=` became `cache=`,
`crop` changed its argument), so every model call and every cache edit goes through the
functions here. No monkey-patching: only `DynamicCache`'s public methods and its layers'
`keys` / `values`.

Also here, for what calls transformers directly and is no runtime: training's forwards
(`forward_hidden`, `prefill_rows` / `fork_rows` / `feed_rows` for one prefix shared by several
blocks) and an EAGLE head's layer (`EmbedsCache`).
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Sequence

import torch
import transformers
from transformers import DynamicCache

from cllm.runtime.protocol import Forward, position_limit
from cllm.runtime.rows import Batch, BatchedSession

_TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])


# ---------------------------------------------------------------------------------------------
# Calls


def call(model: torch.nn.Module, cache: DynamicCache | None, input_ids: torch.Tensor, position_ids: torch.Tensor,
         attention_mask: torch.Tensor | None, *, last_only: bool = False, hidden: bool = False) -> Forward:
    """One forward of a transformers causal LM appending to `cache`, whatever its version calls
    the argument. `attention_mask`: None, a (B, S + L) key mask, or a boolean (B, 1, L, S + L)
    one (converted to the form the model's attention takes)."""
    kwargs = {_cache_kwarg(model): cache, "use_cache": True} if cache is not None else {"use_cache": False}
    if last_only and accepts_logits_to_keep(model):
        kwargs["logits_to_keep"] = 1  # a prefill needs the last position's logits only
    if hidden:
        # transformers 5.x returns the final norm's output as the last entry (checked in tests)
        kwargs["output_hidden_states"] = True
    if attention_mask is not None and attention_mask.dim() == 4:
        attention_mask = custom_mask(model, attention_mask)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
    logits = out.logits[:, -1:] if last_only else out.logits
    states = out.hidden_states[-1] if hidden else None
    return Forward(logits=logits, hidden=states[:, -1:] if hidden and last_only else states)


def forward_hidden(model: torch.nn.Module, input_ids: torch.Tensor,
                   attention_mask: torch.Tensor | None = None) -> Forward:
    """One forward without a cache over (B, T) (left padding allowed): logits and last hidden
    state at every position. For training on the frozen model's own states."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    position_ids = (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)  # (B, T)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                use_cache=False, output_hidden_states=True)
    return Forward(logits=out.logits, hidden=out.hidden_states[-1])


def custom_mask(model: torch.nn.Module, allowed: torch.Tensor) -> torch.Tensor:
    """A custom 4D attention mask (B, 1, Q, K), True where a query may attend to a key, in the
    form the model's attention takes as-is: boolean for sdpa / flex, additive (0 or the dtype's
    minimum) for eager attention."""
    if getattr(getattr(model, "config", None), "_attn_implementation", "sdpa") != "eager":
        return allowed
    dtype = next(model.parameters()).dtype
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


@functools.lru_cache(maxsize=64)
def _signature_parameters(forward_fn) -> frozenset[str]:
    return frozenset(inspect.signature(forward_fn).parameters)


def _forward_parameters(model: torch.nn.Module) -> frozenset[str]:
    forward = model.forward
    return _signature_parameters(getattr(forward, "__func__", forward))


def _cache_kwarg(model: torch.nn.Module) -> str:
    """Name of the forward argument that takes the cache: `cache` (5.x) or `past_key_values` (4.x).
    Wrappers that only take **kwargs (e.g. peft) get the name of the installed version."""
    params = _forward_parameters(model)
    if "cache" in params:
        return "cache"
    if "past_key_values" in params:
        return "past_key_values"
    return "cache" if _TRANSFORMERS_MAJOR >= 5 else "past_key_values"


def accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    """Whether the model's forward takes `logits_to_keep` (transformers >= 4.45 causal LMs)."""
    return "logits_to_keep" in _forward_parameters(model)


# ---------------------------------------------------------------------------------------------
# The cache as a batched runtime's storage


class CacheStorage:
    """A `DynamicCache` as `rows.Storage`: the edits a `rows.Batch` makes, on its layers' keys and
    values (B, heads, S, D)."""

    def __init__(self, cache: DynamicCache | None = None) -> None:
        self.cache = cache if cache is not None else DynamicCache()

    def _layers(self) -> list:
        # a layer that holds nothing (e.g. one that shares another's KV) is left alone
        return [layer for layer in self.cache.layers if getattr(layer, "keys", None) is not None
                and layer.keys.numel() > 0]

    def slots(self) -> int:
        return self.cache.get_seq_length()

    def crop(self, slots: int) -> None:
        drop = self.slots() - slots
        if drop > 0:
            self.cache.crop(-drop)  # negative = remove that many, in transformers 4.56+ and 5.x

    def gather(self, index: torch.Tensor) -> None:
        for layer in self._layers():
            layer.keys, layer.values = _gather_time(layer.keys, index), _gather_time(layer.values, index)

    def move(self, base: int, kept: Sequence[int]) -> None:
        for layer in self._layers():
            index = torch.tensor(list(kept), device=layer.keys.device) + base
            for x in (layer.keys, layer.values):  # index_select copies before the write
                x[:, :, base : base + len(kept)] = x.index_select(2, index)

    def select(self, rows: Sequence[int]) -> None:
        if self._layers():
            self.cache.batch_select_indices(torch.tensor(list(rows), device=self._layers()[0].keys.device))

    def join(self, other: CacheStorage) -> None:
        end = max(self.slots(), other.slots())
        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            if getattr(mine, "keys", None) is None or mine.keys.numel() == 0:
                continue
            mine.keys = torch.cat([_pad_time(mine.keys, end, after=True), _pad_time(theirs.keys, end, after=False)])
            mine.values = torch.cat([_pad_time(mine.values, end, after=True),
                                     _pad_time(theirs.values, end, after=False)])

    def fork(self, index: torch.Tensor, *, detach: bool = False) -> CacheStorage:
        """A new cache whose row i is a copy of row ``index[i]`` (rows may repeat); differentiable
        unless `detach`."""
        forked = DynamicCache()
        for i, layer in enumerate(self.cache.layers):
            keys, values = layer.keys.index_select(0, index), layer.values.index_select(0, index)
            forked.update(keys.detach() if detach else keys, values.detach() if detach else values, i)
        return CacheStorage(forked)


def _pad_time(x: torch.Tensor, length: int, *, after: bool) -> torch.Tensor:
    """x (B, H, S, D) -> (B, H, length, D), zeros after the entries or before them."""
    B, H, S, D = x.shape
    if S == length:
        return x
    pad = x.new_zeros(B, H, length - S, D)
    return torch.cat([x, pad] if after else [pad, x], dim=2)


def _gather_time(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x (B, H, S, D), index (B, S_new) -> (B, H, S_new, D)."""
    B, H, _, D = x.shape
    idx = index.to(x.device)[:, None, :, None].expand(B, H, index.shape[1], D)
    return x.gather(2, idx)


# ---------------------------------------------------------------------------------------------
# Training's shared prefixes (a cache under gradients, not a runtime)


def prefill_rows(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
                 ) -> tuple[Batch, torch.Tensor]:
    """One forward over left-padded prompts (B, T): their cache as a `Batch`, and the last
    logits (B, V)."""
    valid = attention_mask.bool()
    dense = bool(valid.all())
    position_ids = (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)  # (B, T)
    storage = CacheStorage()
    out = call(model, storage.cache, input_ids, position_ids, None if dense else valid, last_only=True)
    return Batch(storage, list(range(len(valid))), valid.sum(dim=1).tolist(), None if dense else valid), \
        out.logits[:, -1]


def fork_rows(batch: Batch, index: torch.Tensor, *, detach: bool = False) -> Batch:
    """A new batch whose row i is a copy of `batch`'s row ``index[i]``; `batch` is left as it was.
    Differentiable unless `detach`: training runs one forward over shared prefixes and several
    blocks per prefix on their forks."""
    rows = index.tolist()
    return Batch(batch.storage.fork(index, detach=detach), list(range(len(rows))), [batch.lengths[r] for r in rows],
                 None if batch.valid is None else batch.valid.index_select(0, index.to(batch.valid.device)))


def feed_rows(model: torch.nn.Module, batch: Batch, input_ids: torch.Tensor, fed: Sequence[int]) -> torch.Tensor:
    """One forward over `input_ids` (B, L), row r's first `fed[r]` tokens real, continuing each
    row's sequence (every entry appended); logits (B, L, V)."""
    positions, mask = batch.chain(list(fed), input_ids.shape[1], input_ids.device)
    return call(model, batch.storage.cache, input_ids, positions, mask).logits


# ---------------------------------------------------------------------------------------------
# An EAGLE head's layer: a transformers base model fed embeddings


class EmbedsCache:
    """One row's cache of a transformers base model (e.g. `LlamaModel`, no LM head) fed input
    embeddings: an EAGLE head's layer. `length` entries, every one valid."""

    def __init__(self) -> None:
        self.cache, self.length = DynamicCache(), 0

    def feed(self, body: torch.nn.Module, embeds: torch.Tensor, position_ids: torch.Tensor,
             allowed: torch.Tensor | None = None) -> torch.Tensor:
        """One forward over embeddings (1, L, H) at `position_ids` (1, L), appended; `allowed`
        (1, L, S + L), True where a fed query may attend to a key (the S cached entries, then
        the fed ones), lays them out as a tree (None: causal). Returns the last hidden states."""
        mask = None if allowed is None else custom_mask(body, allowed.to(embeds.device).bool()[:, None])
        out = body(inputs_embeds=embeds, position_ids=position_ids, attention_mask=mask,
                   **{_cache_kwarg(body): self.cache, "use_cache": True})
        self.length += embeds.shape[1]
        return out.last_hidden_state

    def rewind(self, length: int) -> None:
        """Forget every entry past the first `length`."""
        if self.length > length:
            self.cache.crop(-(self.length - length))
            self.length = length


def feed_embeds_uncached(body: torch.nn.Module, embeds: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """The same without a cache (training): causal, and right padding is harmless."""
    return body(inputs_embeds=embeds, position_ids=position_ids, use_cache=False).last_hidden_state


# ---------------------------------------------------------------------------------------------
# The runtime


class TransformersRuntime:
    """Any transformers causal LM through its own forward (`Runtime`): the reference runtime,
    exact by construction; each session's rows share one `DynamicCache`."""

    name = "transformers"
    offers_hidden = True
    step_costs: tuple[float, ...] | None = None  # measured by `cllm.runtime.stepcost`, when asked
    batch_invariant = True  # float32: a wide forward differs in the last bits at most (near-ties aside)

    def __init__(self, model: torch.nn.Module, *, why: str = "asked for", weak: bool = False) -> None:
        # `weak`: the model's own "auto" runtime (`as_runtime`), which must not keep it alive
        self._model = weakref.ref(model) if weak else (lambda: model)
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        self.vocab_size = int(head.weight.shape[0]) if getattr(head, "weight", None) is not None \
            else int(model.config.vocab_size)
        self.position_limit = position_limit(model)
        self.device = next(model.parameters()).device
        self.forwards = 0
        self.why = why

    @property
    def model(self) -> torch.nn.Module:
        model = self._model()
        if model is None:
            raise RuntimeError("the model of this runtime was freed")
        return model

    def session(self) -> TransformersSession:
        return TransformersSession(self)

    def prepare(self) -> None:
        """Nothing to ready: transformers' forward is what it is."""

    def compile(self, *, batches: bool = True) -> str | None:
        return f"the compiled forward is the lean runtime's; this model decodes on transformers' ({self.why})"

    def describe(self) -> str:
        return f"transformers' forward ({self.why})"


class TransformersSession(BatchedSession):
    """Rows decoding together on a `TransformersRuntime`."""

    def __init__(self, runtime: TransformersRuntime) -> None:
        super().__init__(runtime)
        self.model = runtime.model

    def _prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, hidden: bool,
                 every: bool) -> tuple[CacheStorage, Forward]:
        valid = attention_mask.bool()
        position_ids = (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)  # (B, T)
        storage = CacheStorage()
        out = call(self.model, storage.cache, input_ids, position_ids, None if bool(valid.all()) else valid,
                   last_only=not every, hidden=hidden)
        return storage, out

    def _forward(self, storage: CacheStorage, input_ids: torch.Tensor, position_ids: torch.Tensor,
                 mask: torch.Tensor | None, *, hidden: bool) -> Forward:
        return call(self.model, storage.cache, input_ids, position_ids, mask, hidden=hidden)

