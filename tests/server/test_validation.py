"""Field validation without an engine, with the built-in model's real tokenizer and vocabulary:
every error has a status, a param and a message."""

from __future__ import annotations

import dataclasses
import functools

import pytest

from runtime.model import load_model
from server.app import model_limits
from server.errors import ApiError
from server.prompts import MAX_PROMPTS, TokenizerEncoder
from server.validation import (
    MAX_CHOICES,
    MAX_N,
    MAX_STOP_SEQUENCES,
    ModelLimits,
    validate_request,
)

# The model's context is cut short so that its edges are reached with small prompts.
CONTEXT = 64


@functools.cache
def model() -> tuple[ModelLimits, TokenizerEncoder]:
    """The built-in model's limits (with a CONTEXT-token context) and its real tokenizer, the
    pair the server validates with."""
    bundle = load_model(None)
    limits = dataclasses.replace(model_limits(bundle), context_length=CONTEXT)
    return limits, TokenizerEncoder(bundle.tokenizer)


def limits() -> ModelLimits:
    return model()[0]


def encoder() -> TokenizerEncoder:
    return model()[1]


def validate(kind, body, encoder_=None):
    return validate_request(kind, body, limits(), encoder_ or encoder())


def completion(**fields):
    return validate("completion", {"prompt": "hi", **fields})


def chat(**fields):
    return validate("chat", {"messages": [{"role": "user", "content": "hi"}], **fields})


def expect(call, *args, status=400, param=None, match="", **kwargs) -> ApiError:
    with pytest.raises(ApiError) as info:
        call(*args, **kwargs)
    err = info.value
    assert err.status == status, err.message
    assert err.param == param, err.message
    assert match in err.message
    body = err.to_body()["error"]
    assert body["message"] == err.message and body["param"] == param
    assert body["type"] == ("invalid_request_error" if status < 500 else "server_error")
    return err


# --- fields shared by both endpoints ----------------------------------------------------------

def test_defaults_are_greedy_and_16_tokens_for_completions():
    valid = completion()
    assert valid.prompt_tokens == tuple(encoder().encode_prompt("hi"))
    assert valid.sampling.temperature == 0.0 and valid.sampling.max_tokens == 16
    assert not valid.stream and not valid.include_usage


def test_chat_defaults_to_the_server_default_cut_to_the_room_left():
    body = {"messages": [{"role": "user", "content": "hi"}]}
    valid = chat()
    assert valid.prompt_tokens == tuple(encoder().encode_chat(body["messages"]))
    # 2048 by default: more than this CONTEXT leaves, so the room left is what runs.
    assert valid.sampling.max_tokens == CONTEXT - len(valid.prompt_tokens)
    small = dataclasses.replace(limits(), default_chat_max_tokens=5)
    assert validate_request("chat", body, small, encoder()).sampling.max_tokens == 5
    assert validate_request("completion", {"prompt": "hi"}, small,
                            encoder()).sampling.max_tokens == 16, "completions keep 16"


def test_supported_fields_reach_sampling_params():
    valid = completion(temperature=0.7, top_p=0.9, top_k=5, seed=3, max_tokens=8, min_tokens=2,
                       stop=["a", "b"], ignore_eos=True, stream=True,
                       stream_options={"include_usage": True}, n=1, user="me", model=limits().name)
    s = valid.sampling
    assert (s.temperature, s.top_p, s.top_k, s.seed) == (0.7, 0.9, 5, 3)
    assert (s.max_tokens, s.min_tokens, s.stop, s.ignore_eos) == (8, 2, ("a", "b"), True)
    assert valid.stream and valid.include_usage


def test_unknown_field():
    err = expect(completion, frobnicate=1, param="frobnicate", match="Unrecognized")
    assert err.code == "unknown_parameter"


def test_unknown_model_is_404():
    err = expect(completion, model="gpt-4", status=404, param="model", match="gpt-4")
    assert err.code == "model_not_found"


def test_every_served_name_is_accepted():
    named = dataclasses.replace(limits(), name="org/m", aliases=("m",))
    for name in ("org/m", "m"):
        validate_request("completion", {"prompt": "hi", "model": name}, named, encoder())
    with pytest.raises(ApiError) as info:
        validate_request("completion", {"prompt": "hi", "model": limits().name}, named, encoder())
    assert info.value.status == 404 and "`org/m`, `m`" in info.value.message


