"""Prometheus metrics of one engine, in a registry of its own (the server exposes it).

Names follow Prometheus' conventions: the unit in the name (`_seconds`, `_tokens`, `_ticks`),
seconds as the unit of time, counters exported with `_total`. docs/operations.md lists each with
its type, unit, labels and meaning; a test holds that list and this registry equal.
"""

from __future__ import annotations

from typing import get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from runtime.api import AbortCause
from statemachine.records import Plan, World
from statemachine.tick import TickState

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 25.0, 60.0, 120.0)
# A whole generation may run for minutes.
_E2E_BUCKETS = (*_LATENCY_BUCKETS, 300.0, 600.0, 1800.0)
_TICK_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)
# A tick's duration over the latency target its slice was sized for.
_TARGET_BUCKETS = (0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0)


class EngineMetrics:
    """Every metric the server exports; label values known in advance are exported from the
    start (at 0), so a dashboard shows a series before its first event."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.prefill_chunks = Counter("fairtick_prefill_chunks", "Prompt chunks prefilled",
                                      registry=r)
        self.decode_steps = Counter(
            "fairtick_decode_steps",
            "Batched decode steps (decode and mixed ticks; a lane tick's every step)", registry=r)
        self.mixed_steps = Counter(
            "fairtick_mixed_steps", "Ticks that decoded and prefilled (in one forward, or the "
            "slices on the lane beside the rows' steps)", registry=r)
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
                              "Submission to a request's first token (of any choice or prompt)",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("fairtick_inter_token_latency_seconds",
                             "Time between two tokens of one request", buckets=_LATENCY_BUCKETS,
                             registry=r)
        self.queue_time = Histogram("fairtick_request_queue_time_seconds",
                                    "Submission to a request's first admission",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.parked_wait = Histogram("fairtick_parked_wait_ticks",
                                     "Ticks a parked prefill waited before each grant",
                                     buckets=_TICK_BUCKETS, registry=r)
        self.tick_duration = Histogram("fairtick_tick_duration_seconds", "Wall time of a tick",
                                       buckets=_LATENCY_BUCKETS, registry=r)
        self.scheduler_time = Counter(
            "fairtick_scheduler_seconds", "Time spent in the scheduler core: decide_tick, "
            "lifecycle triggers and bookkeeping (not the model)", registry=r)
        self.tick_over_target = Histogram(
            "fairtick_tick_over_target_ratio", "A tick whose prefill slice was sized for a "
            "latency target (tick_budget_ms): its wall time over that target, by kind: mixed "
            "(one forward) or probe (the decode rows' forward, then the slice's)", ["kind"],
            buckets=_TARGET_BUCKETS, registry=r)
        for kind in ("mixed", "probe"):
            self.tick_over_target.labels(kind)
        self.running = Gauge("fairtick_requests_running", "Sequences holding KV",
                             registry=r)
        self.waiting = Gauge("fairtick_requests_waiting",
                             "Sequences queued for KV room or a running place (preempted ones "
                             "included; each waiting choice of an n > 1 request counts)",
                             registry=r)
        self.kv_used = Gauge("fairtick_kv_used_tokens", "Tokens held in the KV caches, counted "
                             "against the KV budget", registry=r)
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
            self.ticks.labels(action)
        self._add_outcomes(r)

    def record_tick(self, plan: Plan, extra: int = 0) -> None:
        """Count a tick's action, slices, steps (a lane tick's `extra` steps past its one as
        well), grants and the granted prompts' waits."""
        decision = plan.decision
        self.ticks.labels(decision.action).inc()
        self.prefill_chunks.inc(len(plan.prefills))
        if plan.decode:
            self.decode_steps.inc(1 + extra)
        if decision.action == "mixed":
            self.mixed_steps.inc()
        if plan.state.num_decoding:
            self.prefill_grants.inc(len(decision.granted))
        waits = {p.seq_id: p.wait_ticks for p in plan.state.parked}
        for seq_id in decision.granted:
            self.parked_wait.observe(waits[seq_id])

    def set_gauges(self, world: World, state: TickState) -> int:
        """Set the sequence and KV gauges; returns the KV tokens in use."""
        self.parked.set(state.num_parked)
        self.waiting.set(state.num_waiting)
        self.running.set(state.num_running)
        kv_used = sum(s.kv_cached for s in world.seqs)
        self.kv_used.set(kv_used)
        return kv_used

    def _add_outcomes(self, r: CollectorRegistry) -> None:
        self.requests_finished = Counter(
            "fairtick_requests_finished", "Requests whose every choice finished, by "
            "finish_reason: length if any choice reached max_tokens, else stop (a stop token or "
            "string)", ["finish_reason"], registry=r)
        for reason in ("stop", "length"):
            self.requests_finished.labels(reason)
        self.requests_aborted = Counter(
            "fairtick_requests_aborted", "Requests the engine took that ended unfinished (a "
            "choice of theirs was cut short), by cause: client_disconnect, server_shutdown or "
            "error", ["cause"], registry=r)
        for cause in get_args(AbortCause):
            self.requests_aborted.labels(cause)
        self.requests_refused = Counter(
            "fairtick_requests_refused", "Requests answered with an error before the engine "
            "took them, by HTTP status and reason (the error's code)", ["status", "reason"],
            registry=r)
        self.e2e_latency = Histogram("fairtick_e2e_request_latency_seconds",
                                     "Submission to a finished request's last token (of "
                                     "all its choices)",
                                     buckets=_E2E_BUCKETS, registry=r)


    def _add_prefix_cache_metrics(self, r: CollectorRegistry) -> None:
        # runtime/prefix_cache.py: what arriving prompts found in it, and what it holds.
        self.prefix_cache_hit_tokens = Counter(
            "fairtick_prefix_cache_hit_tokens", "Prompt tokens whose KV came from the prefix "
            "cache (not prefilled)", registry=r)
        self.prefix_cache_miss_tokens = Counter(
            "fairtick_prefix_cache_miss_tokens", "Prompt tokens not found in the prefix cache "
            "when the request arrived (to prefill; counted whole even if it ends before)",
            registry=r)
        self.prefix_cache_evictions = Counter(
            "fairtick_prefix_cache_evictions", "Prefix cache entries evicted, least recently "
            "used first, to stay within the KV the live sequences leave free or its limit",
            registry=r)
        self.prefix_cache_tokens = Gauge("fairtick_prefix_cache_tokens",
                                         "Tokens of KV held by the prefix cache", registry=r)
