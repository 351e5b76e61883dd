"""A tick's work run so that a fault fails only the requests it belongs to.

`run_isolated` makes one executor call. If it raises, the executor has left every sequence as
it was (runtime/executor.py), and the work runs again in pieces: each prefill slice alone, then
the decode rows together. A piece that fails again fails its sequences; a decode row the
executor names as the fault (`SequenceFault`: its grammar failed) fails alone, and the other
rows step again without it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from runtime.executor import Executor, SequenceFault, SliceWork

Fail = Callable[[int, BaseException], None]  # fails one sequence with the fault


def run_isolated(executor: Executor, fail: Fail, prefills: Sequence[SliceWork] = (),
                 decode: Sequence[int] = ()) -> dict[int, int]:
    """The tokens of every sequence whose work ran; `fail` is called for every other."""
    try:
        return executor.run(prefills, decode)
    except Exception as exc:  # noqa: BLE001
        return _run_apart(executor, fail, list(prefills), list(decode), exc)


def _run_apart(executor: Executor, fail: Fail, prefills: list[SliceWork], decode: list[int],
               exc: Exception) -> dict[int, int]:
    pieces = [([w], []) for w in prefills] + ([([], decode)] if decode else [])
    tokens: dict[int, int] = {}
    for slices, rows in pieces:
        # A lone piece was the whole tick: it failed already.
        error = exc if len(pieces) == 1 else _try_run(executor, slices, rows, tokens)
        while isinstance(error, SequenceFault) and error.seq_id in rows:
            fail(error.seq_id, error)
            rows = [seq_id for seq_id in rows if seq_id != error.seq_id]
            error = _try_run(executor, slices, rows, tokens) if rows else None
        if error is not None:
            for seq_id in [w.seq_id for w in slices] + rows:
                fail(seq_id, error)
    return tokens


def _try_run(executor: Executor, slices: list[SliceWork], rows: list[int],
             tokens: dict[int, int]) -> Exception | None:
    # One executor call whose tokens join `tokens`; the exception it raised, if any.
    try:
        tokens.update(executor.run(slices, rows))
    except Exception as exc:  # noqa: BLE001
        return exc
    return None
