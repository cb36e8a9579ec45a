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


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "1f1b-overlap"])
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


def test_1f1b_overlap_takes_the_exchange_off_the_steady_state_by_hand() -> None:
    """The lowered programs, 2 ranks, 4 mbs, f=1, b=2, 0.5 per message group. Under 1F1B rank 0
    posts [RECV_B1 SEND_F2] after F2 (ends 8.0), so rank 1's F2 starts at 8.5, and each steady step
    waits for such an exchange. One forward ahead, rank 0 sent F2 in the batch it posted at 3.0, which
    completed at 5.0 with rank 1's SEND_B0: rank 1 runs its F and B back to back from 2.5 to 13.5,
    and rank 0, whose grads come each 0.5 after rank 1's B, ends at 16.0 against 17.5."""
    from pipe.lower import lower
    from pipe.simulate import simulate_program

    def run(name: str) -> dict[tuple[int, str], tuple[float, float]]:
        tl = simulate_program(lower(build(name, 2, 4), 2, 4), 2, f_ms=[1, 1], b_ms=[2, 2], comm_ms=[0.5])
        return {(e.rank, str(e.action)): (e.start, e.end) for e in tl.events}

    plain, ahead = run("1f1b"), run("1f1b-overlap")
    assert plain[(1, "1F2")] == (8.5, 9.5) and plain[(0, "0B3")] == (15.5, 17.5)
    assert [ahead[(1, f"1{k}{m}")] for m in range(4) for k in "FB"] == [
        (1.5, 2.5), (2.5, 4.5), (4.5, 5.5), (5.5, 7.5), (7.5, 8.5), (8.5, 10.5), (10.5, 11.5), (11.5, 13.5)]
    assert [ahead[(0, f"0B{m}")] for m in range(4)] == [(5.0, 7.0), (8.5, 10.5), (11.0, 13.0), (14.0, 16.0)]


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
    assert textbook_bubble("looped-bfs", 8, 8, 2) == pytest.approx(3 / 19)
    assert textbook_bubble("interleaved-zb", 8, 8, 2) == pytest.approx(3 / 51)
    assert textbook_bubble("dualpipev", 8, 8, 2) == pytest.approx(3 / 51)
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


def test_posting_a_batch_holds_its_rank() -> None:
    """The same step with 0.5 ms of host time per batch posted and free messages, F = 1, B = 2: rank 1
    posts its receive [0, 0.5]; rank 0 runs 0F0 [0, 1] and posts its activations [1, 1.5], which land then;
    1F0 [1.5, 2.5], 1B0 [2.5, 4.5], rank 1 posts the grads [4.5, 5] (rank 0 posted their receive at
    [1.5, 2]); 0B0 [5, 7]. The posts come back as a lane of their own, through JSON and the trace."""
    from pipe.lower import lower
    from pipe.simulate import simulate_program
    program = lower(build("1f1b", 2, 1), 2, 1)
    tl = simulate_program(program, 2, f_ms=[1, 1], b_ms=[2, 2], post_ms=0.5)
    got = {str(e.action): (e.start, e.end) for e in tl.events}
    assert got == {"0F0": (0, 1), "1F0": (1.5, 2.5), "1B0": (2.5, 4.5), "0B0": (5, 7)}
    assert sorted((e.rank, e.start, e.end) for e in tl.posts) == [(0, 1, 1.5), (0, 1.5, 2), (1, 0, 0.5), (1, 4.5, 5)]
    assert {e.action.kind for e in tl.posts} == {"POST"} and tl.busy(0) == 3  # posts are not compute
    assert simulate_program(program, 2, f_ms=[1, 1], b_ms=[2, 2]).makespan == 6 and tl.makespan == 7
    again = Timeline.from_json(json.loads(json.dumps(tl.to_json())))
    assert again == tl
    trace = [e for e in tl.to_chrome_trace()["traceEvents"] if e["ph"] == "X" and e["cat"] == "POST"]
    assert sorted((e["tid"], e["ts"]) for e in trace) == [(0, 1000.0), (0, 1500.0), (1, 0.0), (1, 4500.0)]


