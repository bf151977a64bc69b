"""The one adapter between our decoders and the transformers KV cache.

Nothing else in the package touches the cache or how a model is handed one: the API moved
between transformers 4.x and 5.x (`past_key_values=` became `cache=`, `crop` changed its
argument), so every model call and every cache edit goes through the functions here. No
monkey-patching: only `DynamicCache`'s public methods and its layers' `keys` / `values`.

Rows of a batch commit different numbers of tokens per Jacobi iteration, but a DynamicCache is
one rectangular tensor per layer, `(B, heads, S, head_dim)`. We keep it rectangular and let the
attention mask do the bookkeeping:

- after a forward that appended `L` entries to every row, row `r` keeps only its first `keep[r]`
  of them; the entries no row keeps are cropped off the end, the others become *holes* that
  the row's key-validity mask hides from attention;
- positions are logical (the count of a row's valid entries), never physical, so a hole
  changes nothing a row computes; causality stays physical, which is right because every row's
  entries are in order;
- when the holes (plus padding) waste a sizeable part of the cache, `compact` gathers each
  row's valid entries into a fresh left-padded layout.

Batch 1 never has holes: rejected entries are simply cropped, and entries kept off the main
branch of a recycling trie are first copied up over the rejected ones (a few entries per layer).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
import transformers
from transformers import DynamicCache

from cllm.runtime.lean import runner as lean

_TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])

# Compact when the cache holds more than this many columns beyond the longest row's valid
# entries, and they are at least this fraction of the cache (amortises the copy).
COMPACT_MIN_WASTE = 32
COMPACT_WASTE_FRACTION = 0.25


@dataclass
class RowCache:
    """A DynamicCache plus which of its entries each row may attend to (state only)."""

    kv: DynamicCache
    lengths: list[int]  # per row: valid entries = the position id of the row's next token
    valid: torch.Tensor | None  # (B, S) bool key-validity mask; None while every entry is valid

    @property
    def physical_length(self) -> int:
        return self.kv.get_seq_length()


@dataclass
class Forward:
    """The logits of a forward and, when asked for, the last hidden state: the output of the
    final norm, which is what the LM head reads (``lm_head(hidden) == logits`` for the models
    the tests build; `tests/decoding/test_cache.py` checks it)."""

    logits: torch.Tensor  # (B, L, V)
    hidden: torch.Tensor | None = None  # (B, L, H)


def prefill(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> tuple[RowCache, torch.Tensor]:
    """One forward over a left-padded prompt batch (B, T): its cache and the last logits (B, V)."""
    rc, out = _prefill(model, input_ids, attention_mask, hidden=False)
    return rc, out.logits[:, -1]


def prefill_hidden(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> tuple[RowCache, Forward]:
    """`prefill` that also returns the last hidden state: logits (B, 1, V), hidden (B, 1, H) at
    every row's last prompt position (Medusa heads read it)."""
    rc, out = _prefill(model, input_ids, attention_mask, hidden=True)
    return rc, Forward(logits=out.logits[:, -1:], hidden=out.hidden[:, -1:])


