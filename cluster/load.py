"""A replica's load as its engine sees it, and the order in which the router tries replicas.

Imports neither Ray nor MLX: the replica measures a `ReplicaLoad` from its engine and reports
it to Ray Serve (`record_routing_stats`); the router reads it back from the stats dict and
ranks the replicas with `rank_replicas`. The ranking is the scheduler's view of where a new
request's first token comes soonest: a replica that cannot fit the request's tokens in its
free KV would queue it (or preempt someone), so it goes last; among the rest, the fewer prompt
tokens left to prefill ahead of it (parked prompts, queued arrivals), the sooner its prompt is
granted; then the fewer streams decoding, the smaller each tick next to which it prefills.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from statemachine.lifecycle import Role

# Prompt bytes a token, for a request the router sent after the replica's last report: BPE
# tokenizers make about 4 bytes of English a token (the built-in byte-level model makes 1).
# Only the order of sizes matters here (a chat vs a 10k-token prompt), not their exact tokens.
BYTES_PER_TOKEN = 4


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica's engine, measured at `time_s` (wall clock, seconds)."""

    time_s: float
    alive: bool
    waiting: int  # requests taken and not admitted yet (admission's queue)
    decoding: int  # streams that decode a token each tick
    prefill_tokens: int  # prompt tokens left to prefill, over every live sequence
    kv_used_tokens: int
    kv_budget_tokens: int

    def to_stats(self) -> dict[str, Any]:
        """The dict a replica's `record_routing_stats` returns."""
        return dataclasses.asdict(self)

    @classmethod
    def from_stats(cls, stats: Mapping[str, Any] | None) -> ReplicaLoad | None:
        """The load in a routing-stats dict; None for one that has not reported yet (Ray's
        stats start empty) or reports something else."""
        names = [f.name for f in dataclasses.fields(cls)]
        if not stats or any(name not in stats for name in names):
            return None
        return cls(**{name: stats[name] for name in names})


def engine_load(engine: Any, now_s: float) -> ReplicaLoad:
    """The load of a running `runtime.engine.Engine` (its snapshot and admission queue)."""
    snapshot = engine.snapshot()
    seqs = snapshot["sequences"]
    return ReplicaLoad(
        time_s=now_s, alive=bool(snapshot["alive"]), waiting=engine.admission.num_queued,
        decoding=sum(1 for s in seqs if s["role"] == Role.DECODING.word),
        prefill_tokens=sum(max(0, int(s["prefill_left"])) for s in seqs),
        kv_used_tokens=int(snapshot["kv"]["cached_tokens"]),
        kv_budget_tokens=int(snapshot["kv"]["budget_tokens"]))


@dataclass(frozen=True)
class Candidate:
    """A replica the router may choose: its last report and what was sent to it since."""

    replica: Hashable
    load: ReplicaLoad | None  # None: no report yet
    unreported_tokens: int = 0  # prompt tokens (estimated) routed after `load` was measured
    unreported_requests: int = 0


def rank_replicas(candidates: Sequence[Candidate], request_tokens: int,
                  rng: random.Random | None = None) -> list[Hashable]:
    """The replicas in the order to try them for a request of about `request_tokens` prompt
    tokens: dead engines last, then those the request would not fit in KV now, then by prompt
    tokens left to prefill, then by streams decoding; ties in random order (so that several
    routers reading the same reports do not all pick the same replica)."""
    rng = rng or random.Random()
    shuffled = list(candidates)
    rng.shuffle(shuffled)
    return [c.replica for c in sorted(shuffled, key=lambda c: _key(c, request_tokens))]


def _key(c: Candidate, request_tokens: int) -> tuple[bool, bool, int, int]:
    load = c.load or ReplicaLoad(0.0, True, 0, 0, 0, 0, 0)
    ahead = load.prefill_tokens + c.unreported_tokens
    kv_after = load.kv_used_tokens + c.unreported_tokens + request_tokens
    # A replica that has not reported yet has a budget of 0: it counts as fitting.
    fits = not load.kv_budget_tokens or kv_after <= load.kv_budget_tokens
    return (not load.alive, not fits, ahead, load.decoding + load.waiting + c.unreported_requests)


def estimate_tokens(prompt_bytes: int) -> int:
    """Prompt tokens for a request body of `prompt_bytes` bytes, before any replica saw it."""
    return max(0, prompt_bytes) // BYTES_PER_TOKEN
