"""pipe.lower: schedules lowered to per-rank programs with their messages, checked under NCCL's matching."""
from __future__ import annotations

import itertools

import pytest

from pipe.lower import format_program, lower, parse_program, validate
from pipe.schedules import SCHEDULES, Action, ScheduleError, build, loop_placement, placement, v_placement

# literal programs, one rank a line (split only to fit the page)
ONE_F_ONE_B_2x4 = "\n".join([
    'rank 0: 0F0 [0SEND_F0] 0F1 [0SEND_F1] [0RECV_B0] 0B0 0F2 [0RECV_B1 0SEND_F2] 0B1 0F3'
    ' [0RECV_B2 0SEND_F3] 0B2 [0RECV_B3] 0B3',
    'rank 1: [1RECV_F0] 1F0 [1RECV_F1] 1B0 [1SEND_B0] 1F1 1B1 [1SEND_B1 1RECV_F2] 1F2 1B2'
    ' [1SEND_B2 1RECV_F3] 1F3 1B3 [1SEND_B3]',
])

INTERLEAVED_2x2_M2 = "\n".join([
    'rank 0: 0F0 [0SEND_F0] 0F1 [0SEND_F1 2RECV_F0] 2F0 [2RECV_F1 2SEND_F0] 2F1'
    ' [2SEND_F1] [2RECV_B0] 2B0 [2SEND_B0] [2RECV_B1] 2B1 [0RECV_B0 2SEND_B1] 0B0'
    ' [0RECV_B1] 0B1',
    'rank 1: [1RECV_F0] 1F0 [1RECV_F1 1SEND_F0] 1F1 [1SEND_F1 3RECV_F0] 3F0 [3RECV_F1]'
    ' 3B0 [3SEND_B0] 3F1 [1RECV_B0] 3B1 [3SEND_B1] 1B0 [1SEND_B0 1RECV_B1] 1B1 [1SEND_B1]',
])


def test_literal_programs() -> None:
    assert lower(build("1f1b", 2, 4), 2, 4) == parse_program(ONE_F_ONE_B_2x4)
    assert lower(build("interleaved-1f1b", 2, 2, 2), 4, 2) == parse_program(INTERLEAVED_2x2_M2)
    assert format_program(parse_program(ONE_F_ONE_B_2x4)) == ONE_F_ONE_B_2x4.strip()


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_schedule_lowers_to_programs_that_match_in_order(name: str) -> None:
    cases = 0
    for R, M, v in itertools.product(range(1, 5), range(1, 17), (1, 2)):
        try:
            schedule = build(name, R, M, v)
        except ScheduleError:  # a size this schedule refuses (e.g. 1f1b with v=2)
            continue
        S = R * v
        place = placement(name, S, R)
        program = lower(schedule, S, M, place)
        validate(program, S, place)  # no deadlock, every message met by its own receive
        cases += 1
        sends = [a for items in program.values() for x in items if not isinstance(x, Action) for a in x
                 if a.kind.startswith("SEND")]
        recvs = [a for items in program.values() for x in items if not isinstance(x, Action) for a in x
                 if a.kind.startswith("RECV")]
        boundaries = sum(place[s] != place[s + 1] for s in range(S - 1))  # the others hand over in memory
        assert len(sends) == len(recvs) == 2 * M * boundaries, (name, R, M, v)
    assert cases >= 4 * 16 // 2, f"{name}: only {cases} sizes built"


def test_a_receive_posted_out_of_order_is_a_mismatch_and_a_missing_one_a_deadlock() -> None:
    program = parse_program(INTERLEAVED_2x2_M2)
    # rank 0 sends activations of boundary 1 (0SEND_F0) while rank 1 first expects boundary 3
    swapped = dict(program)
    swapped[1] = [x if x != (Action(1, "RECV_F", 0),) else (Action(3, "RECV_F", 0),) for x in program[1]]
    with pytest.raises(ScheduleError, match="message mismatch between ranks 0 and 1"):
        validate(swapped, 4)
    dropped = dict(program)
    dropped[1] = [x for x in program[1] if x != (Action(1, "RECV_F", 0),)]
    with pytest.raises(ScheduleError, match=r"(?s)deadlock: ranks \[0, 1\].*rank 1: \[\[1F0\]\]"):
        validate(dropped, 4)


def test_placements() -> None:
    assert loop_placement(6, 3) == [0, 1, 2, 0, 1, 2]
    assert v_placement(6, 3) == [0, 1, 2, 2, 1, 0]
    with pytest.raises(ScheduleError, match="exactly two stages per rank"):
        v_placement(5, 3)


