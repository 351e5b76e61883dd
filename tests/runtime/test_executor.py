"""The Executor against mlx-lm's own unbatched generation, plus sampling and memory."""

from __future__ import annotations

import itertools
import random
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models import llama, qwen2, qwen3

from runtime import decode_batch
from runtime import executor as executor_module
from runtime.executor import Executor, Slice
from runtime.fused import layer_by_layer
from runtime.limits import TEMPERATURE
from runtime.model import BUILTIN_CONFIG, ModelBundle
from runtime.sampling import SamplingParams, SequenceSampler

CHUNK = 16
EOS = 257


def random_bundle(module: Any, **config: Any) -> ModelBundle:
    """An mlx-lm model with seeded random weights. Unlike the built-in model, whose output layer
    is biased so hard that its tokens barely depend on the context, its greedy tokens change
    with any change in the attended keys, so a wrong position or a stale cache shows."""
    args = {**BUILTIN_CONFIG, **config}
    mx.random.seed(11)
    model = module.Model(module.ModelArgs.from_dict(args))
    mx.eval(model.parameters())
    return ModelBundle(model, None, Path("."), f"random-{args['model_type']}", 4096,
                       frozenset(), None)


@pytest.fixture(scope="module")
def llama_bundle() -> ModelBundle:
    return random_bundle(llama)


# qwen2: q/k/v biases, fused; qwen3: q/k norms, which the fused loop does not implement.
OTHER_MODELS = {"qwen2": (qwen2, {"model_type": "qwen2"}),
                "qwen3": (qwen3, {"model_type": "qwen3", "rope_theta": 1e6})}


def reference(bundle: ModelBundle, prompt: list[int], num_tokens: int) -> list[int]:
    """mlx-lm's unbatched greedy generation (its default sampler is argmax)."""
    steps = generate_step(mx.array(prompt), bundle.model, max_tokens=num_tokens)
    return [token for token, _ in steps]


def text_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32, 127) for _ in range(length)]


def prefill_all(ex: Executor, seq_id: int, chunk: int = CHUNK) -> int:
    while (token := ex.prefill(seq_id, chunk)) is None:
        pass
    return token


def prefilled(bundle: ModelBundle, prompts: dict[int, list[int]],
              sampling: dict[int, SamplingParams], chunk: int = CHUNK
              ) -> tuple[Executor, dict[int, list[int]]]:
    """An executor holding a sequence for each of `sampling`, its prompt prefilled in `chunk`
    slices; the first token of each."""
    ex = Executor(bundle)
    out: dict[int, list[int]] = {}
    for seq_id, params in sampling.items():
        ex.add(seq_id, prompts[seq_id], params)
        out[seq_id] = [prefill_all(ex, seq_id, chunk)]
    return ex, out


def run_staggered(
    ex: Executor,
    prompts: dict[int, list[int]],
    sampling: dict[int, SamplingParams],
    num_tokens: int,
    skip: Iterable[tuple[int, int]] = (),
) -> dict[int, list[int]]:
    """A small continuous-batching loop: one prefill chunk per tick while prompts wait (so
    sequences join the decode batch at different ticks), one decode over the others; a
    sequence leaves after `num_tokens`. `skip` holds (tick, seq_id) pairs left out of a decode
    (the sequence stays alive, parked outside the batch)."""
    skip = set(skip)
    out: dict[int, list[int]] = {seq_id: [] for seq_id in prompts}
    waiting, decoding = list(prompts), []
    tick = 0
    while waiting or decoding:
        if waiting:
            seq_id = waiting[0]
            if seq_id not in ex:
                ex.add(seq_id, prompts[seq_id], sampling[seq_id])
            token = ex.prefill(seq_id, CHUNK)
            if token is not None:
                out[seq_id].append(token)
                decoding.append(waiting.pop(0))
        step = [s for s in decoding if (tick, s) not in skip and len(out[s]) < num_tokens]
        for seq_id, token in ex.decode(step).items():
            out[seq_id].append(token)
        for seq_id in [s for s in decoding if len(out[s]) >= num_tokens]:
            decoding.remove(seq_id)
            ex.release(seq_id)
        tick += 1
    return out


