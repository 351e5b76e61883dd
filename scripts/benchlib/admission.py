"""The admission scenario against a running server: N decode streams, then one long prompt.

Timeline (client monotonic clock): the streams start; once all have a token, the quiet window
runs for `settle_s`; the prompt is sent at t_admit; the admission window ends at its first
token, t_first. Every stream is then closed a few tokens later (or runs to max_tokens if the
policy makes the prompt wait for it). Anything that breaks the attribution of latencies to
these windows raises NotComparable instead of returning numbers.

The streams are judged against their own pace: "own p95" is the larger of the quiet window's
p95 and the p95 of the `post_s` seconds right after the prompt's first token (a stream's own
steps slow as its context grows, so the quiet window alone would flatter later gaps). The
work-conserving limit is what no policy can beat while holding the streams to the target ITL
(TARGET_P99_OVER_OWN times their own p95): decode needs the share d / target of the machine,
d the streams' own median step, so the prompt gets at most the rest and its TTFT is at least
TTFT alone / (1 - d / target).

With `shared_prefix_tokens` S > 0 (the prefix cache's case: an agent's system prompt), the
streams' prompts, the prompt alone and the admitted prompt all begin with the same S-token
system prompt, which the warm-up sends first, and every request may use the prefix cache
(`"cache_prompt": true`; without S they all opt out, so that no prompt is served from another's
KV). The prompts differ after the system prompt, so each is served S tokens from the cache on a
server whose cache is on, and prefills them all on one started with `--no-prefix-cache`.
"""

from __future__ import annotations

import math
import random
import string
import time
from dataclasses import dataclass, field
from typing import Any

from benchlib.attribution import NotComparable, check_attribution, policy_actions
from benchlib.client import TimedStream, get_json, get_metrics, get_trace, wait_idle
from benchlib.windows import GapStats, Window, gaps_in, ratio

# The issue's bar for the default policy: admission-window ITL p99 and max against the streams'
# own p95, and the prompt's TTFT against its TTFT alone.
TARGET_P99_OVER_OWN, TARGET_MAX_OVER_OWN, TARGET_TTFT_RATIO = 4.0, 10.0, 1.5

COUNTERS = ("fairtick_prefill_chunks_total", "fairtick_prefill_grants_total",
            "fairtick_mixed_steps_total", "fairtick_decode_steps_total")


@dataclass(frozen=True)
class AdmissionConfig:
    """One measurement; ValueError names a bad field."""

    url: str
    streams: int = 4
    stream_tokens: int = 8192
    prompt_tokens: int = 10_000
    settle_s: float = 5.0
    post_s: float = 5.0  # the streams decode this long after the prompt's first token
    alone: str = "first"  # when to measure the prompt alone: first, last or skip
    ttft_alone_s: float | None = None  # a known value instead of measuring it
    tail_tokens: int = 3
    start_timeout_s: float = 30.0  # until every stream has its first token
    min_quiet_gaps: int = 5
    timeout_s: float = 900.0
    seed: int = 0
    shared_prefix_tokens: int = 0  # a system prompt every request begins with (0: none)

    def __post_init__(self) -> None:
        checks = {"streams": self.streams >= 1, "stream_tokens": self.stream_tokens >= 2,
                  "prompt_tokens": self.prompt_tokens >= 2, "settle_s": self.settle_s >= 0,
                  "post_s": self.post_s >= 0,
                  "alone": self.alone in ("first", "last", "skip"),
                  "tail_tokens": self.tail_tokens >= 1, "timeout_s": self.timeout_s > 0,
                  "start_timeout_s": self.start_timeout_s > 0,
                  "min_quiet_gaps": self.min_quiet_gaps >= 1,
                  "shared_prefix_tokens":
                      0 <= self.shared_prefix_tokens < self.prompt_tokens - 1}
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"{name}: invalid value {getattr(self, name)!r}")

    @property
    def cache_prompt(self) -> bool:
        """Whether requests may use the prefix cache: only when they share a system prompt."""
        return self.shared_prefix_tokens > 0

    @property
    def system_prompt(self) -> str:
        """The text every request begins with ("" without a shared prefix)."""
        return _text(self.shared_prefix_tokens, "system") if self.cache_prompt else ""

    def prompt(self, which: str, seed: int) -> str:
        """The long prompt (`which`: "alone" or "admitted"): `prompt_tokens` tokens with BOS,
        after the system prompt if there is one."""
        if not self.cache_prompt:
            return make_prompt(self.prompt_tokens, seed)
        return self.system_prompt + _text(self.prompt_tokens - 1 - self.shared_prefix_tokens,
                                          f"{which}-{seed}")


