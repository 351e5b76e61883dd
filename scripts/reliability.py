#!/usr/bin/env python3
"""Reliability check of a running fairtick server, over HTTP only (standard library + Hypothesis).

Phases (all by default; `--phases` picks some):

- load: many concurrent SSE streams; each must receive exactly `max_tokens` tokens, equal to a
  reference greedy completion of the same prompt made alone first, with agreeing usage.
- storm: hundreds of streams, about half cut at random points (before the answer, or after k
  tokens); afterwards the gauges and /debug/state are back to idle, the server's RSS is back near
  its start (with --pid), and a normal request is exactly what it was before the storm.
- fuzz: Hypothesis generates malformed and edge-case requests; every answer must be a 2xx or an
  OpenAI-style JSON 4xx, never a 5xx, reset or hang; /health stays ok.
- overload: far more simultaneous requests than slots + --max-waiting; every one must be a
  completion or a 429 with Retry-After.

The built-in model emits one printable character per token and never EOS, so a stream's text
length is its token count. Prints a table per phase; exit 1 on any loss, crash, 5xx to valid
input, drop or hang; exit 2 when the server cannot be reached.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import socket
import sys
import threading
import time
import urllib.parse
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

GAUGES = ("fairtick_requests_running", "fairtick_requests_waiting", "fairtick_requests_parked")
MAX_RETRIES = 30  # 429 retries per stream in load and storm (each waits Retry-After)


# --- HTTP ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Target:
    """The server under test, as discovered from /v1/models and /debug/state."""

    host: str
    port: int
    model: str
    context_length: int
    slots: int
    max_waiting: int
    chunk_size: int
    pid: int | None
    timeout_s: float


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def failure_kind(exc: BaseException) -> str:
    """How a request failed below HTTP: a hang, a reset connection, a refusal."""
    if isinstance(exc, (TimeoutError, socket.timeout)):
        return "hang"
    if isinstance(exc, ConnectionRefusedError):
        return "refused"
    if isinstance(exc, (ConnectionError, http.client.HTTPException)):
        return "reset"
    return type(exc).__name__


def exchange(t: Target, method: str, path: str, body: Any = None, *, raw: bytes | None = None,
             content_type: str | None = "application/json", chunked: bool = False) -> Reply:
    """One request on a fresh connection; raises OSError/HTTPException below HTTP."""
    conn = http.client.HTTPConnection(t.host, t.port, timeout=t.timeout_s)
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    headers = {"Content-Type": content_type} if content_type is not None and data else {}
    if chunked and data:
        headers["Transfer-Encoding"] = "chunked"
    try:
        try:
            conn.request(method, path, body=iter([data[:7], data[7:]]) if chunked and data
                         else data, headers=headers, encode_chunked=chunked)
        except (BrokenPipeError, ConnectionResetError):
            pass  # a server may answer (413) and close before a large body is sent: read it
        response = conn.getresponse()
        return Reply(response.status, {k.lower(): v for k, v in response.getheaders()},
                     response.read())
    finally:
        conn.close()


def retry_after_s(reply_headers: dict[str, str]) -> float | None:
    try:
        value = float(reply_headers.get("retry-after", ""))
    except ValueError:
        return None
    return value if value >= 0 else None


def gauges(t: Target) -> dict[str, float]:
    """Unlabelled samples of /metrics (Prometheus text)."""
    out = {}
    for line in exchange(t, "GET", "/metrics").body.decode().splitlines():
        name, _, value = line.partition(" ")
        if line and not line.startswith("#") and "{" not in name:
            out[name] = float(value)
    return out


def leftovers(t: Target) -> dict[str, float]:
    """What the server still holds: gauges, live sequences, admission, cached sequences."""
    left = {name: gauges(t).get(name, 0.0) for name in GAUGES}
    state = exchange(t, "GET", "/debug/state").json()
    left["live sequences"] = len(state.get("sequences", []))
    admission = state.get("admission", {})
    left["queued (admission)"] = admission.get("queued", 0)
    left["KV tokens reserved"] = admission.get("kv_tokens_reserved", 0)
    left["cached sequences"] = state.get("memory", {}).get("cached_sequences", 0)
    return left


def wait_drained(t: Target, timeout_s: float) -> dict[str, float]:
    """Poll until the server holds nothing (bounded); what it still held at the end."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = leftovers(t)
        if not any(left.values()) or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def rss_bytes(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def settled_rss(pid: int | None, start: int | None, limit_mib: float) -> int | None:
    """The lowest RSS over up to 5 s (allocators give memory back lazily), early once within
    a quarter of the limit of `start`."""
    lowest = rss_bytes(pid)
    for _ in range(10):
        if lowest is None or start is None or lowest - start <= limit_mib * 2**20 / 4:
            break
        time.sleep(0.5)
        lowest = min(lowest, rss_bytes(pid) or lowest)
    return lowest


def health_ok(t: Target) -> bool:
    try:
        reply = exchange(t, "GET", "/health")
        return reply.status == 200 and reply.json().get("status") == "ok"
    except (OSError, http.client.HTTPException, ValueError):
        return False


# --- streams ---------------------------------------------------------------------------------

@dataclass
class Stream:
    """What one streamed completion received."""

    status: int | None = None
    pieces: list[str] = field(default_factory=list)
    finish: list[str] = field(default_factory=list)
    usage: dict[str, int] | None = None
    ids: set[str] = field(default_factory=set)
    done: bool = False
    error: str | None = None
    failure: str | None = None
    retries: int = 0
    retry_after_s: float | None = None
    cut: bool = False

    @property
    def text(self) -> str:
        return "".join(self.pieces)


@dataclass(frozen=True)
class Reference:
    """A greedy completion made alone: what every later run of the prompt must equal."""

    prompt: str
    text: str
    prompt_tokens: int


def reference(t: Target, prompt: str, max_tokens: int) -> Reference:
    for _ in range(MAX_RETRIES):
        reply = exchange(t, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens})
        if reply.status != 429:
            break
        time.sleep(retry_after_s(reply.headers) or 1.0)
    if reply.status != 200:
        raise RuntimeError(f"reference request failed: HTTP {reply.status} {reply.body[:300]!r}")
    body = reply.json()
    return Reference(prompt, body["choices"][0]["text"], body["usage"]["prompt_tokens"])