def test_batched_chunked_greedy_equals_mlx_lm(bundle: ModelBundle) -> None:
    # Prompt lengths: 1, shorter than a chunk, exactly a chunk, several chunks (+1).
    lengths = [1, 5, CHUNK, 3 * CHUNK + 1, 2, CHUNK + 1, 4 * CHUNK]
    prompts = {i: text_prompt(n, seed=i) for i, n in enumerate(lengths)}
    num_tokens = 24
    greedy = {i: SamplingParams(max_tokens=num_tokens) for i in prompts}
    skip = [(6, 0), (7, 0), (9, 2), (12, 1), (13, 4)]
    out = run_staggered(Executor(bundle), prompts, greedy, num_tokens, skip)
    for i, prompt in prompts.items():
        assert out[i] == reference(bundle, prompt, num_tokens), f"prompt {i} of {len(prompt)}"


def test_one_shot_prefill_and_sequence_id_reuse(bundle: ModelBundle) -> None:
    ex = Executor(bundle)
    prompts = {7: text_prompt(40, seed=70), 8: text_prompt(9, seed=80)}
    out = {}
    for seq_id, prompt in prompts.items():
        ex.add(seq_id, prompt, SamplingParams())
        assert ex.prompt_left(seq_id) == len(prompt)
        out[seq_id] = [ex.prefill(seq_id, 1000)]
        assert ex.prompt_left(seq_id) == 0
    for _ in range(5):
        for seq_id, token in ex.decode([7, 8]).items():
            out[seq_id].append(token)
    ex.release(7)
    ex.add(7, prompts[8], SamplingParams())  # same id, new prompt, while 8 still decodes
    out[9] = [prefill_all(ex, 7)]
    for _ in range(5):
        step = ex.decode([7, 8])
        out[8].append(step[8])
        out[9].append(step[7])
    assert ex.num_cached(8) == len(prompts[8]) + 10  # 11 generated, the latest not yet run
    assert out[7] == reference(bundle, prompts[7], 6)
    assert out[8] == reference(bundle, prompts[8], 11)
    assert out[9] == reference(bundle, prompts[8], 6)


def run_mixed_ticks(ex: Executor, prompts: dict[int, list[int]],
                    sampling: dict[int, SamplingParams], num_tokens: int, seed: int,
                    evict: Iterable[tuple[int, int]] = ()) -> dict[int, list[int]]:
    """Ticks as the engine runs them, one `run` each: a prompt arrives every other tick; each
    tick grants slices of random sizes to up to three parked prompts (several finish inside a
    tick) and steps a random subset of the decoding sequences (the others pause). `evict`
    holds (tick, seq_id): the sequence drops its cache then and is prefilled again."""
    rng, evict = random.Random(seed), set(evict)
    out: dict[int, list[int]] = {seq_id: [] for seq_id in prompts}
    arriving, parked, decoding = list(prompts), [], []
    tick = 0
    while arriving or parked or decoding:
        if arriving and tick % 2 == 0:
            ex.add(arriving[0], prompts[arriving[0]], sampling[arriving[0]])
            parked.append(arriving.pop(0))
        for seq_id in [s for s in decoding if (tick, s) in evict]:
            ex.evict(seq_id)
            decoding.remove(seq_id)
            parked.append(seq_id)
        slices = [Slice(s, rng.choice([1, 3, 16, 29, 64, 300]))
                  for s in parked[: rng.randint(0, 3)]]
        rows = [s for s in decoding if rng.random() < 0.85]
        tokens = ex.run(slices, rows)
        done = {w.seq_id for w in slices if ex.prompt_left(w.seq_id) == 0}
        assert set(tokens) == set(rows) | done, f"tick {tick}"
        for seq_id, token in tokens.items():
            out[seq_id].append(token)
        parked = [s for s in parked if s not in done]
        decoding += sorted(done)
        for seq_id in [s for s in decoding if len(out[s]) >= num_tokens]:
            decoding.remove(seq_id)
            ex.release(seq_id)
        tick += 1
    return out


MIX_LENGTHS = [1, 5, 16, 40, 250, 257, 300, 2]  # 250 + its tokens crosses a 256-token cache step


