"""The lifecycle state and trigger names that the tests outside tests/statemachine/ refer to,
in one place.

Each is looked up in the loaded lifecycle spec (specs/lifecycle.yaml): a state or trigger that
the spec no longer declares fails here, by name, instead of as a puzzling mismatch deep inside a
test. When the spec declares roles, these become look-ups by role.
"""

from __future__ import annotations

from statemachine.lifecycle import load_lifecycle

LIFECYCLE = load_lifecycle()
_TRIGGERS = frozenset(edge.trigger for edge in LIFECYCLE.edges)


def _state(name: str) -> str:
    if name not in LIFECYCLE.states:
        raise LookupError(f"the tests expect a lifecycle state {name!r}; {LIFECYCLE.file} "
                          f"declares {', '.join(LIFECYCLE.states)}")
    return name


def _trigger(name: str) -> str:
    if name not in _TRIGGERS:
        raise LookupError(f"the tests expect a lifecycle trigger {name!r}; {LIFECYCLE.file} "
                          f"declares {', '.join(sorted(_TRIGGERS))}")
    return name


WAITING = LIFECYCLE.initial
PARKED = _state("parked_prefill")
PREFILLING = _state("prefilling")
DECODING = _state("decoding")
FINISHED = _state("finished")
ABORTED = _state("aborted")

ADMIT = _trigger("admit")
GRANT = _trigger("grant")
CHUNK_DONE = _trigger("chunk_done")
FINISH = _trigger("finish")
ABORT = _trigger("abort")
