"""Field validation without an engine, with the built-in model's real tokenizer and vocabulary:
every error has a status, a param and a message."""

from __future__ import annotations

import dataclasses
import functools

import pytest

from runtime.limits import MAX_CHOICES, MAX_N, MAX_PROMPTS, MAX_STOP_SEQUENCES
from runtime.model import load_model
from server.app import model_limits
from server.body_models import ChatBody, CompletionBody, DetokenizeBody, TokenizeBody
from server.errors import ApiError
from server.prompts import TokenizerEncoder
from server.validation import ModelLimits, validate_request

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


def test_a_default_max_tokens_is_cut_to_the_room_the_kv_budget_leaves():
    body = {"messages": [{"role": "user", "content": "hi"}]}
    num_prompt = len(chat().prompt_tokens)
    tight = dataclasses.replace(limits(), kv_budget_tokens=num_prompt + 7)
    assert validate_request("chat", body, tight, encoder()).sampling.max_tokens == 7
    assert validate_request("completion", {"prompt": "hi"}, dataclasses.replace(
        limits(), kv_budget_tokens=len(completion().prompt_tokens) + 3),
        encoder()).sampling.max_tokens == 3, "completions' 16 too"
    # Sent, it is the client's to lower: kept (the engine refuses what cannot fit).
    assert validate_request("chat", {**body, "max_tokens": 30}, tight,
                            encoder()).sampling.max_tokens == 30
    # A prompt that fills the budget alone: no cut to 0 (the engine names the budget).
    full = dataclasses.replace(limits(), kv_budget_tokens=num_prompt)
    assert validate_request("chat", body, full, encoder()).sampling.max_tokens == \
        CONTEXT - num_prompt


def test_supported_fields_reach_sampling_params():
    valid = completion(temperature=0.7, top_p=0.9, top_k=5, seed=3, max_tokens=8, min_tokens=2,
                       stop=["a", "b"], ignore_eos=True, stream=True,
                       stream_options={"include_usage": True}, n=1, user="me", model=limits().name)
    s = valid.sampling
    assert (s.temperature, s.top_p, s.top_k, s.seed) == (0.7, 0.9, 5, 3)
    assert (s.max_tokens, s.min_tokens, s.stop, s.ignore_eos) == (8, 2, ("a", "b"), True)
    assert valid.stream and valid.include_usage


def test_unknown_fields_are_ignored_and_named_anywhere_in_the_body():
    # ADR 0010: accepted as vLLM does, each named by its path for the response header.
    valid = chat(frobnicate=1, messages=[
        {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {}}],
         "tool_call_id": "x"}])
    assert valid.ignored == ("frobnicate", "messages[0].tool_call_id",
                             "messages[0].content[0].cache_control")
    assert valid.prompt_tokens == chat().prompt_tokens and chat().ignored == ()


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
    expect(completion, temperature=value, param="temperature", match="number from 0 to 2, got")


@pytest.mark.parametrize("value", [1.5, -1, float("-inf"), 0, 0.0])
def test_top_p_range(value):
    expect(completion, top_p=value, param="top_p")


def test_top_k():
    expect(completion, top_k=-2, param="top_k", match="integer")
    assert completion(top_k=-1).sampling.top_k == 0
    assert completion(top_k=10**6).sampling.top_k == limits().vocab_size


@pytest.mark.parametrize("value", [0, -1, 1.5, 1e30, "16", True])
def test_max_tokens_range(value):
    expect(completion, max_tokens=value, param="max_tokens", match="must be an integer >= 1")


def test_max_tokens_past_the_context_names_the_context():
    err = expect(completion, max_tokens=CONTEXT + 1, param="max_tokens",
                 match=f"maximum context length is {CONTEXT} tokens")
    assert err.code == "context_length_exceeded"


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
    err = expect(completion, prompt=[65] * CONTEXT, param="prompt",
                 match=f"the {CONTEXT} tokens of the prompt leave no room to generate")
    assert err.code == "context_length_exceeded"


