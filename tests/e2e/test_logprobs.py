"""logprobs, echo and the sampling controls through the real `openai` client and server.

Every log-probability is checked against log-softmax of the built-in model's own logits for
the same prefix, computed here with mlx-lm directly (one forward over the whole prefix). The
built-in model's tokens are single bytes (id == byte), so a token's `bytes` give its id.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import openai
import pytest
from openai import OpenAI

from tests.server.http_helpers import post

TOLERANCE = 1e-3  # float32 rounding between the server's batched forward and this one
PROMPT = "The scheduler"
# Longer than the e2e server's 32-token prefill chunk: its prefill runs in several slices.
LONG_PROMPT = "A tick is one forward pass over a ragged batch of decode rows and slices."
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture
def client(server):
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def logprobs_after(builtin, tokens: list[int]) -> np.ndarray:
    """Row p: log-softmax of the model's logits at position p of one forward over `tokens`."""
    logits = builtin.model(mx.array(tokens)[None])[0].astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True), dtype=np.float64)


def chat_prompt(server) -> list[int]:
    return list(post(server.url, "/tokenize", {"messages": MESSAGES}).json()["tokens"])


def token_id(data: list[int]) -> int:
    assert len(data) == 1, data
    return data[0]


def check_chat_entry(entry, row: np.ndarray, num_top: int) -> int:
    """The entry's shape and values against `row`, the model's log-probabilities there."""
    token = token_id(entry.bytes)
    assert entry.bytes == list(entry.token.encode())
    assert entry.logprob == pytest.approx(row[token], abs=TOLERANCE)
    top = entry.top_logprobs
    assert len(top) == num_top
    assert [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)
    for t in top:
        assert t.logprob == pytest.approx(row[token_id(t.bytes)], abs=TOLERANCE)
    return token


def test_chat_logprobs_are_the_models_own(client, model_name, server, builtin):
    out = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=6,
                                         logprobs=True, top_logprobs=5)
    content = out.choices[0].logprobs.content
    assert "".join(e.token for e in content) == out.choices[0].message.content
    assert len(content) == out.usage.completion_tokens == 6
    prefix = chat_prompt(server)
    for entry in content:
        row = logprobs_after(builtin, prefix)[-1]
        token = check_chat_entry(entry, row, 5)
        assert entry.top_logprobs[0].token == entry.token, "greedy: the chosen token is top-1"
        assert entry.logprob == pytest.approx(row.max(), abs=TOLERANCE)
        prefix.append(token)


def test_chat_logprobs_stream_with_their_tokens(client, model_name):
    whole = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=5,
                                           logprobs=True, top_logprobs=2)
    stream = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=5,
                                            logprobs=True, top_logprobs=2, stream=True)
    entries = []
    for chunk in stream:
        choice = chunk.choices[0]
        text = choice.delta.content or ""
        got = choice.logprobs.content if choice.logprobs else []
        assert "".join(e.token for e in got) == text, "a chunk carries its own tokens' logprobs"
        entries += got
    assert [e.model_dump() for e in entries] == \
        [e.model_dump() for e in whole.choices[0].logprobs.content]
    plain = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=2,
                                           logprobs=True)
    assert [e.top_logprobs for e in plain.choices[0].logprobs.content] == [[], []]


def check_completion_logprobs(lp, text: str, prefix: list[int], builtin, num_top: int) -> None:
    # Generated tokens after `prefix`: values, sorted alternatives with the chosen one among
    # them (up to num_top + 1), offsets into `text`.
    rows = logprobs_after(builtin, prefix + [ord(t) for t in lp.tokens])
    for i, (token, value, top) in enumerate(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs,
                                                strict=True)):
        row = rows[len(prefix) - 1 + i]
        assert value == pytest.approx(row[ord(token)], abs=TOLERANCE)
        assert token in top and num_top <= len(top) <= num_top + 1
        values = list(top.values())
        assert values[:num_top] == sorted(values[:num_top], reverse=True)
        assert max(values) == pytest.approx(row.max(), abs=TOLERANCE)
        assert text[lp.text_offset[i]] == token


