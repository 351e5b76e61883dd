"""Two fairtick replicas on Ray Serve behind one endpoint on 127.0.0.1, through the real
`openai` client: requests reach both replicas, a greedy stream and an error are the single
server's, /metrics is every replica's, and a replica killed under load ends its streams with an
error while the other replica serves on and Ray replaces the dead one."""

from __future__ import annotations

import threading
import time
from typing import Any

import openai
import pytest
from benchlib.client import Reply, connect, exchange, get_text
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster.conftest import Cluster, single_server

REPLICA_HEADER = "fairtick-replica"
KILL_STREAMS = 4


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)


def _model(url: str) -> str:
    return _client(url).models.list().data[0].id


def _finished_by_replica(url: str) -> dict[str, float]:
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(get_text(url, "/metrics")):
        for s in family.samples:
            if s.name == "fairtick_requests_finished_total":
                counts[s.labels["replica"]] = counts.get(s.labels["replica"], 0) + s.value
    return counts


def _stream_text(url: str, kind: str, **body: Any) -> tuple[str, list[str], list[str | None]]:
    """The replica that answered, each choice's text, each choice's finish_reason."""
    client, model = _client(url), _model(url)
    if kind == "chat":
        raw: Any = client.chat.completions.with_raw_response.create(
            model=model, stream=True, **body)
    else:
        raw = client.completions.with_raw_response.create(model=model, stream=True, **body)
    text, finish = "", None
    for chunk in raw.parse():
        for choice in chunk.choices:
            text += (choice.delta.content or "") if kind == "chat" else choice.text
            finish = choice.finish_reason or finish
    return raw.headers.get(REPLICA_HEADER, ""), [text], [finish]


def test_concurrent_requests_reach_both_replicas_and_metrics_are_labelled(cluster: Cluster):
    before = _finished_by_replica(cluster.url)
    barrier = threading.Barrier(4)
    served: list[str] = []

    def one(i: int) -> None:
        barrier.wait(30)
        served.append(_stream_text(cluster.url, "completion", prompt=f"hello {i}",
                                   max_tokens=64, temperature=0)[0])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(served) == 4
    assert len(set(served)) == cluster.replicas, served  # the router spread them
    after = _finished_by_replica(cluster.url)
    assert set(after) == set(served)  # /metrics holds every replica, labelled
    assert {r: after[r] - before.get(r, 0) for r in after} == {r: served.count(r) for r in after}
    for replica in after:  # a pinned request goes to its replica
        reply = _pinned_get(cluster.url, "/health", replica)
        assert reply.status == 200 and reply.headers[REPLICA_HEADER] == replica
    # Every replica's model card is the same card (its `created` was each replica's start).
    cards = [_pinned_get(cluster.url, "/v1/models", replica).json() for replica in after]
    assert len(cards) == cluster.replicas and all(card == cards[0] for card in cards), cards
    missing = _pinned_get(cluster.url, "/health", "no-such-replica")
    assert missing.status == 404 and missing.json()["error"]["code"] == "replica_not_found"


def _pinned_get(url: str, path: str, replica: str) -> Reply:
    conn = connect(url, timeout_s=60)
    try:
        conn.request("GET", path, headers={REPLICA_HEADER: replica})
        response = conn.getresponse()
        return Reply(response.status, {k.lower(): v for k, v in response.getheaders()},
                     response.read())
    finally:
        conn.close()


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_greedy_stream_is_the_single_servers(cluster: Cluster, bundle: Any, kind: str):
    body: dict[str, Any] = {"max_tokens": 48, "temperature": 0}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": "Tell me about the cluster."}]
    else:
        body["prompt"] = "The cluster serves"
    with single_server(bundle) as single:
        _, want_text, want_finish = _stream_text(single.url, kind, **body)
    replica, text, finish = _stream_text(cluster.url, kind, **body)
    assert replica
    assert (text, finish) == (want_text, want_finish)
    assert len(text[0]) > 0 and finish == ["length"]


def test_errors_are_the_single_servers(cluster: Cluster, bundle: Any):
    bad = {"prompt": "hi", "max_tokens": 4, "temperature": 7}
    with single_server(bundle) as single:
        want = [exchange(single.url, "POST", "/v1/completions", bad),
                exchange(single.url, "GET", "/v1/no-such-route")]
    got = [exchange(cluster.url, "POST", "/v1/completions", bad),
           exchange(cluster.url, "GET", "/v1/no-such-route")]
    for g, w in zip(got, want, strict=True):
        assert (g.status, g.json()) == (w.status, w.json())
    assert got[0].status == 400 and got[0].json()["error"]["param"] == "temperature"


class _Stream(threading.Thread):
    """A long streamed completion; after `killed` is set it reads `after_kill` more chunks and
    closes, unless its stream ends first (with an error for a stream on the killed replica)."""

    def __init__(self, url: str, model: str, i: int, killed: threading.Event,
                 after_kill: int = 20) -> None:
        super().__init__(daemon=True)
        self.url, self.model, self.i = url, model, i
        self.killed, self.after_kill = killed, after_kill
        self.replica: str | None = None
        self.started = threading.Event()
        self.chunks_after_kill = 0
        self.error: Exception | None = None

    def run(self) -> None:
        raw = _client(self.url).completions.with_raw_response.create(
            model=self.model, prompt=f"stream {self.i}", max_tokens=6000, temperature=0,
            stream=True)
        self.replica = raw.headers.get(REPLICA_HEADER)
        stream = raw.parse()
        try:
            for n, _ in enumerate(stream):
                if n >= 5:
                    self.started.set()
                if self.killed.is_set():
                    self.chunks_after_kill += 1
                    if self.chunks_after_kill >= self.after_kill:
                        break
        except openai.APIError as exc:
            self.error = exc
        finally:
            stream.close()
            self.started.set()


def test_a_killed_replica_ends_its_streams_with_an_error_and_is_replaced(cluster: Cluster):
    import ray

    from cluster.deploy import replica_actor_name

    model, killed = _model(cluster.url), threading.Event()
    streams = [_Stream(cluster.url, model, i, killed) for i in range(KILL_STREAMS)]
    for s in streams:
        s.start()
    for s in streams:
        assert s.started.wait(120) and s.error is None, s.error
    replicas = {s.replica for s in streams}
    assert len(replicas) == cluster.replicas, replicas  # load on both
    victim = streams[0].replica
    assert victim is not None
    ray.kill(ray.get_actor(replica_actor_name(victim), namespace="serve"), no_restart=True)
    killed.set()
    for s in streams:
        s.join(120)
        assert not s.is_alive(), "a stream hung after its replica was killed"
    for s in streams:
        if s.replica == victim:
            assert isinstance(s.error, openai.APIError), s.error
            assert "replica" in str(s.error), s.error
        else:
            assert s.error is None and s.chunks_after_kill >= s.after_kill
    # A new request goes to a live replica at once.
    reply = exchange(cluster.url, "POST", "/v1/completions", {"prompt": "after", "max_tokens": 4})
    assert reply.status == 200 and reply.headers[REPLICA_HEADER] != victim
    # Ray replaces the dead replica; /metrics lists two live replicas again.
    deadline = time.monotonic() + 180
    while True:
        live = set(_finished_by_replica(cluster.url))
        if len(live) == cluster.replicas and victim not in live:
            break
        assert time.monotonic() < deadline, f"the killed replica was not replaced: {live}"
        time.sleep(0.5)
    (new,) = live - replicas
    assert _pinned_get(cluster.url, "/health", new).status == 200
