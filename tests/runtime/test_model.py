"""The built-in model: written once, loaded through mlx-lm, and biased to printable ASCII."""

from __future__ import annotations

import json
import logging
import multiprocessing
import random
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step, stream_generate
from mlx_lm.models.cache import make_prompt_cache

from runtime.detok import TextStream
from runtime.model import ModelBundle, load_model, make_builtin_model

PRINTABLE = set(range(32, 127))
BOS, EOS = 256, 257


def _config(path: Path) -> dict:
    return dict(json.loads((path / "config.json").read_text()))


def _random_prompts(num: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for i in range(num):
        length = rng.choice([1, 2, 7, 30, 120])
        # Half printable text, half arbitrary ids including BOS and EOS as inputs.
        top = 127 if i % 2 else 258
        low = 32 if i % 2 else 0
        prompts.append([rng.randrange(low, top) for _ in range(length)])
    return prompts


def test_make_builtin_model_is_idempotent_and_content_addressed(tmp_path: Path) -> None:
    first = make_builtin_model(tmp_path)
    stamp = {p.name: p.stat().st_mtime_ns for p in first.iterdir()}
    assert make_builtin_model(tmp_path) == first
    assert {p.name: p.stat().st_mtime_ns for p in first.iterdir()} == stamp
    assert make_builtin_model(tmp_path, seed=1) != first
    assert make_builtin_model(tmp_path, allow_eos=True) != first
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]


def test_make_builtin_model_writes_an_ordinary_mlx_lm_directory(bundle: ModelBundle) -> None:
    config = _config(bundle.path)
    assert config["model_type"] == "llama"
    assert config["max_position_embeddings"] >= 16384
    assert config["tie_word_embeddings"] is False
    assert {"model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in bundle.path.iterdir()
    }
    num_params = sum(v.size for v in mx.load(str(bundle.path / "model.safetensors")).values())
    assert 500_000 < num_params < 2_000_000


def _build_in(cache_dir: str) -> str:
    return str(make_builtin_model(Path(cache_dir), seed=3))


def test_concurrent_builders_agree(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(3) as pool:
        paths = pool.map(_build_in, [str(tmp_path)] * 3)
    assert len(set(paths)) == 1
    loaded = load_model(paths[0])
    assert loaded.context_length == _config(loaded.path)["max_position_embeddings"]
    assert [p.name for p in tmp_path.iterdir()] == [Path(paths[0]).name]


def test_load_model_fields(bundle: ModelBundle) -> None:
    assert bundle.context_length == _config(bundle.path)["max_position_embeddings"]
    assert bundle.eos_token_ids == frozenset({EOS})
    assert bundle.bos_token_id == BOS
    assert bundle.name == bundle.path.name
    assert bundle.tokenizer.vocab_size >= 256


def test_a_prompt_past_the_context_is_tokenized_without_a_warning() -> None:
    # The server refuses it with a 400 of its own; transformers' check logged a warning for
    # every such prompt ("Token indices sequence length is longer than ..."). Its loggers do
    # not propagate to the root: listen on its own.
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    library = logging.getLogger("transformers")
    library.addHandler(handler)
    try:
        loaded = load_model(None)  # a tokenizer of its own: transformers warns once per one
        text = "x" * (loaded.context_length + 10)
        assert len(loaded.tokenizer.encode(text)) == loaded.context_length + 11  # BOS, bytes
    finally:
        library.removeHandler(handler)
    assert not [r for r in records if "sequence length is longer" in r.getMessage()], records


def test_load_model_without_a_path_uses_the_cache_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAIRTICK_CACHE", str(tmp_path))
    loaded = load_model(None)
    assert loaded.path.parent == tmp_path


def test_load_model_rejects_a_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)


def test_byte_tokenizer_round_trips_text(bundle: ModelBundle) -> None:
    tok = bundle.tokenizer
    text = "Hello, wörld! \t\n ~"
    ids = tok.encode(text)
    assert ids[0] == BOS
    assert ids[1:] == list(text.encode("utf-8"))
    assert tok.decode(ids, skip_special_tokens=True) == text
    detok = tok.detokenizer
    for token in ids[1:]:
        detok.add_token(token)
    detok.finalize()
    assert detok.text == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert chat[0] == BOS and tok.decode(chat[1:]).endswith("<|assistant|>\n")


def test_greedy_generation_is_printable_ascii_and_never_eos(bundle: ModelBundle) -> None:
    for prompt in _random_prompts(16, seed=1):
        tokens = [t for t, _ in generate_step(mx.array(prompt), bundle.model, max_tokens=48)]
        assert set(tokens) <= PRINTABLE, (prompt, tokens)


def test_only_printable_tokens_have_probability_at_long_context(bundle: ModelBundle) -> None:
    # Every position of a 2k-token context: tokens outside 32..126 have log-prob < -100.
    blocked = mx.array([t not in PRINTABLE for t in range(258)])
    rng = random.Random(2)
    prompt = [rng.randrange(0, 258) for _ in range(2048)]
    cache = make_prompt_cache(bundle.model)
    worst = -mx.inf
    for start in range(0, len(prompt), 512):
        logits = bundle.model(mx.array(prompt[start : start + 512])[None], cache=cache)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        worst = mx.maximum(worst, mx.where(blocked, logprobs, -mx.inf).max())
        mx.eval(worst, [c.state for c in cache])
    assert worst.item() < -100


def test_allow_eos_model_reaches_eos(bundle: ModelBundle, eos_bundle: ModelBundle) -> None:
    prompts = [[t for t in p if t in PRINTABLE] or [65] for p in _random_prompts(24, seed=3)]

    def finish_reasons(b: ModelBundle) -> list[str | None]:
        reasons = []
        for prompt in prompts:
            *_, last = stream_generate(b.model, b.tokenizer, prompt, max_tokens=48)
            reasons.append(last.finish_reason)
        return reasons

    assert "stop" in finish_reasons(eos_bundle)
    assert set(finish_reasons(bundle)) == {"length"}


def _stream(bundle: ModelBundle, text: str, stop: tuple[str, ...]) -> tuple[list[str], bool]:
    stream = TextStream(bundle.tokenizer, stop)
    pieces = [stream.add(t) for t in [BOS, *text.encode("utf-8")]]
    pieces.append(stream.finish())
    return pieces, stream.stopped


@pytest.mark.parametrize(
    ("text", "stop", "expected", "stopped"),
    [
        ("Hello, wörld! ok", (), "Hello, wörld! ok", False),
        ("Hello, wörld! ok", ("wör",), "Hello, ", True),
        ("Hello, wörld! ok", ("xyz", "d!"), "Hello, wörl", True),
        ("abab abd", ("abc",), "abab abd", False),
        ("tail ab", ("abc",), "tail ab", False),
    ],
)
def test_text_stream_cuts_at_stop_strings(
    bundle: ModelBundle, text: str, stop: tuple[str, ...], expected: str, stopped: bool
) -> None:
    pieces, did_stop = _stream(bundle, text, stop)
    assert "".join(pieces) == expected
    assert did_stop is stopped


def test_text_stream_holds_back_only_possible_stop_prefixes(bundle: ModelBundle) -> None:
    pieces, _ = _stream(bundle, "xaby", ("abc",))
    # After "x": sent; "a", "ab": held (could start "abc"); "y" releases "aby".
    assert pieces[1:] == ["x", "", "", "aby", ""]