def test_a_batch_receiving_a_message_sent_before_it_was_posted_holds_its_rank_longer() -> None:
    """GPipe, 2 ranks, 2 mbs, F = 1 and 3, B = 2, posts 0.5 ms, 1.5 ms a late one (gloo takes a message
    that came before its receive in the posting thread). Rank 0: 0F0 [0, 1], posts 0SEND_F0 [1, 1.5], 0F1
    [1.5, 2.5], posts 0SEND_F1 at 2.5, 0RECV_B0 [3, 3.5]. Rank 1: posts 1RECV_F0 [0, 0.5], 1F0 [1.5, 4.5];
    its 1RECV_F1, posted at 4.5 after rank 0's send at 2.5, is late: [4.5, 6]; 1F1 [6, 9], 1B0 [9, 11],
    posts 1SEND_B0 [11, 11.5], 1B1 [11.5, 13.5], posts 1SEND_B1 at 13.5. Rank 0's 0RECV_B0 (posted at 3)
    and 0RECV_B1 (at 13.5, with its send) are not late: 0B0 [11.5, 13.5], 0B1 [14, 16]."""
    from pipe.lower import lower
    from pipe.simulate import simulate_program
    program = lower(build("gpipe", 2, 2), 2, 2)
    tl = simulate_program(program, 2, f_ms=[1, 3], b_ms=[2, 2], post_ms=0.5, late_post_ms=1.5)
    got = {str(e.action): (e.start, e.end) for e in tl.events}
    assert got == {"0F0": (0, 1), "0F1": (1.5, 2.5), "1F0": (1.5, 4.5), "1F1": (6, 9), "1B0": (9, 11),
                   "1B1": (11.5, 13.5), "0B0": (11.5, 13.5), "0B1": (14, 16)}
    assert sorted((e.rank, e.start, e.end) for e in tl.posts) == [
        (0, 1, 1.5), (0, 2.5, 3), (0, 3, 3.5), (0, 13.5, 14), (1, 0, 0.5), (1, 4.5, 6), (1, 11, 11.5), (1, 13.5, 14)]
    # one price for every post, as before: the late one takes 0.5 and the step 15
    same = simulate_program(program, 2, f_ms=[1, 3], b_ms=[2, 2], post_ms=0.5, late_post_ms=0.5)
    assert same == simulate_program(program, 2, f_ms=[1, 3], b_ms=[2, 2], post_ms=0.5) and same.makespan == 15


def test_a_fused_backward_costs_b_and_w_and_a_reload_its_copy() -> None:
    from pipe.lower import fuse_backward, lower, with_reloads
    from pipe.simulate import simulate_program
    program = with_reloads(fuse_backward(lower(build("zb-h1", 1, 1), 1, 1), [0]), [0])
    assert [str(x) for x in program[0]] == ["0F0", "0RELOAD0", "0BW0"]
    tl = simulate_program(program, 1, f_ms=[1.0], b_ms=[2.0], w_ms=[0.5], reload_ms=[0.25])
    assert {str(e.action): (e.start, e.end) for e in tl.events} == {"0F0": (0.0, 1.0), "0BW0": (1.25, 3.75)}


def reduced_1f1b_2x2() -> Timeline:
    """1F1B, 2 ranks, 2 mbs, F=1, B=2, free messages; stage 0's grads in 4 buckets reduced in 2 ms, stage
    1's in 2 buckets in 4 ms (so 0.5 and 2 ms a bucket)."""
    from pipe.lower import lower, with_grad_reduction
    from pipe.simulate import simulate_program
    program = with_grad_reduction(lower(build("1f1b", 2, 2), 2, 2), [0, 1])
    return simulate_program(program, 2, f_ms=[1, 1], b_ms=[2, 2], reduce_ms=[2, 4], buckets=[4, 2])


def test_buckets_launch_as_the_final_backward_finishes_them() -> None:
    """Bucket k of n launches at start + (k+1)/n of its stage's final backward, when the rank's lane
    is free: 1B1 [5, 7] launches stage 1's buckets at 6 and 7, the second waits for the first until 8;
    0B1 [7, 9] launches stage 0's at 7.5, 8, 8.5 and 9. The step ends with the last collective, at 10."""
    tl = reduced_1f1b_2x2()
    assert {str(e.action): (e.start, e.end) for e in tl.events} == {
        "0F0": (0, 1), "0F1": (1, 2), "0B0": (4, 6), "0B1": (7, 9),
        "1F0": (1, 2), "1B0": (2, 4), "1F1": (4, 5), "1B1": (5, 7)}
    assert [(e.rank, str(e.action), e.start, e.end) for e in tl.collectives] == [
        (1, "1REDUCE_GRAD0", 6, 8), (1, "1REDUCE_GRAD1", 8, 10),
        (0, "0REDUCE_GRAD0", 7.5, 8), (0, "0REDUCE_GRAD1", 8, 8.5), (0, "0REDUCE_GRAD2", 8.5, 9),
        (0, "0REDUCE_GRAD3", 9, 9.5)]
    assert tl.makespan == 10  # 9 without the collectives
    assert (tl.collective_time(0), tl.collective_time(1)) == (2, 4)
    assert (tl.exposed(0), tl.exposed(1)) == (0.5, 3)
    assert tl.busy(0) == 6 and tl.bubble == pytest.approx(8 / 20)


