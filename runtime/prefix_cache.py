"""The prefix cache: the KV of finished (and aborted) sequences, kept so that a later prompt
that starts with the same tokens prefills only the rest (docs/adr/0011-prefix-cache.md).

An entry is one sequence's tokens and, per layer, its keys and values as mlx-lm's `KVCache`
holds them: arrays of shape (1, kv_heads, tokens, head_dim). An index maps the chain hash of
every whole block of `BLOCK_TOKENS` leading tokens to the entries that start with them, so a
lookup hashes the prompt block by block, takes the deepest block found and then compares the
candidates token by token into the next block (a match need not end at a block boundary).
An entry is evicted whole, least recently used first; an entry that another extends (a chat's
earlier turn) is dropped when the longer one comes in. Not thread-safe: the engine thread
owns it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

BLOCK_TOKENS = 16  # the index's granularity; a match may end anywhere


@dataclass(frozen=True)
class CachedPrefix:
    """The first `num_tokens` tokens of a prompt found in the cache, and their KV per layer
    (keys, values), each (1, kv_heads, >= num_tokens, head_dim)."""

    num_tokens: int
    layers: tuple[tuple[mx.array, mx.array], ...]


@dataclass(frozen=True)
class _Entry:
    tokens: tuple[int, ...]
    layers: tuple[tuple[mx.array, mx.array], ...]
    hashes: tuple[int, ...]  # chain hash of each whole leading block


def can_cache(cache: Sequence[Any]) -> bool:
    """Whether a model's per-sequence cache (`make_prompt_cache`) is plain KV the prefix cache
    can slice: sliding-window, quantized and recurrent caches are not."""
    return bool(cache) and all(type(c) is KVCache for c in cache)


def attach(cache: Sequence[Any], prefix: CachedPrefix) -> None:
    """Give an empty per-sequence cache the prefix's KV. The arrays are slices of the entry's:
    the cache's first update copies them into a buffer of its own (KVCache grows by concat)."""
    n = prefix.num_tokens
    for c, (keys, values) in zip(cache, prefix.layers, strict=True):
        c.keys, c.values, c.offset = keys[..., :n, :], values[..., :n, :], n


def block_hashes(tokens: Sequence[int]) -> list[int]:
    """The chain hash of every whole leading block of `tokens`."""
    out, h = [], 0
    for start in range(0, len(tokens) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        h = hash((h, *tokens[start:start + BLOCK_TOKENS]))
        out.append(h)
    return out


class PrefixCache:
    """Cached sequences' KV within `max_tokens` (the engine lowers the limit each tick to what
    the live sequences leave free of the KV budget: `shrink_to`)."""

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self.max_tokens = max_tokens
        self.num_tokens = 0
        self.nbytes = 0  # of the arrays the entries hold
        self.num_evictions = 0  # entries evicted to make room (dominated ones are not counted)
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._index: dict[int, dict[int, None]] = {}  # block chain hash -> entry ids
        self._ends: dict[int, dict[int, None]] = {}  # the hash of an entry's last whole block
        self._next_id = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: Sequence[int]) -> CachedPrefix | None:
        """The longest cached prefix of `prompt`, at most `len(prompt) - 1` tokens (the last
        prompt token always runs, to give the logits of the first new token)."""
        limit = len(prompt) - 1
        hashes = block_hashes(prompt[:limit])
        depth = 0
        while depth < len(hashes) and hashes[depth] in self._index:
            depth += 1
        if depth == 0:
            return None
        known = depth * BLOCK_TOKENS
        best_id, best = -1, 0
        for entry_id in self._index[hashes[depth - 1]]:
            # Every candidate shares the `known` tokens by hash; beyond, less than a block.
            n = _common_run(self._entries[entry_id].tokens, prompt, known, limit)
            if n > best:
                best_id, best = entry_id, n
        if tuple(self._entries[best_id].tokens[:known]) != tuple(prompt[:known]):
            return None  # a hash collision: another prompt's KV must not be handed out
        self._entries.move_to_end(best_id)
        return CachedPrefix(best, self._entries[best_id].layers)

    def insert(self, tokens: Sequence[int], layers: Sequence[tuple[mx.array, mx.array]]) -> None:
        """Keep a sequence's KV (`layers` hold exactly `len(tokens)` tokens). Entries it
        extends are dropped; the least recently used go while the cache is over its limit."""
        tokens = tuple(tokens)
        if len(tokens) < BLOCK_TOKENS or len(tokens) > self.max_tokens:
            return  # too short to be found, or larger than the whole cache
        hashes = tuple(block_hashes(tokens))
        for entry_id in list(self._index.get(hashes[-1], ())):
            old = self._entries[entry_id]
            if len(old.tokens) >= len(tokens) and old.tokens[:len(tokens)] == tokens:
                self._entries.move_to_end(entry_id)
                return  # already cached inside an entry at least as long
        for h in hashes:  # entries the new one extends (a chat's earlier turns) end in a block
            for entry_id in list(self._ends.get(h, ())):
                old = self._entries[entry_id]
                if tokens[:len(old.tokens)] == old.tokens:
                    self._remove(entry_id)
        entry_id, self._next_id = self._next_id, self._next_id + 1
        self._entries[entry_id] = _Entry(tokens, tuple(layers), hashes)
        for h in hashes:
            self._index.setdefault(h, {})[entry_id] = None
        self._ends.setdefault(hashes[-1], {})[entry_id] = None
        self.num_tokens += len(tokens)
        self.nbytes += _nbytes(layers)
        self.shrink_to(self.max_tokens)

    def shrink_to(self, max_tokens: int) -> int:
        """Evict least recently used entries until at most `max_tokens` are cached; returns
        how many tokens were evicted."""
        freed = 0
        while self.num_tokens > max(0, max_tokens):
            entry_id = next(iter(self._entries))
            freed += len(self._entries[entry_id].tokens)
            self._remove(entry_id)
            self.num_evictions += 1
        return freed

    def clear(self) -> None:
        """Evict everything."""
        self.shrink_to(0)

    def _remove(self, entry_id: int) -> None:
        entry = self._entries.pop(entry_id)
        self.num_tokens -= len(entry.tokens)
        self.nbytes -= _nbytes(entry.layers)
        for table, keys in ((self._index, entry.hashes), (self._ends, entry.hashes[-1:])):
            for h in keys:
                ids = table[h]
                del ids[entry_id]
                if not ids:
                    del table[h]


def _common_run(a: Sequence[int], b: Sequence[int], start: int, limit: int) -> int:
    # How far `a` and `b` agree from `start` on (they agree before it), at most `limit`.
    n, end = start, min(len(a), len(b), limit)
    while n < end and a[n] == b[n]:
        n += 1
    return n


def _nbytes(layers: Sequence[tuple[mx.array, mx.array]]) -> int:
    return sum(int(k.nbytes) + int(v.nbytes) for k, v in layers)
