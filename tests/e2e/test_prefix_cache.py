"""Prompt caching seen from a client: the real `openai` client against the real server (its
prefix cache on by default). A chat's second turn reuses the first turn's KV and says so in
`usage.prompt_tokens_details.cached_tokens`, as OpenAI reports it; `/metrics` and the trace
count the same tokens; a request that sends `cache_prompt: false` reuses nothing and gets the
same greedy answer. Across a conversation's turns (the previous answer re-rendered by the chat
template and re-tokenized), each turn finds all of the conversation so far in the cache but the
previous answer's last token, and answers as a server without the cache does."""

from __future__ import annotations

import pytest
from openai import OpenAI

from tests.e2e.conftest import SERVE_FLAGS, start_server, stop_server
from tests.e2e.test_ops import trace_events

MAX_TOKENS = 6
SYSTEM = "You schedule prompts fairly. " * 8  # a few chunks of 32 tokens


@pytest.fixture
def client(server):
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def counters(server) -> dict[str, float]:
    names = ("fairtick_prefix_cache_hit_tokens_total", "fairtick_prefix_cache_miss_tokens_total")
    gauges = server.gauges()
    return {n: gauges[n] for n in names}


def test_a_second_chat_turn_reports_its_cached_prompt_tokens(client, server, model_name):
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Which prompt goes first?"}]
    first = client.chat.completions.create(model=model_name, messages=messages,
                                           max_tokens=MAX_TOKENS)
    server.wait_idle()  # its KV reaches the cache when it is released
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And then?"}]
    before = counters(server)
    second = client.chat.completions.create(model=model_name, messages=messages,
                                            max_tokens=MAX_TOKENS)
    after = counters(server)
    cached = second.usage.prompt_tokens_details.cached_tokens
    # At least the first turn's whole prompt (its answer follows it in the template).
    assert first.usage.prompt_tokens <= cached < second.usage.prompt_tokens
    assert after["fairtick_prefix_cache_hit_tokens_total"] - \
        before["fairtick_prefix_cache_hit_tokens_total"] == cached
    assert after["fairtick_prefix_cache_miss_tokens_total"] - \
        before["fairtick_prefix_cache_miss_tokens_total"] == second.usage.prompt_tokens - cached
    [arrival] = [e for e in trace_events(server, request_id=second.id) if e["kind"] == "arrival"]
    assert arrival["cached_tokens"] == cached

    cold = client.chat.completions.create(model=model_name, messages=messages,
                                          max_tokens=MAX_TOKENS,
                                          extra_body={"cache_prompt": False})
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert cold.choices[0].message.content == second.choices[0].message.content


def test_streamed_usage_reports_cached_tokens_too(client, server, model_name):
    prompt = SYSTEM + "Stream this."
    client.completions.create(model=model_name, prompt=prompt, max_tokens=MAX_TOKENS)
    server.wait_idle()
    chunks = list(client.completions.create(model=model_name, prompt=prompt,
                                            max_tokens=MAX_TOKENS, stream=True,
                                            stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1


def test_cache_prompt_must_be_a_boolean(client, model_name):
    from openai import BadRequestError

    with pytest.raises(BadRequestError) as err:
        client.completions.create(model=model_name, prompt="x", max_tokens=1,
                                  extra_body={"cache_prompt": "no"})
    assert "cache_prompt" in str(err.value)


def test_later_chat_turns_prefill_only_their_new_tokens_and_answer_as_a_cold_server(
        client, server, model_name, tmp_path):
    turns = [[{"role": "system", "content": SYSTEM + "Chat turns."},
              {"role": "user", "content": "Which prompt goes first?"}]]
    replies = []
    for question in ("And then?", "Why that one?", "Thanks."):
        replies.append(client.chat.completions.create(model=model_name, messages=turns[-1],
                                                      max_tokens=MAX_TOKENS))
        server.wait_idle()  # its prompt and answer reach the cache when it is released
        turns.append(turns[-1] + [
            {"role": "assistant", "content": replies[-1].choices[0].message.content},
            {"role": "user", "content": question}])
    for before, after in zip(replies, replies[1:], strict=False):
        # The KV of the previous turn's prompt and of its answer but the last token (whose
        # KV is never written): the template's markers and the new question are all it runs.
        assert after.usage.prompt_tokens_details.cached_tokens == \
            before.usage.prompt_tokens + before.usage.completion_tokens - 1
    cold = start_server(tmp_path, "--no-prefix-cache", *SERVE_FLAGS)
    try:
        cold_client = OpenAI(base_url=f"{cold.url}/v1", api_key="unused", max_retries=0,
                             timeout=60)
        for messages, reply in zip(turns, replies, strict=False):
            answer = cold_client.chat.completions.create(model=model_name, messages=messages,
                                                         max_tokens=MAX_TOKENS)
            assert answer.usage.prompt_tokens_details.cached_tokens == 0
            assert answer.choices[0].message.content == reply.choices[0].message.content
    finally:
        assert stop_server(cold) == 0