def test_a_text_prompt_is_measured_in_the_tokenizers_tokens():
    # The tokenizer adds BOS: the text that fills the context is one character shorter.
    text = "x" * (CONTEXT - 1)
    assert len(encoder().encode_prompt(text)) == CONTEXT
    expect(completion, prompt=text, param="prompt", match="maximum context length")
    assert completion(prompt=text[1:]).sampling.max_tokens == 1


def test_chat_longer_than_the_context():
    err = expect(chat, messages=[{"role": "user", "content": "x" * CONTEXT}], param="messages",
                 match="maximum context length")
    # The message reads right whatever the prompt's param is called ("the messages has" did not).
    assert " tokens of the messages leave no room to generate" in err.message


def test_min_tokens():
    expect(completion, min_tokens=-1, param="min_tokens")
    expect(completion, min_tokens=9, max_tokens=8, param="min_tokens", match="must not exceed")


@pytest.mark.parametrize("value", [-1, 2**64, "7", 1.0])
def test_seed_range(value):
    expect(completion, seed=value, param="seed", match="integer from 0")


@pytest.mark.parametrize("value", [5, {"a": 1}, True])
def test_stop_must_be_strings(value):
    expect(completion, stop=value, param="stop", match="string or a list of strings")


@pytest.mark.parametrize("value,param", [([1], "stop[0]"), (["a", None], "stop[1]")])
def test_each_stop_item_must_be_a_string(value, param):
    expect(completion, stop=value, param=param, match="must be a string of 1 to 256 characters")


def test_stop_limits():
    assert completion(stop="x").sampling.stop == ("x",)
    expect(completion, stop=["s"] * (MAX_STOP_SEQUENCES + 1), param="stop",
           match=f"a list of at most {MAX_STOP_SEQUENCES} strings, got 17 items")
    expect(completion, stop=[""], param="stop[0]", match="1 to 256 characters")
    expect(completion, stop="y" * 10_000, param="stop",
           match="1 to 256 characters, got a string of 10000 characters")


def test_metadata_limits_count_the_items_sent():
    entries = {f"k{i}": "v" for i in range(16)}
    assert chat(metadata=entries).prompt_tokens == chat().prompt_tokens
    # pydantic leaves a dict's length out of its error; it once read "got None items".
    expect(chat, metadata={**entries, "k16": "v"}, param="metadata",
           match="an object of at most 16 items, got 17 items")


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
    for n, best_of in ((1, 2), (2, 5)):
        err = expect(completion, n=n, best_of=best_of, param="best_of", match="not supported")
        assert err.code == "unsupported_parameter"
    err = expect(completion, n=3, best_of=2, param="best_of", match="must be at least `n`")
    assert err.code is None
    assert chat(best_of=3).ignored == ("best_of",), "a completions field, unknown to chat"
    expect(completion, prompt=["a"] * 3, n=MAX_CHOICES // 2, param="n",
           match=f"at most {MAX_CHOICES}")


@pytest.mark.parametrize("value", [0, MAX_N + 1, True, 1.0])
def test_n_outside_its_range_is_a_400_naming_the_range(value):
    err = expect(completion, n=value, param="n", match=f"an integer from 1 to {MAX_N}")
    assert err.code is None


def test_chat_logprobs_and_top_logprobs():
    assert chat(logprobs=True, top_logprobs=20).sampling.logprobs == 20
    assert chat(logprobs=True).sampling.logprobs == 0, "the chosen token's only"
    assert chat(logprobs=False, top_logprobs=0) == chat(), "the defaults are accepted"
    assert chat().sampling.logprobs is None and chat().sampling.prompt_logprobs is None
    expect(chat, top_logprobs=2, param="top_logprobs", match="needs `logprobs`")
    expect(chat, logprobs=True, top_logprobs=21, param="top_logprobs", match="0 to 20")
    expect(chat, logprobs=True, top_logprobs=-1, param="top_logprobs")
    expect(chat, logprobs=1, param="logprobs", match="true or false")
    assert not chat(logprobs=True).echo, "chat has no echo"