def char_starts(text: str) -> list[int]:
    """For each UTF-8 byte of `text`, the offset of the character it belongs to."""
    return [i for i, char in enumerate(text) for _ in char.encode()]


def merged_columns(chunks) -> dict[str, list]:
    """The completion logprobs columns of a stream's chunks (one choice), end to end."""
    merged: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                               "text_offset": []}
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].logprobs:
            for key, values in chunk.choices[0].logprobs.model_dump().items():
                merged[key] += values
    return merged


def test_completion_logprobs_shape_and_values(client, model_name, builtin):
    out = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=6, logprobs=3)
    choice = out.choices[0]
    lp = choice.logprobs
    assert "".join(lp.tokens) == choice.text and lp.text_offset == list(range(6))
    prompt = builtin.tokenizer.encode(PROMPT)
    check_completion_logprobs(lp, choice.text, prompt, builtin, 3)
    assert lp.token_logprobs == [top[t] for t, top in zip(lp.tokens, lp.top_logprobs,
                                                          strict=True)]
    assert all(max(top.values()) == top[t] for t, top in zip(lp.tokens, lp.top_logprobs,
                                                             strict=True)), "greedy is top-1"
    zero = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=3, logprobs=0)
    assert [list(top) for top in zero.choices[0].logprobs.top_logprobs] == \
        [[t] for t in zero.choices[0].logprobs.tokens], "the chosen token always"


def test_logprobs_are_of_the_raw_distribution_whatever_the_controls(client, model_name,
                                                                    builtin):
    # A bias forces "A": its reported log-probability is still the model's, far from 0.
    out = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=4, logprobs=1,
                                    logit_bias={"65": 100}, presence_penalty=2, temperature=0.5)
    lp = out.choices[0].logprobs
    assert lp.tokens == ["A"] * 4
    check_completion_logprobs(lp, out.choices[0].text, builtin.tokenizer.encode(PROMPT),
                              builtin, 1)
    assert max(lp.token_logprobs) < -1.0


def test_echo_returns_the_prompt_and_its_logprobs_from_the_prefill(client, model_name, builtin):
    out = client.completions.create(model=model_name, prompt=LONG_PROMPT, max_tokens=4,
                                    logprobs=2, echo=True)
    choice = out.choices[0]
    assert choice.text.startswith(LONG_PROMPT) and len(choice.text) == len(LONG_PROMPT) + 4
    lp = choice.logprobs
    prompt = builtin.tokenizer.encode(LONG_PROMPT)  # BOS and one token per byte
    assert len(prompt) > 32 and len(lp.tokens) == len(prompt) + 4
    assert lp.tokens[0] == "<s>" and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens[1:len(prompt)]) == LONG_PROMPT
    rows = logprobs_after(builtin, prompt)
    for position in range(1, len(prompt)):
        assert lp.token_logprobs[position] == pytest.approx(rows[position - 1][prompt[position]],
                                                            abs=TOLERANCE)
        assert len(lp.top_logprobs[position]) in (2, 3)
    assert lp.text_offset[:3] == [0, 0, 1], "BOS takes no place in the text"
    check_completion_logprobs(
        type(lp)(**{k: v[len(prompt):] for k, v in lp.model_dump().items()}),
        choice.text, prompt, builtin, 2)
    plain = client.completions.create(model=model_name, prompt=LONG_PROMPT, max_tokens=4,
                                      echo=True)
    assert plain.choices[0].text == choice.text and plain.choices[0].logprobs is None


def test_echo_streams_the_prompt_first(client, model_name):
    whole = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=3, logprobs=1,
                                      echo=True)
    chunks = [c for c in client.completions.create(model=model_name, prompt=PROMPT,
                                                   max_tokens=3, logprobs=1, echo=True,
                                                   stream=True) if c.choices]
    assert chunks[0].choices[0].text == PROMPT
    assert chunks[0].choices[0].logprobs.token_logprobs[0] is None
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert merged_columns(chunks) == whole.choices[0].logprobs.model_dump()


