"""One source of request limits (runtime/limits.py): what the HTTP layer accepts is what the
engine's SamplingParams accepts, the context is checked by one function, and the validation
path imports no MLX."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.limits import ContextOverflow, check_context, fit_context
from runtime.sampling_params import SamplingParams
from server.errors import ApiError
from tests.server.test_validation import completion, limits


def accepted_by_server(**fields: object) -> bool:
    try:
        completion(max_tokens=8, **fields)
    except ApiError as exc:
        assert exc.status == 400 and exc.param in fields, exc.message
        return False
    return True


def accepted_by_engine(**fields: object) -> bool:
    try:
        SamplingParams(max_tokens=8, **fields).validate()  # type: ignore[arg-type]
    except ValueError as exc:
        assert any(name in str(exc) for name in fields), exc
        return False
    return True


def around(low: float, high: float) -> st.SearchStrategy[float]:
    """Numbers at, just inside and just outside [low, high], and anywhere near it."""
    edges = [low, high, low - 1e-9, high + 1e-9, low + 1e-9, high - 1e-9, -0.0]
    return st.sampled_from(edges) | st.floats(low - 1, high + 1, allow_nan=False)


@settings(max_examples=200, deadline=None, database=None)
@given(value=around(0.0, 2.0))
def test_temperature_the_server_accepts_is_the_one_the_engine_runs(value):
    assert accepted_by_server(temperature=value) == accepted_by_engine(temperature=value)


@settings(max_examples=200, deadline=None, database=None)
@given(value=around(0.0, 1.0))
def test_top_p_the_server_accepts_is_the_one_the_engine_runs(value):
    assert accepted_by_server(top_p=value) == accepted_by_engine(top_p=value)


@settings(max_examples=200, deadline=None, database=None)
@given(value=st.sampled_from([-1, 0, 2**63 - 1, 2**63]) | st.integers(-(2**64), 2**64))
def test_seed_the_server_accepts_is_the_one_the_engine_runs(value):
    assert accepted_by_server(seed=value) == accepted_by_engine(seed=value)


@settings(max_examples=100, deadline=None, database=None)
@given(value=st.integers(0, 8) | st.integers(-5, -1))
def test_min_tokens_the_server_accepts_is_the_one_the_engine_runs(value):
    assert accepted_by_server(min_tokens=value) == accepted_by_engine(min_tokens=value)


def test_top_k_inside_the_vocabulary_reaches_the_engine_as_sent():
    for value in (0, 1, limits().vocab_size - 1):
        assert completion(top_k=value).sampling.top_k == value
        assert accepted_by_engine(top_k=value)
    # vLLM's -1 is the engine's 0 (off); the engine itself takes no negative value.
    assert completion(top_k=-1).sampling.top_k == 0 and not accepted_by_engine(top_k=-1)


def test_the_context_check_is_one_function():
    assert fit_context(10, None, 16, 20) == 10, "the default is cut to the room left"
    assert fit_context(10, 10, 16, 20) == 10
    with pytest.raises(ContextOverflow) as info:
        fit_context(10, 11, 16, 20)
    assert not info.value.leaves_no_room and "21 tokens" in str(info.value)
    with pytest.raises(ContextOverflow) as info:
        check_context(20, 1, 20)
    assert info.value.leaves_no_room
    assert "the 20 tokens of the prompt leave no room to generate" in str(info.value)


def test_validation_imports_no_mlx():
    code = ("import sys, server.validation, server.body_models, runtime.sampling_params; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'mlx'))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, check=True, cwd=Path(__file__).resolve().parents[2])
    assert result.stdout.strip() == "[]", result.stdout
