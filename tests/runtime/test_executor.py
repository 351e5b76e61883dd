"""The Executor against mlx-lm's own unbatched generation, plus sampling and memory."""

from __future__ import annotations

import random
from collections.abc import Iterable

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from runtime.executor import Executor
from runtime.model import ModelBundle
from runtime.sampling import SamplingParams

CHUNK = 16
EOS = 257


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
    assert ex.num_tokens(8) == len(prompts[8]) + 11
    assert out[7] == reference(bundle, prompts[7], 6)
    assert out[8] == reference(bundle, prompts[8], 11)
    assert out[9] == reference(bundle, prompts[8], 6)


def test_default_model_emits_printable_ascii_only(bundle: ModelBundle) -> None:
    prompts = {i: text_prompt(3 + 11 * i, seed=100 + i) for i in range(4)}
    sampling = {
        i: SamplingParams(temperature=[0.0, 1.0, 3.0, 10.0][i], seed=i, max_tokens=32)
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
    ex = Executor(bundle)
    out: dict[int, list[int]] = {}
    for seq_id, params in sampling.items():
        ex.add(seq_id, prompts[seq_id], params)
        out[seq_id] = [ex.prefill(seq_id, 1000)]  # type: ignore[list-item]

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
