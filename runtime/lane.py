"""A prefill lane (ADR 0016): a thread that runs a lane tick's prompt slices while the engine
thread steps the decode rows beside them.

MLX runs each thread's graph on that thread's own streams and cannot evaluate on one thread
what was left lazy on another's; the executor keeps a prefill-only tick to its own sequences'
state (runtime/executor.py), and the lane runs it `layer_by_layer` (runtime/fused.py), since
MLX caps the tasks queued by all threads together and a forward with its layers queued held
the engine thread's decode steps behind the prompt's attention. The thread warms its compiled
kernels before the engine's first tick and frees its streams when it closes.

With priority "idle" (the default) the lane's thread puts itself in Linux's SCHED_IDLE class
before it makes its streams, whose worker threads inherit the class: the prompt's work runs on
what the decode rows' threads and the server's leave of the cores, and a row's step due while
the lane computes takes a core at once instead of sharing it with the lane's workers. In the
admission scenario (4 streams, a 10,000-token prompt, 12 runs each, alternated) the streams'
p99 gap fell from 2.77-4.55x their own p95 to 2.47-3.35x and their worst from 3.64-6.98x to
2.82-4.71x, the prompt's TTFT / alone no higher (median 1.39 against 1.46; ADR 0016,
twenty-fifth session). The price: while other processes keep every core busy, the lane waits
for them (`--lane-priority normal` on such a machine).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from runtime import kernels
from runtime.engine_config import check_lane_priority
from runtime.fused import layer_by_layer


def run_when_idle() -> str | None:
    """Put the calling thread in Linux's SCHED_IDLE class (threads it starts from now on
    inherit it). None once done, else why it could not be."""
    if not hasattr(os, "SCHED_IDLE"):
        return "this system has no SCHED_IDLE"
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except OSError as exc:  # e.g. a sandbox that forbids the call
        return f"sched_setscheduler refused it: {exc}"
    return None


class LaneJob:
    """One job on the lane: `done` is set once it returned or raised."""

    def __init__(self, work: Callable[[], Any]) -> None:
        self.work = work
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with layer_by_layer():
                self.result = self.work()
        except BaseException as exc:  # noqa: BLE001 - handed to the engine thread
            self.error = exc
        finally:
            self.done.set()


class PrefillLane:
    """The lane's thread; `submit` a job, `close` when the engine stops."""

    def __init__(self, priority: str = "idle") -> None:
        """Start the lane's thread at `priority` (runtime.engine_config.LANE_PRIORITIES); raises
        (RuntimeError) if it could not warm its kernels, so that the engine fails at start
        rather than waiting for ever on a lane with no thread."""
        # What the thread runs at: the priority asked for, or "normal (why)" where the system
        # refused "idle".
        self.priority = check_lane_priority(priority)
        self._jobs: queue.Queue[LaneJob | None] = queue.Queue()
        self._failed: BaseException | None = None
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready, priority),
                                        name="prefill-lane", daemon=True)
        self._thread.start()
        ready.wait()
        if self._failed is not None:
            self._thread.join()
            raise RuntimeError(f"the prefill lane could not start: {self._failed!r}") \
                from self._failed

    def _run(self, ready: threading.Event, priority: str) -> None:
        try:
            try:
                # Before any stream is made: MLX's worker threads for them inherit the class.
                why = run_when_idle() if priority == "idle" else None
                if why is not None:
                    self.priority = f"normal ({why})"
                kernels.warm_up()  # MLX keeps compiled functions per thread
            except BaseException as exc:  # noqa: BLE001 - raised again by __init__
                self._failed = exc
                return
            finally:
                ready.set()
            while (job := self._jobs.get()) is not None:
                job.run()
        finally:
            mx.clear_streams()  # a thread's streams are freed by that thread

    def submit(self, work: Callable[[], Any]) -> LaneJob:
        job = LaneJob(work)
        self._jobs.put(job)
        return job

    def tick(self, slices: Callable[[], Any], step: Callable[[list[int]], list[int]],
             rows: list[int], period_s: float, room: int,
             last_step_s: float) -> tuple[LaneJob, int, float]:
        """A lane tick (ADR 0016): `slices` runs on the lane while this thread calls `step` on
        the decode rows (it returns the rows that go on), a step beginning at most once every
        `period_s` after the last began (`last_step_s`, carried across ticks, on the
        `time.perf_counter` clock), at least once while rows are left, and at most `room` more
        times; the tick ends when the slices are done. Returns their finished job, the steps
        taken, and when the last began."""
        job, steps = self.submit(slices), 0
        while rows and steps <= room:
            wait = last_step_s + period_s - time.perf_counter()
            if steps and (job.done.is_set() or (wait > 0 and job.done.wait(wait))):
                break  # the slices are done: the tick ends
            if wait > 0 and not steps:
                time.sleep(wait)  # the tick's one step, in its time
            last_step_s = time.perf_counter()
            rows = step(rows)
            steps += 1
        job.done.wait()
        return job, steps, last_step_s

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()
