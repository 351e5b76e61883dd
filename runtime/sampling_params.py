"""`SamplingParams`: how one request's tokens are chosen and when its generation may stop.

A plain frozen dataclass, importable without MLX (the HTTP layer builds it; runtime/sampling.py
and runtime/row_sampling.py apply it). Its ranges are those of runtime/limits.py, the ones the
HTTP layer declares.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime import limits


@dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are chosen and when its generation may stop. `logit_bias`:
    (token id, bias) pairs, each id once; `logprobs`: how many alternatives to report with each
    generated token's log-probability (None: none); `prompt_logprobs`: the same for every prompt
    token after the first (completions' `echo`)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def validate(self) -> SamplingParams:
        """Raise ValueError naming the first bad field and its allowed range; return self."""
        limits.TEMPERATURE.check("temperature (0 means greedy)", self.temperature)
        limits.TOP_P.check("top_p", self.top_p)
        limits.TOP_K.check("top_k (0 disables it)", self.top_k)
        self._validate_controls()
        if self.seed is not None:
            limits.SEED.check("seed", self.seed)
        limits.MAX_TOKENS.check("max_tokens", self.max_tokens)
        limits.MIN_TOKENS.check("min_tokens", self.min_tokens)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must not exceed max_tokens={self.max_tokens}, got "
                             f"{self.min_tokens}")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a tuple of non-empty strings, got {self.stop!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                limits.TOP_LOGPROBS.check(f"{name} (or None)", value)
        return self

    def _validate_controls(self) -> None:
        limits.MIN_P.check("min_p (0 disables it)", self.min_p)
        limits.PENALTY.check("presence_penalty", self.presence_penalty)
        limits.PENALTY.check("frequency_penalty", self.frequency_penalty)
        limits.REPETITION_PENALTY.check("repetition_penalty (1 disables it)",
                                        self.repetition_penalty)
        pairs = self.logit_bias
        if not isinstance(pairs, tuple) or not all(
                isinstance(pair, tuple) and len(pair) == 2 and limits.is_int(pair[0])
                and pair[0] >= 0 and limits.LOGIT_BIAS.allows(pair[1]) for pair in pairs) \
                or len({token for token, _ in pairs}) != len(pairs):
            raise ValueError(f"logit_bias must be a tuple of (token id >= 0, bias: "
                             f"{limits.LOGIT_BIAS.describe()}) pairs, each id once, got "
                             f"{pairs!r}")

    def check_vocabulary(self, vocab_size: int) -> SamplingParams:
        """Raise ValueError unless every `logit_bias` id is inside the vocabulary; return self."""
        outside = [token for token, _ in self.logit_bias if token >= vocab_size]
        if outside:
            raise ValueError(f"logit_bias ids must be inside the vocabulary [0, {vocab_size}), "
                             f"got {outside[0]}")
        return self

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Whether the counts of generated tokens matter (presence, frequency, repetition)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 \
            or self.repetition_penalty != 1.0
