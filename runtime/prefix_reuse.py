"""The engine's side of the prefix cache (runtime/prefix_cache.py): an arriving request takes
the longest cached prefix of its prompt, a finished or aborted one leaves its KV behind, and
each tick the cache is cut to what the live sequences leave free of the KV budget. Engine
thread only."""

from __future__ import annotations

import logging
from collections.abc import Collection

from runtime.executor import Executor
from runtime.metrics import EngineMetrics
from runtime.prefix_cache import BLOCK_TOKENS, CachedPrefix, PrefixCache
from runtime.requests import LiveRequest
from statemachine.lifecycle import Role
from statemachine.records import Seq
from statemachine.room import census

log = logging.getLogger("fairtick.prefix_cache")


class PrefixReuse:
    """A `PrefixCache` of at most `max_tokens`, within a KV budget of `budget_tokens`
    accounted under the policy's `kv_full`."""

    def __init__(self, executor: Executor, metrics: EngineMetrics, max_tokens: int,
                 budget_tokens: int, kv_full: str) -> None:
        self.cache = PrefixCache(min(max_tokens, budget_tokens))
        self._executor, self._metrics = executor, metrics
        self._budget_tokens, self._kv_full = budget_tokens, kv_full
        self._evictions_counted = 0  # of cache.num_evictions, in /metrics

    def lookup(self, live: LiveRequest) -> CachedPrefix | None:
        """The longest cached prefix of the request's prompt (`live.num_cached` says how
        long); the sequence prefills only the rest. None for a request that opted out, or that
        asks for its prompt's log-probabilities (echo): a cached prefix has none, so its forward
        must run over every prompt token."""
        prompt = live.request.prompt_tokens
        if not live.request.cache_prompt or live.request.sampling.prompt_logprobs is not None:
            return None
        prefix = self.cache.lookup(prompt)
        live.num_cached = prefix.num_tokens if prefix is not None else 0
        self._metrics.prefix_cache_hit_tokens.inc(live.num_cached)
        self._metrics.prefix_cache_miss_tokens.inc(len(prompt) - live.num_cached)
        return prefix

    def keep(self, live: LiveRequest, seqs: Collection[Seq]) -> None:
        """Keep a leaving sequence's KV (before the executor releases it); `seqs` are the
        live ones, whose room the cache must leave."""
        if live.request.cache_prompt and \
                self._executor.num_cached(live.seq_id) >= BLOCK_TOKENS:
            try:
                self.cache.insert(*self._executor.kv_of(live.seq_id))
            except Exception:  # noqa: BLE001 - a cache is worth less than the engine thread
                log.exception("could not keep request %s's KV", live.request_id)
        self.fit(seqs)

    def fit(self, seqs: Collection[Seq]) -> None:
        """Evict down to what `seqs` leave free of the budget (what they have reserved, and
        the token each decoding row writes next). The scheduler never sees the cache, so it
        never refuses or preempts anyone for it."""
        counts, committed = census(list(seqs), self._kv_full)
        room = self._budget_tokens - committed - counts[Role.DECODING]
        self.cache.shrink_to(min(self.cache.max_tokens, room))
        self._metrics.prefix_cache_evictions.inc(self.cache.num_evictions -
                                                 self._evictions_counted)
        self._evictions_counted = self.cache.num_evictions
        self._metrics.prefix_cache_tokens.set(self.cache.num_tokens)
