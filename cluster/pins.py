"""What the ingress and the routers share in one process: the keywords a request carries for
its router, the routers that run here (so the ingress can list the live replicas) and pins.

Kept apart from cluster.router because Ray Serve ships a router's module by value (cloudpickle)
to each process that routes: a registry there would be a copy the ingress never sees.
"""

from __future__ import annotations

import threading
from typing import Any

PIN_KWARG = "fairtick_replica"  # the unique id of the replica a request must go to
PROMPT_BYTES_KWARG = "fairtick_prompt_bytes"  # the size of a request's body
# The routers that fairtick_cluster deploys, by the name of `fairtick cluster --router`.
ROUTER_PATHS = {"fairtick": "cluster.router.FairtickRouter",
                "power-of-two": "cluster.router.PowerOfTwoRouter"}

_routers: dict[str, Any] = {}  # this process's routers, by deployment name
_lock = threading.Lock()  # the ingress reads from its thread; a router writes from Ray's loop


def register(router: Any, deployment: str) -> None:
    """Called by each router when Ray builds it: this process routes `deployment` with it."""
    with _lock:
        _routers[deployment] = router


def live_replica_ids(deployment: str) -> list[str]:
    """The unique ids of the replicas this process's router of `deployment` routes to (empty
    before the handle has routed its first request)."""
    with _lock:
        router = _routers.get(deployment)
    if router is None:
        return []
    return sorted(replica_id.unique_id for replica_id in list(router.curr_replicas))


def pinned(candidates: list[Any], pending: Any) -> list[list[Any]] | None:
    """The rank of a request pinned to a replica (`PIN_KWARG`), or None if it is not pinned.
    A pin to a replica that is not live matches nothing, and Ray retries with backoff until
    the caller's timeout."""
    pin = pending.kwargs.get(PIN_KWARG) if pending is not None else None
    if not pin:
        return None
    pending.routing_context.should_backoff = True
    return [[r for r in candidates if r.replica_id.unique_id == pin]]
