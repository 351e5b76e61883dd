"""How the engine runs (`EngineConfig`), validated on construction. Imports no MLX."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

# How a lane policy's prefill lane (runtime/lane.py) is scheduled by the operating system.
LANE_PRIORITIES = ("idle", "normal")
LANE_PRIORITY_ENV = "FAIRTICK_LANE_PRIORITY"


def check_lane_priority(value: str) -> str:
    """`value` if it is one of LANE_PRIORITIES, else ValueError saying which are."""
    if value not in LANE_PRIORITIES:
        raise ValueError(f"lane_priority must be one of {', '.join(LANE_PRIORITIES)}, "
                         f"got {value!r}")
    return value


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs; validated on construction."""

    model: str | None = None
    # Sequences holding KV at once; the KV budget is the real limit. mlx_lm.server decodes 32
    # at once; 256 (vLLM's default) keeps the running limit out of the way of the budget.
    max_running: int = 256
    prefill_chunk_size: int = 512
    policy: str = "default"
    policy_params: Mapping[str, float] = field(default_factory=dict)
    # Requests not yet admitted. Every request waits here before its first admission, however
    # idle the server, so at least 1 (0 would refuse every request).
    max_waiting: int = 256
    max_kv_tokens: int | None = None  # None: sized from the memory available at start-up
    lifecycle: str | None = None  # None: specs/lifecycle.yaml
    trace_capacity: int = 100_000
    check_invariants: bool = False
    # "idle": the lane's threads run in Linux's SCHED_IDLE class, on what the decode rows'
    # and the server's threads leave of the cores (ADR 0016); "normal": as every thread.
    lane_priority: str = "idle"
    prefix_cache: bool = True  # keep finished sequences' KV for prompts that start the same
    prefix_cache_tokens: int | None = None  # its most tokens; None: all the KV budget leaves

    def __post_init__(self) -> None:
        for name, low in (("max_running", 1), ("prefill_chunk_size", 1), ("max_waiting", 1),
                          ("trace_capacity", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        check_lane_priority(self.lane_priority)
        for name in ("max_kv_tokens", "prefix_cache_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1 or unset, got {value!r}")