def test_text_offsets_count_characters_of_a_multibyte_echo(client, model_name):
    # One token per byte: those of "é" and "😀" all start where their character starts, and the
    # generated tokens follow the echo's 6 characters, not its 10 bytes.
    prompt = "héllo😀"
    args = {"model": model_name, "prompt": prompt, "max_tokens": 2, "logprobs": 1, "echo": True}
    whole = client.completions.create(**args)
    text, lp = whole.choices[0].text, whole.choices[0].logprobs
    assert text.startswith(prompt) and len(lp.tokens) == 1 + len(text.encode())
    assert lp.text_offset == [0, *char_starts(text)], "BOS first, at 0"
    assert lp.text_offset[-2:] == [6, 7]
    assert merged_columns(client.completions.create(**args, stream=True)) == lp.model_dump()


@pytest.mark.parametrize("prompt", [[256, 89, 111], "<s>Yo"])
def test_an_echoed_special_token_counts_its_characters(client, model_name, prompt):
    # The echo holds "<s>" (ids decoded, or written in the text): every token's offset is where
    # its text starts. "Y" was at 0 and the first generated token at 5, 4 past "o" at 1.
    args = {"model": model_name, "prompt": prompt, "max_tokens": 2, "logprobs": 0, "echo": True}
    whole = client.completions.create(**args)
    text, lp = whole.choices[0].text, whole.choices[0].logprobs
    assert text.startswith("<s>Yo") and len(text) == 7
    added = 1 if isinstance(prompt, str) else 0  # the BOS the tokenizer adds to a text
    assert lp.tokens == ["<s>"] * (1 + added) + ["Y", "o", text[5], text[6]]
    assert lp.text_offset == [0] * (1 + added) + [3, 4, 5, 6]
    assert all(text.startswith(token, offset) for token, offset in
               zip(lp.tokens[added:], lp.text_offset[added:], strict=True))
    assert merged_columns(client.completions.create(**args, stream=True)) == lp.model_dump()


def test_text_offsets_count_characters_of_multibyte_generated_text(client, model_name):
    # The built-in model emits only ASCII by itself; a schema's enum makes it write "é😀!".
    form = {"type": "json_schema", "json_schema": {"name": "t", "schema": {"enum": ["é😀!"]}}}
    args = {"model": model_name, "prompt": "hé", "max_tokens": 20, "logprobs": 0,
            "extra_body": {"response_format": form}}
    whole = client.completions.create(**args)
    text, lp = whole.choices[0].text, whole.choices[0].logprobs
    assert text == '"é😀!"' and lp.text_offset == char_starts(text) == [0, 1, 1, 2, 2, 2, 2, 3, 4]
    assert merged_columns(client.completions.create(**args, stream=True)) == lp.model_dump()
    echoed = client.completions.create(**args, echo=True)
    assert echoed.choices[0].text == "hé" + text
    assert echoed.choices[0].logprobs.text_offset == [0, *char_starts("hé" + text)]


def test_sampling_controls_through_the_client(client, model_name):
    base = {"model": model_name, "prompt": PROMPT, "max_tokens": 8}
    forced = client.completions.create(**base, logit_bias={"65": 100})
    assert forced.choices[0].text == "A" * 8
    seeded = {**base, "temperature": 1.0, "seed": 3, "presence_penalty": 1.5,
              "frequency_penalty": 0.5, "extra_body": {"min_p": 0.05, "top_k": 20,
                                                       "repetition_penalty": 1.2}}
    first = client.completions.create(**seeded).choices[0].text
    assert client.completions.create(**seeded).choices[0].text == first
    chat = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=4,
                                          logit_bias={"66": 100}, presence_penalty=-2)
    assert chat.choices[0].message.content == "BBBB"


@pytest.mark.parametrize("fields,param", [
    ({"logprobs": 6}, "logprobs"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"extra_body": {"min_p": 1.5}}, "min_p"),
    ({"logit_bias": {"9999": 1}}, "logit_bias"),
])
def test_out_of_range_controls_name_the_field(client, model_name, fields, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model_name, prompt=PROMPT, max_tokens=2, **fields)
    assert info.value.body["param"] == param  # type: ignore[index]