def stream_once(t: Target, prompt: str, max_tokens: int, cut_after: float | None) -> Stream:
    """One streamed completion; `cut_after` closes the connection after that many tokens, or
    (when negative) -cut_after seconds after sending the request, reading nothing."""
    out = Stream()
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    conn = http.client.HTTPConnection(t.host, t.port, timeout=t.timeout_s)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        if cut_after is not None and cut_after < 0:
            time.sleep(-cut_after)
            out.cut = True
            return out
        response = conn.getresponse()
        out.status = response.status
        if response.status != 200:
            out.error = response.read().decode(errors="replace")[:300]
            out.retry_after_s = retry_after_s({k.lower(): v for k, v in response.getheaders()})
            return out
        while not out.done:
            line = response.readline()
            if not line:
                break  # the stream ended without [DONE]
            if cut_after is not None and len(out.pieces) >= cut_after:
                out.cut = True
                return out
            read_event(line, out)
    except (OSError, http.client.HTTPException) as exc:
        out.failure = failure_kind(exc)
    finally:
        conn.close()
    return out


def read_event(line: bytes, out: Stream) -> None:
    if not line.startswith(b"data: "):
        return
    payload = line[len(b"data: "):].strip()
    if payload == b"[DONE]":
        out.done = True
        return
    event = json.loads(payload)
    if "error" in event:
        out.error = event["error"].get("message")
        return
    out.ids.add(event["id"])
    if event.get("usage"):
        out.usage = event["usage"]
    for choice in event["choices"]:
        if choice.get("text"):
            out.pieces.append(choice["text"])
        if choice.get("finish_reason"):
            out.finish.append(choice["finish_reason"])


