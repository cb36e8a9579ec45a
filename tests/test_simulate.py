"""Tests for pipe.simulate: bubbles against the textbook, communication, traces and pictures."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from pipe.schedules import Action, ScheduleError, build
from pipe.simulate import Event, Timeline, simulate, textbook_bubble


def equal_costs(name: str, r: int, m: int, v: int = 1, w: float | None = None) -> Timeline:
    n = r * v
    w_ms = None if w is None else [w] * n
    return simulate(build(name, r, m, v), f_ms=[1.0] * n, b_ms=[1.0] * n, w_ms=w_ms)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_equal_costs_match_textbook(name: str) -> None:
    for s in range(1, 5):
        for m in range(1, 9):
            tl = equal_costs(name, s, m)
            assert tl.makespan == pytest.approx((m + s - 1) * 2.0)
            assert tl.bubble == pytest.approx((s - 1) / (m + s - 1))
            assert tl.bubble == pytest.approx(textbook_bubble(name, s, m))
            uneven = simulate(build(name, s, m), f_ms=[1.0] * s, b_ms=[2.5] * s)
            assert uneven.makespan == pytest.approx((m + s - 1) * 3.5)


def test_full_backward_takes_b_plus_w_without_w_actions() -> None:
    tl = simulate(build("1f1b", 3, 4), f_ms=[1.0] * 3, b_ms=[1.0] * 3, w_ms=[0.5] * 3)
    assert tl.makespan == pytest.approx((4 + 3 - 1) * 2.5)


def test_interleaved_exact_small_case() -> None:
    # R=2, v=2, M=4, every chunk f=b=1: 16 busy units per rank, 2 idle -> (R-1)/(vM+R-1).
    tl = equal_costs("interleaved-1f1b", 2, 4, v=2)
    assert tl.makespan == pytest.approx(18.0)
    assert [tl.idle(r) for r in range(2)] == [pytest.approx(2.0)] * 2
    assert tl.bubble == pytest.approx(1 / 9)
    assert textbook_bubble("interleaved-1f1b", 4, 4, 2) == pytest.approx(1 / 9)


def test_interleaved_at_or_below_textbook() -> None:
    for r in range(1, 5):
        for v in (1, 2, 3):
            for m in range(r, 9, r):
                bubble = equal_costs("interleaved-1f1b", r, m, v).bubble
                assert bubble <= textbook_bubble("interleaved-1f1b", r * v, m, v) + 1e-12


def test_zb_h1_bubble_is_a_third_of_1f1b() -> None:
    for s in range(2, 5):
        for m in range(1, 9):
            zb = equal_costs("zb-h1", s, m, w=1.0)
            ofob = equal_costs("1f1b", s, m, w=1.0)  # B = b + w = 2 units
            assert zb.bubble < ofob.bubble
            if m >= s:  # the paper's (S-1)(F+B-W) bubble against M(F+B+W) of work
                assert zb.makespan == pytest.approx(3 * m + s - 1)
                assert zb.bubble == pytest.approx(textbook_bubble("zb-h1", s, m))
                assert zb.bubble == pytest.approx((s - 1) / (3 * m + s - 1))


def test_comm_two_stages_by_hand() -> None:
    # 1f1b, 2 stages, 2 mbs, f=b=1, 0.5 ms per hop. rank 0: F0 [0,1] F1 [1,2];
    # rank 1: F0 [1.5,2.5] B0 [2.5,3.5] F1 [3.5,4.5] B1 [4.5,5.5];
    # rank 0: B0 [4,5] B1 [6,7]. Makespan 7 = 6 without comm + one hop each way.
    tl = simulate(build("1f1b", 2, 2), f_ms=[1, 1], b_ms=[1, 1], comm_ms=[0.5])
    times = {(e.rank, str(e.action)): (e.start, e.end) for e in tl.events}
    assert times == {
        (0, "0F0"): (0.0, 1.0), (0, "0F1"): (1.0, 2.0), (0, "0B0"): (4.0, 5.0),
        (0, "0B1"): (6.0, 7.0), (1, "1F0"): (1.5, 2.5), (1, "1B0"): (2.5, 3.5),
        (1, "1F1"): (3.5, 4.5), (1, "1B1"): (4.5, 5.5),
    }
    assert tl.makespan == pytest.approx(7.0)
    no_comm = simulate(build("1f1b", 2, 2), f_ms=[1, 1], b_ms=[1, 1])
    assert tl.makespan - no_comm.makespan == pytest.approx(2 * 0.5)


def test_comm_is_free_between_stages_on_one_rank() -> None:
    schedule = build("interleaved-1f1b", 1, 3, 2)
    costs = {"f_ms": [1.0, 2.0], "b_ms": [1.0, 1.0]}
    assert simulate(schedule, **costs, comm_ms=[5.0]).makespan == pytest.approx(15.0)


def test_deadlock_raises_schedule_error() -> None:
    schedule = build("1f1b", 2, 2)
    schedule[1].reverse()
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(schedule, f_ms=[1, 1], b_ms=[1, 1])


def test_cost_length_errors() -> None:
    with pytest.raises(ValueError, match="b_ms needs 2 values"):
        simulate(build("1f1b", 2, 2), f_ms=[1, 1], b_ms=[1])
    with pytest.raises(ValueError, match="comm_ms needs 1 values"):
        simulate(build("1f1b", 2, 2), f_ms=[1, 1], b_ms=[1, 1], comm_ms=[1, 1])


def test_busy_idle_bubble_by_hand() -> None:
    events = [Event(0, Action(0, "F", 0), 0.0, 2.0), Event(1, Action(1, "F", 0), 2.0, 3.0)]
    tl = Timeline(events, n_ranks=2)
    assert tl.makespan == 3.0
    assert (tl.busy(0), tl.busy(1), tl.idle(0), tl.idle(1)) == (2.0, 1.0, 1.0, 2.0)
    assert tl.bubble == pytest.approx(3.0 / 6.0)
    assert Timeline([], n_ranks=2).bubble == 0.0


def test_json_round_trip() -> None:
    tl = equal_costs("zb-h1", 3, 4, w=0.5)
    again = Timeline.from_json(json.loads(json.dumps(tl.to_json())))
    assert again == tl


def test_chrome_trace() -> None:
    tl = simulate(build("1f1b", 2, 3), f_ms=[1.0, 1.5], b_ms=[2.0, 2.0], comm_ms=[0.25])
    trace = json.loads(json.dumps(tl.to_chrome_trace()))
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == 2 * 2 * 3
    assert sorted(e["name"] for e in complete) == sorted(str(e.action) for e in tl.events)
    first = next(e for e in complete if e["name"] == "1F0")
    assert (first["tid"], first["cat"], first["ts"], first["dur"]) == (1, "F", 1250.0, 1500.0)


def test_to_text_rows() -> None:
    tl = equal_costs("1f1b", 2, 2)
    assert tl.to_text(width=6).splitlines()[:2] == ["rank 0 |FF.B.B|", "rank 1 |.FBFB.|"]
    text = equal_costs("zb-h1", 4, 8, w=1.0).to_text(width=54)
    rows = text.splitlines()
    assert len(rows) == 4 + 1 and rows[-1].startswith("legend: F forward")
    assert all(len(row) == len("rank 0 |") + 54 + 1 for row in rows[:4])
    assert set("".join(rows[:4])) <= set("rank0123 |FBW.")


def test_to_png_writes_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "zb.png"
    equal_costs("zb-h1", 3, 4, w=1.0).to_png(str(path), title="zb-h1")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_to_png_without_matplotlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("matplotlib", "matplotlib.backends.backend_agg", "matplotlib.figure"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(RuntimeError, match=r"pip install fxpipe\[plot\]"):
        equal_costs("1f1b", 2, 2).to_png(str(tmp_path / "x.png"))


def test_textbook_bubble_values_and_errors() -> None:
    assert textbook_bubble("1f1b", 4, 8) == pytest.approx(3 / 11)
    assert textbook_bubble("zb-h1", 4, 8) == pytest.approx(3 / 27)
    assert textbook_bubble("interleaved-1f1b", 8, 8, 2) == pytest.approx(3 / 19)
    with pytest.raises(ScheduleError, match="no textbook bubble"):
        textbook_bubble("1f1b", 4, 8, 2)
    with pytest.raises(ScheduleError, match="no textbook bubble"):
        textbook_bubble("mystery", 4, 8)


def test_the_lowered_program_simulates_like_the_schedule_without_messages_and_slower_with_them() -> None:
    """simulate_program runs what the runtime runs: with free messages it is the schedule's own
    simulation; with a cost per message, batches matched per pair one at a time can only wait more."""
    import random

    from pipe.lower import lower
    from pipe.schedules import SCHEDULES, ScheduleError, default_stages_per_rank, placement
    from pipe.simulate import simulate_program
    for name in sorted(SCHEDULES):
        for r, m in ((2, 4), (3, 6), (4, 8)):
            v = default_stages_per_rank(name)
            try:
                schedule = build(name, r, m, v)
            except ScheduleError:
                continue
            s, place = r * v, placement(name, r * v, r)
            program = lower(schedule, s, m, place)
            rng = random.Random(r * m)
            f = [rng.uniform(1, 2) for _ in range(s)]
            b = [2 * x for x in f]
            for comm in ([0.0] * (s - 1), [0.3] * (s - 1)):
                plain = simulate(schedule, f_ms=f, b_ms=b, w_ms=f, comm_ms=comm, place=place)
                lowered = simulate_program(program, s, f_ms=f, b_ms=b, w_ms=f, comm_ms=comm, place=place)
                assert sorted(e.action for e in lowered.events) == sorted(e.action for e in plain.events)
                if comm[0] == 0.0:
                    assert lowered.makespan == pytest.approx(plain.makespan), (name, r, m)
                else:
                    assert lowered.makespan >= plain.makespan - 1e-9, (name, r, m)


def test_program_simulation_by_hand() -> None:
    """1F1B, 2 ranks, 1 mb, F = B = 1, 0.5 per message: 0F0 [0, 1]; its activations land at 1.5;
    1F0 [1.5, 2.5], 1B0 [2.5, 3.5]; the grads land at 4; 0B0 [4, 5]."""
    from pipe.lower import lower
    from pipe.simulate import simulate_program
    tl = simulate_program(lower(build("1f1b", 2, 1), 2, 1), 2, f_ms=[1, 1], b_ms=[1, 1], comm_ms=[0.5])
    got = {str(e.action): (e.start, e.end) for e in tl.events}
    assert got == {"0F0": (0, 1), "1F0": (1.5, 2.5), "1B0": (2.5, 3.5), "0B0": (4, 5)}


def test_a_fused_backward_costs_b_and_w_and_a_reload_its_copy() -> None:
    from pipe.lower import fuse_backward, lower, with_reloads
    from pipe.simulate import simulate_program
    program = with_reloads(fuse_backward(lower(build("zb-h1", 1, 1), 1, 1), [0]), [0])
    assert [str(x) for x in program[0]] == ["0F0", "0RELOAD0", "0BW0"]
    tl = simulate_program(program, 1, f_ms=[1.0], b_ms=[2.0], w_ms=[0.5], reload_ms=[0.25])
    assert {str(e.action): (e.start, e.end) for e in tl.events} == {"0F0": (0.0, 1.0), "0BW0": (1.25, 3.75)}
