"""Tests for pipe.schedules: exact small schedules, validity over grids, the validator's errors."""

from __future__ import annotations

import re

import pytest

from pipe.schedules import (
    SCHEDULES,
    Action,
    Schedule,
    ScheduleError,
    build,
    default_stages_per_rank,
    default_stages_text,
    dependencies,
    execution_order,
    grid,
    in_flight_limit,
    max_in_flight,
    placement,
    register,
    validate,
)
from pipe.simulate import simulate, textbook_bubble

V_CHOICES = {"gpipe": (1, 2, 3), "1f1b": (1,), "1f1b-overlap": (1,), "interleaved-1f1b": (1, 2, 3), "zb-h1": (1,),
             "zbv": (2,), "looped-bfs": (1, 2, 3), "interleaved-zb": (1, 2, 3), "dualpipev": (2,)}
ZERO_BUBBLE = ("zb-h1", "zbv", "interleaved-zb", "dualpipev")


def grid_cases() -> list[tuple[str, int, int, int]]:
    """(name, n_ranks, n_microbatches, stages_per_rank) for every allowed point of the grid."""
    cases = []
    for name, vs in V_CHOICES.items():
        for r in range(1, 5):
            for m in range(1, 9):
                if name in ("interleaved-1f1b", "interleaved-zb") and m % r or name == "dualpipev" and m < 2 * r:
                    continue
                cases += [(name, r, m, v) for v in vs]
    return cases


def parse(text: str) -> Schedule:
    """One line per rank, actions separated by spaces."""
    lines = text.strip().splitlines()
    return {r: [Action.from_str(t) for t in line.split()] for r, line in enumerate(lines)}


def test_action_prints_and_parses() -> None:
    assert str(Action(2, "F", 0)) == "2F0"
    assert Action.from_str("2F0") == Action(2, "F", 0)
    assert Action.from_str("12B3") == Action(12, "B", 3)
    assert Action.from_str("3W105") == Action(3, "W", 105)
    for a in (Action(0, "F", 0), Action(10, "W", 11), Action(7, "B", 123)):
        assert Action.from_str(str(a)) == a


@pytest.mark.parametrize("text", ["", "2X0", "F0", "2F", "-1F0", "2f0", " 2F0", "2F0 1B0", "2 F 0"])
def test_action_parse_error_names_text_and_form(text: str) -> None:
    with pytest.raises(ValueError, match=re.escape("expected '{stage}{kind}{mb}'")) as err:
        Action.from_str(text)
    assert repr(text) in str(err.value)


EXPECTED = {
    ("gpipe", 2, 3): """
        0F0 0F1 0F2 0B0 0B1 0B2
        1F0 1F1 1F2 1B0 1B1 1B2
    """,
    ("1f1b", 2, 4): """
        0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3
        1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3
    """,
    ("1f1b", 4, 4): """
        0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3
        1F0 1F1 1F2 1B0 1F3 1B1 1B2 1B3
        2F0 2F1 2B0 2F2 2B1 2F3 2B2 2B3
        3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3
    """,
    # One more warm-up forward than 1F1B on every stage but the last.
    ("1f1b-overlap", 2, 4): """
        0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3
        1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3
    """,
    ("1f1b-overlap", 3, 4): """
        0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3
        1F0 1F1 1F2 1B0 1F3 1B1 1B2 1B3
        2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3
    """,
    # Stage s holds back its first s W, so each W trails its B by s microbatches.
    ("zb-h1", 2, 4): """
        0F0 0F1 0B0 0W0 0F2 0B1 0W1 0F3 0B2 0W2 0B3 0W3
        1F0 1B0 1F1 1B1 1W0 1F2 1B2 1W1 1F3 1B3 1W2 1W3
    """,
    ("zb-h1", 3, 4): """
        0F0 0F1 0F2 0B0 0W0 0F3 0B1 0W1 0B2 0W2 0B3 0W3
        1F0 1F1 1B0 1F2 1B1 1W0 1F3 1B2 1W1 1B3 1W2 1W3
        2F0 2B0 2F1 2B1 2F2 2B2 2W0 2F3 2B3 2W1 2W2 2W3
    """,
}