def test_model_must_be_a_string():
    expect(completion, model=3, param="model", match="must be a string")


@pytest.mark.parametrize("value", ["hot", True, -0.1, 2.5, float("nan"), float("inf")])
def test_temperature_type_range_and_finiteness(value):
    expect(completion, temperature=value, param="temperature", match="number from 0.0 to 2.0")


@pytest.mark.parametrize("value", [1.5, -1, float("-inf"), 0, 0.0])
def test_top_p_range(value):
    expect(completion, top_p=value, param="top_p")


def test_top_k():
    expect(completion, top_k=-2, param="top_k", match="integer")
    assert completion(top_k=-1).sampling.top_k == 0
    assert completion(top_k=10**6).sampling.top_k == limits().vocab_size


@pytest.mark.parametrize("value", [0, -1, 1.5, 1e30, "16", True, CONTEXT + 1])
def test_max_tokens_range(value):
    expect(completion, max_tokens=value, param="max_tokens",
           match=f"integer from 1 to {CONTEXT}")


def test_max_completion_tokens_for_chat():
    assert chat(max_completion_tokens=3).sampling.max_tokens == 3
    expect(chat, max_completion_tokens=0, param="max_completion_tokens")
    # Past the room the prompt leaves, the error names the field that was sent.
    room = CONTEXT - len(chat().prompt_tokens)
    assert chat(max_completion_tokens=room).sampling.max_tokens == room
    expect(chat, max_completion_tokens=room + 1, param="max_completion_tokens",
           match="Reduce the prompt or max_completion_tokens")
    expect(chat, max_tokens=room + 1, param="max_tokens", match="Reduce the prompt or max_tokens")


def test_prompt_plus_max_tokens_fill_the_context_and_no_more():
    prompt = [65] * (CONTEXT - 3)  # token ids: exactly CONTEXT - 3 tokens
    assert completion(prompt=prompt, max_tokens=3).sampling.max_tokens == 3
    err = expect(completion, prompt=prompt, max_tokens=4, param="max_tokens",
                 match=f"maximum context length is {CONTEXT}")
    assert err.code == "context_length_exceeded"
    assert completion(prompt=prompt).sampling.max_tokens == 3, "the default fits the room left"


def test_a_prompt_needs_room_for_one_token():
    assert completion(prompt=[65] * (CONTEXT - 1)).sampling.max_tokens == 1
    err = expect(completion, prompt=[65] * CONTEXT, param="prompt", match="maximum context length")
    assert err.code == "context_length_exceeded"


def test_a_text_prompt_is_measured_in_the_tokenizers_tokens():
    # The tokenizer adds BOS: the text that fills the context is one character shorter.
    text = "x" * (CONTEXT - 1)
    assert len(encoder().encode_prompt(text)) == CONTEXT
    expect(completion, prompt=text, param="prompt", match="maximum context length")
    assert completion(prompt=text[1:]).sampling.max_tokens == 1


def test_chat_longer_than_the_context():
    expect(chat, messages=[{"role": "user", "content": "x" * CONTEXT}], param="messages",
           match="maximum context length")


def test_min_tokens():
    expect(completion, min_tokens=-1, param="min_tokens")
    expect(completion, min_tokens=9, max_tokens=8, param="min_tokens", match="must not exceed")


@pytest.mark.parametrize("value", [-1, 2**64, "7", 1.0])
def test_seed_range(value):
    expect(completion, seed=value, param="seed", match="integer from 0")


@pytest.mark.parametrize("value", [5, [1], ["a", None], {"a": 1}])
def test_stop_must_be_strings(value):
    expect(completion, stop=value, param="stop", match="string or a list of strings")


def test_stop_limits():
    assert completion(stop="x").sampling.stop == ("x",)
    expect(completion, stop=["s"] * (MAX_STOP_SEQUENCES + 1), param="stop", match="at most")
    expect(completion, stop=[""], param="stop", match="1 to")
    expect(completion, stop="y" * 10_000, param="stop", match="1 to")


def test_stream_flags():
    expect(completion, stream="yes", param="stream", match="true or false")
    expect(completion, stream_options={"include_usage": True}, param="stream_options",
           match="only allowed when `stream` is true")
    expect(completion, stream=True, stream_options=[], param="stream_options")
    expect(completion, stream=True, stream_options={"include_usage": 1},
           param="stream_options.include_usage")


