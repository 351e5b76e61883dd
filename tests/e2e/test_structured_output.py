"""`response_format` through the real server with the real `openai` client, whole and streamed.

The built-in model's free output is printable noise and it never emits EOS by itself: a valid
document that ends ("stop") can only come from the grammar mask. The schema bounds every string,
array and integer, so the grammar forces the document to end within max_tokens.
"""

from __future__ import annotations

import json
import threading
from typing import Annotated, Literal

import jsonschema
import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel, ConfigDict, Field

from tests.runtime.test_grammar_engine import SCHEMA

MAX_TOKENS = 600
SCHEMA_FORMAT = {"type": "json_schema",
                 "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "Describe a thing as JSON."}]


@pytest.fixture
def client(server):
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def streamed_chat(client: OpenAI, **kwargs: object) -> tuple[str, str | None]:
    text, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **kwargs):  # type: ignore[call-overload]
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "seed": 7}])
def test_chat_json_schema_whole_and_streamed(client, model_name, sampling):
    args = dict(model=model_name, messages=MESSAGES, max_tokens=MAX_TOKENS,
                response_format=SCHEMA_FORMAT, **sampling)
    whole = client.chat.completions.create(**args)
    assert whole.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(whole.choices[0].message.content), SCHEMA)
    text, finish = streamed_chat(client, **args)
    assert finish == "stop"
    assert text == whole.choices[0].message.content  # greedy, or the same seed


@pytest.mark.parametrize("stream", [False, True])
def test_completions_take_a_response_format_too(client, model_name, stream):
    out = client.completions.create(model=model_name, prompt="A thing:", max_tokens=MAX_TOKENS,
                                    temperature=1.0, seed=11, stream=stream,
                                    extra_body={"response_format": SCHEMA_FORMAT})
    chunks = list(out) if stream else [out]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


class Owner(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: Annotated[int, Field(ge=1, le=99)]
    active: bool


class Thing(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Annotated[str, Field(max_length=10)]
    kind: Literal["tool", "part", "kit"]
    tags: Annotated[list[Literal["red", "blue"]], Field(max_length=3)]
    owner: Owner
    ref: Annotated[str, Field(max_length=5)] | None


def test_the_clients_own_parse_gets_its_pydantic_model(client, model_name):
    # openai's parse() sends a strict schema with $defs/$ref for the nested model.
    out = client.chat.completions.parse(model=model_name, messages=MESSAGES,
                                        max_tokens=MAX_TOKENS, response_format=Thing,
                                        temperature=1.0, seed=3)
    assert isinstance(out.choices[0].message.parsed, Thing)
    assert out.choices[0].finish_reason == "stop"


def test_json_object_that_ends_is_an_object(client, model_name):
    outs = [client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=200, temperature=1.0, seed=seed,
        response_format={"type": "json_object"}) for seed in range(3)]
    for out in outs:
        choice = out.choices[0]
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:
            assert choice.finish_reason == "length" and out.usage.completion_tokens == 200


def test_max_tokens_cuts_the_document_with_length(client, model_name):
    out = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=12,
                                         response_format=SCHEMA_FORMAT)
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].message.content.startswith('{"name": "')
    assert out.usage.completion_tokens == 12
    with pytest.raises(ValueError):
        json.loads(out.choices[0].message.content)


@pytest.mark.parametrize(("schema", "says"), [
    ({"type": "objec"}, "'objec' is not a type"),
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"type": "string", "maxLength": "é" * 60}, "maxLength` is not valid JSON Schema"),
    ({"type": "object", "required": 5}, "required` is not valid JSON Schema"),
])
def test_a_schema_the_engine_cannot_enforce_is_a_400_naming_it(client, model_name, schema, says):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model_name, messages=MESSAGES, max_tokens=5,
            response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema}})
    error = info.value.body
    assert error["param"] == "response_format.json_schema.schema"
    assert says in error["message"]


def test_a_constrained_and_a_free_request_share_the_batch(client, model_name, server):
    free = dict(model=model_name, prompt="free text", max_tokens=60)
    alone = client.completions.create(**free).choices[0].text
    results: dict[str, str] = {}

    def constrained() -> None:
        out = client.chat.completions.create(model=model_name, messages=MESSAGES,
                                             max_tokens=MAX_TOKENS, response_format=SCHEMA_FORMAT)
        results["constrained"] = out.choices[0].message.content

    worker = threading.Thread(target=constrained)
    worker.start()
    together = client.completions.create(**free).choices[0].text
    worker.join(120)
    assert together == alone
    jsonschema.validate(json.loads(results["constrained"]), SCHEMA)


@pytest.mark.parametrize("stream", [False, True])
def test_every_choice_of_n_is_schema_valid(client, model_name, stream):
    # The choices fork one prefill; each has a grammar matcher of its own.
    out = client.chat.completions.create(model=model_name, messages=MESSAGES, n=3,
                                         max_tokens=MAX_TOKENS, temperature=1.0, seed=21,
                                         response_format=SCHEMA_FORMAT, stream=stream)
    texts, finishes = {}, {}
    for chunk in (out if stream else []):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            finishes[c.index] = c.finish_reason or finishes.get(c.index)
    for c in ([] if stream else out.choices):
        texts[c.index], finishes[c.index] = c.message.content, c.finish_reason
    assert sorted(texts) == [0, 1, 2] and set(finishes.values()) == {"stop"}
    for text in texts.values():
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts.values())) == 3


def test_logprobs_are_of_the_raw_distribution_not_the_masked_one(client, model_name):
    # The grammar forces `{` first; the noise model's favourite is another token. Masked, `{`
    # would have log-probability 0; raw, it is below the model's favourite.
    out = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=3,
                                         logprobs=True, top_logprobs=1,
                                         response_format={"type": "json_object"})
    first = out.choices[0].logprobs.content[0]
    assert first.token == "{"
    assert first.top_logprobs[0].token != "{"
    assert first.logprob < first.top_logprobs[0].logprob < 0