@dataclass(frozen=True)
class AdmissionResult:
    """What one run measured; times in seconds unless named _ms."""

    policy: str
    params: dict[str, Any]
    max_running: int
    chunk_tokens: int
    streams: int
    prompt_tokens: int
    prompt_cached_tokens: int  # of the admitted prompt, served from the prefix cache
    shared_prefix_tokens: int
    ttft_s: float
    ttft_alone_s: float
    ttft_ratio: float
    quiet: list[GapStats]  # one per stream
    admission: list[GapStats]
    quiet_pooled: GapStats
    admission_pooled: GapStats
    post_pooled: GapStats  # the post_s seconds after the prompt's first token
    p95_inflation: float
    own_p95_ms: float  # max(quiet p95, post p95)
    p99_over_own: float  # admission-window p99 / own p95
    max_over_own: float  # admission-window max / own p95
    work_conserving_limit: float  # the lowest TTFT / TTFT alone at the target ITL
    first_token_before_last_stream_token: bool
    prompt_chunks: int
    prompt_chunks_while_streams_live: int
    quiet_tokens_per_s: float
    counters: dict[str, float]  # deltas over the admission window
    grants_by_rule: dict[str, int]
    # Per kind of tick sized for a latency target (mixed, probe): how many ran in the
    # admission window ("ticks"), and the shares of them longer than their target ("over_1")
    # and than 1.25x it ("over_1.25"); NaN shares where none ran (a policy without a target).
    over_target: dict[str, dict[str, float]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def make_prompt(num_tokens: int, seed: int) -> str:
    """Printable text of about num_tokens tokens (one per byte, plus BOS)."""
    return _text(num_tokens - 1, seed)


def _text(num_chars: int, seed: int | str) -> str:
    rng = random.Random(seed)
    alphabet = string.ascii_letters + string.digits + " "
    return "".join(rng.choice(alphabet) for _ in range(num_chars))


def run_admission(cfg: AdmissionConfig) -> AdmissionResult:
    """Measure once; NotComparable when attribution fails."""
    deadline = time.monotonic() + cfg.timeout_s
    state = get_json(cfg.url, "/debug/state")
    if state["max_running"] < cfg.streams + 1:
        raise NotComparable(f"the server runs at most {state['max_running']} sequences: "
                            f"{cfg.streams} streams and the prompt need {cfg.streams + 1} "
                            "(--max-running)")
    missing = [c for c in COUNTERS if c not in get_metrics(cfg.url)]
    if missing:
        raise NotComparable(f"missing counters in /metrics: {', '.join(missing)}")
    wait_idle(cfg.url, timeout_s=60)
    _complete(cfg, "warm-up", cfg.system_prompt + "warm up", 2, deadline)
    alone_s = cfg.ttft_alone_s
    if alone_s is None and cfg.alone == "first":
        alone_s = _measure_alone(cfg, deadline)
    run = _contend(cfg, deadline)
    if alone_s is None and cfg.alone == "last":
        wait_idle(cfg.url, timeout_s=60)
        alone_s = _measure_alone(cfg, deadline)
    return _summarize(cfg, state, run, math.nan if alone_s is None else alone_s)


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise NotComparable("the run exceeded --timeout-s")
    return left


def _complete(cfg: AdmissionConfig, what: str, prompt: str, max_tokens: int,
              deadline: float) -> TimedStream:
    stream = TimedStream(cfg.url, prompt, max_tokens, _remaining(deadline),
                         cache_prompt=cfg.cache_prompt).start()
    if not stream.join(_remaining(deadline)) or stream.error or not stream.done:
        raise NotComparable(f"the {what} request failed: {stream.error or 'timed out'}")
    return stream


def _measure_alone(cfg: AdmissionConfig, deadline: float) -> float:
    stream = _complete(cfg, "prompt-alone", cfg.prompt("alone", cfg.seed + 1), 1, deadline)
    assert stream.ttft_s is not None
    return stream.ttft_s


@dataclass
class _Run:
    streams: list[TimedStream]
    prompt: TimedStream
    t_streaming: float
    t_admit: float
    t_first: float
    tick_admit: int
    stream_seqs: set[int]
    at_admit: dict[str, float]
    at_first: dict[str, float]
    trace: list[dict[str, Any]]


def _contend(cfg: AdmissionConfig, deadline: float) -> _Run:
    streams = [TimedStream(cfg.url, f"{cfg.system_prompt}stream {i}: ", cfg.stream_tokens,
                           _remaining(deadline), cache_prompt=cfg.cache_prompt)
               for i in range(cfg.streams)]
    try:
        return _admit_into(cfg, streams, deadline)
    finally:
        for s in streams:  # on any failure, do not leave streams running for max_tokens
            if not s.ended:
                s.close()


def _admit_into(cfg: AdmissionConfig, streams: list[TimedStream], deadline: float) -> _Run:
    for s in streams:
        s.start()
    _wait_streaming(cfg, streams, deadline)
    t_streaming = max(s.times_s[0] for s in streams)
    time.sleep(cfg.settle_s)
    ended = [i for i, s in enumerate(streams) if s.ended]
    if ended:
        raise NotComparable(f"stream(s) {ended} ended before the admission: they cannot "
                            f"straddle the admission window (raise --stream-tokens)")
    state = get_json(cfg.url, "/debug/state")
    seqs = state["sequences"]
    if len(seqs) != cfg.streams or any(s["state"] != "decoding" for s in seqs):
        raise NotComparable(f"at admission the server held {[s['state'] for s in seqs]}, not "
                            f"{cfg.streams} decoding streams (other traffic, or streams too "
                            f"short: raise --stream-tokens)")
    at_admit = get_metrics(cfg.url)
    prompt = TimedStream(cfg.url, cfg.prompt("admitted", cfg.seed), 1, _remaining(deadline),
                         cache_prompt=cfg.cache_prompt).start()
    prompt.first_token.wait(_remaining(deadline))
    if not prompt.times_s or prompt.sent_s is None:
        raise NotComparable(f"the admitted prompt failed: {prompt.error or 'timed out'}")
    at_first = get_metrics(cfg.url)
    t_first = prompt.times_s[0]
    for s in streams:
        s.stop_after(t_first + cfg.post_s, cfg.tail_tokens)
    for i, s in enumerate([*streams, prompt]):
        if not s.join(_remaining(deadline)):
            raise NotComparable(f"stream {i} did not end before --timeout-s")
    short = [i for i, s in enumerate(streams)  # (streams over before t_first: attribution's)
             if cfg.post_s > 0 and not s.cancelled and s.times_s[-1] >= t_first]
    if short:
        raise NotComparable(f"stream(s) {short} reached max_tokens within {cfg.post_s:g} s "
                            f"of the prompt's first token: they did not outlast the prompt "
                            f"(raise --stream-tokens)")
    wait_idle(cfg.url, timeout_s=60)
    return _Run(streams, prompt, t_streaming, prompt.sent_s, t_first, int(state["tick"]),
                {int(s["seq"]) for s in seqs}, at_admit, at_first,
                get_trace(cfg.url, int(state["tick"])))


def _wait_streaming(cfg: AdmissionConfig, streams: list[TimedStream], deadline: float) -> None:
    start_by = min(deadline, time.monotonic() + cfg.start_timeout_s)
    for i, s in enumerate(streams):
        s.first_token.wait(max(0.0, start_by - time.monotonic()))
        if s.error:
            raise NotComparable(f"stream {i} failed before its first token: {s.error}")
    started = sum(1 for s in streams if s.times_s)
    if started < len(streams):
        states = sorted(q["state"] for q in get_json(cfg.url, "/debug/state")["sequences"])
        raise NotComparable(
            f"after {cfg.start_timeout_s:.0f} s only {started} of {len(streams)} streams had a "
            f"token (server holds {states}): the policy does not prefill the streams' own "
            f"prompts beside a decoding stream, so they cannot all decode at once "
            f"(measure it with --streams 1)")


def _summarize(cfg: AdmissionConfig, state: dict[str, Any], run: _Run,
               alone_s: float) -> AdmissionResult:
    quiet_w, adm_w = Window(run.t_streaming, run.t_admit), Window(run.t_admit, run.t_first)
    post_w = Window(run.t_first, run.t_first + cfg.post_s)
    quiet = [gaps_in(s.times_s, quiet_w) for s in run.streams]
    admission = [gaps_in(s.times_s, adm_w, mostly=True) for s in run.streams]
    post = [g for s in run.streams for g in gaps_in(s.times_s, post_w)]
    delta = {k: v - run.at_admit.get(k, 0.0) for k, v in run.at_first.items()
             if k.endswith("_total") or k.startswith("fairtick_ticks_total{")}
    over_target = ticks_over_target(run.at_admit, run.at_first)
    spec = policy_actions(state["policy"])
    facts = check_attribution(cfg, run, quiet, admission, delta, spec)
    quiet_pooled = GapStats.of([g for gs in quiet for g in gs])
    admission_pooled = GapStats.of([g for gs in admission for g in gs])
    post_pooled = GapStats.of(post)
    own_p95 = max(quiet_pooled.p95_ms, post_pooled.p95_ms if post else 0.0)
    own_step = max(quiet_pooled.p50_ms, post_pooled.p50_ms if post else 0.0)
    ttft_s = run.t_first - run.t_admit
    quiet_s = quiet_w.end_s - quiet_w.start_s
    return AdmissionResult(
        policy=state["policy"], params=state["params"], max_running=state["max_running"],
        chunk_tokens=state["prefill_chunk_size"], streams=cfg.streams,
        prompt_tokens=cfg.prompt_tokens, prompt_cached_tokens=facts.prompt_cached_tokens,
        shared_prefix_tokens=cfg.shared_prefix_tokens, ttft_s=ttft_s, ttft_alone_s=alone_s,
        ttft_ratio=ratio(ttft_s, alone_s), quiet=[GapStats.of(g) for g in quiet],
        admission=[GapStats.of(g) for g in admission], quiet_pooled=quiet_pooled,
        admission_pooled=admission_pooled, post_pooled=post_pooled,
        p95_inflation=ratio(admission_pooled.p95_ms, quiet_pooled.p95_ms),
        own_p95_ms=own_p95, p99_over_own=ratio(admission_pooled.p99_ms, own_p95),
        max_over_own=ratio(admission_pooled.max_ms, own_p95),
        work_conserving_limit=work_conserving_limit(own_step, own_p95),
        first_token_before_last_stream_token=run.t_first < max(s.times_s[-1]
                                                               for s in run.streams),
        prompt_chunks=facts.prompt_chunks,
        prompt_chunks_while_streams_live=facts.contended_chunks,
        quiet_tokens_per_s=sum(len(g) for g in quiet) / quiet_s if quiet_s > 0 else math.nan,
        counters={k: v for k, v in delta.items() if not k.endswith("_created")},
        grants_by_rule=facts.grants_by_rule, over_target=over_target, notes=facts.notes)


OVER_TARGET = "fairtick_tick_over_target_ratio"


def ticks_over_target(before: dict[str, float],
                      after: dict[str, float]) -> dict[str, dict[str, float]]:
    """From two /metrics snapshots (get_metrics): per kind of tick sized for a latency target,
    the ticks between them and the shares longer than 1x and 1.25x their target."""
    def delta(sample: str, labels: str) -> float:
        key = f"{OVER_TARGET}_{sample}{{{labels}}}"
        return after.get(key, 0.0) - before.get(key, 0.0)

    out = {}
    for kind in ("mixed", "probe"):
        ticks = delta("count", f'kind="{kind}"')
        out[kind] = {"ticks": ticks, **{
            f"over_{bound:g}": ratio(ticks - delta("bucket", f'kind="{kind}",le="{bound}"'),
                                     ticks)
            for bound in (1.0, 1.25)}}
    return out


def work_conserving_limit(step_ms: float, own_p95_ms: float) -> float:
    """The lowest TTFT / TTFT alone a policy can reach while the streams' ITL stays at the
    target (TARGET_P99_OVER_OWN x own p95), their steps taking step_ms: 1 / (1 - decode share)."""
    share = ratio(step_ms, TARGET_P99_OVER_OWN * own_p95_ms)
    return math.nan if math.isnan(share) or share >= 1 else 1.0 / (1.0 - share)