def stream(t: Target, prompt: str, max_tokens: int, cut_after: float | None = None) -> Stream:
    """A streamed completion, retried after each 429 (up to MAX_RETRIES, honouring
    Retry-After)."""
    for attempt in range(MAX_RETRIES + 1):
        out = stream_once(t, prompt, max_tokens, cut_after)
        out.retries = attempt
        if out.status != 429:
            return out
        time.sleep(out.retry_after_s or 1.0)
    return out


def problems(out: Stream, ref: Reference, max_tokens: int) -> list[str]:
    """Why a stream that was not cut is wrong (empty when it is exact)."""
    if out.failure:
        return [out.failure]
    if out.status != 200:
        return [f"HTTP {out.status}"]
    found = []
    if out.error:
        found.append("in-band error")
    if not out.done:
        found.append("no [DONE]")
    if out.text != ref.text:
        found.append("text differs")
    if out.finish != ["length"]:
        found.append("finish reason")
    expected_usage = {"prompt_tokens": ref.prompt_tokens, "completion_tokens": max_tokens,
                      "total_tokens": ref.prompt_tokens + max_tokens}
    if out.usage != expected_usage:
        found.append("usage")
    if len(out.ids) != 1:
        found.append("ids")
    return found


# --- phases ----------------------------------------------------------------------------------

@dataclass
class PhaseResult:
    name: str
    rows: list[tuple[str, Any]]
    failures: list[str]

    def print(self) -> None:
        print(f"\n## {self.name}\n")
        width = max(len(label) for label, _ in self.rows)
        print(f"| {'what':<{width}} | value |")
        print(f"|{'-' * (width + 2)}|-------|")
        for label, value in self.rows:
            print(f"| {label:<{width}} | {value} |")
        print(f"\nverdict: {'FAIL: ' + '; '.join(self.failures) if self.failures else 'PASS'}")