def prefill_features(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> tuple[RowCache, Forward]:
    """`prefill` that returns the logits (B, T, V) and last hidden state (B, T, H) at every
    prompt position (an EAGLE head reads the features of the whole prompt)."""
    return _prefill(model, input_ids, attention_mask, hidden=True, last_only=False)


def _prefill(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, hidden: bool,
    last_only: bool = True,
) -> tuple[RowCache, Forward]:
    valid = attention_mask.bool()
    dense = bool(valid.all())
    # positions count real tokens only, so a left-padded row reads exactly like an unpadded one
    position_ids = (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)  # (B, T)
    kv = _new_cache(model, *input_ids.shape)
    out = _call(model, kv, input_ids, position_ids, None if dense else valid, last_only=last_only, hidden=hidden)
    rc = RowCache(kv=kv, lengths=valid.sum(dim=1).tolist(), valid=None if dense else valid)
    return rc, out


def feed(
    model: torch.nn.Module, rc: RowCache, input_ids: torch.Tensor, fed: list[int]
) -> torch.Tensor:
    """One forward over `input_ids` (B, L): row r's first `fed[r]` tokens are real, the rest pad.

    Every row's tokens continue its own sequence (positions from `rc.lengths`). All L entries
    are appended to the cache; call `commit` next to say which of them each row keeps.
    Returns logits (B, L, V).
    """
    B, L = input_ids.shape
    positions = [
        [n + min(i, f - 1) for i in range(L)] for n, f in zip(rc.lengths, fed, strict=True)
    ]
    position_ids = torch.tensor(positions, device=input_ids.device)  # (B, L)
    mask = attention_mask_for(rc, fed, L)
    return model_forward(model, rc.kv, input_ids, position_ids, mask)


def model_forward(
    model: torch.nn.Module,
    kv: DynamicCache,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    last_only: bool = False,
) -> torch.Tensor:
    """Call a transformers causal LM with our cache, whatever its version calls the argument."""
    return _call(model, kv, input_ids, position_ids, attention_mask, last_only=last_only, hidden=False).logits


def forward_hidden(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> Forward:
    """One forward without a cache over (B, T) (left padding allowed): logits and last hidden
    state at every position. For training on the frozen model's own states."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    position_ids = (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)  # (B, T)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                use_cache=False, output_hidden_states=True)
    return Forward(logits=out.logits, hidden=out.hidden_states[-1])


def _new_cache(model: torch.nn.Module, batch: int, length: int) -> DynamicCache | lean.LeanKV:
    """The cache of a decoding run: the lean runner's preallocated one where it can run the
    model (never with gradients), else transformers' DynamicCache."""
    runner = None if torch.is_grad_enabled() else lean.runner_for(model)
    return runner.new_cache(batch, length) if runner is not None else DynamicCache()


def _call(
    model: torch.nn.Module,
    kv: DynamicCache | lean.LeanKV,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    last_only: bool,
    hidden: bool,
) -> Forward:
    if isinstance(kv, lean.LeanKV):  # the lean runner made this cache: it runs the forward too
        out = kv.runner.forward(kv, input_ids, position_ids, attention_mask, last_only=last_only, hidden=hidden)
        return Forward(logits=out.logits, hidden=out.hidden)
    kwargs = {_cache_kwarg(model): kv, "use_cache": True}
    if last_only and accepts_logits_to_keep(model):
        kwargs["logits_to_keep"] = 1  # the prefill needs the last position's logits only
    if hidden:
        # transformers 5.x returns the final norm's output as the last entry (checked in tests)
        kwargs["output_hidden_states"] = True
    out = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs
    )
    return Forward(logits=out.logits, hidden=out.hidden_states[-1] if hidden else None)


def attention_mask_for(rc: RowCache, fed: list[int], width: int) -> torch.Tensor | None:
    """The 2D mask (B, S + width) for a forward feeding `fed[r]` real tokens per row, right-padded
    to `width`. None when nothing needs hiding (lets the attention kernel take its fast path)."""
    if rc.valid is None and all(f == width for f in fed):
        return None
    B, S = len(fed), rc.physical_length
    past = rc.valid
    if past is None:
        past = torch.ones(B, S, dtype=torch.bool, device=_cache_device(rc))
    fed_t = torch.tensor(fed, device=past.device)
    new = torch.arange(width, device=past.device)[None, :] < fed_t[:, None]  # (B, width)
    return torch.cat([past, new], dim=1)


def feed_tree(
    model: torch.nn.Module, rc: RowCache, input_ids: torch.Tensor, offsets: torch.Tensor,
    tree: torch.Tensor,
) -> torch.Tensor:
    """One forward over `input_ids` (B, L) laid out as a tree: token i of row r has position
    ``lengths[r] + offsets[r, i]`` and attends to the row's valid cache entries and to the fed
    tokens j with ``tree[r, i, j]`` (each token to itself at least). Several draft branches that
    share a first token are verified in one forward this way (n-gram recycling). All L entries
    are appended; `commit_kept` then says which of them each row keeps. Returns logits (B, L, V).
    """
    position_ids, mask = _tree_inputs(model, rc, input_ids, offsets, tree)
    return model_forward(model, rc.kv, input_ids, position_ids, mask)


def feed_tree_hidden(
    model: torch.nn.Module, rc: RowCache, input_ids: torch.Tensor, offsets: torch.Tensor,
    tree: torch.Tensor,
) -> Forward:
    """`feed_tree` that also returns the last hidden state (B, L, H) of every fed token."""
    position_ids, mask = _tree_inputs(model, rc, input_ids, offsets, tree)
    return _call(model, rc.kv, input_ids, position_ids, mask, last_only=False, hidden=True)


def _tree_inputs(
    model: torch.nn.Module, rc: RowCache, input_ids: torch.Tensor, offsets: torch.Tensor,
    tree: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids (B, L) and the 4D mask (B, 1, L, S + L) of a tree forward."""
    B, L = input_ids.shape
    device = input_ids.device
    lengths = torch.tensor(rc.lengths, device=device)
    position_ids = lengths[:, None] + offsets.to(device)
    S = rc.physical_length
    past = rc.valid if rc.valid is not None else torch.ones(B, S, dtype=torch.bool, device=device)
    own = tree.to(device).bool() | torch.eye(L, dtype=torch.bool, device=device)[None]
    mask = torch.cat([past.to(device)[:, None, :].expand(B, L, S), own], dim=2)[:, None]  # (B,1,L,S+L)
    return position_ids, custom_mask(model, mask)


def empty_cache() -> RowCache:
    """An empty one-row cache for a decoder body called with `feed_embeds` (an EAGLE head's)."""
    return RowCache(kv=DynamicCache(), lengths=[0], valid=None)


def feed_embeds(
    body: torch.nn.Module, rc: RowCache | None, embeds: torch.Tensor, position_ids: torch.Tensor,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """One forward of a transformers base model (e.g. `LlamaModel`, no LM head) over input
    embeddings (B, L, H) at `position_ids` (B, L); returns its last hidden states (B, L, H).

    With `rc` (one row, every entry valid) the L entries are appended to its cache and counted
    in `rc.lengths`; `allowed` (B, L, S + L), True where a fed query may attend to a key (the
    S cached entries, then the fed ones), lays the fed tokens out as a tree; None is causal.
    Without `rc` there is no cache (training): causal, and right padding is harmless."""
    kwargs: dict = {"use_cache": False}
    mask = None
    if rc is not None:
        kwargs = {_cache_kwarg(body): rc.kv, "use_cache": True}
        if allowed is not None:
            mask = custom_mask(body, allowed.to(embeds.device).bool()[:, None])  # (B, 1, L, S + L)
    out = body(inputs_embeds=embeds, position_ids=position_ids, attention_mask=mask, **kwargs)
    if rc is not None:
        rc.lengths = [n + embeds.shape[1] for n in rc.lengths]
    return out.last_hidden_state


def custom_mask(model: torch.nn.Module, allowed: torch.Tensor) -> torch.Tensor:
    """A custom 4D attention mask (B, 1, Q, K), True where a query may attend to a key, in the
    form the model's attention takes as-is: boolean for sdpa / flex, additive (0 or the dtype's
    minimum) for eager attention."""
    if getattr(getattr(model, "config", None), "_attn_implementation", "sdpa") != "eager":
        return allowed
    dtype = next(model.parameters()).dtype
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


def commit_kept(rc: RowCache, kept: list[list[int]], fed: int) -> None:
    """After a forward appended `fed` entries to every row, row r keeps exactly the entries
    ``kept[r]`` (increasing indices into them); the rest become holes or are cropped."""
    if all(k == list(range(len(k))) for k in kept):
        commit(rc, [len(k) for k in kept], fed)
        return
    if len(kept) == 1 and rc.valid is None:  # one row: move the kept entries up, leave no holes
        _move_to_front(rc, kept[0], fed)
        commit(rc, [len(kept[0])], fed)
        return
    last = max((k[-1] + 1 for k in kept if k), default=0)
    if fed > last:
        rc.kv.crop(-(fed - last))
    B = len(kept)
    device = _cache_device(rc)
    if rc.valid is None:
        rc.valid = torch.ones(B, rc.physical_length - last, dtype=torch.bool, device=device)
    new = [[False] * last for _ in range(B)]  # built on the host: one tensor, not one write per row
    for row, k in zip(new, kept, strict=True):
        for i in k:
            row[i] = True
    rc.valid = torch.cat([rc.valid, torch.tensor(new, dtype=torch.bool, device=rc.valid.device)], dim=1)
    rc.lengths = [n + len(k) for n, k in zip(rc.lengths, kept, strict=True)]


def _move_to_front(rc: RowCache, kept: list[int], fed: int) -> None:
    """Copy the entries `kept` (increasing indices among the last `fed`) to the first len(kept)
    of those slots, in order, in every layer (a handful of entries: cheaper than holes, which
    every later forward would have to mask)."""
    base = rc.physical_length - fed
    index = torch.tensor(kept, device=_cache_device(rc)) + base
    for layer in rc.kv.layers:
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue  # a layer that holds nothing (e.g. one that shares another's KV)
        for x in (layer.keys, layer.values):  # (B, H, S, D); index_select copies before the write
            x[:, :, base : base + len(kept)] = x.index_select(2, index.to(x.device))


def commit(rc: RowCache, keep: list[int], fed: int) -> None:
    """After a forward appended `fed` entries to every row, keep the first `keep[r]` of row r.

    Entries that no row keeps are cropped; the rest of the rejected ones become holes.
    """
    kept = max(keep)
    if fed > kept:
        rc.kv.crop(-(fed - kept))  # negative = remove that many, in transformers 4.56+ and 5.x
    rc.lengths = [n + k for n, k in zip(rc.lengths, keep, strict=True)]
    if rc.valid is None and all(k == kept for k in keep):
        return  # still dense: nothing to record
    B = len(keep)
    if rc.valid is None:
        S_old = rc.physical_length - kept
        device = _cache_device(rc)
        rc.valid = torch.ones(B, S_old, dtype=torch.bool, device=device)
    keep_t = torch.tensor(keep, device=rc.valid.device)
    new = torch.arange(kept, device=rc.valid.device)[None, :] < keep_t[:, None]  # (B, kept)
    rc.valid = torch.cat([rc.valid, new], dim=1)


def rollback(rc: RowCache, drop: list[int]) -> None:
    """Forget row r's last `drop[r]` entries, which must all be valid (e.g. a draft model's
    tokens that verification rejected, appended one per forward): the cache is then as if the
    forwards that wrote them had kept only the rest (`commit`: cropped, or holes)."""
    most = max(drop)
    if most == 0:
        return
    if rc.valid is not None:
        if not bool(rc.valid[:, -most:].all()):
            raise ValueError("rollback: the entries to forget must all be valid")
        rc.valid = rc.valid[:, :-most]
    # un-count the last `most` entries, then keep the first most - drop[r] of them per row
    rc.lengths = [n - most for n in rc.lengths]
    commit(rc, [most - d for d in drop], fed=most)


def select_rows(rc: RowCache, rows: list[int]) -> None:
    """Keep only batch rows `rows`, in that order (e.g. drop the finished ones)."""
    index = torch.tensor(rows, device=_cache_device(rc))
    rc.kv.batch_select_indices(index)
    rc.lengths = [rc.lengths[r] for r in rows]
    if rc.valid is not None:
        rc.valid = rc.valid[index]
    maybe_compact(rc)


def keep_rows(rc: RowCache, rows: list[int]) -> list[int]:
    """Keep only batch rows `rows` (increasing), in the order that moves the fewest: the kept
    rows past the new batch size fill the gaps the others left, so the lean cache copies one row
    per row that left. Returns the rows in their new order (indices into the old batch)."""
    n, kept = len(rows), set(rows)
    movers = iter(r for r in rows if r >= n)
    order = [j if j in kept else next(movers) for j in range(n)]
    select_rows(rc, order)
    return order


def append_rows(rc: RowCache, other: RowCache) -> None:
    """Append `other`'s rows after `rc`'s (new rows joining a running batch), in place. Every
    entry keeps its slot; the part with fewer slots is padded with hidden entries, `rc`'s rows
    after their entries and `other`'s before theirs: positions are logical, so every row reads
    exactly as before."""
    S, S2 = rc.physical_length, other.physical_length
    end = max(S, S2)
    device = _cache_device(rc)
    masks = []
    for part, pad_after in ((rc, True), (other, False)):  # (B, end) validity of each, padded
        valid = part.valid
        if valid is None:
            valid = torch.ones(len(part.lengths), part.physical_length, dtype=torch.bool, device=device)
        pad = torch.zeros(valid.shape[0], end - valid.shape[1], dtype=torch.bool, device=device)
        masks.append(torch.cat([valid.to(device), pad] if pad_after else [pad, valid.to(device)], dim=1))
    if isinstance(rc.kv, lean.LeanKV) and isinstance(other.kv, lean.LeanKV):
        rc.kv.join(other.kv)  # the running rows stay where they are
    else:
        for mine, theirs in zip(rc.kv.layers, other.kv.layers, strict=True):
            if getattr(mine, "keys", None) is None or mine.keys.numel() == 0:
                continue  # a layer that holds nothing (e.g. one that shares another's KV)
            mine.keys = torch.cat([_pad_time(mine.keys, end, after=True), _pad_time(theirs.keys, end, after=False)])
            mine.values = torch.cat([_pad_time(mine.values, end, after=True),
                                     _pad_time(theirs.values, end, after=False)])
    valid = torch.cat(masks)  # (B + B', end)
    rc.valid = None if bool(valid.all()) else valid
    rc.lengths = rc.lengths + other.lengths


def _pad_time(x: torch.Tensor, length: int, *, after: bool) -> torch.Tensor:
    """x (B, H, S, D) -> (B, H, length, D), zeros after the entries or before them."""
    B, H, S, D = x.shape
    if S == length:
        return x
    pad = x.new_zeros(B, H, length - S, D)
    return torch.cat([x, pad] if after else [pad, x], dim=2)


def fork_rows(rc: RowCache, index: torch.Tensor, *, detach: bool = False) -> RowCache:
    """A new cache whose row i is a copy of `rc`'s row ``index[i]`` (rows may repeat); `rc` is
    left as it was. Differentiable unless `detach`: training runs one forward over shared
    prefixes and several blocks per prefix on their forks (`cllm.modeling.forwards.forward_shared_prefix`)."""
    index = index.to(_cache_device(rc))
    forked = DynamicCache()
    for i, layer in enumerate(rc.kv.layers):
        keys, values = layer.keys.index_select(0, index), layer.values.index_select(0, index)
        forked.update(keys.detach() if detach else keys, values.detach() if detach else values, i)
    rows = index.tolist()
    return RowCache(kv=forked, lengths=[rc.lengths[r] for r in rows],
                    valid=None if rc.valid is None else rc.valid.index_select(0, index))


def maybe_compact(rc: RowCache) -> bool:
    """Compact when holes and padding waste enough of the cache; returns whether it did."""
    if rc.valid is None:
        return False
    S, longest = rc.physical_length, max(rc.lengths)
    waste = S - longest
    if waste < COMPACT_MIN_WASTE or waste < COMPACT_WASTE_FRACTION * S:
        return False
    compact(rc)
    return True


def compact(rc: RowCache) -> None:
    """Gather every row's valid entries, in order, into a left-padded cache of the longest
    row's length: the holes go, the positions (logical) are unchanged."""
    assert rc.valid is not None
    S_new = max(rc.lengths)
    # A stable sort on validity puts each row's invalid entries first and its valid ones last,
    # in their original order; the last S_new columns are then exactly what we keep.
    order = torch.sort(rc.valid.to(torch.int8), dim=1, stable=True).indices  # (B, S)
    index = order[:, -S_new:]  # (B, S_new)
    for layer in rc.kv.layers:
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue  # a layer that holds nothing (e.g. one that shares another's KV)
        layer.keys = _gather_time(layer.keys, index)
        layer.values = _gather_time(layer.values, index)
    lengths = torch.tensor(rc.lengths, device=rc.valid.device)
    rc.valid = torch.arange(S_new, device=rc.valid.device)[None, :] >= (S_new - lengths)[:, None]
    if bool(rc.valid.all()):
        rc.valid = None


def _gather_time(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x (B, H, S, D), index (B, S_new) -> (B, H, S_new, D)."""
    B, H, _, D = x.shape
    idx = index.to(x.device)[:, None, :, None].expand(B, H, index.shape[1], D)
    return x.gather(2, idx)


def _cache_device(rc: RowCache) -> torch.device:
    if rc.valid is not None:
        return rc.valid.device
    for layer in rc.kv.layers:
        keys = getattr(layer, "keys", None)
        if keys is not None and keys.numel() > 0:
            return keys.device
    return torch.device("cpu")


@functools.lru_cache(maxsize=64)
def _signature_parameters(forward_fn) -> frozenset[str]:
    return frozenset(inspect.signature(forward_fn).parameters)


def _forward_parameters(model: torch.nn.Module) -> frozenset[str]:
    forward = model.forward
    return _signature_parameters(getattr(forward, "__func__", forward))


def _cache_kwarg(model: torch.nn.Module) -> str:
    """Name of the forward argument that takes the cache: `cache` (5.x) or `past_key_values` (4.x).

    Wrappers that only take **kwargs (e.g. peft) get the name of the installed version.
    """
    params = _forward_parameters(model)
    if "cache" in params:
        return "cache"
    if "past_key_values" in params:
        return "past_key_values"
    return "cache" if _TRANSFORMERS_MAJOR >= 5 else "past_key_values"


def accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    """Whether the model's forward takes `logits_to_keep` (transformers >= 4.45 causal LMs)."""
    return "logits_to_keep" in _forward_parameters(model)
