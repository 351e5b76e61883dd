"""Log-probabilities from the Executor: each sampled token's and, for echo, every prompt
token's from the prefill's own forward, against log-softmax of an independent mlx-lm forward."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama

from runtime.executor import Executor, Slice
from runtime.logprobs import TokenLogprob
from runtime.sampling import SamplingParams
from tests.runtime.test_executor import random_bundle, text_prompt

TOLERANCE = 1e-4  # float32 rounding between a batched, cached forward and a fresh one


@pytest.fixture(scope="module")
def llama_bundle():
    return random_bundle(llama)


def prompt_logprobs(bundle, prompt: list[int]) -> np.ndarray:
    """Row p: log-softmax of the logits at position p of one forward over the whole prompt."""
    logits = bundle.model(mx.array(prompt)[None])[0].astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True), dtype=np.float64)


def check(record: TokenLogprob, token: int, row: np.ndarray, num_top: int) -> None:
    assert record.token_id == token
    assert record.logprob == pytest.approx(row[token], abs=TOLERANCE)
    ids = [t for t, _ in record.top]
    values = [v for _, v in record.top]
    assert len(record.top) == num_top and values == sorted(values, reverse=True)
    assert values == pytest.approx([row[t] for t in ids], abs=TOLERANCE)
    if num_top:  # the first is the most likely token, up to a tie within rounding
        assert values[0] == pytest.approx(row.max(), abs=TOLERANCE)


@pytest.mark.parametrize("fuse", [True, False], ids=["one-forward", "forward-apart"])
def test_prompt_logprobs_come_from_the_prefill_slices_beside_decode_rows(llama_bundle, fuse):
    bundle = llama_bundle
    ex = Executor(bundle, fuse=fuse)
    ex.add(0, text_prompt(10, seed=1), SamplingParams(max_tokens=40))
    ex.prefill(0, 100)
    prompt = text_prompt(70, seed=2)
    ex.add(1, prompt, SamplingParams(max_tokens=4, prompt_logprobs=3, logprobs=2))
    rng = random.Random(5)
    sent: dict[int, tuple[TokenLogprob, ...]] = {}
    firsts: dict[int, TokenLogprob] = {}
    tick = 0
    while ex.prompt_left(1):
        ex.run([Slice(1, rng.choice([1, 7, 16, 29]))], [0])  # slices next to a decode row
        tokens, prompts = ex.take_logprobs()
        assert 0 not in tokens and 0 not in prompts, "sequence 0 asked for none"
        sent.update(prompts)
        firsts.update({k: v for k, v in tokens.items() if k == 1})
        tick += 1
    assert tick > 3, "the prompt ran in several slices"
    expected = prompt_logprobs(bundle, prompt)
    assert len(sent[1]) == len(prompt) - 1
    for position, record in enumerate(sent[1]):
        check(record, prompt[position + 1], expected[position], 3)
    check(firsts[1], firsts[1].token_id, expected[-1], 2)


def test_prompt_logprobs_are_sent_once_and_survive_an_eviction(llama_bundle):
    bundle = llama_bundle
    prompt = text_prompt(40, seed=9)
    ex = Executor(bundle)
    ex.add(0, prompt, SamplingParams(max_tokens=12, prompt_logprobs=0, logprobs=0))
    ex.prefill(0, 15)
    ex.evict(0)  # mid-prompt: 15 positions known, the next slices must not repeat them
    ex.prefill(0, 25)
    first = ex.prefill(0, 100)
    tokens, prompts = ex.take_logprobs()
    expected = prompt_logprobs(bundle, prompt)
    assert [r.token_id for r in prompts[0]] == prompt[1:]
    for position, record in enumerate(prompts[0]):
        check(record, prompt[position + 1], expected[position], 0)
    assert tokens[0].token_id == first
    out = [first]
    for _ in range(3):
        out.append(ex.decode([0])[0])
    ex.evict(0)  # decoding: prompt + output prefilled again; the prompt's are not sent again
    out.append(ex.prefill(0, 100))
    tokens, prompts = ex.take_logprobs()
    assert not prompts and tokens[0].token_id == out[-1]
    check(tokens[0], out[-1], prompt_logprobs(bundle, prompt + out[:-1])[-1], 0)