# Interleaved, R=2, v=2, M=4: stages 0,2 on rank 0 and 1,3 on rank 1. Warm-up is
# (v-1)*R + 2*(R-1-r) = 4 and 2 forwards; mbs go in groups of R=2 through chunk 0 then 1.
INTERLEAVED_2x2x4 = """
    0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3
    1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3
"""

# ZB-V, R=2, M=2: stages 0 and 3 on rank 0, 1 and 2 on rank 1 (the V); W fill the drain.
ZBV_2x2 = """
    0F0 0F1 3F0 3B0 3F1 3B1 0B0 3W0 0B1 0W0 3W1 0W1
    1F0 2F0 1F1 2F1 2B0 1B0 2B1 1B1 2W0 1W0 2W1 1W1
"""

# DualPipeV, R=2, M=4, read off its phases (see dualpipev). Rank 0 (stages 0 and 3): 2 F chunk 0;
# F0 F1; B1 with its W deferred and popped at once, F1; one F0 B1 F1 B0; one B1 F1 B0; phase 6 defers
# the chunk 0 B's W (rank 0 is even); W, B0 with W deferred; the last deferred W.
DUALPIPEV_2x4 = """
    0F0 0F1 0F2 3F0 3B0 3W0 3F1 0F3 3B1 3W1 3F2 0B0 0W0 3B2 3W2 3F3 0B1 0W1 3B3 3W3 0B2 0W2 0B3 0W3
    1F0 2F0 1F1 2F1 1F2 2B0 2W0 2F2 1B0 1W0 1F3 2B1 2W1 2F3 1B1 1W1 2B2 2W2 1B2 1W2 2B3 1B3 2W3 1W3
"""

# Interleaved zero bubble, R=2, v=2, M=4: interleaved 1F1B's F and B (above) in their order, each W
# deferred until the rank's next F or B is not ready, or R=2 W wait (rank 1: 3B1 then 3W0).
INTERLEAVED_ZB_2x2x4 = """
    0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2W0 2F2 0B0 2W1 2F3 0B1 0W0 0W1 2B2 2W2 2B3 2W3 0B2 0W2 0B3 0W3
    1F0 1F1 3F0 3B0 3F1 3B1 3W0 1F2 1B0 3W1 1F3 1B1 1W0 3F2 3B2 1W1 3F3 3B3 3W2 1B2 3W3 1B3 1W2 1W3
"""

GPIPE_LOOPED_2x2x2 = """
    0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1
    1F0 1F1 3F0 3F1 3B0 3B1 1B0 1B1
"""


@pytest.mark.parametrize("key", list(EXPECTED))
def test_exact_small_schedules(key: tuple[str, int, int]) -> None:
    name, r, m = key
    assert build(name, r, m) == parse(EXPECTED[key])


def test_exact_interleaved_and_looped_gpipe() -> None:
    assert build("interleaved-1f1b", 2, 4, 2) == parse(INTERLEAVED_2x2x4)
    assert build("gpipe", 2, 2, 2) == parse(GPIPE_LOOPED_2x2x2)
    assert build("zbv", 2, 2, 2) == parse(ZBV_2x2)
    assert build("looped-bfs", 2, 2, 2) == parse(GPIPE_LOOPED_2x2x2)


def test_exact_dualpipev_and_interleaved_zb() -> None:
    assert build("dualpipev", 2, 4, 2) == parse(DUALPIPEV_2x4)
    assert build("interleaved-zb", 2, 4, 2) == parse(INTERLEAVED_ZB_2x2x4)


def _alive(actions: list[Action], closer: str) -> int:
    """Peak (stage, mb) pairs alive on one rank: F opens one, `closer` closes it."""
    n = peak = 0
    for a in actions:
        n += 1 if a.kind == "F" else -1 if a.kind == closer else 0
        peak = max(peak, n)
    return peak


