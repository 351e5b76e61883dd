"""The trace log's ring buffer, read incrementally: each transition once, in order, with wait
runs left out, also after the buffer has dropped its oldest events."""

from statemachine.trace import TraceEvent, TraceLog


def transition(seq: int, src: str, dst: str) -> TraceEvent:
    return TraceEvent(seq, seq, src, dst, "step", "rule", time=float(seq))


def test_transitions_are_read_once_each_and_wait_runs_are_left_out():
    log = TraceLog(capacity=100)
    log.record(transition(0, "queued", "prefilling"))
    log.waited(0, None, "prefilling", "parked", "rule", 1, 1.0)
    log.record(transition(1, "prefilling", "decoding"))
    first, start = log.transitions()
    assert [(e.src, e.dst) for e in first] == [("queued", "prefilling"),
                                               ("prefilling", "decoding")]
    assert start == 3  # two transitions and the wait run
    log.record(transition(2, "decoding", "finished"))
    later, start = log.transitions(start)
    assert [(e.src, e.dst) for e in later] == [("decoding", "finished")]
    assert log.transitions(start) == ([], start)


def test_a_reader_behind_the_ring_buffer_gets_what_it_still_holds():
    log = TraceLog(capacity=2)
    for seq in range(5):
        log.record(transition(seq, f"s{seq}", f"s{seq + 1}"))
    held, start = log.transitions(1)  # events 1 and 2 are gone already
    assert [e.seq for e in held] == [3, 4] and start == 5