def test_n_and_best_of():
    assert completion(n=3).n == chat(n=3).n == 3 and completion().n == 1
    assert completion(n=2, best_of=2).n == 2, "best_of equal to n is n"
    for value in (0, True, MAX_N + 1, 1.5):
        expect(completion, n=value, param="n", match=f"integer from 1 to {MAX_N}")
    for n, best_of in ((1, 2), (3, 2), (2, 5)):
        err = expect(completion, n=n, best_of=best_of, param="best_of", match="not supported")
        assert err.code == "unsupported_parameter"
    expect(chat, best_of=1, param="best_of", match="Unrecognized")  # a completions field
    expect(completion, prompt=["a"] * 3, n=MAX_CHOICES // 2, param="n",
           match=f"at most {MAX_CHOICES}")


def test_logprobs_are_not_supported():
    expect(completion, logprobs=1, param="logprobs", match="not supported")
    expect(chat, logprobs=True, param="logprobs", match="not supported")
    expect(chat, top_logprobs=2, param="top_logprobs")
    assert chat(logprobs=False, top_logprobs=0) == chat(), "the defaults are accepted"


def test_logit_bias_is_not_supported():
    err = expect(completion, logit_bias={"5": 10}, param="logit_bias", match="not supported")
    assert err.code == "unsupported_parameter"
    expect(completion, logit_bias=[1], param="logit_bias", match="object")
    assert completion(logit_bias={}) == completion(logit_bias=None) == completion()


VOCAB_SIZE = "the vocabulary size"  # the first id past the vocabulary, read from the model


@pytest.mark.parametrize("key", [VOCAB_SIZE, "-1", "999999", "x", "1.5", "", "\u0663", "9" * 5000])
def test_logit_bias_keys_must_be_inside_the_vocabulary(key):
    key = str(limits().vocab_size) if key == VOCAB_SIZE else key
    expect(completion, logit_bias={key: 1}, param="logit_bias", match="inside the vocabulary")


@pytest.mark.parametrize("bias", [101, -100.5, float("nan"), float("inf"), "1", None, 10**400])
def test_logit_bias_values_are_finite_numbers_in_range(bias):
    expect(completion, logit_bias={"5": bias}, param="logit_bias", match="-100 to 100")


@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty"])
def test_an_integer_too_large_for_a_float_is_a_400(field):
    expect(completion, **{field: 10**400}, param=field)


@pytest.mark.parametrize("field,value", [("echo", True), ("best_of", 2), ("suffix", "x"),
                                         ("presence_penalty", 0.5), ("frequency_penalty", 3)])
def test_other_unsupported_completion_fields(field, value):
    expect(completion, **{field: value}, param=field, match="not supported")


def test_unsupported_chat_fields():
    expect(chat, tools=[{"type": "function"}], param="tools")
    expect(chat, response_format={"type": "json_object"}, param="response_format")
    defaults = {"tools": [], "response_format": {"type": "text"}, "tool_choice": "none",
                "store": False}
    assert chat(**defaults) == chat(), "the defaults are accepted"


def test_user_must_be_a_string():
    expect(completion, user=5, param="user")


# --- prompts and messages ---------------------------------------------------------------------

def test_prompt_as_token_ids_or_a_batch_of_one():
    assert completion(prompt=[1, 2, 3]).prompt_tokens == (1, 2, 3)
    assert completion(prompt=[[4, 5]]).prompt_tokens == (4, 5)
    assert completion(prompt=["ab"]).prompt_tokens == tuple(encoder().encode_prompt("ab"))


def test_prompt_token_ids_outside_the_vocab():
    last = limits().vocab_size - 1
    assert completion(prompt=[0, last]).prompt_tokens == (0, last)
    expect(completion, prompt=[1, last + 1], param="prompt", match="outside the vocabulary")
    expect(completion, prompt=[-1], param="prompt", match="outside the vocabulary")


def test_prompt_shapes():
    expect(validate, "completion", {}, param="prompt", match="required")
    expect(completion, prompt=5, param="prompt", match="string or a list of token ids")
    expect(completion, prompt=[1, "a"], param="prompt")
    # The tokenizer turns "" into [BOS]: an empty prompt is refused before it is tokenized.
    for empty in ("", []):
        expect(completion, prompt=empty, param="prompt", match="must not be empty")
    for empty in ([""], [[]], ["a", ""], [[1], []]):
        expect(completion, prompt=empty, param=f"prompt[{len(empty) - 1}]",
               match="must not be empty")


