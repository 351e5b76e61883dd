"""Policy parameters on the command line: the flags and FAIRTICK_* variables a spec declares.

Precedence for each parameter: its flag, then its environment variable, then the spec default.
Every value is checked by the spec's own `ParameterSpec.validate` (type and range).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from statemachine.spec import PolicySpec


def flag_dest(name: str) -> str:
    return f"policy_{name}"


def add_policy_flags(parser: argparse.ArgumentParser, spec: PolicySpec) -> None:
    """One option per parameter of `spec`, in a group named after the policy."""
    group = parser.add_argument_group(
        f"parameters of policy {spec.name!r}",
        f"{spec.doc}\nEach flag overrides its environment variable, which overrides the default.",
    )
    for p in spec.parameters:
        group.add_argument(
            p.flag, dest=flag_dest(p.name), default=None, metavar="N",
            help=f"{p.doc} (default {p.default}, range [{p.minimum}, {p.maximum}], env {p.env})",
        )


def resolve_policy_params(
    spec: PolicySpec, flags: Mapping[str, Any], environ: Mapping[str, str]
) -> dict[str, int | float]:
    """The value of every parameter of `spec`: flag, else env, else default; ValueError if bad."""
    values: dict[str, int | float] = {}
    for p in spec.parameters:
        text = flags.get(flag_dest(p.name))
        origin = p.flag
        if text is None and p.env in environ:
            text, origin = environ[p.env], p.env
        if text is None:
            values[p.name] = p.default
            continue
        values[p.name] = p.validate(_number(text, origin), f"{origin} (policy {spec.name})")
    return values


def _number(text: str, origin: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{origin}: expected a number, got {text!r}") from None
