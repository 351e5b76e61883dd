"""The lifecycle state and trigger names the tests refer to, looked up by role in the loaded
lifecycle spec (specs/lifecycle.yaml): the spec is the one place that names states."""

from __future__ import annotations

from statemachine.lifecycle import Role, Trigger, load_lifecycle

LIFECYCLE = load_lifecycle()

WAITING = LIFECYCLE.state_of[Role.QUEUED]
PARKED = LIFECYCLE.state_of[Role.PARKED]
PREFILLING = LIFECYCLE.state_of[Role.PREFILLING]
DECODING = LIFECYCLE.state_of[Role.DECODING]
PAUSED = LIFECYCLE.state_of[Role.PAUSED]
PREEMPTED = LIFECYCLE.state_of[Role.PREEMPTED]
FINISHED = LIFECYCLE.state_of[Role.FINISHED]
ABORTED = LIFECYCLE.state_of[Role.ABORTED]

ADMIT = Trigger.ADMIT.value
GRANT = Trigger.GRANT.value
CHUNK_DONE = Trigger.CHUNK_DONE.value
FINISH = Trigger.FINISH.value
ABORT = Trigger.ABORT.value
PREEMPT = Trigger.PREEMPT.value
PAUSE = Trigger.PAUSE.value
RESUME = Trigger.RESUME.value
READMIT = Trigger.READMIT.value
FORK = Trigger.FORK.value
