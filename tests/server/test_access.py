"""The API key and CORS over the real app and engine: who gets a 401, which routes stay open, what
a browser's preflight and a cross-origin response carry, and that none of it is there unless
configured."""

from __future__ import annotations

import json

import pytest

from tests.server.http_helpers import OpenStream, get, post, request
from tests.server.serving import serve

KEY = "sk-test-0123456789"
BEARER = {"Authorization": f"Bearer {KEY}"}
APP = "http://app.example"
GOOD = {"prompt": "hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def keyed(bundle):
    """A key, operator routes open, CORS for any origin."""
    with serve(bundle, server={"api_key": KEY, "allowed_origins": ("*",)}) as served:
        yield served


@pytest.fixture(scope="module")
def locked(bundle):
    """A key asked of every route, CORS for two origins."""
    server = {"api_key": KEY, "api_key_protect_ops": True,
              "allowed_origins": (APP, "http://localhost:3000")}
    with serve(bundle, server=server) as served:
        yield served


@pytest.fixture(scope="module")
def plain(bundle):
    with serve(bundle) as served:
        yield served


def preflight(url, path, origin, headers="authorization, content-type"):
    return request(url, "OPTIONS", path, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": headers})


# --- the API key -----------------------------------------------------------------------------

@pytest.mark.parametrize("method,path", [("POST", "/v1/completions"),
                                         ("POST", "/v1/chat/completions"),
                                         ("GET", "/v1/models"), ("GET", "/v1/models/x"),
                                         ("POST", "/tokenize"), ("POST", "/detokenize"),
                                         ("GET", "/no/such/path")])
def test_without_the_key_every_api_route_is_401_in_openais_shape(keyed, method, path):
    reply = request(keyed.url, method, path, GOOD if method == "POST" else None)
    error = reply.error()
    assert reply.status == 401 and reply.headers["www-authenticate"] == "Bearer"
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", None,
                                                              "invalid_api_key")
    assert "Missing API key" in error["message"]


@pytest.mark.parametrize("authorization,words", [
    (f"Bearer {KEY}x", "Incorrect API key"),
    (f"Bearer {KEY[:-1]}", "Incorrect API key"),
    ("Bearer sk-other", "Incorrect API key"),
    (f"Basic {KEY}", "Missing API key"),
    ("Bearer", "Missing API key"),
    (KEY, "Missing API key"),
])
def test_a_wrong_key_is_401_and_never_reaches_the_engine(keyed, authorization, words):
    before = len(keyed.trace())
    reply = post(keyed.url, "/v1/completions", GOOD, headers={"Authorization": authorization})
    assert reply.status == 401 and words in reply.error()["message"]
    assert KEY not in reply.body.decode(), "the key is never echoed"
    assert len(keyed.trace()) == before, "no sequence was admitted"


def test_the_right_key_is_served(keyed):
    reply = post(keyed.url, "/v1/completions", GOOD, headers={"Authorization": f"bearer {KEY}"})
    assert reply.status == 200 and len(reply.json()["choices"][0]["text"]) == 2
    assert post(keyed.url, "/tokenize", {"prompt": "hi"}, headers=BEARER).status == 200


@pytest.mark.parametrize("path", ["/health", "/metrics", "/version", "/debug/state",
                                  "/debug/trace"])
def test_operator_routes_stay_open_unless_asked(keyed, locked, path):
    assert get(keyed.url, path).status == 200
    reply = get(locked.url, path)
    assert reply.status == 401 and reply.error()["code"] == "invalid_api_key"
    assert get(locked.url, path, headers=BEARER).status == 200


# --- CORS ------------------------------------------------------------------------------------

def test_a_preflight_needs_no_key_and_allows_any_origin_with_star(keyed):
    reply = preflight(keyed.url, "/v1/chat/completions", "https://elsewhere.example")
    assert reply.status == 204 and reply.body == b""
    assert reply.headers["access-control-allow-origin"] == "*"
    assert "POST" in reply.headers["access-control-allow-methods"]
    assert reply.headers["access-control-allow-headers"] == "authorization, content-type"
    assert int(reply.headers["access-control-max-age"]) > 0


def test_cross_origin_responses_carry_the_allow_origin_header(keyed):
    origin = {"Origin": "https://elsewhere.example"}
    ok = post(keyed.url, "/v1/completions", GOOD, headers={**BEARER, **origin})
    refused = post(keyed.url, "/v1/completions", GOOD, headers=origin)
    bad = post(keyed.url, "/v1/completions", {**GOOD, "max_tokens": 0},
               headers={**BEARER, **origin})
    for reply, status in ((ok, 200), (refused, 401), (bad, 400)):
        assert reply.status == status, reply.body
        assert reply.headers["access-control-allow-origin"] == "*"
        assert "X-Request-Id" in reply.headers["access-control-expose-headers"]
    assert ok.headers["x-request-id"] == ok.json()["id"], "a page can read the id it exposes"


def test_a_stream_carries_the_allow_origin_header(keyed):
    stream = OpenStream(keyed.url, "/v1/completions", {**GOOD, "stream": True},
                        headers={**BEARER, "Origin": APP})
    try:
        assert stream.response.status == 200
        assert stream.response.getheader("Access-Control-Allow-Origin") == "*"
        assert json.loads(stream.read_event())["object"] == "text_completion"
    finally:
        stream.drop()
    keyed.wait_idle()


def test_listed_origins_are_echoed_and_others_refused(locked):
    reply = preflight(locked.url, "/v1/completions", APP, headers="content-type")
    assert reply.status == 204
    assert (reply.headers["access-control-allow-origin"], reply.headers["vary"]) == (APP, "Origin")
    assert reply.headers["access-control-allow-headers"] == "content-type"
    other = preflight(locked.url, "/v1/completions", "http://evil.example")
    assert other.status == 403 and other.error()["code"] == "cors_origin_not_allowed"
    assert "access-control-allow-origin" not in other.headers
    ok = get(locked.url, "/v1/models", headers={**BEARER, "Origin": "http://localhost:3000"})
    assert ok.headers["access-control-allow-origin"] == "http://localhost:3000"
    foreign = get(locked.url, "/v1/models", headers={**BEARER, "Origin": "http://evil.example"})
    assert foreign.status == 200 and "access-control-allow-origin" not in foreign.headers


def test_without_the_flags_there_is_no_cors_and_no_key(plain):
    reply = preflight(plain.url, "/v1/completions", APP)
    assert reply.status == 405
    reply = post(plain.url, "/v1/completions", GOOD, headers={"Origin": APP})
    assert reply.status == 200
    assert not [h for h in reply.headers if h.startswith("access-control-")]
