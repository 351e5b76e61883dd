"""Start and stop a fairtick cluster: Ray (local, or an existing cluster), Ray Serve's HTTP
proxy on the endpoint's address, and the application: N `FairtickReplica`s behind one
`Ingress`, routed by the chosen router (cluster.router)."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from cluster.ingress import Ingress
from cluster.pins import ROUTER_PATHS
from cluster.replica import FairtickReplica
from server.config import ServerConfig

log = logging.getLogger("fairtick.cluster")
APP_NAME = "fairtick"
REPLICA_DEPLOYMENT = "FairtickReplica"
# The directory holding cluster/, server/, runtime/: replicas import the same code as the
# command that started them (a path missing on another machine is skipped by Python, which
# then imports the fairtick installed there).
CODE_ROOT = str(Path(__file__).resolve().parents[1])
# Environment the replicas need as the command has it (the BLAS under MLX, the caches).
FORWARDED_ENV = ("FAIRTICK_BLAS", "FAIRTICK_CACHE", "FAIRTICK_POLICY", "FAIRTICK_API_KEY")


@dataclass(frozen=True)
class ClusterSpec:
    """How many replicas, routed how, on which Ray; validated on construction."""

    replicas: int = 2
    router: str = "fairtick"
    stats_period_s: float = 0.2  # how often each replica reports its load to the routers
    replica_cpus: float = 1.0  # Ray CPUs each replica reserves (its engine uses what it finds)
    address: str | None = None  # a running Ray cluster ("auto", "ray://host:10001"); None: local
    num_cpus: int | None = None  # CPUs of a local Ray (None: the machine's)
    max_ongoing_requests: int = 1024  # a replica's open requests; its engine's queue refuses first

    def __post_init__(self) -> None:
        if not isinstance(self.replicas, int) or self.replicas < 1:
            raise ValueError(f"--replicas must be an integer >= 1, got {self.replicas!r}")
        if self.router not in ROUTER_PATHS:
            raise ValueError(f"--router must be one of {', '.join(ROUTER_PATHS)}, got "
                             f"{self.router!r}")
        if not 0.01 <= self.stats_period_s <= 60:
            raise ValueError(f"--stats-period-s must be in [0.01, 60], got "
                             f"{self.stats_period_s!r}")
        if not 0 <= self.replica_cpus <= 1024:
            raise ValueError(f"--replica-cpus must be in [0, 1024], got {self.replica_cpus!r}")
        if self.num_cpus is not None and self.num_cpus < 1:
            raise ValueError(f"--num-cpus must be an integer >= 1, got {self.num_cpus!r}")
        if self.max_ongoing_requests < 1:
            raise ValueError("max_ongoing_requests must be an integer >= 1, got "
                             f"{self.max_ongoing_requests!r}")


def build_app(config: ServerConfig, spec: ClusterSpec) -> Any:
    """The Ray Serve application: the replicas (each a whole engine with `config`) behind
    the ingress."""
    router = RequestRouterConfig(
        request_router_class=ROUTER_PATHS[spec.router],
        request_routing_stats_period_s=spec.stats_period_s)
    replica = serve.deployment(FairtickReplica).options(
        name=REPLICA_DEPLOYMENT, num_replicas=spec.replicas,
        max_ongoing_requests=spec.max_ongoing_requests,
        ray_actor_options={"num_cpus": spec.replica_cpus},
        request_router_config=router,
        graceful_shutdown_timeout_s=config.stop_grace_s + 2.0)
    ingress = serve.deployment(Ingress).options(
        name="Ingress", num_replicas=1, max_ongoing_requests=spec.max_ongoing_requests * 4,
        ray_actor_options={"num_cpus": 0},
        # It relays the replicas' streams: it must outlive their grace.
        graceful_shutdown_timeout_s=config.stop_grace_s + 4.0)
    # One `created` for every replica's model cards (each made its own, a second apart).
    created = config.created if config.created is not None else int(time.time())
    return ingress.bind(replica.bind(replace(config, created=created)), REPLICA_DEPLOYMENT)


def init_ray(spec: ClusterSpec) -> None:
    """Start a local Ray, or join the running cluster at `spec.address`; the replicas get this
    command's code path and fairtick's environment variables."""
    env = {name: os.environ[name] for name in FORWARDED_ENV if name in os.environ}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (CODE_ROOT, os.environ.get("PYTHONPATH"))
                                        if p)
    if not ray.is_initialized():
        ray.init(address=spec.address, num_cpus=spec.num_cpus if spec.address is None else None,
                 include_dashboard=False, logging_level=logging.WARNING,
                 runtime_env={"env_vars": env})


def deploy(config: ServerConfig, spec: ClusterSpec) -> str:
    """Serve's HTTP proxy on `config.host:config.port` and the application on it; returns the
    endpoint's URL once every replica serves."""
    serve.start(http_options={"host": config.host, "port": config.port})
    serve.run(build_app(config, spec), name=APP_NAME, route_prefix="/")
    return f"http://{config.host}:{config.port}"


def replica_actor_name(replica_id: str) -> str:
    """The name of a replica's Ray actor (namespace "serve"), as Ray Serve names it."""
    return f"SERVE_REPLICA::{APP_NAME}#{REPLICA_DEPLOYMENT}#{replica_id}"


def stop_cluster(port: int | None = None, grace_s: float = 0.0) -> None:
    """Delete the application, then stop Serve (its proxy and controller) and Ray. Ray Serve
    stops each replica once its in-flight requests have ended (or its
    graceful_shutdown_timeout_s has passed), the ingress after its own streams; the proxy
    still holds the streams' last events then (it relays them behind the replicas on a busy
    machine), so it lives until no client is connected to `port`, for at most `grace_s`.
    (`serve.shutdown` alone killed the proxy at once, cutting every stream.)"""
    serve.delete(APP_NAME)
    deadline = time.monotonic() + grace_s
    while port is not None and time.monotonic() < deadline and _clients_connected(port):
        time.sleep(0.1)
    serve.shutdown()
    ray.shutdown()


def _clients_connected(port: int) -> bool:
    # Whether a TCP connection to local `port` is established (Linux's /proc; elsewhere no
    # wait: the proxy stops with Serve).
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            if state == "01" and int(local.rsplit(":", 1)[1], 16) == port:  # 01: ESTABLISHED
                return True
    return False
