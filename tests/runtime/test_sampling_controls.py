"""Sampling controls in the batched step, on the built-in model through the real Executor.

Each control is checked against what OpenAI (and vLLM, for the ones OpenAI lacks) document,
computed here from the model's own logits for the same prefix (an independent forward through
mlx-lm's model, no cache): a bias forces or forbids a token; penalties change the argmax exactly
as their formula says and reduce repeats; min_p and top_k keep every sampled token inside the
set they allow. Greedy rows next to rows using every control stay exactly mlx-lm's tokens, and a
seeded row draws the same tokens alone or in a changing batch.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama

from runtime.executor import Executor
from runtime.model import ModelBundle
from runtime.sampling import SamplingParams
from tests.runtime.test_executor import random_bundle, reference, run_staggered, text_prompt

NUM_TOKENS = 24
# Logits of the same prefix from a batched, cached forward and from a fresh one agree to float32
# rounding (under OpenBLAS); a comparison of two of them allows this much.
TOLERANCE = 1e-3


def generate(bundle: ModelBundle, prompt: list[int], params: SamplingParams,
             num_tokens: int = NUM_TOKENS) -> list[int]:
    """One sequence alone: its prompt in one slice, then decode steps."""
    return run_staggered(Executor(bundle), {0: prompt}, {0: params}, num_tokens)[0]


def next_logits(bundle: ModelBundle, tokens: list[int]) -> np.ndarray:
    """The model's logits after `tokens`, from a forward of its own over the whole prefix."""
    logits = bundle.model(mx.array(tokens)[None])[0, -1].astype(mx.float32)
    return np.array(logits, dtype=np.float64)


def log_softmax(x: np.ndarray) -> np.ndarray:
    return x - (np.log(np.sum(np.exp(x - x.max()))) + x.max())


def penalized(logits: np.ndarray, prompt: list[int], generated: list[int],
              params: SamplingParams) -> np.ndarray:
    """OpenAI's presence/frequency formula over the generated tokens, after vLLM's repetition
    penalty over prompt and generated tokens (divide a positive logit, multiply a negative)."""
    x = logits.copy()
    if params.repetition_penalty != 1.0:
        for token in set(prompt) | set(generated):
            r = params.repetition_penalty
            x[token] = x[token] * r if x[token] < 0 else x[token] / r
    for token, count in Counter(generated).items():
        x[token] -= count * params.frequency_penalty + params.presence_penalty
    return x


def num_repeats(tokens: list[int]) -> int:
    return len(tokens) - len(set(tokens))


@pytest.fixture(scope="module")
def llama_bundle() -> ModelBundle:
    return random_bundle(llama)


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return text_prompt(12, seed=21)


def test_a_large_logit_bias_forces_or_forbids_a_token(bundle, prompt):
    greedy = generate(bundle, prompt, SamplingParams(max_tokens=NUM_TOKENS))
    forced = next(t for t in range(65, 91) if t not in greedy)
    for base in (SamplingParams(max_tokens=NUM_TOKENS),
                 SamplingParams(temperature=1.0, seed=4, max_tokens=NUM_TOKENS)):
        out = generate(bundle, prompt, replace(base, logit_bias=((forced, 100.0),)))
        assert out == [forced] * NUM_TOKENS, "the first token (after prefill) too"
        banned = tuple((t, -100.0) for t in sorted(set(greedy)))
        out = generate(bundle, prompt, replace(base, logit_bias=banned))
        assert not set(out) & set(greedy), out


@pytest.mark.parametrize("controls", [
    {"presence_penalty": 2.0},
    {"frequency_penalty": 1.5},
    {"presence_penalty": 0.5, "frequency_penalty": 1.0},
    {"repetition_penalty": 1.8},
    {"repetition_penalty": 1.3, "frequency_penalty": -0.5, "logit_bias": ((70, 1.5),)},
])
def test_greedy_with_penalties_follows_the_documented_formula(bundle, prompt, controls):
    params = SamplingParams(max_tokens=NUM_TOKENS, **controls)
    out = generate(bundle, prompt, params)
    for i, token in enumerate(out):
        x = penalized(next_logits(bundle, prompt + out[:i]), prompt, out[:i], params)
        for biased, bias in params.logit_bias:
            x[biased] += bias
        assert x[token] >= x.max() - TOLERANCE, f"token {i}: {token} is not the argmax"
    plain = generate(bundle, prompt, SamplingParams(max_tokens=NUM_TOKENS))
    if controls.get("frequency_penalty", 0) >= 0:  # a negative one may favour repeats
        assert num_repeats(out) < num_repeats(plain), (out, plain)


@pytest.mark.parametrize("controls", [{"presence_penalty": 2.0}, {"frequency_penalty": 2.0},
                                      {"repetition_penalty": 2.0}])
def test_penalties_reduce_repeats_when_sampling_at_the_same_seed(bundle, prompt, controls):
    base = SamplingParams(temperature=0.7, seed=11, max_tokens=48)
    plain = generate(bundle, prompt, base, 48)
    out = generate(bundle, prompt, replace(base, **controls), 48)
    assert num_repeats(out) < num_repeats(plain), (out, plain)


def allowed_by_min_p(logits: np.ndarray, min_p: float) -> set[int]:
    probs = np.exp(log_softmax(logits))
    return {int(t) for t in np.flatnonzero(probs >= min_p * probs.max() * (1 - TOLERANCE))}


def allowed_by_top_k(logits: np.ndarray, k: int) -> set[int]:
    kth = np.sort(logits)[::-1][k - 1]
    return {int(t) for t in np.flatnonzero(logits >= kth - TOLERANCE)}


