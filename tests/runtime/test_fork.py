"""Executor.fork: sibling choices (`n` > 1) start on a copy of their prompt's KV cache and draw
their first token from the logits the prompt ended with; each then runs exactly as a sequence
that prefilled the prompt itself. The model has random weights (tests/runtime/test_executor.py),
so a wrong or shared cache changes the tokens."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache, RotatingKVCache

from runtime.api import choice_sampling
from runtime.cache_fork import fork_cache
from runtime.executor import Executor
from runtime.model import ModelBundle
from runtime.sampling import SamplingParams
from tests.runtime.test_executor import prefill_all, random_bundle, reference, text_prompt

CHUNK = 16
STEPS = 10


@pytest.fixture(scope="module")
def llama_bundle() -> ModelBundle:
    return random_bundle(llama)


def decode_all(ex: Executor, seq_ids: list[int], steps: int) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {s: [] for s in seq_ids}
    for _ in range(steps):
        for seq_id, token in ex.decode(seq_ids).items():
            out[seq_id].append(token)
    return out


def alone(bundle, prompt: list[int], sampling: SamplingParams, steps: int) -> list[int]:
    """The tokens of one sequence that prefills the prompt itself, in an executor of its own."""
    ex = Executor(bundle)
    ex.add(0, prompt, sampling)
    first = prefill_all(ex, 0, CHUNK)
    return [first] + decode_all(ex, [0], steps)[0]


@pytest.mark.parametrize("length", [5, 3 * CHUNK + 1, 256])  # 256: a full cache step
def test_greedy_siblings_continue_exactly_as_the_prompt_does(llama_bundle, length):
    prompt = text_prompt(length, seed=900 + length)
    ex = Executor(llama_bundle)
    ex.add(0, prompt, SamplingParams(), forks=True)
    first = prefill_all(ex, 0, CHUNK)
    assert ex.fork(0, [(1, SamplingParams()), (2, SamplingParams())]) == {1: first, 2: first}
    assert ex.num_cached(1) == ex.num_cached(2) == length == ex.num_cached(0)
    out = decode_all(ex, [0, 1, 2], STEPS)
    expected = reference(llama_bundle, prompt, STEPS + 1)
    assert [first] + out[0] == [first] + out[1] == [first] + out[2] == expected


def test_seeded_siblings_each_equal_a_request_with_their_seed(llama_bundle):
    prompt = text_prompt(40, seed=950)
    sampling = SamplingParams(temperature=1.0, seed=1234, max_tokens=STEPS + 1)
    ex = Executor(llama_bundle)
    ex.add(0, prompt, sampling, forks=True)
    first = prefill_all(ex, 0, CHUNK)
    firsts = ex.fork(0, [(j, choice_sampling(sampling, j)) for j in (1, 2, 3)])
    out = decode_all(ex, [0, 1, 2, 3], STEPS)
    choices = {0: [first] + out[0], **{j: [firsts[j]] + out[j] for j in (1, 2, 3)}}
    for j, tokens in choices.items():
        assert tokens == alone(llama_bundle, prompt, choice_sampling(sampling, j), STEPS), j
    assert len({tuple(t) for t in choices.values()}) == 4, "each sibling draws its own tokens"


def test_siblings_with_every_control_each_equal_a_request_with_their_seed(llama_bundle):
    # Each sibling samples with its own state: its own PRNG key and its own token counts for
    # the penalties (none at the fork: the prompt's first token is its parent's, not its own).
    prompt = text_prompt(30, seed=960)
    sampling = SamplingParams(temperature=1.2, seed=77, max_tokens=STEPS + 1, top_k=40,
                              min_p=0.02, presence_penalty=1.5, frequency_penalty=0.7,
                              repetition_penalty=1.3, logit_bias=((101, 3.0), (32, -5.0)))
    ex = Executor(llama_bundle)
    ex.add(0, prompt, sampling, forks=True)
    first = prefill_all(ex, 0, CHUNK)
    firsts = ex.fork(0, [(j, choice_sampling(sampling, j)) for j in (1, 2)])
    out = decode_all(ex, [0, 1, 2], STEPS)
    choices = {0: [first] + out[0], **{j: [firsts[j]] + out[j] for j in (1, 2)}}
    for j, tokens in choices.items():
        assert tokens == alone(llama_bundle, prompt, choice_sampling(sampling, j), STEPS), j


def test_siblings_first_tokens_carry_their_logprobs_and_the_prompts(llama_bundle):
    prompt = text_prompt(2 * CHUNK + 3, seed=970)
    sampling = SamplingParams(temperature=1.0, seed=9, max_tokens=4, logprobs=3,
                              prompt_logprobs=2)
    ex = Executor(llama_bundle)
    ex.add(0, prompt, sampling, forks=True)
    prefill_all(ex, 0, CHUNK)
    tokens, prompts = ex.take_logprobs()
    firsts = ex.fork(0, [(j, choice_sampling(sampling, j)) for j in (1, 2)])
    child_tokens, child_prompts = ex.take_logprobs()
    assert set(child_tokens) == set(child_prompts) == {1, 2}
    logits = llama_bundle.model(mx.array(prompt)[None])[0].astype(mx.float32)
    rows = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    for j in (1, 2):
        assert child_prompts[j] == prompts[0], "the prompt's, found once by the shared prefill"
        lp = child_tokens[j]
        assert lp.token_id == firsts[j] and len(lp.top) == 3
        assert lp.logprob == pytest.approx(rows[-1, firsts[j]].item(), abs=1e-4)
        assert lp.top[0][1] == pytest.approx(rows[-1].max().item(), abs=1e-4)
    assert [lp.token_id for lp in prompts[0]] == prompt[1:]
    assert tokens[0].logprob == pytest.approx(rows[-1, tokens[0].token_id].item(), abs=1e-4)


def test_fork_needs_a_prompt_that_just_ended_with_forks(llama_bundle):
    ex = Executor(llama_bundle)
    ex.add(0, text_prompt(8, seed=1), SamplingParams())
    prefill_all(ex, 0, CHUNK)
    with pytest.raises(ValueError, match="just ended its prompt"):
        ex.fork(0, [(1, SamplingParams())])  # added without `forks`: no logits were kept
    ex.add(2, text_prompt(8, seed=2), SamplingParams(), forks=True)
    prefill_all(ex, 2, CHUNK)
    assert ex.fork(2, []) == {}  # none wanted: the kept logits are dropped
    with pytest.raises(ValueError, match="just ended its prompt"):
        ex.fork(2, [(3, SamplingParams())])
    ex.add(4, text_prompt(8, seed=3), SamplingParams(), forks=True)
    prefill_all(ex, 4, CHUNK)
    with pytest.raises(ValueError, match="already exists"):
        ex.fork(4, [(2, SamplingParams())])
    assert 3 not in ex and ex.num_sequences == 3


@pytest.mark.parametrize("length", [3, 256, 300])  # inside, at and past a 256-token step
def test_a_forked_cache_never_sees_the_others_writes(length):
    cache = [KVCache(), RotatingKVCache(max_size=512)]
    for layer in cache:
        layer.update_and_fetch(mx.ones((1, 2, length, 4)), mx.ones((1, 2, length, 4)))
    twins = [fork_cache(cache), fork_cache(cache)]
    for value, layers in zip((5.0, 7.0, 9.0), [cache, *twins], strict=True):
        for layer in layers:
            new = mx.full((1, 2, 1, 4), value)
            keys, _ = layer.update_and_fetch(new, new)
        layers[0].keys[..., 0:1, :] = value  # an in-place write inside the shared positions
    for value, layers in zip((5.0, 7.0, 9.0), [cache, *twins], strict=True):
        keys, _ = layers[0].update_and_fetch(mx.zeros((1, 2, 1, 4)), mx.zeros((1, 2, 1, 4)))
        assert keys[0, 0, :, 0].tolist() == [value] + [1.0] * (length - 1) + [value, 0.0]
        keys, _ = layers[1].update_and_fetch(mx.zeros((1, 2, 1, 4)), mx.zeros((1, 2, 1, 4)))
        assert keys[0, 0, -2:, 0].tolist() == [value, 0.0]