def test_interleaved_zb_and_dualpipev_idle_only_at_the_start_up() -> None:
    """With T_F = T_B = T_W each rank works 3vM units and the first microbatch reaches the last rank
    after R-1: both schedules end at exactly 3vM + R - 1 (textbook_bubble's bound), against
    interleaved 1F1B's (R-1)/(vM+R-1). Memory: interleaved-zb holds at most R more (stage, mb) pairs per
    rank (F to W) than interleaved 1F1B (F to B); DualPipeV 2R+1 of its half-size stages."""
    for r in range(1, 5):
        for m in range(1, 17):
            for name, v in [("interleaved-zb", v) for v in (1, 2, 3) if m % r == 0] + [("dualpipev", 2)] * (m >= 2 * r):
                schedule, place = build(name, r, m, v), placement(name, r * v, r)
                ones = [1.0] * (r * v)
                tl = simulate(schedule, f_ms=ones, b_ms=ones, w_ms=ones, place=place)
                assert tl.makespan == 3 * v * m + r - 1, (name, r, m, v)
                assert tl.bubble == pytest.approx(textbook_bubble(name, r * v, m, v))
                if name == "dualpipev":
                    assert max(_alive(acts, "W") for acts in schedule.values()) == 2 * r + 1
                else:
                    base = build("interleaved-1f1b", r, m, v)
                    for rank in range(r):
                        assert _alive(schedule[rank], "W") <= _alive(base[rank], "B") + r
                    one = simulate(base, f_ms=ones, b_ms=[2.0] * (r * v))  # B + W as one backward
                    assert tl.bubble <= one.bubble + 1e-12
    assert placement("dualpipev", 4, 2) == [0, 1, 1, 0]
    assert default_stages_per_rank("dualpipev") == default_stages_per_rank("interleaved-zb") == 2
    assert default_stages_text() == "2 for dualpipev, interleaved-1f1b, interleaved-zb, looped-bfs and zbv, else 1"


@pytest.mark.parametrize("case", grid_cases(), ids=lambda c: "-".join(map(str, c)))
def test_every_schedule_validates(case: tuple[str, int, int, int]) -> None:
    name, r, m, v = case
    schedule = build(name, r, m, v)
    place = placement(name, r * v, r)
    validate(schedule, r * v, m, place)
    n_actions = sum(len(a) for a in schedule.values())
    assert n_actions == r * v * m * (3 if name in ZERO_BUBBLE else 2)
    assert len(execution_order(schedule, r * v, m, place)) == n_actions
    for s in range(r * v):
        assert in_flight_limit(name, r * v, m, s, v) == max_in_flight(schedule, s)


def test_in_flight_closed_forms() -> None:
    for s in range(4):
        assert in_flight_limit("gpipe", 4, 6, s) == 6
        assert in_flight_limit("1f1b", 4, 6, s) == 4 - s
        assert in_flight_limit("1f1b", 4, 2, s) == min(2, 4 - s)
    assert [in_flight_limit("interleaved-1f1b", 4, 4, s, 2) for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight_limit("1f1b-overlap", 4, 8, s) for s in range(4)] == [5, 4, 3, 1]
    assert [in_flight_limit("1f1b-overlap", 4, 3, s) for s in range(4)] == [3, 3, 3, 1]
    for r in range(1, 6):  # the closed form is what the built schedule keeps
        for m in range(1, 9):
            built = build("1f1b-overlap", r, m)
            assert [max_in_flight(built, s) for s in range(r)] == [in_flight_limit("1f1b-overlap", r, m, s)
                                                                  for s in range(r)]


def test_zb_h1_in_flight_is_1f1b_peak() -> None:
    """F to W: every stage holds min(M, S), the 1F1B first stage's count, never more."""
    for r in range(1, 5):
        for m in range(1, 9):
            zb, ofob = build("zb-h1", r, m), build("1f1b", r, m)
            peak_1f1b = max(max_in_flight(ofob, s) for s in range(r))
            assert peak_1f1b == min(m, r)
            assert [max_in_flight(zb, s) for s in range(r)] == [peak_1f1b] * r