def test_completion_logprobs_and_echo():
    assert completion(logprobs=5).sampling.logprobs == 5
    assert completion(logprobs=0).sampling.logprobs == 0
    assert completion(logprobs=2).sampling.prompt_logprobs is None, "the prompt's: with echo"
    echoed = completion(logprobs=3, echo=True)
    assert echoed.echo and echoed.sampling.prompt_logprobs == 3
    plain = completion(echo=True)
    assert plain.echo and plain.sampling.logprobs is None and plain.sampling.prompt_logprobs is None
    for bad in (6, -1, True, 1.5, "2"):
        expect(completion, logprobs=bad, param="logprobs")
    expect(completion, logprobs=6, param="logprobs", match="0 to 5")
    expect(completion, echo=1, param="echo", match="true or false")


def test_echo_keeps_each_prompt_text_as_sent():
    batch = completion(prompt=["ab", "cd"], echo=True)
    assert [p.text for p in batch.prompts] == ["ab", "cd"]
    assert completion(prompt=[1, 2], echo=True).prompts[0].text is None, "ids: decoded later"
    assert completion(prompt=[[1, 2], [3]], echo=True).prompts[1].text is None


def test_logit_bias_becomes_token_bias_pairs():
    assert completion(logit_bias={"5": 10, "65": -100}).sampling.logit_bias == \
        ((5, 10.0), (65, -100.0))
    expect(completion, logit_bias=[1], param="logit_bias", match="object")
    err = expect(completion, logit_bias={"7": 1, "007": 2}, param="logit_bias", match="twice")
    assert "'7'" in err.message and "'007'" in err.message
    assert completion(logit_bias={}) == completion(logit_bias=None) == completion()


def test_sampling_controls_with_their_ranges():
    s = completion(min_p=0.1, presence_penalty=-2, frequency_penalty=2, repetition_penalty=1.3,
                   top_k=-1).sampling
    assert (s.min_p, s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.top_k) == \
        (0.1, -2.0, 2.0, 1.3, 0)
    defaults = completion(min_p=0, presence_penalty=0, frequency_penalty=0, repetition_penalty=1)
    assert defaults == completion()
    for field, bad, words in [("min_p", 1.5, "a number from 0 to 1"),
                              ("min_p", -0.1, "a number from 0 to 1"),
                              ("presence_penalty", 2.5, "a number from -2 to 2"),
                              ("frequency_penalty", -3, "a number from -2 to 2"),
                              ("repetition_penalty", 0, "a number > 0"),
                              ("repetition_penalty", -1, "a number > 0"),
                              ("repetition_penalty", "1", "number"),
                              ("top_k", -2, "an integer from -1")]:
        expect(completion, **{field: bad}, param=field, match=words)


VOCAB_SIZE = "the vocabulary size"  # the first id past the vocabulary, read from the model


@pytest.mark.parametrize("key", [VOCAB_SIZE, "-1", "999999", "x", "1.5", "", "\u0663", "9" * 5000])
def test_logit_bias_keys_must_be_inside_the_vocabulary(key):
    key = str(limits().vocab_size) if key == VOCAB_SIZE else key
    expect(completion, logit_bias={key: 1}, param="logit_bias", match="inside the vocabulary")


@pytest.mark.parametrize("bias", [101, -100.5, float("nan"), float("inf"), "1", None, 10**400])
def test_logit_bias_values_are_finite_numbers_in_range(bias):
    expect(completion, logit_bias={"5": bias}, param="logit_bias.5", match="-100 to 100")


@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty", "min_p",
                                   "frequency_penalty", "repetition_penalty"])
def test_an_integer_too_large_for_a_float_is_a_400(field):
    expect(completion, **{field: 10**400}, param=field)


