"""The KV token budget: how many tokens of keys and values fit in this machine's memory.

By default a fraction of the memory available at start-up, divided by what one token of the
model's KV cache takes (measured on the model itself, so any architecture and dtype counts
right). `--max-kv-tokens` overrides it. The scheduler accounts tokens as they are used against
this budget (statemachine.world). The memory really held runs above the count: a prompt's
cache holds its whole prompt from its first slice, and each of the decode batch's groups is
padded to its longest row and grows by half its capacity (at most 2,048 positions a row:
runtime/decode_batch.py; a long prompt joining short rows forms a group of its own, so they are
not padded to it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

DEFAULT_MEMORY_FRACTION = 0.5  # of the memory available at start-up; the rest for the rest


@dataclass(frozen=True)
class KvBudget:
    """The budget and where it came from."""

    tokens: int
    bytes_per_token: int
    available_bytes: int | None  # None: set by the operator, not sized from memory

    def describe(self) -> str:
        gib = self.tokens * self.bytes_per_token / 2**30
        if self.available_bytes is None:
            return (f"{self.tokens:,} tokens ({gib:.2f} GiB at {self.bytes_per_token:,} bytes a "
                    "token; --max-kv-tokens)")
        return (f"{self.tokens:,} tokens ({gib:.2f} GiB: {DEFAULT_MEMORY_FRACTION:.0%} of "
                f"{self.available_bytes / 2**30:.1f} GiB available, at "
                f"{self.bytes_per_token:,} bytes a token; --max-kv-tokens overrides)")


_MEASURE_TOKENS = 256  # mlx-lm grows caches in steps of 256 tokens: one full step


def kv_bytes_per_token(model: Any) -> int:
    """Bytes one token takes in the model's KV cache, measured on one full cache step."""
    cache = make_prompt_cache(model)
    model(mx.zeros((1, _MEASURE_TOKENS), dtype=mx.int32), cache=cache)
    arrays = [a for _, a in tree_flatten([c.state for c in cache]) if isinstance(a, mx.array)]
    mx.eval(arrays)
    return max(1, sum(int(a.nbytes) for a in arrays) // _MEASURE_TOKENS)


def available_memory_bytes(meminfo: Path = Path("/proc/meminfo")) -> int:
    """Memory the kernel says is available now (Linux), else the machine's physical memory."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))


def make_kv_budget(model: Any, max_kv_tokens: int | None) -> KvBudget:
    """The operator's budget, or one sized from the memory available now."""
    per_token = kv_bytes_per_token(model)
    if max_kv_tokens is not None:
        return KvBudget(max_kv_tokens, per_token, None)
    available = available_memory_bytes()
    return KvBudget(max(1, int(available * DEFAULT_MEMORY_FRACTION) // per_token), per_token,
                    available)
