"""`fairtick cluster`: `fairtick serve`'s flags (each replica's engine and API) plus how many
replicas, routed how, on which Ray. Runs until SIGINT or SIGTERM, then stops Serve and Ray."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from cluster.pins import ROUTER_PATHS

log = logging.getLogger("fairtick.cluster")


def add_cluster_flags(parser: argparse.ArgumentParser) -> None:
    """The flags `fairtick cluster` adds to `fairtick serve`'s."""
    from cluster.deploy import ClusterSpec

    d = ClusterSpec()
    parser.description = ("Serve the OpenAI-compatible API from N fairtick engines, each a "
                          "Ray Serve replica with the engine and API flags below, behind one "
                          "endpoint (--host, --port); --max-kv-tokens is each replica's budget.")
    g = parser.add_argument_group("cluster")
    g.add_argument("--replicas", type=int, default=d.replicas, metavar="N",
                   help=f"fairtick engines, each a Ray Serve replica (default {d.replicas})")
    g.add_argument("--router", default=d.router, choices=list(ROUTER_PATHS),
                   help="'fairtick' picks the replica by the load its engine reports (KV room, "
                   "prompt tokens left to prefill, streams decoding); 'power-of-two' is Ray "
                   "Serve's default, by open requests, kept for comparison (default fairtick)")
    g.add_argument("--stats-period-s", type=float, default=d.stats_period_s, metavar="S",
                   help=f"how often each replica reports its load to the router "
                   f"(default {d.stats_period_s:g})")
    g.add_argument("--replica-cpus", type=float, default=d.replica_cpus, metavar="N",
                   help=f"Ray CPUs each replica reserves; Ray places replicas where they fit "
                   f"(default {d.replica_cpus:g})")
    g.add_argument("--address", default=None, metavar="ADDRESS",
                   help="a running Ray cluster to join ('auto' for the one `ray start --head` "
                   "started on this machine); default: start a local Ray")
    g.add_argument("--num-cpus", type=int, default=None, metavar="N",
                   help="CPUs of the local Ray (default: the machine's)")


def cluster_main(argv: Sequence[str]) -> int:
    """Entry point of `fairtick cluster`; returns the exit status."""
    from cluster.deploy import ClusterSpec
    from server.cli import parse_serve_args
    from server.logs import configure_logging

    parsed = parse_serve_args(argv, "fairtick cluster", add_cluster_flags)
    if isinstance(parsed, int):
        return parsed
    config, args, blas = parsed
    try:
        spec = ClusterSpec(replicas=args.replicas, router=args.router,
                           stats_period_s=args.stats_period_s, replica_cpus=args.replica_cpus,
                           address=args.address, num_cpus=args.num_cpus)
    except ValueError as exc:
        print(f"fairtick cluster: {exc}", file=sys.stderr)
        return 2
    configure_logging(config.log_level)
    log.info("BLAS: %s", blas.describe())
    return _run(config, spec)


def _run(config: Any, spec: Any) -> int:
    from cluster.deploy import deploy, init_ray, stop_cluster

    stop = threading.Event()
    init_ray(spec)
    # After Ray's start, before the endpoint answers: ray.init puts its own SIGTERM handler in
    # this process (it dumps the stack and exits at once), which cut every in-flight stream off
    # without its grace period.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    url = deploy(config, spec)
    log.info("serving %d replicas at %s (router %s)", spec.replicas, url, spec.router)
    stop.wait()
    log.info("stopping the cluster")
    stop_cluster(config.port, config.stop_grace_s)
    return 0