def test_a_fused_backward_closes_each_microbatch_at_its_b() -> None:
    """Compiled stages run each backward as one BW at its B (found by review: zb-h1's hold of the activations
    until W was counted for them, its last stage predicted 36% over the measured): zb-h1's B are 1F1B's."""
    for r in range(1, 5):
        for m in range(1, 9):
            assert [in_flight_limit("zb-h1", r, m, s, fused=True) for s in range(r)] == \
                [in_flight_limit("1f1b", r, m, s) for s in range(r)]
            assert [in_flight_limit("1f1b", r, m, s, fused=True) for s in range(r)] == \
                [in_flight_limit("1f1b", r, m, s) for s in range(r)]


def test_zbv_keeps_1f1b_memory_and_fills_the_drain() -> None:
    """At most 2R (stage, mb) pairs alive per rank (half-size stages: 1F1B's first-rank activations);
    with equal F, B, W the step is within R units of 6M + R - 1 (only the start-up idle) for
    M >= 2R, and its bubble is never above ZB-H1's on the same ranks and work."""
    for r in range(1, 5):
        for m in range(2 * r, 17):
            schedule, place = build("zbv", r, m, 2), placement("zbv", 2 * r, r)
            for acts in schedule.values():
                alive = [sum(1 if a.kind == "F" else -1 if a.kind == "W" else 0 for a in acts[:i + 1])
                         for i in range(len(acts))]
                assert max(alive) <= 2 * r
            ones = [1.0] * (2 * r)
            tl = simulate(schedule, f_ms=ones, b_ms=ones, w_ms=ones, place=place)
            assert 6 * m + r - 1 <= tl.makespan <= 6 * m + 2 * r - 1, (r, m, tl.makespan)
            assert tl.bubble >= textbook_bubble("zbv", 2 * r, m, 2) - 1e-12  # the start-up bound
            twos = [2.0] * r  # a stage of ZB-H1 is two of ZB-V's
            zb = simulate(build("zb-h1", r, m), f_ms=twos, b_ms=twos, w_ms=twos)
            assert tl.bubble <= zb.bubble + 1e-12, (r, m)
            if (r, m) == (4, 16):
                assert tl.bubble < 0.7 * zb.bubble  # 0.040 against 0.059
    assert placement("zbv", 6, 3) == [0, 1, 2, 2, 1, 0]
    with pytest.raises(ScheduleError, match="exactly two stages per rank"):
        build("zbv", 2, 4, 3)


def test_dependencies_rule() -> None:
    assert dependencies(Action(0, "F", 3), 4) == []
    assert dependencies(Action(2, "F", 3), 4) == [Action(1, "F", 3)]
    assert dependencies(Action(3, "B", 1), 4) == [Action(3, "F", 1)]
    assert dependencies(Action(1, "B", 1), 4) == [Action(1, "F", 1), Action(2, "B", 1)]
    assert dependencies(Action(1, "W", 1), 4) == [Action(1, "B", 1)]


def test_grid_layout_and_mark() -> None:
    text = grid(parse("0F0 0F1 0B0 0B1\n1F0 1B0 1F10 1B10"), mark={(1, 2)})
    assert text.splitlines()[:3] == [
        "step   | 0     1     2     3",
        "rank 0 | 0F0   0F1   0B0   0B1",
        "rank 1 | 1F0   1B0  [1F10] 1B10",
    ]
    assert text.splitlines()[3].startswith("legend:")


def invalid(schedule: Schedule, n_stages: int, n_microbatches: int) -> str:
    with pytest.raises(ScheduleError) as err:
        validate(schedule, n_stages, n_microbatches)
    return str(err.value)


def test_validate_reports_missing_action() -> None:
    schedule = build("1f1b", 2, 4)
    schedule[1].remove(Action(1, "B", 3))
    message = invalid(schedule, 2, 4)
    assert "missing 1B3" in message
    assert "rank 1 | 1F0  1B0  1F1" in message


def test_validate_reports_duplicate_with_mark() -> None:
    schedule = build("1f1b", 2, 4)
    schedule[0].append(Action(0, "F", 1))
    message = invalid(schedule, 2, 4)
    assert "rank 0 step 8: 0F1 is a duplicate of rank 0 step 1" in message
    assert "rank 0 | 0F0  0F1  0B0  0F2  0B1  0F3  0B2  0B3 [0F1]" in message