def test_batch_prompts_are_one_prompt_each_with_the_room_its_context_leaves():
    text, ids = encoder().encode_prompt("ab"), [7] * (CONTEXT - 3)
    valid = completion(prompt=["ab", "hello"], n=2)
    assert [p.tokens for p in valid.prompts] == [tuple(text), tuple(encoder().encode_prompt(
        "hello"))] and valid.n == 2
    valid = completion(prompt=[text, ids])
    assert [p.tokens for p in valid.prompts] == [tuple(text), tuple(ids)]
    assert [p.sampling.max_tokens for p in valid.prompts] == [16, 3], "each fits its context"
    expect(completion, prompt=[text, ids], max_tokens=4, param="max_tokens",
           match="61 in the prompt[1]")
    expect(completion, prompt=[text, [7] * CONTEXT], param="prompt[1]", match="no room")


def test_batch_prompt_shapes_and_limits():
    last = limits().vocab_size
    expect(completion, prompt=["a", [1]], param="prompt", match="may not mix")
    expect(completion, prompt=[[1], ["a"]], param="prompt[1]", match="list of token ids")
    expect(completion, prompt=[[1], [2, last]], param="prompt[1]", match="outside the vocab")
    expect(completion, prompt=[[1], [True]], param="prompt[1]", match="list of token ids")
    expect(completion, prompt=[[1], [[1]]], param="prompt[1]", match="list of token ids")
    assert len(completion(prompt=["a"] * MAX_PROMPTS).prompts) == MAX_PROMPTS
    expect(completion, prompt=["a"] * (MAX_PROMPTS + 1), param="prompt",
           match=f"at most {MAX_PROMPTS}")


def test_message_shapes():
    expect(validate, "chat", {}, param="messages", match="required")
    expect(chat, messages=[], param="messages", match="non-empty")
    expect(chat, messages="hi", param="messages")
    expect(chat, messages=["hi"], param="messages[0]")
    expect(chat, messages=[{"role": "wizard", "content": "x"}], param="messages[0].role")
    expect(chat, messages=[{"role": "user", "content": 5}], param="messages[0].content")
    expect(chat, messages=[{"role": "user", "content": [{"type": "image_url"}]}],
           param="messages[0].content", match="not supported")


def test_a_role_of_any_other_type_is_a_400_naming_it():
    # An object or a list once reached a set lookup and answered 500 (unhashable type).
    for role in ({"a": 1}, ["user"], 5, True, None):
        expect(chat, messages=[{"role": role, "content": "x"}], param="messages[0].role",
               match="must be one of")


def test_message_name_tool_call_id_and_tool_calls_shapes():
    ok = {"role": "user", "content": "x"}
    assert chat(messages=[{**ok, "name": "ann", "tool_calls": []}]).prompt_tokens == \
        chat(messages=[ok]).prompt_tokens
    for field in ("name", "tool_call_id"):
        expect(chat, messages=[ok, {**ok, field: {"a": 1}}], param=f"messages[1].{field}",
               match="must be a string")
    for calls in ({"id": "a"}, "call", 5):
        expect(chat, messages=[{**ok, "tool_calls": calls}], param="messages[0].tool_calls",
               match="must be a list")
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    err = expect(chat, messages=[{**ok, "tool_calls": [call]}], param="messages[0].tool_calls",
                 match="not supported")
    assert err.code == "unsupported_parameter"


def test_text_parts_are_joined():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    valid = chat(messages=[{"role": "developer", "content": parts}])
    system = chat(messages=[{"role": "system", "content": "ab"}])
    assert valid.prompt_tokens == system.prompt_tokens


def test_a_failing_chat_template_is_a_400():
    # Many models' templates refuse content they do not expect (raise_exception in Jinja); the
    # built-in one accepts everything, so a fresh copy of its tokenizer gets such a template.
    tokenizer = load_model(None).tokenizer
    tokenizer._tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    body = {"messages": [{"role": "user", "content": "hi"}]}
    expect(validate, "chat", body, TokenizerEncoder(tokenizer), param="messages",
           match="roles must alternate")