@pytest.mark.parametrize("field,value", [("best_of", 2), ("suffix", "x")])
def test_other_unsupported_completion_fields(field, value):
    err = expect(completion, **{field: value}, param=field, match="not supported")
    assert err.code == "unsupported_parameter"


@pytest.mark.parametrize("field,value,allowed", [
    ("best_of", 21, "an integer from 1 to 20"), ("suffix", 1, "a string")])
def test_declared_fields_are_range_checked_before_they_are_refused(field, value, allowed):
    expect(completion, **{field: value}, param=field, match=f"must be {allowed}, got")


def test_no_op_values_of_unsupported_fields_are_accepted():
    assert completion(n=1, best_of=1, suffix="") == completion()


def test_unsupported_chat_fields():
    # tools, tool_choice and response_format are taken (tests/server/test_tool_request.py,
    # test_response_format.py); their shapes are the body model's.
    expect(chat, tools=[{"type": "function"}], param="tools[0].function", match="is required")
    expect(chat, response_format={"type": "xml"}, param="response_format.type",
           match='one of "text", "json_object", "json_schema"')
    expect(chat, tool_choice="auto", param="tool_choice", match="needs `tools`")
    function = {"name": "f", "parameters": {"type": "object"}}
    expect(chat, functions=[function], param="functions", match="not supported")
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
    expect(completion, prompt=[1, last + 1], param="prompt[1]",
           match=f"token id inside the vocabulary [0, {last + 1}), got {last + 1}")
    expect(completion, prompt=[-1], param="prompt[0]", match="inside the vocabulary")
    expect(completion, prompt=[[2], [0, last + 1]], param="prompt[1][1]",
           match="inside the vocabulary")


def test_prompt_shapes():
    expect(validate, "completion", {}, param="prompt", match="required")
    expect(completion, prompt=5, param="prompt", match="a string, a list of strings, a list of "
           "token ids or a list of lists of token ids, got 5")
    expect(completion, prompt=[1, "a"], param="prompt[1]", match='an integer, got "a"')
    expect(completion, prompt=["a", 1], param="prompt[1]", match="a non-empty string, got 1")
    # The tokenizer turns "" into [BOS]: an empty prompt is refused before it is tokenized.
    for empty, param in (("", "prompt"), ([], "prompt"), ([""], "prompt[0]"),
                         ([[]], "prompt[0]"), (["a", ""], "prompt[1]"), ([[1], []], "prompt[1]")):
        expect(completion, prompt=empty, param=param, match="must be a non-empty")


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
    expect(completion, prompt=["a", [1]], param="prompt[1]", match="a non-empty string, got [1]")
    expect(completion, prompt=[[1], ["a"]], param="prompt[1][0]", match='an integer, got "a"')
    expect(completion, prompt=[[1], [2, last]], param="prompt[1][1]",
           match="inside the vocabulary")
    expect(completion, prompt=[[1], [True]], param="prompt[1][0]", match="an integer")
    expect(completion, prompt=[[1], [[1]]], param="prompt[1][0]", match="an integer")
    assert len(completion(prompt=["a"] * MAX_PROMPTS).prompts) == MAX_PROMPTS
    expect(completion, prompt=["a"] * (MAX_PROMPTS + 1), param="prompt",
           match=f"a list of 1 to {MAX_PROMPTS} strings, got {MAX_PROMPTS + 1} items")


