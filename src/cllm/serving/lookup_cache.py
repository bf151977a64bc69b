"""A draft table (`cllm drafts`) as llama.cpp's static n-gram cache, the file its `llama-lookup`
example reads with `--lookup-cache-static FILE`.

llama.cpp's format (`common/ngram-cache.h`): a sequence of records, each an n-gram of 4 int32
token ids (unused places -1), an int32 count of the tokens seen after it, then that many
(int32 token, int32 count) pairs; little-endian, no header. Its lookup reads the static cache
with the last **2** tokens only (`LLAMA_NGRAM_STATIC`), drafts a token when the counts after
that 2-gram add up to at least 2 and the most frequent holds at least half of them, and also
uses those counts to rank what its context and dynamic caches propose.

What carries over: the table's 2-token contexts, each with the one token the table keeps for
it. What does not: its 3- and 4-token contexts (llama.cpp's static cache has no longer keys),
and the counts (the table keeps only each context's winner, which passed its own `min_count` and
`min_share`): each is written with count `max(2, min_count)`, enough for llama.cpp to draft it.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

from cllm.core.outputs import replacing
from cllm.decoding.draft_table import DraftTable

NGRAM_MAX = 4  # llama.cpp's LLAMA_NGRAM_MAX: every key is 4 ids wide
STATIC_ORDER = 2  # llama.cpp's LLAMA_NGRAM_STATIC: the static cache is looked up by 2 tokens
NULL_TOKEN = -1  # LLAMA_TOKEN_NULL: an unused place in a key
_KEY = struct.Struct(f"<{NGRAM_MAX}i")
_PAIR = struct.Struct("<ii")
_COUNT = struct.Struct("<i")


def static_entries(table: DraftTable) -> dict[tuple[int, int], int]:
    """The table's 2-token contexts and their tokens: what llama.cpp's static cache can hold."""
    return {ctx: token for ctx, token in table.next_token.items() if len(ctx) == STATIC_ORDER}


def lookup_cache_bytes(entries: dict[tuple[int, ...], dict[int, int]]) -> bytes:
    """llama.cpp's n-gram cache file for `entries`: n-gram -> {token: count}, in key order."""
    out = bytearray()
    for ngram in sorted(entries):
        counts = entries[ngram]
        if not 1 <= len(ngram) <= NGRAM_MAX or not counts or min(counts.values()) < 1:
            raise ValueError(f"an n-gram cache entry needs 1-{NGRAM_MAX} tokens and counts >= 1: {ngram}")
        out += _KEY.pack(*ngram, *[NULL_TOKEN] * (NGRAM_MAX - len(ngram)))
        out += _COUNT.pack(len(counts))
        for token in sorted(counts):
            out += _PAIR.pack(token, counts[token])
    return bytes(out)


def read_lookup_cache(path: str | os.PathLike) -> dict[tuple[int, ...], dict[int, int]]:
    """An n-gram cache file as llama.cpp reads it (keys without their -1 places)."""
    data, at, out = Path(path).read_bytes(), 0, {}
    while at < len(data):
        key = tuple(t for t in _KEY.unpack_from(data, at) if t != NULL_TOKEN)
        (n,) = _COUNT.unpack_from(data, at + _KEY.size)
        at += _KEY.size + _COUNT.size
        out[key] = dict(_PAIR.unpack_from(data, at + i * _PAIR.size) for i in range(n))
        at += n * _PAIR.size
    return out


def write_lookup_cache(table: DraftTable, path: str | os.PathLike) -> int:
    """Write the table's 2-token contexts as llama.cpp's static cache; returns how many."""
    count = max(2, int(table.meta.get("min_count", 2)))
    entries = {ctx: {token: count} for ctx, token in static_entries(table).items()}
    with replacing(path) as tmp:
        tmp.write_bytes(lookup_cache_bytes(entries))
    return len(entries)