def prompts(t: Target, count: int) -> list[str]:
    """Short prompts and some spanning several prefill chunks (so some sequences park)."""
    long_len = min(int(t.chunk_size * 2.5), t.context_length // 4)
    return [f"p{i}: the tick scheduler " + ("x" * long_len if i % 4 == 3 else "")
            for i in range(count)]


def run_load(t: Target, args: argparse.Namespace) -> PhaseResult:
    tokens, n = args.load_tokens, args.load_streams
    refs = [reference(t, p, tokens) for p in prompts(t, 8)]
    concurrency = args.load_concurrency or min(t.max_waiting, 32)
    started = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        outs = list(pool.map(lambda i: stream(t, refs[i % len(refs)].prompt, tokens), range(n)))
    wall = time.monotonic() - started
    found = [problems(o, refs[i % len(refs)], tokens) for i, o in enumerate(outs)]
    received = sum(len(o.pieces) for o in outs)
    lost = sum(max(0, tokens - len(o.pieces)) for o in outs)
    dup = sum(max(0, len(o.pieces) - tokens) for o in outs)
    kinds = Counter(p for f in found for p in f)
    exact = sum(1 for f in found if not f)
    rows = [("streams x max_tokens", f"{n} x {tokens}"), ("concurrent clients", concurrency),
            ("streams exact", f"{exact}/{n}"), ("tokens expected", n * tokens),
            ("tokens received", received), ("lost", lost), ("duplicated", dup),
            ("text differs from reference", kinds["text differs"]),
            ("usage disagrees", kinds["usage"]), ("429 retries", sum(o.retries for o in outs)),
            ("other problems", dict(kinds - Counter({"text differs": kinds["text differs"],
                                                     "usage": kinds["usage"]})) or "none"),
            ("wall", f"{wall:.1f} s ({received / wall:.0f} tokens/s)")]
    failures = [f"{n - exact} streams not exact: {dict(kinds)}"] if exact != n else []
    return PhaseResult("load", rows, failures)


def run_storm(t: Target, args: argparse.Namespace) -> PhaseResult:
    tokens, n, rng = args.storm_tokens, args.storm_streams, random.Random(args.seed)
    normal = reference(t, "the normal request", 32)
    refs = [reference(t, p, tokens) for p in prompts(t, 8)]
    wait_drained(t, 30)
    rss_start = rss_bytes(t.pid)
    # About half are cut: a third of those up to 2 s after sending, reading nothing (waiting,
    # parked or prefilling), the rest after k tokens (decoding).
    plan = [(i % len(refs), None if rng.random() < 0.5 else -rng.uniform(0.001, 2.0)
             if rng.random() < 1 / 3 else rng.randrange(tokens)) for i in range(n)]
    first_tick = exchange(t, "GET", "/debug/state").json().get("tick", 0)
    concurrency = args.storm_concurrency or t.max_waiting
    started = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        outs = list(pool.map(lambda p: stream(t, refs[p[0]].prompt, tokens, p[1]), plan))
    wall = time.monotonic() - started
    left = wait_drained(t, 60)
    rss_end = settled_rss(t.pid, rss_start, args.rss_limit_mib)
    after = reference(t, normal.prompt, 32)
    uncut = [(o, refs[p[0]]) for o, p in zip(outs, plan, strict=True) if p[1] is None]
    bad_uncut = Counter(x for o, ref in uncut for x in problems(o, ref, tokens))
    cut = [o for o, p in zip(outs, plan, strict=True) if p[1] is not None]
    bad_cut = Counter(o.failure or f"HTTP {o.status}" for o in cut
                      if o.failure or (o.status is not None and o.status >= 500))
    exact_uncut = sum(1 for o, ref in uncut if not problems(o, ref, tokens))
    cut_states = Counter("before the answer" if p[1] < 0 else "after k tokens"
                         for p in plan if p[1] is not None)
    trace = exchange(t, "GET", f"/debug/trace?since={first_tick}").body.decode().splitlines()
    aborted_from = Counter(e["from"] for e in map(json.loads, trace) if e["trigger"] == "abort")
    rows = [("streams x max_tokens", f"{n} x {tokens}"), ("concurrent clients", concurrency),
            ("cut", f"{len(cut)} ({dict(cut_states)})"),
            ("aborts by lifecycle state (trace)", dict(aborted_from.most_common()) or "none"),
            ("uncut streams exact", f"{exact_uncut}/{len(uncut)}"),
            ("uncut problems", dict(bad_uncut) or "none"),
            ("cut streams: 5xx/reset/hang before the cut", dict(bad_cut) or "none"),
            ("429 retries", sum(o.retries for o in outs)), ("wall", f"{wall:.1f} s")]
    rows += [(f"after: {name}", value) for name, value in left.items()]
    failures = []
    if rss_start is None or rss_end is None:
        rows.append(("server RSS", "not measurable (give --pid of the server on this machine)"))
    else:
        grow = (rss_end - rss_start) / 2**20
        rows.append(("server RSS start -> end", f"{rss_start / 2**20:.1f} -> "
                     f"{rss_end / 2**20:.1f} MiB ({grow:+.1f} MiB; limit +{args.rss_limit_mib})"))
        if grow > args.rss_limit_mib:
            failures.append(f"RSS grew {grow:.1f} MiB")
    exact_after = after.text == normal.text and after.prompt_tokens == normal.prompt_tokens
    rows.append(("normal request after the storm", "exact" if exact_after else "DIFFERS"))
    if exact_uncut != len(uncut):
        failures.append(f"{len(uncut) - exact_uncut} uncut streams not exact")
    if bad_cut:
        failures.append(f"cut streams failed before their cut: {dict(bad_cut)}")
    if any(left.values()):
        failures.append(f"not drained: {left}")
    if not exact_after:
        failures.append("the normal request differs after the storm")
    return PhaseResult("disconnect storm", rows, failures)


def run_overload(t: Target, args: argparse.Namespace) -> PhaseResult:
    n = args.overload_requests or 4 * (t.slots + t.max_waiting)
    ref = reference(t, "overload", args.overload_tokens)
    wait_drained(t, 30)
    barrier = threading.Barrier(n, timeout=60)

    def one(_: int) -> tuple[str, float]:
        barrier.wait()
        tic = time.monotonic()
        try:
            reply = exchange(t, "POST", "/v1/completions",
                             {"prompt": ref.prompt, "max_tokens": args.overload_tokens})
        except (OSError, http.client.HTTPException) as exc:
            return failure_kind(exc), time.monotonic() - tic
        took = time.monotonic() - tic
        if reply.status == 200:
            text = reply.json()["choices"][0]["text"]
            return ("completed" if text == ref.text else "completed, text differs"), took
        if reply.status == 429:
            ok = (retry_after_s(reply.headers) or 0) >= 1 and is_json_error(reply)
            return ("429 with Retry-After" if ok else "429 without Retry-After/JSON"), took
        return f"HTTP {reply.status}", took

    started = time.monotonic()
    with ThreadPoolExecutor(n) as pool:
        outcomes = list(pool.map(one, range(n)))
    wall = time.monotonic() - started
    left = wait_drained(t, 60)
    kinds = Counter(kind for kind, _ in outcomes)
    refused = sorted(took for kind, took in outcomes if kind.startswith("429"))
    rows = [("simultaneous requests", n), ("slots + max_waiting", t.slots + t.max_waiting)]
    rows += [(f"answered: {kind}", count) for kind, count in sorted(kinds.items())]
    if refused:
        rows.append(("429 answered within (p50 / max)",
                     f"{refused[len(refused) // 2]:.3f} / {refused[-1]:.3f} s"))
    rows += [("wall", f"{wall:.1f} s"), ("after: anything held", dict(left) if any(
        left.values()) else "nothing"), ("health after", "ok" if health_ok(t) else "NOT OK")]
    good = kinds["completed"] + kinds["429 with Retry-After"]
    failures = [f"{n - good} requests neither completed exactly nor refused with 429: "
                f"{dict(kinds)}"] if good != n else []
    if not kinds["429 with Retry-After"]:
        rows.append(("note", "no 429: not overloaded; raise --overload-requests"))
    if any(left.values()) or not health_ok(t):
        failures.append("not drained or unhealthy afterwards")
    return PhaseResult("overload", rows, failures)


# --- fuzz ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    """One generated request: where, what bytes, which content type, and what it exercises."""

    path: str
    body: bytes
    content_type: str | None
    label: str  # "kind: detail"
    method: str = "POST"
    chunked: bool = False


def is_json_error(reply: Reply) -> bool:
    try:
        error = reply.json()["error"]
        return isinstance(error["message"], str) and set(error) >= {"type", "param", "code"}
    except (ValueError, KeyError, TypeError):
        return False


def classify(reply: Reply) -> str:
    if 200 <= reply.status < 300:
        text = reply.body.decode(errors="replace")
        if reply.headers.get("content-type", "").startswith("text/event-stream"):
            return "2xx" if text.rstrip().endswith("data: [DONE]") else "2xx malformed stream"
        return "2xx" if "choices" in json.loads(text) else "2xx malformed body"
    if 400 <= reply.status < 500:
        return "4xx JSON" if is_json_error(reply) else "4xx not JSON"
    return f"{reply.status // 100}xx"


EDGE_VALUES = [0, 1, -1, 2**31, 2**63, 2**64, 10**30, 10**400, -(10**400), 1e30, -0.0, 1e-320,
               float("nan"), float("inf"), float("-inf"), "", " ", "\x00", "\u2028", "é" * 50,
               [], {}, [[]], {"a": {"b": {}}}, True, False, None, 258, 255]
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
          "top_p", "top_k", "seed", "stop", "stream", "stream_options", "n", "min_tokens",
          "ignore_eos", "logit_bias", "logprobs", "top_logprobs", "presence_penalty",
          "frequency_penalty", "user", "best_of", "echo", "suffix", "response_format", "tools",
          "tool_choice", "metadata", "store", "parallel_tool_calls", "nonsense_field"]