def test_message_shapes():
    expect(validate, "chat", {}, param="messages", match="required")
    expect(chat, messages=[], param="messages", match="a list of 1 to 1024 objects, got 0 items")
    expect(chat, messages="hi", param="messages")
    expect(chat, messages=["hi"], param="messages[0]", match='an object whose `role` is one of')
    expect(chat, messages=[{"role": "wizard", "content": "x"}], param="messages[0].role",
           match='must be one of "system", "developer", "user", "assistant", "tool", got '
           '"wizard"')
    expect(chat, messages=[{"content": "x"}], param="messages[0].role", match="is required")
    expect(chat, messages=[{"role": "user", "content": 5}], param="messages[0].content",
           match="a string or a list of content parts, got 5")
    expect(chat, messages=[{"role": "user"}], param="messages[0].content", match="is required")
    expect(chat, messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}],
           param="messages[0].content[0].text", match="must be a string, got 5")
    expect(chat, messages=[{"role": "system", "content": [{"type": "image_url"}]}],
           param="messages[0].content[0].type", match='must be "text"')
    # An empty list of parts is no content (OpenAI refuses it too): every role that takes parts.
    for role in ("system", "developer", "user", "assistant", "tool"):
        message = {"role": role, "content": [], **({"tool_call_id": "c"} if role == "tool" else {})}
        expect(chat, messages=[message, {"role": "user", "content": "x"}],
               param="messages[0].content", match="must be a non-empty list, got 0 items")


def test_a_tool_message_answers_a_call_of_the_assistant_message_before_it():
    # As OpenAI: a tool message follows an assistant message with `tool_calls` (or another tool
    # message answering it) and names one of its calls.
    roomy = dataclasses.replace(limits(), context_length=4096)

    def call(name):
        return {"id": name, "type": "function", "function": {"name": "f", "arguments": "{}"}}

    asked = {"role": "assistant", "content": None, "tool_calls": [call("a"), call("b")]}
    user = {"role": "user", "content": "hi"}

    def tool(answers):
        return {"role": "tool", "content": "42", "tool_call_id": answers}

    for messages in ([user, asked, tool("a"), tool("b")], [user, asked, tool("b")],
                     [asked, tool("a"), user, asked, tool("b"), tool("a")]):
        assert validate_request("chat", {"messages": messages}, roomy, encoder()).prompt_tokens
    for messages, at in (([user, tool("a")], 1), ([tool("a")], 0),
                         ([asked, tool("a"), user, tool("b")], 3),
                         ([{"role": "assistant", "content": "x"}, tool("a")], 1)):
        expect(chat, messages=messages, param=f"messages[{at}].role",
               match=f'`messages[{at}]` has role "tool" but does not follow an assistant '
               "message with `tool_calls`")
    expect(chat, messages=[user, asked, tool("a"), tool("z")], param="messages[3].tool_call_id",
           match='`messages[3].tool_call_id` is "z", which is no call of the assistant message '
           'it answers (messages[1]); its calls\' ids: "a", "b"')


def test_content_parts_other_than_text_are_refused_naming_the_part():
    image = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    text = {"type": "text", "text": "look"}
    err = expect(chat, messages=[{"role": "user", "content": [text, image]}],
                 param="messages[0].content[1]", match="'image_url' part; this server takes "
                 "only text parts")
    assert err.code == "unsupported_parameter"
    expect(chat, messages=[{"role": "user", "content": [{"type": "image_url"}]}],
           param="messages[0].content[0].image_url", match="is required: an object")


def test_a_role_of_any_other_type_is_a_400_naming_it():
    # An object or a list once reached a set lookup and answered 500 (unhashable type).
    for role in ({"a": 1}, ["user"], 5, True, None):
        expect(chat, messages=[{"role": role, "content": "x"}], param="messages[0].role",
               match="must be one of")
    # A stale role of OpenAI's (`function`) is named with the roles this server takes.
    expect(chat, messages=[{"role": "function", "name": "f", "content": "x"}],
           param="messages[0].role", match='"tool", got "function"')