@pytest.mark.parametrize("fuse", [True, False], ids=["one-forward", "forward-apart"])
def test_every_mix_of_slices_and_decode_rows_equals_mlx_lm(llama_bundle, fuse):
    prompts = {i: text_prompt(n, seed=400 + i) for i, n in enumerate(MIX_LENGTHS)}
    greedy = {i: SamplingParams(max_tokens=12) for i in prompts}
    ex = Executor(llama_bundle, fuse=fuse)
    assert ex.fused is fuse
    out = run_mixed_ticks(ex, prompts, greedy, 12, seed=1)
    for i, prompt in prompts.items():
        assert out[i] == reference(llama_bundle, prompt, 12), f"prompt {i} of {len(prompt)}"
    assert ex.num_sequences == 0


@pytest.mark.parametrize("name", OTHER_MODELS)
def test_other_architectures_fuse_or_run_apart_and_equal_mlx_lm(name):
    module, config = OTHER_MODELS[name]
    bundle = random_bundle(module, **config)
    ex = Executor(bundle)
    assert ex.fused is (name == "qwen2")
    prompts = {i: text_prompt(n, seed=450 + i) for i, n in enumerate(MIX_LENGTHS[:5])}
    greedy = {i: SamplingParams(max_tokens=8) for i in prompts}
    out = run_mixed_ticks(ex, prompts, greedy, 8, seed=3)
    for i, prompt in prompts.items():
        assert out[i] == reference(bundle, prompt, 8), f"prompt {i} of {len(prompt)}"


def test_an_evicted_sequence_prefills_its_tokens_again_and_continues_exactly(llama_bundle):
    bundle = llama_bundle
    prompts = {i: text_prompt(n, seed=500 + i) for i, n in enumerate([30, 9, 70])}
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=16)
    sampling = {0: SamplingParams(max_tokens=16), 1: seeded, 2: SamplingParams(max_tokens=16)}
    # Evicted while the batch runs ahead (tick 9) and from a paused state; 0 twice.
    evict = [(9, 0), (9, 1), (14, 2), (20, 0)]
    out = run_mixed_ticks(Executor(bundle), prompts, sampling, 16, seed=2, evict=evict)
    assert out[0] == reference(bundle, prompts[0], 16)
    assert out[2] == reference(bundle, prompts[2], 16)
    alone = run_staggered(Executor(bundle), {1: prompts[1]}, {1: seeded}, 16)[1]
    assert out[1] == alone, "a seeded sampler carries on across its eviction"


def test_a_long_prompt_in_small_slices_never_copies_its_cache_to_grow_it(llama_bundle):
    # mlx-lm's KVCache grows 256 positions at a time by copying what it holds; a prompt's
    # cache is made to hold the whole prompt from its first slice, then prefills in place.
    ex = Executor(llama_bundle)
    prompt = text_prompt(700, seed=7)
    ex.add(0, prompt, SamplingParams(max_tokens=4))
    buffers = set()
    while ex.prompt_left(0):
        ex.prefill(0, 37)
        cache = ex._seqs[0].cache
        if cache is not None:
            buffers.add(tuple(layer.keys.shape[2] for layer in cache))
    assert buffers == {(768,) * len(llama_bundle.model.layers)}
    assert ex.decode([0])[0] == reference(llama_bundle, prompt, 2)[1]


