"""The real `openai` client against the real server: completions and chat, whole and streamed.

The built-in model never emits EOS, so every request runs to `max_tokens` ("length"), and it
emits only printable ASCII, one character per token.
"""

from __future__ import annotations

import pytest
from openai import OpenAI

PROMPT = "The scheduler"
MAX_TOKENS = 6


@pytest.fixture
def client(server):
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_lists_the_served_model(client, builtin):
    assert [m.id for m in client.models.list().data] == [builtin.name]


def test_completion(client, model_name, builtin):
    out = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=MAX_TOKENS)
    choice = out.choices[0]
    assert choice.finish_reason == "length" and len(choice.text) == MAX_TOKENS
    assert out.usage.completion_tokens == MAX_TOKENS
    assert out.usage.prompt_tokens == len(builtin.tokenizer.encode(PROMPT))
    assert out.usage.total_tokens == out.usage.prompt_tokens + MAX_TOKENS


def test_greedy_completion_is_reproducible_and_streams_the_same_text(client, model_name):
    whole = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=MAX_TOKENS)
    again = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=MAX_TOKENS)
    assert again.choices[0].text == whole.choices[0].text
    stream = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) <= {None}
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_completion_from_token_ids(client, model_name):
    out = client.completions.create(model=model_name, prompt=[72, 105], max_tokens=2)
    assert out.usage.prompt_tokens == 2 and out.usage.completion_tokens == 2


def test_chat(client, model_name):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    out = client.chat.completions.create(model=model_name, messages=messages,
                                         max_tokens=MAX_TOKENS)
    choice = out.choices[0]
    assert choice.message.role == "assistant" and len(choice.message.content) == MAX_TOKENS
    assert choice.finish_reason == "length" and out.usage.completion_tokens == MAX_TOKENS
    assert choice.message.refusal is None and "refusal" in choice.message.model_fields_set


def test_every_response_and_chunk_has_the_servers_fingerprint(client, model_name):
    # OpenAI's system_fingerprint: the same for every request to this server (same version,
    # model, MLX and BLAS), in whole responses and in every chunk.
    chat = client.chat.completions.create(model=model_name, max_tokens=2,
                                          messages=[{"role": "user", "content": "Hi"}])
    fingerprint = chat.system_fingerprint
    assert fingerprint.startswith("fp_") and len(fingerprint) == 15
    completion = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=2)
    assert completion.system_fingerprint == fingerprint
    chunks = list(client.completions.create(model=model_name, prompt=PROMPT, max_tokens=2,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks and {c.system_fingerprint for c in chunks} == {fingerprint}


def test_chat_stream(client, model_name):
    stream = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=MAX_TOKENS,
        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text) == MAX_TOKENS
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_stop_sequence_and_extensions(client, model_name):
    whole = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=MAX_TOKENS)
    stop = whole.choices[0].text[2:4]
    out = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                    stop=[stop], extra_body={"ignore_eos": True, "min_tokens": 1})
    assert out.choices[0].finish_reason == "stop"
    assert stop not in out.choices[0].text
    assert whole.choices[0].text.startswith(out.choices[0].text)
