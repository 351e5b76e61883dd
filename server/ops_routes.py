"""Operator routes: /health, /metrics (Prometheus text), /debug/trace (JSON lines), /debug/state;
HEAD too on each, as on every GET route."""

from __future__ import annotations

import json as jsonlib
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sanic import Blueprint, Request
from sanic.response import HTTPResponse, JSONResponse, json, raw

from server.errors import invalid

MAX_QUERY_INT = 2**62
# The methods of every read-only route: a server that answers GET must answer HEAD (RFC 9110
# 9.3.2); Sanic sends the GET's status and headers without the body.
GET_METHODS = ("GET", "HEAD")


def make_ops_blueprint() -> Blueprint:
    """Health, metrics and debug routes; a new blueprint per app."""
    bp = Blueprint("ops")
    bp.add_route(health, "/health", methods=GET_METHODS)
    bp.add_route(metrics, "/metrics", methods=GET_METHODS)
    bp.add_route(debug_trace, "/debug/trace", methods=GET_METHODS)
    bp.add_route(debug_state, "/debug/state", methods=GET_METHODS)
    return bp


async def health(request: Request) -> JSONResponse:
    """200 while the engine thread runs; 503 (never a hang) once it has stopped."""
    ctx = request.app.ctx
    if ctx.engine is None or not ctx.engine.alive:
        return json({"status": "unavailable", "reason": "the engine thread is not running"},
                    status=503)
    status = "draining" if ctx.draining else "ok"
    return json({"status": status, "model": ctx.limits.name, "policy": ctx.engine.policy.name},
                status=503 if ctx.draining else 200)


async def metrics(request: Request) -> HTTPResponse:
    return raw(generate_latest(request.app.ctx.engine.registry), content_type=CONTENT_TYPE_LATEST)


TRACE_PARAMS = ("since", "since_s", "request_id", "state", "limit", "format")
TRACE_FORMATS = ("jsonl", "perfetto")


async def debug_trace(request: Request) -> HTTPResponse:
    """The trace (statemachine/trace.py) as JSON lines, or `format=perfetto` (the Trace Event
    Format, with the engine's ticks). Filters: `since` (tick, inclusive), `since_s` (seconds
    since the server started), `request_id`, `state` (events from or to it), `limit` (the
    latest N). Any other parameter is a 400."""
    unknown = sorted(set(request.args) - set(TRACE_PARAMS))
    if unknown:
        raise invalid(f"unknown query parameter `{unknown[0]}`; /debug/trace takes "
                      f"{', '.join(TRACE_PARAMS)}", unknown[0])
    fmt = request.args.get("format") or "jsonl"
    if fmt not in TRACE_FORMATS:
        raise invalid(f"query parameter `format` must be one of {', '.join(TRACE_FORMATS)}, "
                      f"got {fmt!r}", "format")
    engine = request.app.ctx.engine
    trace, state = engine.trace, request.args.get("state") or None
    states = list(engine.lifecycle.role_of)
    if state is not None and state not in states:
        raise invalid(f"query parameter `state` must be one of the lifecycle's states "
                      f"({', '.join(states)}), got {state!r}", "state")
    since = _query_int(request, "since", 0, minimum=0)
    events = trace.events(since_tick=since, limit=_query_int(request, "limit", None, minimum=1),
                          request_id=request.args.get("request_id") or None,
                          since_s=_query_float(request, "since_s"), state=state)
    if fmt == "perfetto":
        from server.trace_perfetto import to_perfetto

        body = to_perfetto(events, trace.ticks(since), trace.started)
        return raw(jsonlib.dumps(body).encode(), content_type="application/json")
    lines = "".join(jsonlib.dumps(event, default=str) + "\n" for event in events)
    return raw(lines.encode(), content_type="application/x-ndjson")


async def debug_state(request: Request) -> HTTPResponse:
    """The policy, its parameters, the KV budget and each live sequence with its state and KV
    tokens; what admission control holds (requests not yet admitted) and the memory the engine
    holds, so an operator (or a test) can see both return to their baseline when the server is
    idle; and the BLAS that MLX runs on."""
    engine = request.app.ctx.engine
    state = {**engine.snapshot(), "admission": admission_state(engine),
             "memory": memory_state(engine), "blas": blas_state()}
    return raw(jsonlib.dumps(state, default=str).encode(), content_type="application/json")


def admission_state(engine: Any) -> dict[str, int | None]:
    admission = engine.admission
    return {"queued": admission.num_queued, "max_waiting": admission.max_waiting}


def memory_state(engine: Any) -> dict[str, Any]:
    """Sequences holding KV caches, the bytes of KV the prefix cache keeps, MLX's allocator
    (bytes in live arrays: weights, caches, the prefix cache; and kept for reuse), and Python's
    collector: the objects start-up froze out of its reach, and its collections so far by
    generation (a full one, generation 2, stops the engine thread while it walks the heap)."""
    import gc

    import mlx.core as mx

    prefix_cache = engine.prefix_cache
    return {"cached_sequences": engine.executor.num_sequences,
            "prefix_cache_bytes": prefix_cache.nbytes if prefix_cache is not None else 0,
            "mlx_active_bytes": int(mx.get_active_memory()),
            "mlx_cache_bytes": int(mx.get_cache_memory()),
            "gc_frozen_objects": gc.get_freeze_count(),
            "gc_collections": [generation["collections"] for generation in gc.get_stats()]}


def blas_state() -> dict[str, str | None]:
    """runtime.blas.BlasInfo as JSON: the setting, the library (null: MLX's own), why."""
    from runtime.blas import load_blas

    blas = load_blas()
    return {"setting": blas.setting, "library": str(blas.library) if blas.library else None,
            "config": blas.config, "reason": blas.reason}


def _query_float(request: Request, name: str) -> float | None:
    text = request.args.get(name)
    if text is None or text == "":
        return None
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.0 <= value <= MAX_QUERY_INT:  # NaN fails too
        raise invalid(f"query parameter `{name}` must be a number of seconds >= 0, got "
                      f"{text!r}", name)
    return value


def _query_int(request: Request, name: str, default: int | None, minimum: int) -> int | None:
    text = request.args.get(name)
    if text is None or text == "":
        return default
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if not minimum <= value <= MAX_QUERY_INT:
        raise invalid(f"query parameter `{name}` must be an integer >= {minimum}, got {text!r}",
                      name)
    return value
