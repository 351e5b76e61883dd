"""One Ray cluster of two fairtick replicas on 127.0.0.1, shared by a test module (a Ray start
costs 10-60 s on a shared 2-core machine). Skipped, saying why, when Ray is not installed or
cannot start here; a failure of fairtick's own deployment fails the tests."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from runtime.engine import EngineConfig
from runtime.model import load_model
from server.config import ServerConfig
from tests.server.http_helpers import free_port

# Both the replicas and the single server the tests compare with run this engine.
ENGINE = {"max_running": 8, "max_waiting": 64, "prefill_chunk_size": 64, "max_kv_tokens": 40_000}
MAX_BODY_BYTES = 1 << 20
RAY_MISSING = ("Ray is not installed: the cluster tests need the cluster extra "
               "(pip install -e '.[cluster]', which `make test` installs)")


@dataclass
class Cluster:
    """A running cluster: its endpoint and the replicas' names."""

    url: str
    replicas: int


@pytest.fixture(scope="module")
def bundle() -> Any:
    """The built-in model, for the single server the cluster is compared with."""
    return load_model(None)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    if importlib.util.find_spec("ray") is None:
        pytest.skip(RAY_MISSING)
    from cluster.deploy import ClusterSpec, deploy, init_ray, stop_cluster

    spec = ClusterSpec(replicas=2, num_cpus=2)
    try:
        init_ray(spec)
    except Exception as exc:  # noqa: BLE001 - whatever stops Ray here, say it and skip
        pytest.skip(f"Ray could not start on this machine: {exc!r}")
    config = ServerConfig(engine=EngineConfig(**ENGINE), port=free_port(), stop_grace_s=0.0,
                          max_body_bytes=MAX_BODY_BYTES, log_level="warning")
    try:
        yield Cluster(deploy(config, spec), spec.replicas)
    finally:
        stop_cluster()


def single_server(bundle: Any) -> Any:
    """The single `fairtick serve` (in-process) the cluster is compared with: the same engine
    and limits as each replica."""
    from tests.server.serving import serve

    return serve(bundle, max_body_bytes=MAX_BODY_BYTES, **ENGINE)