def test_chat_top_logprobs_past_20_names_the_field(client, model_name):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=2,
                                       logprobs=True, top_logprobs=21)
    assert info.value.body["param"] == "top_logprobs"  # type: ignore[index]


def test_each_of_n_choices_carries_its_own_logprobs_whole_and_streamed(client, model_name,
                                                                      builtin):
    base = {"model": model_name, "prompt": PROMPT, "max_tokens": 5, "logprobs": 2, "n": 3,
            "temperature": 1.0, "seed": 21}
    whole = client.completions.create(**base)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    prompt = builtin.tokenizer.encode(PROMPT)
    for choice in whole.choices:
        assert "".join(choice.logprobs.tokens) == choice.text
        check_completion_logprobs(choice.logprobs, choice.text, prompt, builtin, 2)
    assert len({c.text for c in whole.choices}) > 1, "seeded siblings draw their own tokens"
    merged: dict[int, dict[str, list]] = {}
    for chunk in client.completions.create(**base, stream=True):
        for choice in chunk.choices:
            columns = merged.setdefault(choice.index, {"tokens": [], "token_logprobs": [],
                                                       "top_logprobs": [], "text_offset": []})
            for key, values in (choice.logprobs.model_dump() if choice.logprobs else {}).items():
                columns[key] += values
    assert [merged[c.index] for c in whole.choices] == \
        [c.logprobs.model_dump() for c in whole.choices], "the same, chunk by chunk"


def test_each_chat_choice_carries_its_own_logprobs(client, model_name, server, builtin):
    out = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=4, n=2,
                                         temperature=1.0, seed=8, logprobs=True, top_logprobs=1)
    prefix = chat_prompt(server)
    for choice in out.choices:
        content = choice.logprobs.content
        assert "".join(e.token for e in content) == choice.message.content
        tokens = list(prefix)
        for entry in content:
            tokens.append(check_chat_entry(entry, logprobs_after(builtin, tokens)[-1], 1))


def test_echo_gives_each_prompt_of_a_batch_its_own_choices(client, model_name):
    for prompt, echoed in ((["ab", "xyz"], ["ab", "xyz"]),
                           ([[104, 105], [111, 107]], ["hi", "ok"])):  # ids: echoed decoded
        out = client.completions.create(model=model_name, prompt=prompt, max_tokens=2, n=2,
                                        echo=True, logprobs=0)
        assert [c.index for c in out.choices] == [0, 1, 2, 3]
        for choice in out.choices:
            text = echoed[choice.index // 2]
            assert choice.text.startswith(text) and len(choice.text) == len(text) + 2
            assert choice.logprobs.token_logprobs[0] is None
            assert "".join(choice.logprobs.tokens).endswith(choice.text)


def test_echo_logprobs_run_the_whole_prompt_past_the_prefix_cache(client, model_name, builtin):
    # The prompt is cached by the first request; an echo with logprobs needs every prompt
    # token's, which a cached prefix has not: it reuses nothing, and its values are the model's.
    prompt = LONG_PROMPT + " Twice."
    client.completions.create(model=model_name, prompt=prompt, max_tokens=2)
    out = client.completions.create(model=model_name, prompt=prompt, max_tokens=2, logprobs=1,
                                    echo=True)
    assert out.usage.prompt_tokens_details.cached_tokens == 0
    tokens = builtin.tokenizer.encode(prompt)
    rows = logprobs_after(builtin, tokens)
    lp = out.choices[0].logprobs
    assert lp.token_logprobs[1:len(tokens)] == pytest.approx(
        [rows[p - 1][tokens[p]] for p in range(1, len(tokens))], abs=TOLERANCE)
    again = client.completions.create(model=model_name, prompt=prompt, max_tokens=2, logprobs=1)
    assert again.usage.prompt_tokens_details.cached_tokens > 0, "without echo: from the cache"
