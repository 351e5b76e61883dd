"""The trace log's ring buffer, read incrementally: each transition once, in order, with wait
runs left out, also after the buffer has dropped its oldest events; and what it holds is out
of the garbage collector's walk."""

import gc

from statemachine.trace import TickRecord, TraceEvent, TraceLog


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


def test_a_full_buffer_gives_the_collector_nothing_to_walk():
    # A full collection walks every object the collector tracks, with every thread stopped: the
    # buffer's events and tick records must not be among them, however many it holds.
    log = TraceLog(capacity=5_000)
    gc.collect()
    before = len(gc.get_objects())
    for tick in range(10_000):  # twice the capacity: the dropped ones are freed too
        log.record(TraceEvent(tick, tick % 7, "decoding", "finished", "finish", "decode",
                              time=float(tick), request_id=f"req-{tick}", role="done"))
        log.tick(TickRecord(tick, float(tick), 0.002, "decode", "decode", 4, 0, 1000 + tick))
    gc.collect()
    assert len(gc.get_objects()) - before < 100
    # ... and it reads back what was recorded.
    assert log.ticks(9_999) == [TickRecord(9_999, 9_999.0, 0.002, "decode", "decode", 4, 0,
                                           10_999)]
    last = log.events(since_tick=9_999)
    assert [(e["seq"], e["request_id"], e["to"], e["role"]) for e in last] == \
        [(9_999 % 7, "req-9999", "finished", "done")]