MAX_FUZZ_TOKENS = 16  # a valid body never generates more than this (keeps the phase short)


def json_values() -> st.SearchStrategy[Any]:
    leaves = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(),
                       st.text(max_size=20), st.sampled_from(EDGE_VALUES))
    return st.recursive(leaves, lambda c: st.one_of(
        st.lists(c, max_size=4), st.dictionaries(st.text(max_size=8), c, max_size=4)),
        max_leaves=12)


def bounded(body: dict[str, Any], context: int) -> dict[str, Any]:
    # A valid large max_tokens (or a chat without one) would generate for minutes: cap it.
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and \
                MAX_FUZZ_TOKENS < value <= context:
            body[name] = MAX_FUZZ_TOKENS
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = MAX_FUZZ_TOKENS
    return body


@st.composite
def field_cases(draw: st.DrawFn, context: int) -> Case:
    """A valid body of either endpoint with 1-4 fields set to edge values, dropped or added."""
    chat = draw(st.booleans())
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]} if chat else {
        "prompt": "hi"}
    body["max_tokens"] = draw(st.integers(1, 4))
    changed = []
    for _ in range(draw(st.integers(1, 4))):
        name = draw(st.sampled_from(FIELDS))
        if draw(st.integers(0, 5)) == 0:
            body.pop(name, None)
            changed.append(f"-{name}")
        else:
            body[name] = draw(st.one_of(st.sampled_from(EDGE_VALUES), json_values()))
            changed.append(name)
    body = bounded(body, context)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return Case(path, json.dumps(body).encode(), "application/json",
                f"{'chat' if chat else 'completion'} fields: {','.join(changed)}")


