"""The decode batch's groups (runtime/decode_batch.py): where a newcomer goes, and that rows
in several groups decode exactly as mlx-lm does alone."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models import llama

from runtime import decode_batch
from runtime.decode_batch import JOIN_COPY_BYTES, MAX_GROUPS, place
from runtime.executor import Executor
from runtime.model import ModelBundle
from runtime.sampling import SamplingParams
from tests.runtime.test_executor import (
    prefill_all,
    random_bundle,
    reference,
    run_staggered,
    text_prompt,
)


@pytest.fixture(scope="module")
def llama_bundle() -> ModelBundle:
    return random_bundle(llama)  # its greedy tokens follow any wrong key: see test_executor


KV = 2048  # bytes of KV a position of the built-in model's shape holds (4 layers, 2 x 2 x 32)


def test_a_newcomer_joins_the_group_it_copies_least_when_that_copy_is_small():
    positions = JOIN_COPY_BYTES // KV
    assert place([], 10, KV) is None  # nothing to join
    # Two groups: 4 rows of 300 positions, 1 row of 5,000. A short newcomer joins the short
    # rows (5 x 300 positions copied), not the long one (2 x 5,000).
    assert place([(4, 300), (1, 5000)], 100, KV) == 0
    # Joining copies every row of the group at the longer of its and the newcomer's length.
    assert place([(3, 100)], positions // 4, KV) == 0
    assert place([(3, 100)], positions // 4 + 1, KV) is None
    assert place([(3, positions // 4 + 1)], 1, KV) is None


def test_past_the_most_groups_a_newcomer_joins_the_cheapest_however_large_the_copy():
    big = JOIN_COPY_BYTES // KV
    groups = [(2, big), (1, big), (3, big)]
    assert place(groups, 10 * big, KV) is None
    groups += [(1, 4 * big)][: MAX_GROUPS - len(groups)]
    assert len(groups) == MAX_GROUPS
    assert place(groups, 10 * big, KV) == 1  # (1 + 1) x 10 big positions: the fewest


def test_rows_in_several_groups_decode_as_mlx_lm_alone(llama_bundle, monkeypatch):
    # Every newcomer starts a group of its own while it may (no join is cheap enough), so the
    # staggered loop's rows are spread over MAX_GROUPS groups, joining, parked and leaving.
    monkeypatch.setattr(decode_batch, "JOIN_COPY_BYTES", 0)
    most = []
    real = decode_batch.DecodeBatch.regroup

    def regroup(self, ids):
        real(self, ids)
        most.append(len(self.groups))

    monkeypatch.setattr(decode_batch.DecodeBatch, "regroup", regroup)
    lengths = [3, 40, 17, 90, 1, 33]
    prompts = {i: text_prompt(n, seed=200 + i) for i, n in enumerate(lengths)}
    num_tokens = 20
    greedy = {i: SamplingParams(max_tokens=num_tokens) for i in prompts}
    skip = [(5, 0), (6, 0), (9, 2), (10, 3), (12, 1)]
    out = run_staggered(Executor(llama_bundle), prompts, greedy, num_tokens, skip)
    assert max(most) == MAX_GROUPS
    for i, prompt in prompts.items():
        assert out[i] == reference(llama_bundle, prompt, num_tokens), f"prompt {i}"


def test_a_long_prompt_joining_short_rows_leaves_their_cache_alone(llama_bundle):
    # Before groups, the short rows were padded to the long prompt's length: a copy of every
    # row's KV that stalled every stream (a 10,000-token prompt joining 4 streams: 209 ms).
    ex = Executor(llama_bundle)
    prompts = {0: text_prompt(12, seed=300), 1: text_prompt(30, seed=301),
               2: text_prompt(JOIN_COPY_BYTES // KV // 2, seed=302)}  # 3 rows x 2,048: 12 MB
    num_tokens = 6
    out = {}
    for seq_id in (0, 1):
        ex.add(seq_id, prompts[seq_id], SamplingParams(max_tokens=num_tokens))
        out[seq_id] = [prefill_all(ex, seq_id)]
    for seq_id, token in ex.decode([0, 1]).items():
        out[seq_id].append(token)
    [short] = ex._batch.groups
    capacity = short.cache[0].keys.shape[2]
    ex.add(2, prompts[2], SamplingParams(max_tokens=num_tokens))
    out[2] = [prefill_all(ex, 2, chunk=1024)]
    while any(len(tokens) < num_tokens for tokens in out.values()):
        step = [s for s, tokens in out.items() if len(tokens) < num_tokens]
        for seq_id, token in ex.decode(step).items():
            out[seq_id].append(token)
        if len(step) == 3:
            assert [g.ids for g in ex._batch.groups] == [[0, 1], [2]]
            assert ex._batch.groups[0].cache[0].keys.shape[2] == capacity
    for seq_id, prompt in prompts.items():
        assert out[seq_id] == reference(llama_bundle, prompt, num_tokens), f"prompt {seq_id}"


@pytest.mark.parametrize("alone", [True, False])
def test_a_sequence_leaving_hands_the_prefix_cache_its_exact_kv(llama_bundle, monkeypatch, alone):
    # Alone in its group the sequence's buffers are handed over as they are; beside other rows
    # its row is copied out. Either way the KV is the prompt's and the generated tokens': what
    # a prefill of those tokens computes (to float32 rounding: one slice against token by
    # token), a position off or a padding row would differ by far more.
    if alone:
        monkeypatch.setattr(decode_batch, "JOIN_COPY_BYTES", 0)
    ex = Executor(llama_bundle)
    prompts = {0: text_prompt(20, seed=400), 1: text_prompt(50, seed=401)}
    for seq_id, prompt in prompts.items():
        ex.add(seq_id, prompt, SamplingParams(max_tokens=8))
        prefill_all(ex, seq_id)
    for _ in range(3):
        ex.decode([0, 1])
    assert len(ex._batch.groups) == (2 if alone else 1)
    tokens, layers = ex.kv_of(1)
    assert tokens[:50] == prompts[1] and len(tokens) == 50 + 3
    fresh = Executor(llama_bundle)
    fresh.add(9, tokens, SamplingParams(max_tokens=1))
    prefill_all(fresh, 9, chunk=1024)
    want = fresh._seqs[9].cache
    for (keys, values), c in zip(layers, want, strict=True):
        assert keys.shape[2] == values.shape[2] == len(tokens)
        assert mx.allclose(keys, c.keys[..., :len(tokens), :], atol=1e-4).item()
        assert mx.allclose(values, c.values[..., :len(tokens), :], atol=1e-4).item()
