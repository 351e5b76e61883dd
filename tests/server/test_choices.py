"""`n` choices and batch prompts with the real `openai` client against the real server (the real
engine and the built-in model on 127.0.0.1), whole and streamed.

Oracles: a choice equals the same prompt sent alone as an n=1 request (greedy: every choice; a
seeded sample: choice j equals an n=1 request with `choice_seed(seed, j)`, the documented
rule); the prefill runs once, read from /metrics (`fairtick_prompt_tokens`) and the trace
(siblings `fork`, they are never granted a prefill).
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import pytest
from openai import BadRequestError, OpenAI
from prometheus_client.parser import text_string_to_metric_families

from runtime.api import choice_seed
from tests.lifecycle_names import ABORTED, FORK, GRANT, PREEMPT
from tests.server.http_helpers import OpenStream, get, post
from tests.server.serving import POISON, poison_prompts, serve

PROMPT = "The scheduler"
MAX_TOKENS = 6
SEED = 1234


@pytest.fixture(scope="module")
def served(bundle):
    with serve(bundle, max_running=8, max_waiting=8) as served:
        yield served


@pytest.fixture
def client(served):
    served.wait_idle()
    yield OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=60)
    served.wait_idle()


@pytest.fixture(scope="module")
def model(served) -> str:
    return str(get(served.url, "/v1/models").json()["data"][0]["id"])


def prompt_tokens_prefilled(served) -> float:
    text = get(served.url, "/metrics").body.decode()
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "fairtick_prompt_tokens_total")


def complete(client, model, **fields: Any) -> list[str]:
    out = client.completions.create(model=model, **{"max_tokens": MAX_TOKENS, **fields})
    assert [c.index for c in out.choices] == list(range(len(out.choices)))
    return [c.text for c in out.choices]


def streamed(client, model, **fields: Any) -> tuple[dict[int, str], dict[int, list], Any]:
    """Each choice's text and its finish reasons in order, and the last chunk's usage."""
    texts: dict[int, str] = defaultdict(str)
    finishes: dict[int, list] = defaultdict(list)
    chunks = list(client.completions.create(model=model, max_tokens=MAX_TOKENS, stream=True,
                                            stream_options={"include_usage": True}, **fields))
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        assert not finishes[choice.index] or finishes[choice.index][-1] is None, \
            f"choice {choice.index} sent a chunk after its finish chunk"
        texts[choice.index] += choice.text
        finishes[choice.index].append(choice.finish_reason)
    assert chunks[-1].choices == []
    return dict(texts), dict(finishes), chunks[-1].usage


# --- n ----------------------------------------------------------------------------------------

def test_greedy_choices_each_equal_the_request_alone(client, model):
    (alone,) = complete(client, model, prompt=PROMPT)
    assert complete(client, model, prompt=PROMPT, n=3) == [alone] * 3
    texts, finishes, usage = streamed(client, model, prompt=PROMPT, n=3)
    assert texts == {0: alone, 1: alone, 2: alone}
    for index in range(3):  # each choice ends with its own finish chunk
        assert finishes[index][-1] == "length" and set(finishes[index][:-1]) == {None}
    assert usage.completion_tokens == 3 * MAX_TOKENS
    assert usage.prompt_tokens == client.completions.create(
        model=model, prompt=PROMPT, max_tokens=1).usage.prompt_tokens, "the prompt counts once"


def test_seeded_choices_each_equal_a_request_alone_with_their_seed(client, model):
    sampled = {"temperature": 1.0, "prompt": PROMPT}
    choices = complete(client, model, n=3, seed=SEED, **sampled)
    alone = [complete(client, model, seed=choice_seed(SEED, j), **sampled)[0] for j in range(3)]
    assert choices == alone
    assert len(set(choices)) == 3, "siblings draw their own tokens"
    texts, _, _ = streamed(client, model, n=3, seed=SEED, **sampled)
    assert [texts[j] for j in range(3)] == alone


def test_chat_choices_whole_and_streamed(client, model):
    messages = [{"role": "user", "content": "Hi"}]
    (alone,) = client.chat.completions.create(model=model, messages=messages,
                                              max_tokens=MAX_TOKENS).choices
    out = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS,
                                         n=2)
    assert [(c.index, c.message.content) for c in out.choices] == \
        [(0, alone.message.content), (1, alone.message.content)]
    assert out.usage.completion_tokens == 2 * MAX_TOKENS
    chunks = list(client.chat.completions.create(model=model, messages=messages, n=2,
                                                 max_tokens=MAX_TOKENS, stream=True))
    roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"]
    texts: dict[int, str] = defaultdict(str)
    for chunk in chunks:
        texts[chunk.choices[0].index] += chunk.choices[0].delta.content or ""
    assert roles == [0, 1] and dict(texts) == {0: alone.message.content,
                                               1: alone.message.content}
    assert sorted(c.choices[0].index for c in chunks if c.choices[0].finish_reason) == [0, 1]


def test_the_prompt_is_prefilled_once_and_the_siblings_fork(served, client, model):
    prompt = "A prompt of a few more tokens, prefilled once for four choices"
    # Measured without leaving the prompt in the prefix cache, so the next request is cold.
    length = client.completions.create(model=model, prompt=prompt, max_tokens=1,
                                       extra_body={"cache_prompt": False}).usage.prompt_tokens
    before, events = prompt_tokens_prefilled(served), len(served.trace())
    assert len(set(complete(client, model, prompt=prompt, n=4, temperature=1.0))) > 1
    assert prompt_tokens_prefilled(served) - before == length
    trace = served.trace(events)
    forks = [e for e in trace if e["trigger"] == FORK]
    granted = {e["seq"] for e in trace if e["trigger"] == GRANT}
    (parent,) = granted
    assert len(forks) == 3 and {e["rule"] for e in forks} == {f"fork of {parent}"}
    assert not granted & {e["seq"] for e in forks}, "a sibling never prefills"


def test_siblings_past_the_running_limit_queue_and_prefill_the_prompt_themselves(bundle):
    with serve(bundle, max_running=2, max_waiting=4) as served:
        client = OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
        model_id = client.models.list().data[0].id
        (alone,) = complete(client, model_id, prompt=PROMPT)
        length = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=1).usage.\
            prompt_tokens
        before, events = prompt_tokens_prefilled(served), len(served.trace())
        assert complete(client, model_id, prompt=PROMPT, n=3) == [alone] * 3
        assert prompt_tokens_prefilled(served) - before == 2 * length
        trace = served.trace(events)
        assert len([e for e in trace if e["trigger"] == FORK]) == 1
        assert len({e["seq"] for e in trace if e["trigger"] == GRANT}) == 2
        served.wait_idle()


def test_a_client_that_goes_away_cancels_every_choice(served, client):
    events = len(served.trace())
    stream = OpenStream(served.url, "/v1/completions",
                        {"prompt": PROMPT, "max_tokens": 20_000, "n": 3, "stream": True})
    seen = set()
    while len(seen) < 3:  # every choice is decoding
        seen.add(json_index(stream.read_event()))
    stream.drop()
    served.wait_idle()
    aborted = {e["seq"] for e in served.trace(events) if e["to"] == ABORTED}
    assert len(aborted) == 3


def json_index(data: str) -> int:
    return int(json.loads(data)["choices"][0]["index"])


def test_one_token_choices_finish_with_the_prompts_first_token(client, model):
    (alone,) = complete(client, model, prompt=PROMPT)
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=1, n=3)
    assert [(c.text, c.finish_reason) for c in out.choices] == [(alone[0], "length")] * 3


def test_choices_preempted_for_kv_room_are_prefilled_again_and_end_the_same(bundle):
    # Four choices fork, then outgrow a KV budget that holds about two: the youngest are
    # preempted (recompute) and prefilled again; every invariant is checked after every tick.
    with serve(bundle, max_running=8, max_waiting=8, max_kv_tokens=120,
               check_invariants=True) as served:
        client = OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
        model_id = client.models.list().data[0].id
        (alone,) = complete(client, model_id, prompt=PROMPT, max_tokens=40)
        events = len(served.trace())
        assert complete(client, model_id, prompt=PROMPT, n=4, max_tokens=40) == [alone] * 4
        triggers = [e["trigger"] for e in served.trace(events)]
        assert triggers.count(FORK) >= 1 and PREEMPT in triggers
        served.wait_idle()


def test_a_failed_prompt_of_a_batch_is_500_and_aborts_the_others(bundle, monkeypatch):
    with serve(bundle, max_running=4, max_waiting=4) as served:
        poison_prompts(served.engine, monkeypatch, "prefill")
        reply = post(served.url, "/v1/completions",
                     {"prompt": ["fine", POISON.decode()], "max_tokens": 20_000, "n": 2})
        assert reply.status == 500 and "injected fault" in reply.error()["message"]
        served.wait_idle()


def test_a_batch_no_queue_could_hold_is_400_and_n_takes_no_place(bundle):
    # Each prompt takes a place in the queue; a 429 would have a client retry for ever.
    with serve(bundle, max_running=1, max_waiting=2) as served:
        before = len(served.trace())
        reply = post(served.url, "/v1/completions", {"prompt": ["a", "b", "c"], "max_tokens": 2})
        assert reply.status == 400 and "retry-after" not in reply.headers, reply.body
        error = reply.error()
        assert error["type"] == "invalid_request_error" and error["param"] == "prompt"
        message = error["message"]
        assert "3 prompts" in message and "--max-waiting 2" in message, message
        assert "at most 2 prompts" in message, message
        assert served.trace()[before:] == [], "none of it reached the engine"
        served.wait_idle()
        # `n` takes no place: two prompts of three choices each fit the queue of two.
        reply = post(served.url, "/v1/completions",
                     {"prompt": ["a", "b"], "n": 3, "max_tokens": 2})
        assert reply.status == 200 and len(reply.json()["choices"]) == 6, reply.body
        served.wait_idle()


def test_a_batch_that_fits_an_empty_queue_but_not_this_one_is_429_and_leaves_nothing(bundle):
    with serve(bundle, max_running=1, max_waiting=2) as served:
        holder = OpenStream(served.url, "/v1/completions",
                            {"prompt": "hold", "max_tokens": 20_000, "stream": True})
        holder.read_event()  # it runs: the running place is taken
        queued = OpenStream(served.url, "/v1/completions",
                            {"prompt": "queued", "max_tokens": 3, "stream": True})
        served.wait_for(lambda s: s["admission"]["queued"] == 1)
        reply = post(served.url, "/v1/completions", {"prompt": ["a", "b"], "max_tokens": 2})
        assert reply.status == 429 and int(reply.headers["retry-after"]) >= 1, reply.body
        # The two places counted are the other request's and this batch's first prompt's.
        assert reply.error()["message"].startswith(
            "The server is at capacity: 2 requests are already waiting (--max-waiting 2); this "
            "batch's 1 earlier prompt took a place in it too, and is aborted. Retry after")
        served.wait_for(lambda s: s["admission"]["queued"] == 1)  # its first prompt's place
        holder.drop()
        queued.drop()
        served.wait_idle()
        reply = post(served.url, "/v1/completions", {"prompt": ["a", "b"], "max_tokens": 2})
        assert reply.status == 200, reply.body
        served.wait_idle()


# --- batch and token prompts ------------------------------------------------------------------

PROMPTS = ["The scheduler", "Hello", "x"]


def test_batch_prompts_give_each_prompt_the_text_it_gets_alone(client, model):
    alone = [complete(client, model, prompt=p)[0] for p in PROMPTS]
    assert complete(client, model, prompt=PROMPTS) == alone
    # Choice i * n + j is choice j of prompt i.
    assert complete(client, model, prompt=PROMPTS, n=2) == [t for t in alone for _ in (0, 1)]
    texts, finishes, usage = streamed(client, model, prompt=PROMPTS, n=2)
    assert [texts[i] for i in range(6)] == [t for t in alone for _ in (0, 1)]
    assert all(finishes[i][-1] == "length" for i in range(6))
    lengths = [client.completions.create(model=model, prompt=p, max_tokens=1).usage.
               prompt_tokens for p in PROMPTS]
    assert usage.prompt_tokens == sum(lengths) and usage.completion_tokens == 6 * MAX_TOKENS


def test_token_prompts_equal_the_same_prompts_sent_as_text(client, model, bundle):
    ids = [list(bundle.tokenizer.encode(p)) for p in PROMPTS]
    alone = complete(client, model, prompt=PROMPTS)
    assert complete(client, model, prompt=ids[0]) == alone[:1]
    assert complete(client, model, prompt=ids) == alone
    seeded = {"temperature": 1.0, "seed": SEED, "n": 2}
    assert complete(client, model, prompt=ids, **seeded) == \
        complete(client, model, prompt=PROMPTS, **seeded)


@pytest.mark.parametrize(("fields", "param"), [
    ({"n": 0}, "n"),
    ({"n": 65}, "n"),
    ({"n": 2, "best_of": 3}, "best_of"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[1, 2], []]}, "prompt[1]"),
    ({"prompt": ["a", [1, 2]]}, "prompt[1]"),  # a batch of strings: its item 1 is not one
    ({"prompt": [[1], [1, 10**6]]}, "prompt[1][1]"),
    ({"prompt": ["a"] * 65}, "prompt"),
    ({"prompt": ["a"] * 3, "n": 50}, "n"),
])
def test_bad_shapes_are_400s_naming_the_field(client, model, fields, param):
    with pytest.raises(BadRequestError) as info:
        client.completions.create(model=model, max_tokens=2, **{"prompt": PROMPT, **fields})
    assert info.value.status_code == 400 and info.value.body["param"] == param