def test_validate_reports_wrong_rank_with_mark() -> None:
    schedule = build("1f1b", 2, 2)
    schedule[1].remove(Action(1, "F", 1))
    schedule[0].insert(0, Action(1, "F", 1))
    message = invalid(schedule, 2, 2)
    assert "1F1 is on the wrong rank: stage 1 lives on rank 1" in message
    assert "rank 0 |[1F1] 0F0" in message


def test_validate_reports_w_on_some_mbs_only() -> None:
    schedule = build("zb-h1", 2, 2)
    schedule[0].remove(Action(0, "W", 1))
    assert "missing 0W1" in invalid(schedule, 2, 2)


def test_validate_reports_deadlock_with_blocked_actions_marked() -> None:
    schedule = build("1f1b", 2, 4)
    r1 = schedule[1]
    r1[0], r1[1] = r1[1], r1[0]  # 1B0 before its own 1F0
    message = invalid(schedule, 2, 4)
    assert message.startswith("deadlock")
    assert "rank 1 step 0: 1B0 waits for 1F0 (rank 1 step 1)" in message
    assert "rank 0 step 2: 0B0 waits for 1B0 (rank 1 step 0)" in message
    assert "rank 0 | 0F0  0F1 [0B0] 0F2" in message
    assert "rank 1 |[1B0] 1F0  1F1" in message


def test_validate_reports_cross_rank_deadlock() -> None:
    schedule = parse("0F0 0B1 0F1 0B0\n1F1 1B1 1F0 1B0")
    message = invalid(schedule, 2, 2)
    assert "rank 0 |[0B1]" not in message  # rank 0 first runs 0F0, then blocks on 0B1
    assert "rank 0 | 0F0 [0B1] 0F1" in message
    assert "rank 1 |[1F1] 1B1" in message


def test_unknown_name_lists_known_schedules() -> None:
    with pytest.raises(ScheduleError, match="unknown schedule 'pipedream'") as err:
        build("pipedream", 2, 4)
    for name in ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1"):
        assert name in str(err.value)


def test_size_errors_name_values_and_fix() -> None:
    with pytest.raises(ScheduleError, match=r"M=0.*at least one microbatch"):
        build("1f1b", 2, 0)
    with pytest.raises(ScheduleError, match=r"M=6, R=4.*multiple of 4, e.g. M=8"):
        build("interleaved-1f1b", 4, 6, 2)
    with pytest.raises(ScheduleError, match=r"stages_per_rank=2.*interleaved-1f1b"):
        build("1f1b", 2, 4, 2)
    with pytest.raises(ScheduleError, match="stages_per_rank=3"):
        build("zb-h1", 2, 4, 3)
    with pytest.raises(ValueError, match="R=0"):
        build("gpipe", 0, 4)
    with pytest.raises(ScheduleError, match=r"dualpipev needs at least two microbatches per rank.*M=5, R=3.*M >= 6"):
        build("dualpipev", 3, 5, 2)
    with pytest.raises(ScheduleError, match=r"dualpipev runs exactly two stages per rank.*stages_per_rank=3"):
        build("dualpipev", 2, 8, 3)
    with pytest.raises(ScheduleError, match=r"interleaved-zb needs n_microbatches divisible.*e.g. M=4"):
        build("interleaved-zb", 2, 3, 2)


def test_register_adds_a_schedule_as_one_function() -> None:
    @register("test-reversed-gpipe")
    def reversed_gpipe(n_ranks: int, n_microbatches: int, stages_per_rank: int = 1) -> Schedule:
        schedule = build("gpipe", n_ranks, n_microbatches, stages_per_rank)
        return {r: [a for a in acts if a.kind == "F"] + [a for a in acts if a.kind == "B"][::-1]
                for r, acts in schedule.items()}

    try:
        schedule = build("test-reversed-gpipe", 3, 2)
        validate(schedule, 3, 2)
        assert in_flight_limit("test-reversed-gpipe", 3, 2, 0) == 2
        with pytest.raises(ValueError, match="already registered"):
            register("test-reversed-gpipe")(reversed_gpipe)
    finally:
        SCHEDULES.pop("test-reversed-gpipe")
