"""Prometheus metrics of one engine, in a registry of its own (the server exposes it)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 25.0, 60.0, 120.0)
_TICK_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)


class EngineMetrics:
    """The metric names of DESIGN.md; seconds as the unit of time."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.prefill_chunks = Counter("fairtick_prefill_chunks", "Prompt chunks prefilled",
                                      registry=r)
        self.decode_steps = Counter("fairtick_decode_steps",
                                    "Batched decode steps (decode and mixed ticks)", registry=r)
        self.mixed_steps = Counter("fairtick_mixed_steps",
                                   "Ticks that decoded and prefilled in one step", registry=r)
        self.prefill_grants = Counter(
            "fairtick_prefill_grants", "Prefill chunks granted while sequences were decoding "
            "(the grants that cost the streams latency)", registry=r)
        self.ticks = Counter("fairtick_ticks", "Scheduler ticks by action", ["action"],
                             registry=r)
        self.prompt_tokens = Counter("fairtick_prompt_tokens", "Prompt tokens prefilled",
                                     registry=r)
        self.generation_tokens = Counter("fairtick_generation_tokens", "Tokens generated",
                                         registry=r)
        self.ttft = Histogram("fairtick_time_to_first_token_seconds",
                              "Submission to first token", buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("fairtick_inter_token_latency_seconds",
                             "Time between two tokens of one request", buckets=_LATENCY_BUCKETS,
                             registry=r)
        self.queue_time = Histogram("fairtick_request_queue_time_seconds",
                                    "Submission to first admission",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.parked_wait = Histogram("fairtick_parked_wait_ticks",
                                     "Ticks a parked prefill waited before each grant",
                                     buckets=_TICK_BUCKETS, registry=r)
        self.tick_duration = Histogram("fairtick_tick_duration_seconds", "Wall time of a tick",
                                       buckets=_LATENCY_BUCKETS, registry=r)
        self.scheduler_time = Counter(
            "fairtick_scheduler_seconds", "Time spent in the scheduler core: decide_tick, "
            "lifecycle triggers and bookkeeping (not the model)", registry=r)
        self.running = Gauge("fairtick_requests_running", "Sequences holding KV",
                             registry=r)
        self.waiting = Gauge("fairtick_requests_waiting",
                             "Requests queued for KV room or a running place (preempted ones "
                             "included)", registry=r)
        self.kv_tokens = Gauge("fairtick_kv_tokens", "Tokens in the KV caches", registry=r)
        self.kv_budget = Gauge("fairtick_kv_budget_tokens", "The KV token budget", registry=r)
        self.preemptions = Counter(
            "fairtick_preemptions", "Sequences preempted when the KV budget ran out, by kind: "
            "drop (KV freed, re-prefilled later) or pause (KV kept)", ["kind"], registry=r)
        for kind in ("drop", "pause"):
            self.preemptions.labels(kind)
        self.parked = Gauge("fairtick_requests_parked", "Prefills parked, waiting for a tick",
                            registry=r)
        self._add_prefix_cache_metrics(r)
        for action in ("idle", "decode", "prefill", "mixed"):
            self.ticks.labels(action)  # export every action from the start

    def _add_prefix_cache_metrics(self, r: CollectorRegistry) -> None:
        # runtime/prefix_cache.py: what arriving prompts found in it, and what it holds.
        self.prefix_cache_hit_tokens = Counter(
            "fairtick_prefix_cache_hit_tokens", "Prompt tokens whose KV came from the prefix "
            "cache (not prefilled)", registry=r)
        self.prefix_cache_miss_tokens = Counter(
            "fairtick_prefix_cache_miss_tokens", "Prompt tokens not found in the prefix cache "
            "(prefilled)", registry=r)
        self.prefix_cache_evictions = Counter(
            "fairtick_prefix_cache_evictions", "Prefix cache entries evicted, least recently "
            "used first, to stay within the KV the live sequences leave free or its limit",
            registry=r)
        self.prefix_cache_tokens = Gauge("fairtick_prefix_cache_tokens",
                                         "Tokens of KV held by the prefix cache", registry=r)
