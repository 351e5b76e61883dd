"""Whether a run's latencies can be attributed to the admission, and what the policy under
test may do (read from its spec, the single source of truth)."""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
ACTIONS = ("idle", "decode", "prefill", "mixed")


class NotComparable(Exception):
    """Attribution failed: this run's numbers must not be put beside another's."""


@dataclass(frozen=True)
class PolicyRules:
    """The rule names of a policy, by the action each rule takes."""

    name: str
    rules_by_action: dict[str, frozenset[str]]

    @property
    def actions(self) -> frozenset[str]:
        return frozenset(a for a, rules in self.rules_by_action.items() if rules)


def policy_actions(name: str) -> PolicyRules | None:
    """The rules of the shipped policy (or spec path) `name`; None if it cannot be loaded."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from statemachine.spec import SpecError, load_policy

    try:
        spec = load_policy(name)
    except (SpecError, OSError):
        return None
    return PolicyRules(spec.name, {a: frozenset(r.name for r in spec.rules if r.action == a)
                                   for a in ACTIONS})


@dataclass(frozen=True)
class Facts:
    """What the trace says about the prompt, and notes for the report."""

    prompt_chunks: int
    contended_chunks: int  # prompt chunks done while some stream was still live
    grants_by_rule: dict[str, int]
    notes: list[str]
    prompt_cached_tokens: int = 0  # its arrival's tokens served from the prefix cache


def check_attribution(cfg: Any, run: Any, quiet: list[list[float]],
                      admission: list[list[float]], delta: dict[str, float],
                      rules: PolicyRules | None) -> Facts:
    """Facts of a comparable run; NotComparable naming the first reason it is not."""
    _check_streams(cfg, run, quiet, admission)
    facts = _trace_facts(run)
    if delta.get("fairtick_prefill_chunks_total", 0) <= 0 or facts.prompt_chunks == 0:
        raise NotComparable("no prefill-chunk progress in the admission window")
    late = [i for i, s in enumerate(run.streams) if s.times_s[-1] < run.t_first]
    if late and facts.contended_chunks:
        raise NotComparable(
            f"stream(s) {late} ended before the prompt's first token although "
            f"{facts.contended_chunks} of its chunks ran beside them: the streams are too "
            f"short to straddle the admission window (raise --stream-tokens)")
    if late:
        facts.notes.append("the prompt made no progress while the streams decoded: it waited "
                           "for the whole batch to finish (starvation)")
    if not facts.contended_chunks and delta.get("fairtick_prefill_grants_total", 0) > 0:
        raise NotComparable("counters contradict the trace: prefill grants beside decoding "
                            "streams, but none of the prompt's chunks ran beside them "
                            "(other traffic?)")
    _check_policy(delta, facts, rules, run)
    return facts


def _check_streams(cfg: Any, run: Any, quiet: list[list[float]],
                   admission: list[list[float]]) -> None:
    if run.prompt.error or not run.prompt.done:
        raise NotComparable(f"the admitted prompt failed: {run.prompt.error}")
    for i, s in enumerate(run.streams):
        if s.error or not (s.done or s.cancelled):
            raise NotComparable(f"stream {i} failed: {s.error}")
        if s.times_s[-1] <= run.t_admit:
            raise NotComparable(f"stream {i} ended before the admission: it did not straddle "
                                f"the admission window (raise --stream-tokens)")
        if len(quiet[i]) < cfg.min_quiet_gaps:
            raise NotComparable(f"stream {i} has {len(quiet[i])} inter-token gaps in the quiet "
                                f"window, fewer than {cfg.min_quiet_gaps} (raise --settle-s)")
        if not admission[i]:
            raise NotComparable(f"stream {i} has no inter-token gap in the admission window")


def _trace_facts(run: Any) -> Facts:
    events = run.trace
    admitted = [e["seq"] for e in events
                if e["trigger"] == "admit" and e["seq"] not in run.stream_seqs]
    if len(admitted) != 1:
        raise NotComparable(f"the trace shows {len(admitted)} admissions after the streams' "
                            f"(expected the prompt alone; other traffic, or a too small "
                            f"--trace-capacity)")
    prompt_seq = admitted[0]
    ends = {e["seq"]: e["tick"] for e in events
            if e["seq"] in run.stream_seqs and e["to"] in ("finished", "aborted")}
    if set(ends) != run.stream_seqs:
        raise NotComparable("the trace lacks the end of some stream")
    last_end = max(ends.values())
    chunk_ticks = [e["tick"] for e in events
                   if e["seq"] == prompt_seq and e["trigger"] == "chunk_done"]
    grants = Counter(e["rule"] for e in events if e["trigger"] == "grant")
    cached = [e.get("cached_tokens", 0) for e in events
              if e["seq"] == prompt_seq and e.get("kind") == "arrival"]
    return Facts(len(chunk_ticks), sum(1 for t in chunk_ticks if t <= last_end), dict(grants),
                 [], cached[0] if cached else 0)


def _check_policy(delta: dict[str, float], facts: Facts, rules: PolicyRules | None,
                  run: Any) -> None:
    if rules is None:
        facts.notes.append("policy spec not found: counters not checked against the policy")
        return
    for action in ACTIONS:
        ticks = delta.get(f'fairtick_ticks_total{{action="{action}"}}', 0)
        if ticks > 0 and action not in rules.actions:
            raise NotComparable(f"counters contradict policy {rules.name}: {ticks:.0f} "
                                f"{action} ticks, but none of its rules takes that action")
    if delta.get("fairtick_mixed_steps_total", 0) > 0 and "mixed" not in rules.actions:
        raise NotComparable(f"counters contradict policy {rules.name}: mixed steps under a "
                            f"policy with no mixed rule")
    granting = rules.rules_by_action["prefill"] | rules.rules_by_action["mixed"]
    foreign = sorted(set(facts.grants_by_rule) - granting)
    if foreign:
        raise NotComparable(f"the trace shows grants by rule(s) {foreign}, which policy "
                            f"{rules.name} does not have")