@pytest.mark.parametrize("control,value,allowed", [
    ("min_p", 0.6, allowed_by_min_p),
    ("top_k", 3, allowed_by_top_k),
])
def test_min_p_and_top_k_keep_sampled_tokens_in_their_set(bundle, prompt, control, value,
                                                          allowed):
    # A high temperature spreads the draws: without the control they leave the set.
    base = SamplingParams(temperature=2.0, seed=7, max_tokens=40)
    for params, inside in ((replace(base, **{control: value}), True), (base, False)):
        out = generate(bundle, prompt, params, 40)
        sets = [allowed(next_logits(bundle, prompt + out[:i]), value) for i in range(len(out))]
        assert max(len(s) for s in sets) < 20, "the control leaves a small set"
        hits = [token in s for token, s in zip(out, sets, strict=True)]
        assert all(hits) if inside else not all(hits), (control, inside, out)


@pytest.mark.parametrize("top_p", [1e-30, 1e-46, 5e-324])
def test_a_top_p_too_small_for_float32_keeps_the_top_token(bundle, prompt, top_p):
    # Any top_p > 0 is valid; one below float32's range rounded to 0 and kept no token, so the
    # draw took token 0, which the model never emits. It keeps the most likely token, as a
    # tiny top_p does: the greedy tokens, however hot the temperature.
    greedy = generate(bundle, prompt, SamplingParams(max_tokens=NUM_TOKENS))
    out = generate(bundle, prompt, SamplingParams(temperature=2.0, top_p=top_p, seed=3,
                                                  max_tokens=NUM_TOKENS))
    assert out == greedy


def test_each_row_of_a_batch_keeps_its_own_filter(bundle):
    # Different top_k and min_p per row in one batched step: each row's tokens lie in the set
    # its own values allow (a row given another row's value would leave it).
    prompts = {i: text_prompt(5 + 6 * i, seed=90 + i) for i in range(4)}
    rows = {0: ("top_k", 2), 1: ("min_p", 0.7), 2: ("top_k", 6), 3: ("min_p", 0.3)}
    sampling = {i: SamplingParams(temperature=2.0, seed=i, max_tokens=30, **{c: v})
                for i, (c, v) in rows.items()}
    out = run_staggered(Executor(bundle), prompts, sampling, 30)
    for i, (control, value) in rows.items():
        allowed = allowed_by_top_k if control == "top_k" else allowed_by_min_p
        for step, token in enumerate(out[i]):
            assert token in allowed(next_logits(bundle, prompts[i] + out[i][:step]), value), \
                (i, step)
    assert len(set(out[2])) > 2, "row 2 (top_k 6) is not held to row 0's top_k 2"


def test_greedy_rows_stay_exact_beside_rows_using_every_control(bundle):
    prompts = {i: text_prompt(4 + 9 * i, seed=60 + i) for i in range(4)}
    every = SamplingParams(temperature=1.3, top_p=0.9, top_k=20, min_p=0.05,
                           presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.2,
                           logit_bias=((66, 3.0), (67, -50.0)), seed=5, max_tokens=20,
                           logprobs=3)
    sampling = {0: SamplingParams(max_tokens=20), 1: every,
                2: SamplingParams(max_tokens=20, logprobs=5), 3: replace(every, seed=6)}
    out = run_staggered(Executor(bundle), prompts, sampling, 20, skip=[(5, 0), (6, 1), (9, 2)])
    assert out[0] == reference(bundle, prompts[0], 20)
    assert out[2] == reference(bundle, prompts[2], 20), "asking for logprobs changes nothing"


def test_a_seeded_row_with_every_control_draws_alike_alone_and_in_any_batch(bundle):
    prompt = text_prompt(15, seed=8)
    seeded = SamplingParams(temperature=1.0, top_k=30, min_p=0.02, presence_penalty=0.8,
                            frequency_penalty=0.3, repetition_penalty=1.1,
                            logit_bias=((72, 2.0),), seed=99, max_tokens=24)
    alone = generate(bundle, prompt, seeded)
    others = {i: text_prompt(3 + 7 * i, seed=80 + i) for i in (1, 2, 3)}
    sampling = {1: SamplingParams(temperature=0.9, presence_penalty=1.0, max_tokens=24),
                0: seeded, 2: SamplingParams(max_tokens=24, frequency_penalty=1.0),
                3: SamplingParams(temperature=2.0, top_k=5, max_tokens=24)}
    # Row 0 joins second, pauses twice (its row and counts leave the batch and come back).
    batched = run_staggered(Executor(bundle), {1: others[1], 0: prompt, 2: others[2],
                                               3: others[3]}, sampling, 24,
                            skip=[(4, 0), (5, 0), (9, 0)])
    assert batched[0] == alone
    assert generate(bundle, prompt, replace(seeded, seed=100)) != alone


def test_an_evicted_penalized_sequence_keeps_its_counts(llama_bundle):
    # Evicted (its KV dropped, prefilled again from prompt + output) between decode steps: its
    # counts come back with it, so its greedy tokens follow the formula as if never evicted.
    bundle = llama_bundle
    prompt = text_prompt(20, seed=3)
    params = SamplingParams(max_tokens=16, presence_penalty=1.5, frequency_penalty=0.5)
    ex = Executor(bundle)
    ex.add(0, prompt, params)
    ex.add(1, text_prompt(9, seed=4), SamplingParams(max_tokens=16))
    out = [ex.prefill(0, 100)]
    ex.prefill(1, 100)
    for step in range(15):
        if step in (4, 9):
            ex.evict(0)
            out.append(ex.prefill(0, 1000))
            continue
        out.append(ex.decode([0, 1])[0])
    assert out == generate(bundle, prompt, params, 16)
