"""The engine: one thread owns MLX and runs the scheduler's ticks over the model.

Each tick: drain the inbox (submit, abort) -> decide (the scheduler core asks `decide_tick`) ->
execute the plan (one forward over its decode rows and prefill slices) -> apply the outcome
through the lifecycle triggers -> publish tokens, metrics and the trace.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Mapping
from typing import Any

import mlx.core as mx

from runtime import kernels
from runtime.admission import Admission
from runtime.api import (
    AbortCause,
    EngineDead,
    EngineFull,
    GenerationRequest,
    Sink,
    choice_sampling,
)
from runtime.capacity import make_kv_budget
from runtime.engine_config import EngineConfig
from runtime.executor import Executor
from runtime.grammar import GrammarCompiler, make_grammar_compiler
from runtime.isolation import run_isolated
from runtime.lane import PrefillLane
from runtime.limits import check_context
from runtime.metrics import EngineMetrics
from runtime.model import ModelBundle, load_model
from runtime.outcomes import Outcomes
from runtime.prefix_reuse import PrefixReuse
from runtime.requests import LiveRequest
from runtime.tick_budget import TickBudget
from statemachine.lifecycle import Role, Trigger, load_lifecycle
from statemachine.scheduler import Scheduler
from statemachine.tick import make_policy
from statemachine.trace import TickRecord, TraceEvent, TraceLog
from statemachine.world import Layout, Plan, admissible, lane_tick

log = logging.getLogger("fairtick.engine")
GRAMMAR_ENDS_OUTPUT = ("min_tokens and ignore_eos cannot be used with a grammar "
                       "(response_format or a forced tool_choice): the grammar decides where the "
                       "output ends")


class Engine:
    """Owns the model, the scheduler core and the thread that runs them."""

    def __init__(self, config: EngineConfig, bundle: ModelBundle | None = None) -> None:
        self.config = config
        self.policy = make_policy(config.policy, config.policy_params, origin="policy parameter")
        self.bundle = bundle or load_model(config.model)
        self.metrics = EngineMetrics()
        self.registry = self.metrics.registry
        self.outcomes = Outcomes(self.metrics)
        self.trace = TraceLog(config.trace_capacity, started=time.time())
        self.kv = make_kv_budget(self.bundle.model, config.max_kv_tokens)
        self.metrics.kv_budget.set(self.kv.tokens)
        self.layout = Layout(config.max_running, config.prefill_chunk_size, self.kv.tokens)
        self.lifecycle = load_lifecycle(config.lifecycle)
        self.scheduler = Scheduler(self.policy, self.layout, self.lifecycle, trace=self.trace,
                                   check=config.check_invariants, clock=time.time)
        self.executor = Executor(self.bundle)
        self.prefixes = self._make_prefix_reuse()
        self.prefix_cache = self.prefixes.cache if self.prefixes is not None else None
        self.budget = TickBudget(self.policy, self.executor, config.prefill_chunk_size)
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._lock = threading.Lock()  # guards the scheduler against snapshot() readers
        self._live: dict[int, LiveRequest] = {}
        self._by_request: dict[str, list[int]] = {}  # a request's live choices' sequences
        self._ids = itertools.count()
        self.admission = Admission(config.max_waiting)
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._accepting = True
        self.error: BaseException | None = None
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()
        # A lane policy's prefill lane (ADR 0016), made on the engine thread's start, and when
        # the decode rows last began a step beside it.
        self._lane: PrefillLane | None = None
        self._lane_step_s = 0.0

    # -- callers' side ---------------------------------------------------------------------
    @property
    def params(self) -> dict[str, int | float]:
        return dict(self.policy.params)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def grammars(self) -> GrammarCompiler:
        """The grammar compiler for this model's tokenizer, built on first use (any thread)."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = make_grammar_compiler(self.bundle)
            return self._grammars

    def start(self) -> None:
        """Start the engine thread."""
        self._thread = threading.Thread(target=self._run, name="fairtick-engine", daemon=True)
        self._thread.start()

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop admitting; let running requests finish for up to `grace_s`; abort the rest."""
        self._accepting = False
        deadline = time.monotonic() + grace_s
        while self._live and self.alive and time.monotonic() < deadline:
            time.sleep(0.01)
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def submit(self, request: GenerationRequest, sink: Sink) -> None:
        """Queue a request; `sink` receives its events on the engine thread. A refusal
        (EngineDead, EngineFull, ValueError) is raised, and recorded in the trace."""
        try:
            self._accept(request)
        except (EngineDead, EngineFull, ValueError) as exc:
            reason = {EngineDead: "engine_unavailable", EngineFull: "queue_full"}.get(
                type(exc), "invalid_request")
            if request.num_prompts > 1 and self.alive:
                # A batch's prompt: the batch is a refusal, its prompts taken go uncounted. The
                # engine traces it when it takes this, after the arrivals of those prompts.
                self._inbox.put(("refuse", (request.client_id, reason)))
                self._wake.set()
            else:
                self._trace_refusal(request.client_id, reason)
            raise
        self._inbox.put(("submit", (request, sink, time.monotonic())))
        self._wake.set()
        if not self.alive:  # it died after the check above: answer and release the request
            self._drain_inbox(refuse=f"engine stopped: {self.error or 'stopped'}")

    def _accept(self, request: GenerationRequest) -> None:
        # Every check a request must pass, then its place in the admission queue.
        if not self.alive or not self._accepting:
            raise EngineDead(f"the engine is not running ({self.error or 'stopped'})")
        if not request.prompt_tokens:
            raise ValueError("the prompt is empty: send at least one token")
        if not isinstance(request.n, int) or isinstance(request.n, bool) or request.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {request.n!r}")
        if not isinstance(request.num_prompts, int) or request.num_prompts < 1:
            raise ValueError(f"num_prompts must be an integer >= 1, got {request.num_prompts!r}")
        if request.grammar is not None and (request.sampling.ignore_eos or
                                            request.sampling.min_tokens):
            raise ValueError(GRAMMAR_ENDS_OUTPUT)
        check_context(len(request.prompt_tokens), request.sampling.max_tokens,
                      self.bundle.context_length)
        request.sampling.validate().check_vocabulary(self.bundle.vocab_size)
        problem = admissible(len(request.prompt_tokens), request.sampling.max_tokens,
                             self.kv.tokens)
        if problem is not None:
            raise ValueError(f"{problem} (--max-kv-tokens); lower max_tokens or the prompt")
        self.admission.reserve()

    def abort(self, request_id: str, cause: AbortCause = "client_disconnect") -> None:
        """Abort a request (all its choices) at the next tick, whatever state it is in;
        `cause` is counted."""
        self._inbox.put(("abort", (request_id, cause)))
        self._wake.set()

    def snapshot(self) -> dict[str, Any]:
        """The policy, its parameters, the KV budget and every live sequence with its state."""
        with self._lock:
            world = self.scheduler.world()
            # Each sequence under the id its client saw (a batch's prompts share it: `seq`
            # tells them apart), as the trace and the request log name it.
            seqs = [{"seq": s.seq_id, "request_id": self._live[s.seq_id].request.client_id
                     if s.seq_id in self._live else None,
                     "choice": self._live[s.seq_id].index if s.seq_id in self._live else None,
                     "state": self.lifecycle.state_of[s.role], "role": s.role.word,
                     "prefill_left": s.target - s.prefilled, "wait_ticks": s.wait,
                     "generated": s.generated, "kv_tokens": s.kv_cached,
                     "preemptions": s.preemptions}
                    for s in world.seqs]
            return {"policy": self.policy.name, "params": self.params,
                    "tick": self.scheduler.tick, "max_running": self.layout.max_running,
                    "prefill_chunk_size": self.layout.chunk_size,
                    "kv": {"budget_tokens": self.kv.tokens, "cached_tokens":
                           sum(s["kv_tokens"] for s in seqs),
                           "bytes_per_token": self.kv.bytes_per_token,
                           "prefix_cache_tokens": self.prefix_cache.num_tokens
                           if self.prefix_cache is not None else None},
                    "alive": self.alive, "sequences": seqs}

    # -- the engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            # MLX keeps compiled functions per thread: trace the compiled kernels on this one
            # before any request (they were built before the engine started).
            kernels.warm_up()
            if self.policy.spec.lane is not None:
                self._lane = PrefillLane(self.config.lane_priority)
                log.info("prefill lane: %s", "SCHED_IDLE (its threads run on what the decode "
                         "rows and the server leave of the cores)"
                         if self._lane.priority == "idle" else self._lane.priority)
            while not self._stopping.is_set():
                self._drain_inbox()
                if not self._live:
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                self.step()
        except BaseException as exc:  # noqa: BLE001 - the engine reports its death
            log.exception("engine thread died")
            self.error = exc
        finally:
            reason = f"engine stopped: {self.error}" if self.error else "server shutting down"
            for live in list(self._live.values()):
                live.end("error" if self.error else "abort", error=reason)
                self.admission.release(queued=live.admitted_s is None)
                self._record_outcome(live)
            self._live.clear()
            self._by_request.clear()
            self._drain_inbox(refuse=reason)
            if self._lane is not None:
                self._lane.close()
            # MLX needs its per-thread streams freed by the thread that used them, or the
            # process aborts at exit ("terminate called without an active exception").
            mx.clear_streams()

    def _drain_inbox(self, refuse: str | None = None) -> None:
        drained = False
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                if drained:
                    self._set_gauges()  # an abort may have emptied the engine: no tick follows
                return
            drained = True
            if kind == "submit":
                request, sink, submitted_s = item
                live = LiveRequest(next(self._ids), request, sink, self.bundle.tokenizer,
                                   self.bundle.eos_token_ids,
                                   self.outcomes.take(request, submitted_s))
                if refuse is not None:
                    live.end("error", error=refuse)
                    self.admission.release(queued=True)
                    self._record_outcome(live)
                    continue
                self._live[live.seq_id] = live
                self._by_request[request.request_id] = [live.seq_id]
                prefix = self.prefixes.lookup(live) if self.prefixes is not None else None
                with self._lock:  # traced under the id its client saw (a batch's, too)
                    self.scheduler.submit(live.seq_id, len(request.prompt_tokens),
                                          request.sampling.max_tokens, request.client_id,
                                          cached=live.num_cached)
                self.executor.add(live.seq_id, request.prompt_tokens, request.sampling,
                                  prefix=prefix, forks=request.n > 1, grammar=request.grammar)
            elif kind == "abort":
                request_id, cause = item
                for seq_id in list(self._by_request.get(request_id, ())):
                    self._retire(seq_id, cause)
            elif kind == "refuse":
                response_id, reason = item
                self.outcomes.refuse(response_id)
                self._trace_refusal(response_id, reason)

    def _trace_refusal(self, request_id: str, reason: str) -> None:
        self.trace.record(TraceEvent(self.scheduler.tick, None, None, None, "refuse", reason,
                                     time.time(), request_id, "refusal"))

    def step(self) -> None:
        """One tick: decide, execute, apply, publish."""
        start = time.perf_counter()
        budget = self.budget.slice_tokens if self.policy.spec.tick_budget_ms is not None else None
        if self.policy.spec.lane is not None:
            budget = self.budget.lane_tokens
        with self._lock:
            plan_tick = self.scheduler.tick
            self.budget.begin(plan_tick)
            plan = self.scheduler.schedule(budget)
        self._preempt(plan)
        if self.prefixes is not None:
            self.prefixes.fit(plan.world.seqs)
        self._note_admissions(time.monotonic())
        shape = self.budget.shape(plan.prefills, plan.decode)
        laned = self._lane is not None and lane_tick(plan, self.policy)
        executing = time.perf_counter()
        finished, extra = self._execute_lane(plan) if laned else (self._execute(plan), 0)
        applying = time.perf_counter()
        with self._lock:
            self.scheduler.complete(plan, finished, extra)
        finished += self._fork(plan)  # before the finished release their caches
        for seq_id in finished:
            self._retire(seq_id, None)
        self.metrics.record_tick(plan, extra)
        kv_used = self._set_gauges()
        end = time.perf_counter()
        self.trace.tick(TickRecord(
            plan_tick, time.time() - (end - start), end - start, plan.decision.action,
            plan.decision.rule, len(plan.decode), sum(w.num_tokens for w in plan.prefills),
            kv_used))
        if not laned:  # a lane tick's length is its slice's, beside the rows' steps
            self.budget.observe(shape, end - start)
        self.metrics.tick_duration.observe(end - start)
        target_s = self.budget.target_s
        if target_s and plan.prefills and plan.decode and not laned:
            kind = "probe" if self.budget.probe is not None else "mixed"
            self.metrics.tick_over_target.labels(kind).observe((end - start) / target_s)
        self.metrics.scheduler_time.inc((executing - start) + (end - applying))

    def _preempt(self, plan: Plan) -> None:
        # A preempted sequence drops its KV (re-prefilled later from prompt + output); a
        # paused one keeps it and is just not in the decode rows.
        for event in plan.events:
            if event.trigger in (Trigger.PREEMPT, Trigger.PAUSE):
                kind = "drop" if event.trigger is Trigger.PREEMPT else "pause"
                self.metrics.preemptions.labels(kind).inc()
                if event.seq_id in self._live:
                    self._live[event.seq_id].num_preemptions = event.rec.preemptions
                if kind == "drop" and event.seq_id in self.executor:
                    self.executor.evict(event.seq_id)

    def _execute(self, plan: Plan) -> list[int]:
        # The tick is one executor call (two on a tick that probes the streams' pace: the
        # decode rows', timed, then the slices'), each run so that a fault in one request's
        # work fails that request only (runtime/isolation.py).
        prefills = [w for w in plan.prefills if w.seq_id in self._live]
        decode = [seq_id for seq_id in plan.decode if seq_id in self._live]
        if self.budget.probe is not None and prefills and decode:
            # The decode rows in a forward of their own, timed, then the slices.
            start = time.perf_counter()
            tokens = run_isolated(self.executor, self._fail, decode=decode)
            if all(seq_id in tokens for seq_id in decode):  # none failed
                self.budget.observe_probe(time.perf_counter() - start)
            shape, start = self.budget.shape(prefills, []), time.perf_counter()
            tokens.update(run_isolated(self.executor, self._fail, prefills=prefills))
            if all(w.seq_id in self._live for w in prefills):  # none failed
                self.budget.observe_probe_slices(shape, time.perf_counter() - start)
        else:
            tokens = run_isolated(self.executor, self._fail, prefills, decode)
        self.metrics.prompt_tokens.inc(sum(w.num_tokens for w in prefills
                                           if w.seq_id in self._live))
        return self._publish(tokens)

    def _execute_lane(self, plan: Plan) -> tuple[list[int], int]:
        # A lane tick (runtime/lane.py): the rows' tokens go out as each step ends; a slice that
        # failed on the lane runs again here, apart, so that a fault fails its own sequence
        # only. Returns the sequences that finished and the rows' steps past their one.
        assert self._lane is not None
        prefills = [w for w in plan.prefills if w.seq_id in self._live]
        finished: list[int] = []

        def step(rows: list[int]) -> list[int]:
            # The tokens of the step queued after the last go out first, then the next step is
            # queued: the streams' gaps follow the pace, not the step's dispatch (ADR 0016).
            finished.extend(self._publish(run_isolated(self.executor, self._fail, decode=rows)))
            rows = [seq_id for seq_id in rows if seq_id in self._live and seq_id not in finished]
            if rows:
                try:
                    self.executor.queue_step(rows)
                except Exception:  # noqa: BLE001 - left as it was: the next step runs itself
                    log.exception("the decode rows' next step could not be queued")
            return rows

        job, steps, self._lane_step_s = self._lane.tick(
            lambda: self.executor.run(prefills, []), step,
            [seq_id for seq_id in plan.decode if seq_id in self._live],
            self.budget.lane_period_s(), self.scheduler.extra_room(plan), self._lane_step_s)
        tokens = job.result if job.error is None else \
            run_isolated(self.executor, self._fail, prefills=prefills)
        self.metrics.prompt_tokens.inc(sum(w.num_tokens for w in prefills
                                           if w.seq_id in self._live))
        return finished + self._publish(tokens), max(0, steps - 1)

    def _publish(self, tokens: Mapping[int, int]) -> list[int]:
        # Hand each sequence its token (and its log-probabilities); the ones it finished. Only
        # theirs: a lane may be committing another sequence's meanwhile.
        logprobs, prompt_logprobs = self.executor.take_logprobs(tokens.keys())
        now, finished = time.monotonic(), []
        for seq_id, token in tokens.items():
            try:
                if self._live[seq_id].accept(token, now, self.metrics, logprobs.get(seq_id),
                                             prompt_logprobs.get(seq_id)):
                    finished.append(seq_id)
            except Exception as exc:  # noqa: BLE001
                self._fail(seq_id, exc)
        return finished

    def _fork(self, plan: Plan) -> list[int]:
        # The sibling choices of each prompt (n > 1) whose first token came in this tick: born
        # decoding on a copy of its KV where they fit (statemachine.world.fork), else queued
        # arrivals that prefill the prompt themselves. Returns the siblings already finished
        # (by their first token), which the scheduler has finished too.
        finished = []
        for work in plan.prefills:
            live = self._live.get(work.seq_id)
            if live is not None and live.index == 0 and live.request.n > 1 and \
                    not live.forked and live.num_generated >= 1:
                live.forked = True
                finished += self._fork_siblings(live)
        with self._lock:
            for seq_id in finished:
                self.scheduler.finish(seq_id)
        return finished

    def _fork_siblings(self, live: LiveRequest) -> list[int]:
        request, bundle = live.request, self.bundle
        size = (len(request.prompt_tokens), request.sampling.max_tokens)
        born = []
        for index in range(1, request.n):
            child = LiveRequest(next(self._ids), request, live.sink, bundle.tokenizer,
                                bundle.eos_token_ids, live.response, index)
            live.response.fork()
            child.admitted_s = live.admitted_s  # its request was admitted: no queue place
            self._live[child.seq_id] = child
            self._by_request[request.request_id].append(child.seq_id)
            sampling = choice_sampling(request.sampling, index)
            with self._lock:
                forked = self.scheduler.fork(child.seq_id, live.seq_id, *size,
                                             request.client_id)
                if not forked:
                    self.scheduler.submit(child.seq_id, *size, request.client_id)
            if forked:
                born.append((child.seq_id, sampling))
            else:
                self.executor.add(child.seq_id, request.prompt_tokens, sampling,
                                  grammar=request.grammar)
        try:
            tokens = self.executor.fork(live.seq_id, born)
        except Exception as exc:  # noqa: BLE001
            for seq_id, _ in born:
                self._fail(seq_id, exc)
            return []
        return self._publish(tokens)

    def _fail(self, seq_id: int, exc: BaseException) -> None:
        log.error("request failed in the engine: %r", exc, exc_info=exc)
        live = self._live.get(seq_id)
        if live is not None:
            live.end("error", error=f"internal error while generating: {exc}")
            self._retire(seq_id, "error")

    def _retire(self, seq_id: int, cause: AbortCause | None) -> None:
        live = self._live.pop(seq_id)
        choices = self._by_request.get(live.request_id, [])
        if seq_id in choices:
            choices.remove(seq_id)
        if not choices:
            self._by_request.pop(live.request_id, None)
        self.admission.release(queued=live.admitted_s is None)
        if cause is not None:  # aborted (or failed) before it finished
            with self._lock:
                self.scheduler.abort(seq_id)
            live.end("abort")
        # Counted before its cache is freed: a server seen idle has counted every request.
        self._record_outcome(live, cause)
        if seq_id in self.executor:
            if cause != "error" and self.prefixes is not None:
                self.prefixes.keep(live, self.scheduler.world().seqs)
            self.executor.release(seq_id)

    def _record_outcome(self, live: LiveRequest, cause: AbortCause | None = None) -> None:
        # Without a cause, a sequence that ended unfinished ended with the engine.
        if cause is None and live.finish_reason in ("abort", "error"):
            cause = "error" if self.error else "server_shutdown"
        self.outcomes.end(live.response, live.ended(time.monotonic(), cause))

    def _make_prefix_reuse(self) -> PrefixReuse | None:
        if not self.config.prefix_cache or not self.executor.can_cache_prefixes:
            if self.config.prefix_cache:
                log.info("prefix cache off: %s's KV caches are not plain KVCache",
                         type(self.bundle.model).__module__)
            return None
        return PrefixReuse(self.executor, self.metrics,
                           self.config.prefix_cache_tokens or self.kv.tokens, self.kv.tokens,
                           self.policy.spec.kv_full)

    def _note_admissions(self, now_s: float) -> None:
        for live in self._live.values():
            if live.admitted_s is None:
                role = self.scheduler.role(live.seq_id)
                if role is not None and role is not Role.QUEUED:
                    live.admitted_s = now_s
                    if live.response.admit(now_s):  # observed once per response
                        self.metrics.queue_time.observe(now_s - live.response.submitted_s)
                    self.admission.admitted(now_s)

    def _set_gauges(self) -> int:
        """Set the sequence and KV gauges; returns the KV tokens in use."""
        return self.metrics.set_gauges(self.scheduler.world(), self.scheduler.tick_state())
