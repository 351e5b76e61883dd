"""`SamplingParams`: how one request's tokens are chosen and when its generation may stop.

A plain frozen dataclass, importable without MLX (the HTTP layer builds it; runtime/sampling.py
applies it). Its ranges are those of runtime/limits.py, the ones the HTTP layer declares.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime import limits


@dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are chosen and when its generation may stop."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def validate(self) -> SamplingParams:
        """Raise ValueError naming the first bad field and its allowed range; return self."""
        limits.TEMPERATURE.check("temperature (0 means greedy)", self.temperature)
        limits.TOP_P.check("top_p", self.top_p)
        limits.TOP_K.check("top_k (0 disables it)", self.top_k)
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
        return self

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