def test_the_collectives_of_a_rank_run_one_at_a_time_in_launch_order() -> None:
    """Two stages per rank (interleaved and V) and several buckets: each rank's collectives form one
    lane, launched in program order, never overlapping; each starts no earlier than its backward
    finishes its share; every stage has its buckets."""
    from pipe.lower import final_backward, lower, with_grad_reduction
    from pipe.schedules import placement
    from pipe.simulate import simulate_program
    for name in ("interleaved-1f1b", "zbv", "zb-h1"):
        v = 1 if name == "zb-h1" else 2
        R, M = 3, 6
        S, place = R * v, placement(name, R * v, R)
        program = with_grad_reduction(lower(build(name, R, M, v), S, M, place), range(S))
        tl = simulate_program(program, S, f_ms=[1.0] * S, b_ms=[1.5] * S, w_ms=[0.5] * S, comm_ms=[0.1] * (S - 1),
                              place=place, reduce_ms=[7.0] * S, buckets=[3] * S)
        assert sorted((e.action.stage, e.action.mb) for e in tl.collectives) == [
            (s, k) for s in range(S) for k in range(3)]
        by_action = {e.action: e for e in tl.events}
        final = {s: by_action[a] for s in range(S) if (a := final_backward(program[place[s]], s)) is not None}
        assert sorted(final) == list(range(S))
        for r in range(R):
            lane = [e for e in tl.collectives if e.rank == r]
            assert all(a.end <= b.start + 1e-12 for a, b in zip(lane, lane[1:])), (name, r)
            assert all(e.end - e.start == pytest.approx(7.0 / 3) for e in lane)
            for e in lane:
                f = final[e.action.stage]
                assert e.rank == place[e.action.stage] == f.rank
                assert e.start >= f.start + (e.action.mb + 1) / 3 * (f.end - f.start) - 1e-12
        assert tl.makespan == max(e.end for e in tl.events + tl.collectives)


def test_exposed_and_collective_time_on_a_hand_made_timeline() -> None:
    """Rank 0 computes until 5; its collectives [2, 4], [3, 6] and [7, 8] overlap in part: 5 ms in flight,
    exposed from 5 to 8. Rank 1 computes until 9, its collective [1, 2] is hidden. Rank 2 has none."""
    ev = [Event(0, Action(0, "B", 0), 0.0, 5.0), Event(1, Action(1, "B", 0), 0.0, 9.0)]
    coll = [Event(0, Action(0, "REDUCE_GRAD", k), lo, hi) for k, (lo, hi) in enumerate([(2, 4), (3, 6), (7, 8)])]
    coll.append(Event(1, Action(1, "REDUCE_GRAD", 0), 1.0, 2.0))
    tl = Timeline(ev, 3, coll)
    assert [tl.collective_time(r) for r in range(3)] == [5.0, 1.0, 0.0]
    assert [tl.exposed(r) for r in range(3)] == [3.0, 0.0, 0.0]
    assert tl.makespan == 9.0
    late = Timeline(ev, 2, [Event(1, Action(1, "REDUCE_GRAD", 0), 8.0, 12.0)])
    assert (late.makespan, late.exposed(1), late.idle(0), late.idle(1)) == (12.0, 3.0, 7.0, 3.0)


def test_the_collectives_lane_in_json_trace_text_and_png(tmp_path: Path) -> None:
    tl = reduced_1f1b_2x2()
    again = Timeline.from_json(json.loads(json.dumps(tl.to_json())))
    assert again == tl and len(again.collectives) == 6
    assert Timeline.from_json({"n_ranks": 1, "events": []}).collectives == []  # files from before the lane
    trace = json.loads(json.dumps(tl.to_chrome_trace()))
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert names == {0: "rank 0", 1: "rank 1", 1000: "rank 0 grad all-reduce", 1001: "rank 1 grad all-reduce"}
    lane = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "REDUCE_GRAD"]
    assert sorted((e["tid"], e["name"]) for e in lane) == [
        (1000, "0REDUCE_GRAD0"), (1000, "0REDUCE_GRAD1"), (1000, "0REDUCE_GRAD2"), (1000, "0REDUCE_GRAD3"),
        (1001, "1REDUCE_GRAD0"), (1001, "1REDUCE_GRAD1")]
    first = next(e for e in lane if e["name"] == "1REDUCE_GRAD0")
    assert (first["ts"], first["dur"], first["args"]) == (6000.0, 2000.0, {"stage": 1, "bucket": 0})
    assert [name for name, _ in tl.lanes()] == ["rank 0", "rank 0 all-reduce", "rank 1", "rank 1 all-reduce"]
    assert tl.to_text(width=20).splitlines()[:4] == [
        "rank 0            |FFFF....BBBB..BBBB..|",
        "rank 0 all-reduce |...............RRRR.|",
        "rank 1            |..FFBBBBFFBBBB......|",
        "rank 1 all-reduce |............RRRRRRRR|"]
    assert "R grad all-reduce" in tl.to_text(width=20).splitlines()[-1]
    pytest.importorskip("matplotlib")
    path = tmp_path / "dp.png"
    tl.to_png(str(path), title="1f1b, 2 ranks, dp collectives")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