def test_message_name_tool_call_id_and_tool_calls_shapes():
    # Each role has OpenAI's fields: `tool_calls` on assistant turns, `tool_call_id` on tool ones.
    ok = {"role": "assistant", "content": "x"}
    assert chat(messages=[{**ok, "name": "ann", "tool_calls": []}]).prompt_tokens == \
        chat(messages=[ok]).prompt_tokens
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    asked = {**ok, "tool_calls": [call]}
    tool = {"role": "tool", "content": "42", "tool_call_id": "c"}
    roomy = dataclasses.replace(limits(), context_length=4096)  # a tool turn renders long
    assert validate_request("chat", {"messages": [asked, tool]}, roomy, encoder()).ignored == ()
    # OpenAI requires the id of the call a tool message answers.
    expect(chat, messages=[ok, {"role": "tool", "content": "42"}],
           param="messages[1].tool_call_id", match="`messages[1].tool_call_id` is required")
    for message, field in ((ok, "name"), (tool, "tool_call_id")):
        expect(chat, messages=[ok, {**message, field: {"a": 1}}], param=f"messages[1].{field}",
               match="must be a string")
    for calls in ({"id": "a"}, "call", 5):
        expect(chat, messages=[{**ok, "tool_calls": calls}], param="messages[0].tool_calls",
               match="must be a list")
    expect(chat, messages=[{**ok, "tool_calls": [{"id": "c", "type": "function"}]}],
           param="messages[0].tool_calls[0].function", match="is required")
    called = validate_request("chat", {"messages": [{"role": "assistant", "tool_calls": [call]}]},
                              roomy, encoder()).prompt_tokens
    assert '"name": "f", "arguments": {}' in encoder().decode(list(called)), "rendered"
    # NaN and Infinity parse in Python's json, and are not JSON: no JSON object.
    for arguments in ("[1]", "{", "", '{"a": NaN}', '{"a": -Infinity}'):
        bad = {**call, "function": {"name": "f", "arguments": arguments}}
        expect(chat, messages=[{**ok, "tool_calls": [bad]}],
               param="messages[0].tool_calls[0].function.arguments",
               match="must be a JSON object as a string")
    # A number past the float range is JSON, and a call the server returned may hold one
    # (server/tool_calls.py keeps it as written): sent back, it is taken.
    huge = {**call, "function": {"name": "f", "arguments": '{"a": 1e400, "b": -4e9999}'}}
    sent_back = validate_request("chat", {"messages": [{"role": "assistant",
                                                        "tool_calls": [huge]}]},
                                 roomy, encoder()).prompt_tokens
    assert '"arguments": {"a": 1e400, "b": -4e9999}' in encoder().decode(list(sent_back))
    err = expect(chat, messages=[{**ok, "function_call": call["function"]}],
                 param="messages[0].function_call", match="not supported")
    assert err.code == "unsupported_parameter"
    # On a user turn `tool_calls` is not OpenAI's field: ignored (and named) as any unknown one.
    assert chat(messages=[{"role": "user", "content": "x", "tool_calls": 5}]).ignored == (
        "messages[0].tool_calls",)


def test_an_assistant_turn_may_have_no_content():
    empty = chat(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}])
    for content in (None, "absent"):
        turn = {"role": "assistant"} if content == "absent" else {"role": "assistant",
                                                                   "content": content}
        assert chat(messages=[{"role": "user", "content": "x"}, turn]) == empty
    expect(chat, messages=[{"role": "user", "content": None}], param="messages[0].content",
           match="a string or a list of content parts, got null")


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


def schema_types(node: object) -> set[str]:
    """Every `type` in a pydantic core schema, at any depth."""
    if isinstance(node, dict):
        found = {node["type"]} if isinstance(node.get("type"), str) else set()
        return found.union(*(schema_types(v) for v in node.values()))
    if isinstance(node, (list, tuple)):
        return set().union(*(schema_types(v) for v in node))
    return set()


@pytest.mark.parametrize("model", [CompletionBody, ChatBody, TokenizeBody, DetokenizeBody])
def test_every_union_of_the_body_models_is_tagged(model):
    # An untagged union reports every member's error, each under a label the client never wrote
    # (`stop.list[str].1`); tagged ones report one member's, and body_reading drops the tag.
    types = schema_types(model.__pydantic_core_schema__)
    assert "model-fields" in types and "union" not in types
