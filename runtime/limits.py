"""Request limits in one place: the allowed range of every generation field, and the one check
that a prompt and its completion fit the model's context.

The HTTP layer declares its request bodies with these bounds (server/body_models.py) and the
engine's `SamplingParams.validate` checks the same ones, so whatever the server accepts the
engine runs. Imports no MLX (nor anything else outside the standard library).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def is_int(value: object) -> bool:
    """An integer that is not a bool (JSON's true is Python's 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """A finite int or float that is not a bool; an int too large for a float counts."""
    if isinstance(value, float):
        return math.isfinite(value)
    return is_int(value)


def describe_range(integer: bool, low: float | None, high: float | None,
                   low_open: bool = False) -> str:
    """What a number field allows, in words: "a number from 0 to 2", "an integer >= 1"."""
    what = "an integer" if integer else "a number"
    low, high = _plain(low), _plain(high)
    if low is not None and high is not None and not low_open:
        return f"{what} from {low} to {high}"
    if low is not None and high is not None:
        return f"{what} greater than {low} and at most {high}"
    if low is not None:
        return f"{what} {'>' if low_open else '>='} {low}"
    if high is not None:
        return f"{what} <= {high}"
    return what


def _plain(limit: float | None) -> float | None:
    """A limit as people write it: 2 rather than 2.0 (exact for integers of any size)."""
    return int(limit) if isinstance(limit, float) and limit.is_integer() else limit


@dataclass(frozen=True)
class Bound:
    """The allowed range of a number field: [low, high] (`low` excluded when `low_open`);
    None means unbounded on that side."""

    low: float | None
    high: float | None
    integer: bool = False
    low_open: bool = False

    def describe(self) -> str:
        return describe_range(self.integer, self.low, self.high, self.low_open)

    def allows(self, value: object) -> bool:
        if not (is_int(value) if self.integer else is_number(value)):
            return False
        number = float(value) if isinstance(value, float) else int(value)  # type: ignore[arg-type]
        if self.low is not None and (number <= self.low if self.low_open else number < self.low):
            return False
        return self.high is None or number <= self.high

    def check(self, name: str, value: object) -> None:
        """Raise ValueError naming `name` and the allowed range unless `value` is inside it."""
        if not self.allows(value):
            raise ValueError(f"{name} must be {self.describe()}, got {value!r}")

    def constraints(self) -> dict[str, float]:
        """The bound as pydantic/annotated-types keywords (`ge`, `gt`, `le`)."""
        found: dict[str, float] = {}
        if self.low is not None:
            found["gt" if self.low_open else "ge"] = self.low
        if self.high is not None:
            found["le"] = self.high
        return found


MAX_INT32 = 2**31 - 1

# Sampling. OpenAI's ranges where OpenAI has the field, vLLM's where only vLLM has it.
TEMPERATURE = Bound(0.0, 2.0)  # 0: greedy
TOP_P = Bound(0.0, 1.0, low_open=True)
TOP_K = Bound(0, MAX_INT32, integer=True)  # the engine's: 0 disables
TOP_K_REQUEST = Bound(-1, MAX_INT32, integer=True)  # vLLM's: -1 disables too
MIN_P = Bound(0.0, 1.0)  # 0 disables
PENALTY = Bound(-2.0, 2.0)  # presence_penalty, frequency_penalty
REPETITION_PENALTY = Bound(0.0, None, low_open=True)  # 1 disables (vLLM: > 0)
LOGIT_BIAS = Bound(-100.0, 100.0)
SEED = Bound(0, 2**63 - 1, integer=True)

# Lengths. max_tokens has no static upper bound: the context, less the prompt, is the limit.
MAX_TOKENS = Bound(1, None, integer=True)
MIN_TOKENS = Bound(0, None, integer=True)
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for completions
# A chat request without max_tokens is bounded, not the model's whole context
# (`fairtick serve --default-chat-max-tokens`).
DEFAULT_CHAT_MAX_TOKENS = 2048
MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 256
MAX_MESSAGES = 1024
MAX_TOOLS = 128  # functions offered in one chat request (OpenAI's limit)
MAX_SCHEMA_CHARS = 256 * 1024  # a response format's or a function's schema, as JSON

# Choices and log-probabilities (OpenAI's ranges, but `n` at most MAX_N per prompt).
MAX_N = 64  # choices of one prompt (`n`), sharing its prefill
MAX_PROMPTS = 64  # prompts in one completions batch
MAX_CHOICES = 128  # choices of one request: prompts in a completions batch times `n`
N = Bound(1, MAX_N, integer=True)
BEST_OF = Bound(1, 20, integer=True)
COMPLETION_LOGPROBS = Bound(0, 5, integer=True)
CHAT_TOP_LOGPROBS = Bound(0, 20, integer=True)
# The engine's: alternatives reported per token, the most either endpoint asks for.
TOP_LOGPROBS = Bound(0, max(COMPLETION_LOGPROBS.high or 0, CHAT_TOP_LOGPROBS.high or 0),
                     integer=True)


class ContextOverflow(ValueError):
    """A prompt and the tokens asked of it do not fit the model's context."""

    def __init__(self, num_prompt: int, max_tokens: int | None, context_length: int) -> None:
        self.num_prompt, self.max_tokens = num_prompt, max_tokens
        self.context_length = context_length
        if self.leaves_no_room:
            message = (f"the {num_prompt} tokens of the prompt leave no room to generate in "
                       f"the model's context of {context_length}")
        else:
            message = (f"prompt ({num_prompt} tokens) plus max_tokens ({max_tokens}) is "
                       f"{num_prompt + (max_tokens or 0)} tokens, more than the model's "
                       f"context of {context_length}")
        super().__init__(message)

    @property
    def leaves_no_room(self) -> bool:
        """The prompt alone fills the context (no max_tokens could fit)."""
        return self.num_prompt >= self.context_length


def check_context(num_prompt: int, max_tokens: int, context_length: int) -> None:
    """Raise ContextOverflow unless the prompt and `max_tokens` fit the context together."""
    if num_prompt >= context_length or num_prompt + max_tokens > context_length:
        raise ContextOverflow(num_prompt, max_tokens, context_length)


def fit_context(num_prompt: int, requested: int | None, default: int,
                context_length: int) -> int:
    """The max_tokens to run with: `requested`, or else `default` cut to the room the prompt
    leaves; ContextOverflow when the prompt and the requested tokens cannot fit."""
    if requested is None:
        if num_prompt >= context_length:
            raise ContextOverflow(num_prompt, None, context_length)
        return min(default, context_length - num_prompt)
    check_context(num_prompt, requested, context_length)
    return requested
