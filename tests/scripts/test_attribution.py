"""Attribution rules of the admission benchmark, on hand-made runs (no server).

Which actions and rule names a policy has comes from its shipped spec, never from here."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from benchlib.admission import ticks_over_target, work_conserving_limit
from benchlib.attribution import NotComparable, check_attribution, policy_actions
from benchlib.windows import Window, gaps_in, percentile

from tests.lifecycle_names import (
    ADMIT,
    CHUNK_DONE,
    DECODING,
    FINISH,
    FINISHED,
    GRANT,
    PARKED,
    PREFILLING,
    WAITING,
)

CFG = SimpleNamespace(min_quiet_gaps=2)
T_ADMIT, T_FIRST = 10.0, 20.0


def stream(times):
    return SimpleNamespace(times_s=times, error=None, done=True, cancelled=False)


def event(tick, seq, src, dst, trigger, rule):
    return {"tick": tick, "seq": seq, "from": src, "to": dst, "trigger": trigger, "rule": rule}


def make_run(stream_end_tick, chunk_ticks, rule, stream_times):
    trace = [event(100, 2, WAITING, PARKED, ADMIT, "admit")]
    for tick in chunk_ticks:
        trace += [event(tick, 2, PARKED, PREFILLING, GRANT, rule),
                  event(tick, 2, PREFILLING, PARKED, CHUNK_DONE, rule)]
    trace += [event(stream_end_tick, s, DECODING, FINISHED, FINISH, "decode")
              for s in (0, 1)]
    return SimpleNamespace(streams=[stream(stream_times), stream(stream_times)],
                           prompt=SimpleNamespace(error=None, done=True), t_admit=T_ADMIT,
                           t_first=T_FIRST, trace=trace, stream_seqs={0, 1})


def windows(run):
    quiet = [gaps_in(s.times_s, Window(0.0, T_ADMIT)) for s in run.streams]
    adm = [gaps_in(s.times_s, Window(T_ADMIT, T_FIRST), mostly=True) for s in run.streams]
    return quiet, adm


STRADDLING = [1.0, 2.0, 3.0, 9.0, 12.0, 15.0, 21.0, 22.0]


def test_a_comparable_run_counts_the_prompts_chunks():
    run = make_run(300, [110, 120], "grant_due", STRADDLING)
    delta = {"fairtick_prefill_chunks_total": 2, "fairtick_prefill_grants_total": 2,
             'fairtick_ticks_total{action="prefill"}': 2}
    facts = check_attribution(CFG, run, *windows(run), delta, policy_actions("grant_counter"))
    assert (facts.prompt_chunks, facts.contended_chunks) == (2, 2)
    assert facts.grants_by_rule == {"grant_due": 2} and not facts.notes


def test_mixed_steps_under_a_policy_without_a_mixed_rule_are_refused():
    run = make_run(300, [110], "grant_due", STRADDLING)
    delta = {"fairtick_prefill_chunks_total": 1, "fairtick_prefill_grants_total": 1,
             "fairtick_mixed_steps_total": 1, 'fairtick_ticks_total{action="mixed"}': 1}
    with pytest.raises(NotComparable, match="contradict policy grant_counter"):
        check_attribution(CFG, run, *windows(run), delta, policy_actions("grant_counter"))


def test_a_grant_by_a_rule_the_policy_lacks_is_refused():
    run = make_run(300, [110], "mixed", STRADDLING)
    delta = {"fairtick_prefill_chunks_total": 1, "fairtick_prefill_grants_total": 1}
    with pytest.raises(NotComparable, match=r"rule\(s\) \['mixed'\]"):
        check_attribution(CFG, run, *windows(run), delta, policy_actions("grant_counter"))


def test_streams_ending_while_the_prompt_progressed_beside_them_are_too_short():
    run = make_run(300, [110, 400], "grant_due", [1.0, 2.0, 3.0, 9.0, 12.0, 15.0])
    delta = {"fairtick_prefill_chunks_total": 2, "fairtick_prefill_grants_total": 1}
    with pytest.raises(NotComparable, match="too short to straddle"):
        check_attribution(CFG, run, *windows(run), delta, policy_actions("grant_counter"))


def test_a_prompt_that_waits_for_the_batch_to_drain_is_starvation_not_a_refusal():
    run = make_run(300, [301, 302], "prefill_when_idle", [1.0, 2.0, 3.0, 9.0, 12.0, 15.0])
    delta = {"fairtick_prefill_chunks_total": 2, "fairtick_prefill_grants_total": 0,
             'fairtick_ticks_total{action="prefill"}': 2}
    facts = check_attribution(CFG, run, *windows(run), delta, policy_actions("baseline"))
    assert facts.contended_chunks == 0 and "starvation" in facts.notes[0]


def test_no_chunk_progress_is_refused():
    run = make_run(300, [], "grant_due", STRADDLING)
    with pytest.raises(NotComparable, match="no prefill-chunk progress"):
        check_attribution(CFG, run, *windows(run), {}, policy_actions("grant_counter"))


def test_window_attribution_of_edge_gaps():
    times = [0.0, 1.0, 9.5, 10.5, 12.0, 19.9, 30.0]
    assert gaps_in(times, Window(0.0, 10.0)) == [1.0, 8.5]
    # 9.5..10.5 is half inside the admission window: counted; 19.9..30 mostly after: not.
    assert gaps_in(times, Window(10.0, 20.0), mostly=True) == pytest.approx([1.0, 1.5, 7.9])
    # A stall through the whole window (a prefill-first policy) is the window's.
    assert gaps_in([9.9, 20.1], Window(10.0, 20.0), mostly=True) == pytest.approx([10.2])
    assert gaps_in([9.9, 20.1], Window(10.0, 20.0)) == []


def test_percentile_interpolates():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5.0], 95) == 5.0
    assert percentile([], 50) != percentile([], 50)  # NaN


def test_the_work_conserving_limit_leaves_the_prompt_what_decode_does_not_need():
    # Target ITL 4 x 10 ms = 40 ms; a 10 ms step needs a quarter of the machine, so the prompt
    # gets three quarters: TTFT at least 4/3 of alone. A step as long as the target leaves none.
    assert work_conserving_limit(10.0, 10.0) == pytest.approx(4 / 3)
    assert work_conserving_limit(20.0, 10.0) == pytest.approx(2.0)
    assert math.isnan(work_conserving_limit(40.0, 10.0))
    assert math.isnan(work_conserving_limit(float("nan"), 10.0))


def test_ticks_over_target_are_the_histogram_between_two_snapshots():
    name = "fairtick_tick_over_target_ratio"

    def snapshot(mixed: tuple[float, float, float], probe: tuple[float, float, float]):
        # (within 1x, within 1.25x, all) cumulative counts per kind, as /metrics has them
        out = {}
        for kind, (le1, le125, count) in (("mixed", mixed), ("probe", probe)):
            out[f'{name}_bucket{{kind="{kind}",le="1.0"}}'] = le1
            out[f'{name}_bucket{{kind="{kind}",le="1.25"}}'] = le125
            out[f'{name}_count{{kind="{kind}"}}'] = count
        return out

    before = snapshot((50, 58, 60), (3, 4, 4))
    after = snapshot((140, 166, 170), (3, 4, 4))  # 110 mixed ticks: 20 over 1x, 2 over 1.25x
    got = ticks_over_target(before, after)
    assert got["mixed"] == {"ticks": 110, "over_1": pytest.approx(20 / 110),
                            "over_1.25": pytest.approx(2 / 110)}
    assert got["probe"]["ticks"] == 0  # none in the window: no share
    assert math.isnan(got["probe"]["over_1"]) and math.isnan(got["probe"]["over_1.25"])
    assert ticks_over_target({}, {})["mixed"]["ticks"] == 0  # snapshots without the metric
