"""`fairtick serve` started with the API flags (served names, a key, CORS, the chat max_tokens
default), driven by the real `openai` client: what each flag promises, seen from outside.

The built-in model never emits EOS, so a request without max_tokens runs to its default: the
chat one set small here with --default-chat-max-tokens, OpenAI's 16 for completions.
"""

from __future__ import annotations

import http.client
import urllib.parse

import openai
import pytest
from openai import OpenAI

from tests.e2e.conftest import SERVE_FLAGS, start_server, stop_server
from tests.server.http_helpers import get, request

KEY = "sk-e2e-key"
NAMES = ("org/tiny-chat", "tiny")
CHAT_DEFAULT = 5
ORIGIN = "http://app.example"
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def flagged(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("flags"), *SERVE_FLAGS,
                          "--served-model-name", *NAMES, "--api-key", KEY,
                          "--allowed-origins", f"{ORIGIN}, http://localhost:3000",
                          "--default-chat-max-tokens", str(CHAT_DEFAULT))
    yield server
    assert stop_server(server) == 0, server.log()


@pytest.fixture
def client(flagged):
    flagged.wait_idle()
    return OpenAI(base_url=f"{flagged.url}/v1", api_key=KEY, max_retries=0, timeout=60)


def test_models_are_listed_and_retrieved_by_every_served_name(client):
    assert [m.id for m in client.models.list().data] == list(NAMES)
    for name in NAMES:
        assert client.models.retrieve(name).id == name
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4o")
    assert info.value.code == "model_not_found" and info.value.param == "model"


def test_a_wrong_key_is_an_authentication_error(flagged):
    wrong = OpenAI(base_url=f"{flagged.url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.chat.completions.create(model=NAMES[1], messages=MESSAGES, max_tokens=2)
    assert (info.value.status_code, info.value.code) == (401, "invalid_api_key")
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    assert get(flagged.url, "/health").status == 200, "health stays open"


def test_chat_without_max_tokens_stops_at_the_documented_default(client):
    out = client.chat.completions.create(model=NAMES[1], messages=MESSAGES)
    assert out.model == NAMES[0]
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == CHAT_DEFAULT == len(out.choices[0].message.content)
    stream = client.chat.completions.create(model=NAMES[0], messages=MESSAGES, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == CHAT_DEFAULT


def test_completions_without_max_tokens_keep_openais_16(client):
    out = client.completions.create(model=NAMES[1], prompt="The scheduler")
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 16


def test_the_allowed_origin_may_call_from_a_browser(flagged):
    reply = request(flagged.url, "OPTIONS", "/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert reply.status == 204 and reply.headers["access-control-allow-origin"] == ORIGIN
    reply = get(flagged.url, "/v1/models", headers={"Origin": ORIGIN,
                                                    "Authorization": f"Bearer {KEY}"})
    assert reply.status == 200 and reply.headers["access-control-allow-origin"] == ORIGIN


def test_a_preflight_with_an_empty_body_logs_no_error(flagged):
    # Python's `requests` sends OPTIONS with `Content-Length: 0`; Sanic logs an ERROR for a 2xx
    # answer that left a declared body unread. The next request on the connection is read only
    # once the previous one is done, its log line included.
    logged = len(flagged.log_path.read_text())
    url = urllib.parse.urlparse(flagged.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    try:
        for origin, status in ((ORIGIN, 204), ("http://evil.example", 403)):
            conn.request("OPTIONS", "/v1/chat/completions", headers={
                "Origin": origin, "Access-Control-Request-Method": "POST", "Content-Length": "0"})
            response = conn.getresponse()
            response.read()
            assert response.status == status
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
    finally:
        conn.close()
    log = flagged.log_path.read_text()[logged:]
    assert "ERROR" not in log, log


def test_the_default_server_has_no_cors_and_no_key(server):
    reply = request(server.url, "OPTIONS", "/v1/models", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "GET"})
    assert reply.status == 405
    reply = get(server.url, "/v1/models", headers={"Origin": ORIGIN})
    assert reply.status == 200
    assert not [h for h in reply.headers if h.startswith("access-control-")]
