"""The Ray Serve request routers of the fairtick replicas (Ray ships this module by value to
every process that routes, so its state lives in cluster.pins).

`FairtickRouter` (the default) ranks the replicas by the load each engine reports through
`record_routing_stats` (cluster.load.rank_replicas: KV room, prompt tokens left to prefill,
streams decoding), adding the requests it has sent a replica since that replica's last report,
which the report cannot know yet. `PowerOfTwoRouter` is Ray Serve's default router (two random
replicas, the one with fewer open requests), kept to compare against
(scripts/bench_cluster_routing.py). Both honour a pin (cluster.pins): the ingress pins
/metrics to each replica in turn, and a client may pin with the `fairtick-replica` header.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from cluster import pins
from cluster.load import Candidate, ReplicaLoad, estimate_tokens, rank_replicas


@dataclass(frozen=True)
class _Sent:
    replica: ReplicaID
    sent_s: float
    tokens: int


class FairtickRouter(RequestRouter):
    """Ranks replicas by their engines' reported load plus what was sent since."""

    def initialize_state(self, **kwargs: Any) -> None:
        self._sent: dict[str, _Sent] = {}  # by internal request id, until completed
        pins.register(self, self._deployment_id.name)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        pinned = pins.pinned(candidate_replicas, pending_request)
        if pinned is not None or not candidate_replicas:
            return pinned or []
        tokens = 0
        if pending_request is not None:
            # Without it, Ray retries at once, in a tight loop, while every replica is full.
            pending_request.routing_context.should_backoff = True
            tokens = estimate_tokens(int(pending_request.kwargs.get(pins.PROMPT_BYTES_KWARG, 0)))
        by_id = {r.replica_id: r for r in candidate_replicas}
        order = rank_replicas([self._candidate(r) for r in candidate_replicas], tokens)
        if pending_request is not None:
            # The first rank is where Ray sends it unless that replica is full.
            self._sent[pending_request.metadata.internal_request_id] = _Sent(
                by_id[order[0]].replica_id, time.time(), tokens)  # type: ignore[index]
        return [[by_id[replica_id]] for replica_id in order]  # type: ignore[index]

    def _candidate(self, replica: RunningReplica) -> Candidate:
        load = ReplicaLoad.from_stats(replica.routing_stats)
        reported_s = load.time_s if load is not None else 0.0
        since = [s for s in self._sent.values()
                 if s.replica == replica.replica_id and s.sent_s > reported_s]
        return Candidate(replica.replica_id, load, sum(s.tokens for s in since), len(since))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._sent.pop(internal_request_id, None)


class PowerOfTwoRouter(PowerOfTwoChoicesRequestRouter):  # type: ignore[misc]
    """Ray Serve's default router, with pins: the baseline the benchmark compares against."""

    def initialize_state(self, **kwargs: Any) -> None:
        super().initialize_state(**kwargs)
        pins.register(self, self._deployment_id.name)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        pinned = pins.pinned(candidate_replicas, pending_request)
        if pinned is not None:
            return pinned
        return list(await super().choose_replicas(candidate_replicas, pending_request))