def raw_cases() -> st.SearchStrategy[Case]:
    """Malformed bytes, literals JSON does not allow, nesting, encodings, content types."""
    good = b'{"prompt": "hi", "max_tokens": 2}'
    paths = st.sampled_from(["/v1/completions", "/v1/chat/completions"])
    json_type = st.just("application/json")
    literal = st.sampled_from([b"NaN", b"Infinity", b"-Infinity", b"1e400", b"-1e400",
                               b"1" + b"0" * 5000, b"0x10", b"1_000", b"+1", b".5", b"01"])
    number_field = st.sampled_from([b"max_tokens", b"temperature", b"top_p", b"seed", b"n"])
    return st.one_of(
        st.builds(lambda p, b: Case(p, b, "application/json", "random bytes"),
                  paths, st.binary(max_size=300)),
        st.builds(lambda p, k: Case(p, good[:k], "application/json", "truncated JSON"),
                  paths, st.integers(0, len(good) - 1)),
        st.builds(lambda p, f, v: Case(p, b'{"prompt": "hi", "' + f + b'": ' + v + b"}",
                                       "application/json", "bad number literal"),
                  paths, number_field, literal),
        st.builds(lambda p, n: Case(p, b'{"prompt": "hi", "user": ' + b"[" * n + b"]" * n
                                    + b"}", "application/json", f"nesting: {n}"),
                  paths, st.integers(20, 20_000)),
        st.builds(lambda p, bad: Case(p, b'{"prompt": "' + bad + b'"}', "application/json",
                                      "bad encoding"),
                  paths, st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\\ud800",
                                          b"\\udc00\\ud800", b"\\u00", b"\x00", b"\\x41"])),
        st.builds(lambda p, c: Case(p, good, c, f"content type: {c!r}"), paths,
                  st.sampled_from(["text/plain", "application/x-www-form-urlencoded",
                                   "multipart/form-data; boundary=x", "", None,
                                   "application/json; charset=utf-16", "application/xml",
                                   "application/problem+json", "APPLICATION/JSON"])),
        st.builds(lambda p, v: Case(p, json.dumps(v).encode(), "application/json",
                                    "not an object"), paths, json_values()),
        st.builds(lambda p, b: Case(p, b, "application/json", "empty or blank"), paths,
                  st.sampled_from([b"", b" ", b"\n\t", b"\xef\xbb\xbf{}"])),
        st.builds(lambda p, b: Case(p, b, "application/json", "array or null"), paths,
                  st.sampled_from([b'[{"prompt": "hi"}]', b"null", b'"hi"', b"7"])),
        st.builds(lambda p, m: Case(p.replace("completions", m), good, "application/json",
                                    f"path: {m}"), paths,
                  st.sampled_from(["completion", "completions/", "Completions", "x"])),
        st.builds(lambda p, m: Case(p, good, "application/json", f"method: {m}", method=m),
                  paths, st.sampled_from(["GET", "PUT", "DELETE", "PATCH"])),
        st.builds(lambda p, b: Case(p, b, "application/json", "chunked", chunked=True), paths,
                  st.sampled_from([good, good[:9], b'{"prompt": "' + b"y" * 300 + b'"}'])),
        json_type.map(lambda c: Case("/v1/completions", good, c, "valid control")),
    )


