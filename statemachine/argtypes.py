"""argparse types for the command line's counts and durations: a value out of range is a usage
error naming the flag (exit 2), not a traceback or a failure deep in the work it starts."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def integer_at_least(least: int) -> Callable[[str], int]:
    """An integer >= `least`."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {least}, got {text!r}") \
                from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be >= {least}, got {value}")
        return value
    return parse


def seconds(allow_zero: bool) -> Callable[[str], float]:
    """A finite number of seconds, > 0 (or >= 0 with `allow_zero`)."""
    bound = ">= 0" if allow_zero else "> 0"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected seconds {bound}, got {text!r}") \
                from None
        if not (math.isfinite(value) and (value >= 0 if allow_zero else value > 0)):
            raise argparse.ArgumentTypeError(f"must be a finite number of seconds {bound}, "
                                             f"got {text}")
        return value
    return parse