def test_the_decode_batch_grows_its_caches_by_half_and_rarely(llama_bundle):
    # mlx-lm's BatchKVCache grows 256 positions at a time by copying all it holds (every 256
    # tokens a freeze of every stream); the batch grows by half its capacity instead, capped at
    # MAX_GROWTH a row, and not past what its rows can still add.
    ex = Executor(llama_bundle)
    prompts = {0: text_prompt(12, seed=40), 1: text_prompt(5, seed=41)}
    num_tokens = 2600
    for seq_id, prompt in prompts.items():
        ex.add(seq_id, prompt, SamplingParams(max_tokens=num_tokens))
        prefill_all(ex, seq_id)
    capacities, out = [], []
    for _ in range(num_tokens - 1):
        out.append(ex.decode([0, 1])[0])
        capacity = ex._batch.groups[0].cache[0].keys.shape[2]
        if not capacities or capacity != capacities[-1]:
            capacities.append(capacity)
    for before, after in itertools.pairwise(capacities):
        assert after - before >= min(before // 2, decode_batch.MAX_GROWTH) or \
            after >= len(prompts[0]) + num_tokens, capacities
        assert after - before <= max(decode_batch.MIN_GROWTH, before // 2), capacities
    assert len(capacities) - 1 < (len(prompts[0]) + num_tokens) // 256 - 2, capacities
    assert capacities[-1] < len(prompts[0]) + num_tokens + decode_batch.MIN_GROWTH
    assert out[:400] == reference(llama_bundle, prompts[0], 401)[1:]


def test_growth_is_half_the_capacity_within_its_bounds():
    assert decode_batch.growth(1024, 10_000) == 512
    assert decode_batch.growth(256, 10_000) == decode_batch.MIN_GROWTH  # 128 is too little
    assert decode_batch.growth(100_000, 10_000_000) == decode_batch.MAX_GROWTH
    assert decode_batch.growth(4096, 300) == 300  # the rows cannot use more
    assert decode_batch.growth(4096, 3) == decode_batch.MIN_GROWTH  # never below mlx-lm's


def test_a_tick_that_fails_midway_leaves_every_sequence_as_it_was(llama_bundle, monkeypatch):
    bundle = llama_bundle
    # The fault strikes after the forward has updated every cache: the executor must put the
    # caches and PRNG keys back, so the same work run again gives mlx-lm's tokens.
    prompts = {i: text_prompt(n, seed=600 + i) for i, n in enumerate([12, 20, 45])}
    seeded = SamplingParams(temperature=1.0, seed=8, max_tokens=10)
    ex = Executor(bundle)
    for seq_id in (0, 1):
        ex.add(seq_id, prompts[seq_id], seeded if seq_id == 1 else SamplingParams())
    out = {0: [ex.prefill(0, 100)], 1: [ex.prefill(1, 100)]}
    for _ in range(3):  # the batch runs ahead: the failing tick also undoes a queued step
        for seq_id, token in ex.decode([0, 1]).items():
            out[seq_id].append(token)
    ex.add(2, prompts[2], SamplingParams())
    def failing(*args: object) -> object:
        raise RuntimeError("injected fault in sampling")

    # First the prompt's first token fails (the decode rows take the queued step), then the
    # evaluation itself (nothing queued any more, every row sampled, the slice in the cache).
    for target, name, work in ((SequenceSampler, "sample", Slice(2, 45)),
                               (executor_module.mx, "eval", Slice(2, 20))):
        with monkeypatch.context() as patch:
            patch.setattr(target, name, failing)
            with pytest.raises(RuntimeError, match="injected"):
                ex.run([work], [0, 1])
        assert ex.prompt_left(2) == 45 and ex.num_cached(0) == len(prompts[0]) + 3
    for num_tokens in (20, 25):
        for seq_id, token in ex.run([Slice(2, num_tokens)], [0, 1]).items():
            out.setdefault(seq_id, []).append(token)
    assert out[0] == reference(bundle, prompts[0], 6)
    assert out[2] == reference(bundle, prompts[2], 1)
    assert out[1] == run_staggered(Executor(bundle), {1: prompts[1]}, {1: seeded}, 6)[1]


def test_a_prompt_prefilled_on_another_thread_beside_decode_steps_is_exact(bundle):
    # A prefill lane (ADR 0016): one thread steps the decode rows while another runs the
    # prompt's prefill-only ticks, layer by layer. Each touches only its own sequences, so every
    # sequence gets mlx-lm's tokens; the batch's queued step stays the rows' (a prefill-only
    # tick on the other thread does not undo it).
    prompts = {i: text_prompt(9 + 13 * i, seed=700 + i) for i in range(3)}
    prompt = text_prompt(700, seed=799)
    ex = Executor(bundle)
    out: dict[int, list[int]] = {}
    for seq_id in (0, 1, 2):
        ex.add(seq_id, prompts[seq_id], SamplingParams(max_tokens=200))
        out[seq_id] = [prefill_all(ex, seq_id)]
    for _ in range(3):  # the batch runs ahead: a step is queued when the prompt comes
        for seq_id, token in ex.decode([0, 1, 2]).items():
            out[seq_id].append(token)
    ex.add(9, prompt, SamplingParams(max_tokens=200))  # on this thread, as the engine adds
    assert ex._batch.ahead is not None
    first: list[int] = []
    sliced, stepped = threading.Event(), threading.Event()

    def lane() -> None:
        try:
            with layer_by_layer():
                ex.run([Slice(9, 64)], [])
                sliced.set()
                stepped.wait(60)  # a step of the rows while the prompt is part-way, at least
                first.append(prefill_all(ex, 9, chunk=64))
        finally:
            sliced.set()
            mx.clear_streams()  # a thread's MLX streams are freed by that thread

    thread = threading.Thread(target=lane)
    thread.start()
    part_way = []
    while thread.is_alive() or not stepped.is_set():
        for seq_id, token in ex.decode([0, 1, 2]).items():
            out[seq_id].append(token)
        if sliced.is_set() and not stepped.is_set():
            part_way.append(ex.prompt_left(9))
            stepped.set()
    thread.join()
    assert len(first) == 1 and 0 < part_way[0] < len(prompt)
    out[9] = first
    for _ in range(3):  # the prompt joins the rows
        for seq_id, token in ex.decode([0, 1, 2, 9]).items():
            out[seq_id].append(token)
    for seq_id, tokens in out.items():
        assert tokens == reference(bundle, prompt if seq_id == 9 else prompts[seq_id],
                                   len(tokens)), seq_id


def test_a_failing_prefill_only_tick_leaves_the_decode_batch_alone(bundle, monkeypatch):
    # Undone, a prefill-only tick puts back only what it touched: on a lane it runs beside the
    # thread that steps the batch, whose state and queued step it must not overwrite.
    prompts = {i: text_prompt(11 + 5 * i, seed=720 + i) for i in range(2)}
    ex = Executor(bundle)
    out: dict[int, list[int]] = {}
    for seq_id in (0, 1):
        ex.add(seq_id, prompts[seq_id], SamplingParams(max_tokens=50))
        out[seq_id] = [prefill_all(ex, seq_id)]
    for _ in range(2):
        for seq_id, token in ex.decode([0, 1]).items():
            out[seq_id].append(token)
    ex.add(5, text_prompt(40, seed=729), SamplingParams())
    state, queued = ex._batch.state, ex._batch.ahead
    assert queued is not None

    def failing(*args: object) -> object:
        raise RuntimeError("injected fault in sampling")

    with monkeypatch.context() as patch:
        patch.setattr(SequenceSampler, "sample", failing)
        with pytest.raises(RuntimeError, match="injected"):
            ex.run([Slice(5, 40)], [])
    assert ex._batch.state is state and ex._batch.ahead is queued and ex.prompt_left(5) == 40
    for _ in range(2):  # the rows take their queued step, and go on exactly
        for seq_id, token in ex.decode([0, 1]).items():
            out[seq_id].append(token)
    for seq_id, tokens in out.items():
        assert tokens == reference(bundle, prompts[seq_id], len(tokens))


def test_default_model_emits_printable_ascii_only(bundle: ModelBundle) -> None:
    prompts = {i: text_prompt(3 + 11 * i, seed=100 + i) for i in range(4)}
    sampling = {
        # Up to the highest temperature any request may ask for (runtime/limits.py).
        i: SamplingParams(temperature=[0.0, 1.0, 1.5, TEMPERATURE.high][i], seed=i,
                          max_tokens=32)
        for i in prompts
    }
    out = run_staggered(Executor(bundle), prompts, sampling, 32)
    for tokens in out.values():
        assert all(32 <= t <= 126 for t in tokens), tokens


def _first_eos_prompt(bundle: ModelBundle, num_tokens: int) -> tuple[list[int], int]:
    for seed in range(200):
        prompt = text_prompt(12, seed=seed)
        tokens = reference(bundle, prompt, num_tokens)
        if EOS in tokens[2:]:
            return prompt, tokens.index(EOS)
    raise AssertionError("the allow_eos model never reached EOS")


def test_min_tokens_and_ignore_eos_mask_eos(eos_bundle: ModelBundle) -> None:
    prompt, eos_at = _first_eos_prompt(eos_bundle, 40)
    expected = reference(eos_bundle, prompt, eos_at + 1)
    ex = Executor(eos_bundle)
    params = {
        0: SamplingParams(),
        1: SamplingParams(min_tokens=eos_at + 3, max_tokens=eos_at + 3),
        2: SamplingParams(ignore_eos=True),
        3: SamplingParams(min_tokens=eos_at, max_tokens=eos_at + 3),  # EOS allowed just in time
    }
    out = {}
    for seq_id, sampling in params.items():
        ex.add(seq_id, prompt, sampling)
        out[seq_id] = [prefill_all(ex, seq_id)]
    for _ in range(eos_at + 4):
        for seq_id, token in ex.decode([0, 1, 2, 3]).items():
            out[seq_id].append(token)
    assert out[0][: eos_at + 1] == expected  # EOS where mlx-lm puts it
    assert out[3][: eos_at + 1] == expected
    assert EOS not in out[1][: eos_at + 3]
    assert out[1][:eos_at] == expected[:eos_at]
    assert EOS not in out[2]


def test_seeded_sampling_is_reproducible_across_batch_compositions(bundle: ModelBundle) -> None:
    prompt = text_prompt(20, seed=5)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=20)

    alone = run_staggered(Executor(bundle), {0: prompt}, {0: seeded}, 20)[0]
    others = {i: text_prompt(5 + 9 * i, seed=50 + i) for i in range(1, 4)}
    prompts = {1: others[1], 0: prompt, 2: others[2], 3: others[3]}
    sampling = {
        0: seeded,
        1: SamplingParams(temperature=0.7, seed=9),
        2: SamplingParams(),
        3: SamplingParams(temperature=1.5),
    }
    batched = run_staggered(Executor(bundle), prompts, sampling, 20, skip=[(4, 0)])[0]
    other_seed = run_staggered(
        Executor(bundle), {0: prompt}, {0: SamplingParams(temperature=1.0, seed=99)}, 20
    )[0]
    assert batched == alone
    assert other_seed != alone


def test_decode_ahead_is_undone_when_the_batch_changes(bundle: ModelBundle) -> None:
    # Between steps of an unchanged batch the next step is already queued; a sequence that
    # skips a step, rejoins, joins late or is released must still get mlx-lm's exact tokens,
    # and a seeded sampler its own draws.
    prompts = {i: text_prompt(6 + 7 * i, seed=300 + i) for i in range(4)}
    seeded = SamplingParams(temperature=1.0, seed=77, max_tokens=40)
    sampling = {0: SamplingParams(max_tokens=40), 1: seeded, 2: SamplingParams(max_tokens=40)}
    ex, out = prefilled(bundle, prompts, sampling, chunk=1000)

    def step(ids: list[int], times: int = 1) -> None:
        for _ in range(times):
            for seq_id, token in ex.decode(ids).items():
                out[seq_id].append(token)

    step([0, 1, 2], 3)
    step([0, 2], 2)  # 1 skips two steps (parked), then rejoins
    step([0, 1, 2], 3)
    ex.add(3, prompts[3], SamplingParams(max_tokens=40))  # arrives while the batch runs ahead
    out[3] = [prefill_all(ex, 3)]
    step([0, 1, 2], 2)
    step([0, 1, 2, 3], 3)
    ex.release(2)  # leaves while the batch runs ahead
    step([0, 1, 3], 3)
    step([], 1)  # everyone parked
    step([0, 1, 3], 2)
    assert out[0] == reference(bundle, prompts[0], len(out[0]))
    assert out[3] == reference(bundle, prompts[3], len(out[3]))
    assert out[2] == reference(bundle, prompts[2], len(out[2]))
    alone = run_staggered(Executor(bundle), {1: prompts[1]}, {1: seeded}, len(out[1]))[1]
    assert out[1] == alone


def test_a_step_queued_after_the_tokens_are_read_is_the_step_a_run_takes(bundle, monkeypatch):
    # A lane tick (ADR 0016) publishes a step's tokens and then queues the rows' next step
    # (`queue_step`), even while a prompt outside the batch is prefilling. The next run of the
    # same rows takes it; a run of other rows undoes it; rows at their max_tokens queue none;
    # one that fails is undone. Every token stays mlx-lm's, and a seeded row's draws its own.
    prompts = {i: text_prompt(7 + 9 * i, seed=900 + i) for i in range(3)}
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=30)
    sampling = {0: SamplingParams(max_tokens=30), 1: seeded, 2: SamplingParams(max_tokens=12)}
    ex, out = prefilled(bundle, prompts, sampling)
    prompt = text_prompt(300, seed=999)
    ex.add(9, prompt, SamplingParams(max_tokens=3))  # prefilling beside the rows

    def step(ids: list[int]) -> None:
        for seq_id, token in ex.decode(ids).items():
            out[seq_id].append(token)
        ex.queue_step(ids)

    step([0, 1, 2])
    assert ex._batch.ahead is not None  # queued, with sequence 9 outside the batch
    taken = ex._batch.ahead
    step([0, 1, 2])
    assert ex._batch.ahead is not None and ex._batch.ahead is not taken  # took it, queued one
    for seq_id, token in ex.decode([0, 1, 2]).items():  # takes it, queues none (9 is live)
        out[seq_id].append(token)
    # A queue_step that fails midway leaves everything as it was.
    real = ex._forward

    def fails(model, segments):
        real(model, segments)  # the caches moved
        raise RuntimeError("out of memory")

    monkeypatch.setattr(ex, "_forward", fails)
    with pytest.raises(RuntimeError, match="out of memory"):
        ex.queue_step([0, 1, 2])
    monkeypatch.setattr(ex, "_forward", real)
    assert ex._batch.ahead is None
    step([0, 1, 2])
    ex.run([Slice(9, 100)], [])  # a prefill-only tick leaves it queued
    assert ex._batch.ahead is not None
    step([0, 2])  # 1 parked: the queued step is undone
    for _ in range(12):
        step([0, 1, 2] if len(out[2]) < 12 else [0, 1])
    out[9] = [prefill_all(ex, 9)]
    step([0, 1, 9])  # the prompt joins: the batch changes again
    while len(out[1]) < 30:  # to their max_tokens: no step is queued past the last
        step([0, 1] if len(out[0]) < 30 else [1])
    assert ex._batch.ahead is None
    for seq_id in (0, 2):
        assert out[seq_id] == reference(bundle, prompts[seq_id], len(out[seq_id])), seq_id
    assert out[1] == run_staggered(Executor(bundle), {1: prompts[1]}, {1: seeded}, 30)[1]
    assert out[9] == reference(bundle, prompt, 2)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("top_k", 2.5),
        ("seed", -3),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("min_tokens", 17),
        ("stop", ["x"]),
        ("stop", ("",)),
        ("ignore_eos", 1),
    ],
)
def test_sampling_params_validate_names_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value}).validate()  # type: ignore[arg-type]