def send_case(t: Target, case: Case) -> str:
    """The class of the server's answer to `case`; a field case's 4xx must name a field it
    changed (its base body is valid)."""
    try:
        reply = exchange(t, case.method, case.path, raw=case.body,
                         content_type=case.content_type, chunked=case.chunked)
    except (OSError, http.client.HTTPException) as exc:
        return failure_kind(exc)
    kind = classify(reply)
    if kind == "4xx JSON" and " fields: " in case.label:
        changed = {name.lstrip("-") for name in case.label.split(": ")[1].split(",")}
        param = str(reply.json()["error"]["param"]).split("[")[0].split(".")[0]
        if param not in changed:
            return "4xx not naming a changed field"
    return kind


def run_fuzz(t: Target, args: argparse.Namespace) -> PhaseResult:
    seen: list[tuple[str, Case]] = []
    unhealthy: list[int] = []
    oversize = Case("/v1/completions", b'{"prompt": "' + b"x" * (5 << 20) + b'"}',
                    "application/json", "oversize: 5 MiB")

    @hypothesis_seed(args.seed)
    @settings(max_examples=args.fuzz_examples, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck),
              report_multiple_bugs=False)
    @given(case=st.one_of(field_cases(t.context_length), raw_cases()))
    @example(case=oversize)
    @example(case=Case("/v1/completions", b"{}", None, "content type: none, {}"))
    def probe(case: Case) -> None:
        seen.append((send_case(t, case), case))
        if len(seen) % 25 == 0 and not health_ok(t):
            unhealthy.append(len(seen))

    started = time.monotonic()
    probe()
    wall = time.monotonic() - started
    left = wait_drained(t, 30)
    healthy_after = health_ok(t)
    kinds = Counter(kind for kind, _ in seen)
    labels = Counter(case.label.split(":")[0] for _, case in seen)
    bad = [(kind, case) for kind, case in seen if kind not in ("2xx", "4xx JSON")]
    rows = [("requests", len(seen))]
    rows += [(f"answered: {kind}", count) for kind, count in sorted(kinds.items())]
    rows += [("generated kinds", dict(labels.most_common())), ("wall", f"{wall:.1f} s"),
             ("health checks failed", len(unhealthy)),
             ("health after", "ok" if healthy_after else "NOT OK"),
             ("after: anything held", dict(left) if any(left.values()) else "nothing")]
    for kind, case in bad[:5]:
        rows.append((f"example {kind}", f"{case.label}: {case.path} {case.body[:120]!r}"))
    failures = []
    if bad:
        kinds_bad = dict(Counter(kind for kind, _ in bad))
        failures.append(f"{len(bad)} answers neither 2xx nor JSON 4xx: {kinds_bad}")
    if unhealthy or not healthy_after or any(left.values()):
        failures.append("the server was unhealthy or held work afterwards")
    return PhaseResult("fuzz", rows, failures)