def test_a_v_placed_schedule_hands_over_on_one_rank_and_messages_across() -> None:
    """Stages 0 and 3 on rank 0, 1 and 2 on rank 1 (the V): 1 -> 2 stays on rank 1, 0 -> 1 and
    2 -> 3 cross; the same lists are on the wrong ranks under the loop placement."""
    schedule = {r: [Action.from_str(a) for a in text.split()]
                for r, text in ((0, "0F0 3F0 3B0 0B0"), (1, "1F0 2F0 2B0 1B0"))}
    place = v_placement(4, 2)
    program = lower(schedule, 4, 1, place)
    assert format_program(program) == "\n".join([
        "rank 0: 0F0 [0SEND_F0] [3RECV_F0] 3F0 3B0 [3SEND_B0] [0RECV_B0] 0B0",
        "rank 1: [1RECV_F0] 1F0 2F0 [2SEND_F0] [2RECV_B0] 2B0 1B0 [1SEND_B0]",
    ])
    validate(program, 4, place)
    with pytest.raises(ScheduleError, match="wrong rank"):
        lower(schedule, 4, 1)


def test_the_memory_pass_reloads_offloaded_activations_one_compute_action_ahead() -> None:
    """with_reloads puts sRELOADm right after the compute action before each B and W of an
    offloading stage (ahead of the batch that brings that backward's grads); others are untouched."""
    from pipe.lower import with_reloads
    program = with_reloads(lower(build("zb-h1", 2, 2), 2, 2), [1])
    assert format_program(program) == "\n".join([
        "rank 0: 0F0 [0SEND_F0] 0F1 [0SEND_F1] [0RECV_B0] 0B0 0W0 [0RECV_B1] 0B1 0W1",
        "rank 1: [1RECV_F0] 1F0 1RELOAD0 [1RECV_F1] 1B0 [1SEND_B0] 1F1 1RELOAD1 1B1 1RELOAD0 [1SEND_B1] 1W0"
        " 1RELOAD1 1W1",
    ])
    assert parse_program(format_program(program)) == program
    validate(program, 2)
    assert with_reloads(program, []) == program


def test_fused_backward_replaces_a_recomputing_stages_b_and_w_by_bw() -> None:
    """fuse_backward: stage 1's B become BW and its W leave; stage 0 keeps B and W; the messages and
    their order do not change, so the program still validates; BW prints and parses."""
    from pipe.lower import compute_actions, fuse_backward
    base = lower(build("zb-h1", 2, 2), 2, 2)
    fused = fuse_backward(base, [1])
    assert format_program(fused) == "\n".join([
        "rank 0: 0F0 [0SEND_F0] 0F1 [0SEND_F1] [0RECV_B0] 0B0 0W0 [0RECV_B1] 0B1 0W1",
        "rank 1: [1RECV_F0] 1F0 [1RECV_F1] 1BW0 [1SEND_B0] 1F1 1BW1 [1SEND_B1]",
    ])
    assert parse_program(format_program(fused)) == fused
    validate(fused, 2)
    assert [str(a) for a in compute_actions(fused[1])] == ["1F0", "1BW0", "1F1", "1BW1"]
    assert [x for x in fused[0]] == [x for x in base[0]]


def test_receives_are_posted_ahead_by_a_bounded_number_of_buffers() -> None:
    """A receive is posted in the batch of the round its sender computes (the earliest position both
    ends agree on), and read by the compute action that needs it: the buffers posted and not yet
    read on a rank never exceed 2 per stage it holds, whatever the number of microbatches; except
    breadth first with several stages per rank (looped-bfs), where a stage's inputs arrive while the
    rank still runs its earlier stage: there every microbatch is in flight anyway, and so may be its
    input's buffer (M per stage)."""
    from pipe.lower import needs
    from pipe.schedules import default_stages_per_rank
    for name in sorted(SCHEDULES):
        v = default_stages_per_rank(name)
        for R, M in itertools.product(range(2, 5), (4, 8, 16)):
            try:
                schedule = build(name, R, M, v)
            except ScheduleError:
                continue
            S, place = R * v, placement(name, R * v, R)
            for r, items in lower(schedule, S, M, place).items():
                alive = peak = 0
                for x in items:
                    if isinstance(x, Action):
                        alive -= needs(x, place, S) is not None
                    else:
                        alive += sum(a.kind.startswith("RECV") for a in x)
                        peak = max(peak, alive)
                    assert alive >= 0
                assert alive == 0 and peak <= (M if name == "looped-bfs" else 2) * v, (name, R, M, r, peak)