def test_sampling_params_defaults_are_valid() -> None:
    params = SamplingParams(temperature=0.5, top_p=0.5, top_k=3, seed=0, stop=("\n",))
    assert params.validate() is params


def test_misuse_raises(bundle: ModelBundle) -> None:
    ex = Executor(bundle)
    with pytest.raises(ValueError, match="at least one token"):
        ex.add(1, [], SamplingParams())
    with pytest.raises(ValueError, match="top_p"):
        ex.add(1, [65], SamplingParams(top_p=2.0))
    ex.add(1, [65, 66], SamplingParams())
    with pytest.raises(ValueError, match="already exists"):
        ex.add(1, [65], SamplingParams())
    with pytest.raises(ValueError, match="prefill"):
        ex.decode([1])
    prefill_all(ex, 1)
    with pytest.raises(ValueError, match="no prompt left"):
        ex.prefill(1, 4)
    with pytest.raises(ValueError, match="duplicate"):
        ex.decode([1, 1])
    with pytest.raises(KeyError):
        ex.decode([2])
    ex.release(1)
    with pytest.raises(KeyError):
        ex.release(1)


def test_memory_returns_to_baseline_after_release(bundle: ModelBundle) -> None:
    def workload(ex: Executor) -> None:
        prompts = {i: text_prompt(20 + 37 * i, seed=200 + i) for i in range(5)}
        sampling = {i: SamplingParams(temperature=0.8 * (i % 2), seed=i) for i in prompts}
        run_staggered(ex, prompts, sampling, 12, skip=[(6, 0), (8, 3)])
        ex.add(99, text_prompt(50, seed=9), SamplingParams())  # released mid-prefill
        ex.prefill(99, CHUNK)
        ex.release(99)

    ex = Executor(bundle)
    workload(ex)  # warm-up: compiled samplers keep a few bytes of constants
    baseline = mx.get_active_memory()
    for _ in range(2):
        workload(ex)
        assert ex.num_sequences == 0
        assert mx.get_active_memory() == baseline