# --- main ------------------------------------------------------------------------------------

PHASES = {"load": run_load, "storm": run_storm, "fuzz": run_fuzz, "overload": run_overload}


def discover(args: argparse.Namespace) -> Target:
    url = urllib.parse.urlparse(args.url)
    if url.scheme != "http" or not url.hostname:
        raise ValueError(f"--url must look like http://127.0.0.1:PORT, got {args.url!r}")
    probe = Target(url.hostname, url.port or 80, "", 0, 0, 0, 0, args.pid, args.timeout_s)
    card = exchange(probe, "GET", "/v1/models").json()["data"][0]
    state = exchange(probe, "GET", "/debug/state").json()
    max_waiting = state.get("admission", {}).get("max_waiting", args.max_waiting)
    if max_waiting is None:
        raise ValueError("the server does not report its waiting queue: give --max-waiting")
    return Target(probe.host, probe.port, card["id"], int(card["max_model_len"]),
                  int(state["slots"]), int(max_waiting), int(state["prefill_chunk_size"]),
                  args.pid, args.timeout_s)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--pid", type=int, default=None,
                   help="the server's process id, to read its RSS from /proc (same machine)")
    p.add_argument("--phases", default="load,storm,fuzz,overload")
    p.add_argument("--max-waiting", type=int, default=None,
                   help="the server's --max-waiting, if /debug/state does not report it")
    p.add_argument("--load-streams", type=int, default=64)
    p.add_argument("--load-tokens", type=int, default=64)
    p.add_argument("--load-concurrency", type=int, default=0, help="0: min(max_waiting, 32)")
    p.add_argument("--storm-streams", type=int, default=300)
    p.add_argument("--storm-tokens", type=int, default=64)
    p.add_argument("--storm-concurrency", type=int, default=0, help="0: max_waiting")
    p.add_argument("--rss-limit-mib", type=float, default=64.0,
                   help="largest RSS growth over the storm that passes")
    p.add_argument("--fuzz-examples", type=int, default=300)
    p.add_argument("--overload-requests", type=int, default=0,
                   help="0: 4 x (slots + max_waiting)")
    p.add_argument("--overload-tokens", type=int, default=8)
    p.add_argument("--timeout-s", type=float, default=120.0,
                   help="per request: a request not answered within it is a hang")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None, help="also write the tables as JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    names = [n.strip() for n in args.phases.split(",") if n.strip()]
    unknown = [n for n in names if n not in PHASES]
    if unknown:
        print(f"reliability: unknown phase(s) {unknown}; choose from {list(PHASES)}",
              file=sys.stderr)
        return 2
    try:
        t = discover(args)
    except (OSError, http.client.HTTPException, ValueError, KeyError) as exc:
        print(f"reliability: cannot use the server at {args.url}: {exc}", file=sys.stderr)
        return 2
    print(f"# fairtick reliability: {args.url} ({t.model}, {t.slots} slots, max_waiting "
          f"{t.max_waiting}, chunk {t.chunk_size}, context {t.context_length})")
    results = []
    for name in names:
        try:
            result = PHASES[name](t, args)
        except (OSError, http.client.HTTPException, RuntimeError) as exc:
            result = PhaseResult(name, [("error", repr(exc))], [f"phase crashed: {exc!r}"])
        result.print()
        results.append(result)
    if args.json_out:
        with open(args.json_out, "w") as out:
            json.dump([{"phase": r.name, "rows": [[k, str(v)] for k, v in r.rows],
                        "failures": r.failures} for r in results], out, indent=1)
    failed = [r.name for r in results if r.failures]
    print(f"\n{'FAILED: ' + ', '.join(failed) if failed else 'all phases passed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