def test_the_data_parallel_pass_reduces_each_stages_grads_before_its_final_backward() -> None:
    """with_grad_reduction puts sREDUCE_GRADm right before the last B/W/BW of each stage (after it
    nothing writes the stage's grads in the step): B for 1f1b and interleaved-1f1b, the last W for
    zero-bubble schedules, BW where fuse_backward made one; messages untouched, programs still valid."""
    from pipe.lower import final_backward, fuse_backward, with_grad_reduction
    program = with_grad_reduction(lower(build("1f1b", 2, 4), 2, 4), [0, 1])
    assert format_program(program) == "\n".join([
        'rank 0: 0F0 [0SEND_F0] 0F1 [0SEND_F1] [0RECV_B0] 0B0 0F2 [0RECV_B1 0SEND_F2] 0B1 0F3'
        ' [0RECV_B2 0SEND_F3] 0B2 [0RECV_B3] 0REDUCE_GRAD3 0B3',
        'rank 1: [1RECV_F0] 1F0 [1RECV_F1] 1B0 [1SEND_B0] 1F1 1B1 [1SEND_B1 1RECV_F2] 1F2 1B2'
        ' [1SEND_B2 1RECV_F3] 1F3 1REDUCE_GRAD3 1B3 [1SEND_B3]',
    ])
    assert parse_program(format_program(program)) == program
    validate(program, 2)
    finals = {"1f1b": "B", "zb-h1": "W", "interleaved-1f1b": "B", "zbv": "W"}
    for name, kind in finals.items():
        for R, M in ((2, 4), (3, 6), (4, 8)):
            v = 2 if name in ("interleaved-1f1b", "zbv") else 1
            S, place = R * v, placement(name, R * v, R)
            base = lower(build(name, R, M, v), S, M, place)
            for fused in ([], [0]):
                plain = fuse_backward(base, fused)
                reduced = with_grad_reduction(plain, range(S))
                validate(reduced, S, place)
                for r, items in reduced.items():
                    marks = {i: x for i, x in enumerate(items) if isinstance(x, Action) and x.kind == "REDUCE_GRAD"}
                    mine = sorted(s for s in range(S) if place[s] == r)
                    assert sorted(a.stage for a in marks.values()) == mine, (name, R, M, r)
                    for i, a in marks.items():
                        last = final_backward(plain[r], a.stage)
                        assert last is not None
                        assert items[i + 1] == last and a == Action(last.stage, "REDUCE_GRAD", last.mb)
                        assert last.kind == ("BW" if last.stage in fused else kind), (name, last)
                    assert [x for i, x in enumerate(items) if i not in marks] == plain[r]
    assert with_grad_reduction(base, []) == base


def test_final_backward_is_the_last_backward_of_the_stage() -> None:
    from pipe.lower import final_backward
    program = lower(build("zb-h1", 2, 3), 2, 3)
    assert final_backward(program[0], 0) == Action(0, "W", 2)
    assert final_backward(program[1], 1) == Action(1, "W", 2)
    assert final_backward(lower(build("1f1b", 2, 3), 2, 3)[0], 0) == Action(0, "B", 2)
    assert final_backward(program[0], 1) is None  # stage 1 lives on rank 1
    assert Action.from_str("0REDUCE_GRAD7") == Action(0, "REDUCE_GRAD", 7)
    assert str(Action.from_str("0REDUCE_GRAD7")) == "0REDUCE_GRAD7"


def test_late_batches_are_those_receiving_what_their_peer_began_posting_earlier() -> None:
    """GPipe on 2 ranks, 2 mbs: rank 0 posts [0SEND_F0] [0SEND_F1] [0RECV_B0] [0RECV_B1], rank 1 [1RECV_F0]
    [1RECV_F1] [1SEND_B0] [1SEND_B1]. With rank 1 behind, its 1RECV_F1 (at 5) comes after rank 0's send (at
    2); rank 0's 0RECV_B1 (at 14) after rank 1's send (at 13); 1RECV_F0 at 0 comes first, and a receive
    posted at the same time as its send is not late."""
    from pipe.lower import late_batches
    program = lower(build("gpipe", 2, 2), 2, 2)
    assert format_program(program).splitlines() == [
        "rank 0: 0F0 [0SEND_F0] 0F1 [0SEND_F1] [0RECV_B0] 0B0 [0RECV_B1] 0B1",
        "rank 1: [1RECV_F0] 1F0 [1RECV_F1] 1F1 1B0 [1SEND_B0] 1B1 [1SEND_B1]"]
    starts = {0: [1.0, 2.0, 3.0, 14.0], 1: [0.0, 5.0, 11.0, 13.0]}
    assert late_batches(program, [0, 1], starts) == {0: [False, False, False, True], 1: [False, True, False, False]}
    starts[0][3] = 13.0
    assert late_batches(program, [0, 1], starts)[0] == [False, False, False, False]
