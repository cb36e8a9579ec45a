"""Lowering (pure): a schedule's compute actions plus a placement -> per-rank programs with their messages.

Legend: S stages, R ranks, s stage, m microbatch, t lock-step round. A program is a list of
items, each a compute Action ("1F0") or a batch: a tuple of communication Actions issued
together (one batch_isend_irecv), printed "[0SEND_F0 1RECV_B0]". Communication kinds:
  sSEND_F m  stage s sends its outputs of mb m to stage s+1    sRECV_F m  stage s receives its inputs
  sSEND_B m  stage s sends the grads of its inputs to s-1      sRECV_B m  stage s receives its outputs' grads
Memory passes add memory actions (with_reloads: sRELOAD m, offloaded activations back on the
device ahead of the backward). Messages follow the lock-step rounds of
`pipe.schedules.lock_step`: what round t computes is sent in the batch after round t's
compute, and the peer receives it in its batch of round t,
so both ends of every pair issue their batches in round order with the same messages in the
same order. `validate` checks that by running every rank's program with NCCL's matching:
per pair in issue order, one batch at a time, tags ignored.
"""
from __future__ import annotations

import re
from typing import Callable, Mapping, Sequence, Union

from pipe.schedules import Action, Schedule, ScheduleError, lock_step, loop_placement, v_placement

__all__ = ["Batch", "Item", "Program", "loop_placement", "v_placement", "lower", "validate",
           "forward_only", "fuse_backward", "with_reloads", "with_grad_reduction", "final_backward",
           "compute_actions", "format_program", "parse_program", "peer_of", "needs", "message", "walk", "late_batches"]

Batch = tuple[Action, ...]
Item = Union[Action, Batch]
Program = dict[int, list[Item]]

_ITEM_RE = re.compile(r"\[([^\]]*)\]|(\S+)")


def peer_of(a: Action, place: Sequence[int]) -> int:
    """The rank a communication action talks to."""
    return place[a.stage + 1] if a.kind in ("SEND_F", "RECV_B") else place[a.stage - 1]


def message(a: Action) -> tuple[str, int, int]:
    """(direction, boundary, mb) of the message a communication action moves; boundary b sits
    between stages b-1 and b, so both ends of one message name the same triple."""
    if a.kind in ("SEND_F", "RECV_B"):
        return ("F" if a.kind == "SEND_F" else "B", a.stage + 1, a.mb)
    return ("F" if a.kind == "RECV_F" else "B", a.stage, a.mb)


def lower(schedule: Schedule, n_stages: int, n_microbatches: int, place: Sequence[int] | None = None
          ) -> Program:
    """Each rank's program: its compute actions in schedule order, and after each lock-step round
    one batch with the messages that round exchanges with other ranks (none for a stage whose
    neighbour lives on the same rank). O(number of actions) after the lock-step run."""
    place = list(place) if place is not None else loop_placement(n_stages, len(schedule))
    rounds = lock_step(schedule, n_stages, n_microbatches, place)
    ranks = sorted(schedule)
    compute: dict[tuple[int, int], Action] = {(t, r): a for t, r, a in rounds}
    batches: dict[tuple[int, int], list[Action]] = {}
    for t, r, a in rounds:
        s, m = a.stage, a.mb
        if a.kind == "F" and s < n_stages - 1 and place[s + 1] != r:
            batches.setdefault((t, r), []).append(Action(s, "SEND_F", m))
            batches.setdefault((t, place[s + 1]), []).append(Action(s + 1, "RECV_F", m))
        if a.kind == "B" and s > 0 and place[s - 1] != r:
            batches.setdefault((t, r), []).append(Action(s, "SEND_B", m))
            batches.setdefault((t, place[s - 1]), []).append(Action(s - 1, "RECV_B", m))
    n_rounds = 1 + max((t for t, _, _ in rounds), default=-1)
    program: Program = {r: [] for r in ranks}
    for t in range(n_rounds):
        for r in ranks:
            if (t, r) in compute:
                program[r].append(compute[(t, r)])
            if (t, r) in batches:  # one order on both ends: by peer, then by message
                ops = sorted(batches[(t, r)], key=lambda a: (peer_of(a, place), message(a)))
                program[r].append(tuple(ops))
    return program


def fuse_backward(program: Program, stages: Sequence[int]) -> Program:
    """The pass for stages that recompute under a zero-bubble schedule: a checkpoint recomputes for
    one backward only, so each B of theirs becomes BW (input and weight grads in one backward) and
    their W leave the program. Messages are untouched: BW sends what B sent."""
    fused = set(stages)
    out: Program = {}
    for r, items in program.items():
        kept: list[Item] = []
        for x in items:
            if isinstance(x, Action) and x.stage in fused and x.kind in ("B", "W"):
                if x.kind == "B":
                    kept.append(Action(x.stage, "BW", x.mb))
                continue
            kept.append(x)
        out[r] = kept
    return out


def compute_actions(items: Sequence[Item]) -> list[Action]:
    """The compute actions (F, B, W, BW) of one rank's program, in order."""
    return [x for x in items if isinstance(x, Action) and x.kind in ("F", "B", "W", "BW")]


def with_reloads(program: Program, stages: Sequence[int]) -> Program:
    """The memory pass for activation offload: before every B, W and BW of the given stages, a RELOAD
    of that (stage, mb), placed right after the compute action before it (first in the program
    when there is none), so the copy back is issued while the rank still waits for the backward's
    messages. The handler does nothing when nothing of that (stage, mb) is offloaded."""
    wanted = set(stages)
    out: Program = {}
    for r, items in program.items():
        inserts: dict[int, list[Action]] = {}  # item index -> reloads to put after it (-1: first)
        last = -1
        for i, x in enumerate(items):
            if isinstance(x, Action):
                if x.kind in ("B", "W", "BW") and x.stage in wanted:
                    inserts.setdefault(last, []).append(Action(x.stage, "RELOAD", x.mb))
                last = i
        kept: list[Item] = list(inserts.get(-1, []))
        for i, x in enumerate(items):
            kept.append(x)
            kept += inserts.get(i, [])
        out[r] = kept
    return out


def final_backward(items: Sequence[Item], stage: int) -> Action | None:
    """The last backward (B, W or BW) of `stage` in one rank's program: its grads are final after it."""
    last = None
    for x in items:
        if isinstance(x, Action) and x.stage == stage and x.kind in ("B", "W", "BW"):
            last = x
    return last


def with_grad_reduction(program: Program, stages: Sequence[int]) -> Program:
    """The data-parallel pass: before the final backward of each given stage (the last of its B, W
    and BW, after which nothing writes its grads in the step) a REDUCE_GRAD of that (stage, mb). The
    runtime then all-reduces the stage's grads bucket by bucket as that backward finishes them, so
    the collectives overlap what follows; the step waits for them at its end."""
    wanted = set(stages)
    out: Program = {}
    for r, items in program.items():
        finals = {final_backward(items, s) for s in wanted} - {None}
        kept: list[Item] = []
        for x in items:
            if x in finals:
                assert isinstance(x, Action)
                kept.append(Action(x.stage, "REDUCE_GRAD", x.mb))
            kept.append(x)
        out[r] = kept
    return out


def forward_only(program: Program) -> Program:
    """The program of inference: its forwards and their messages, in the same order."""
    out: Program = {}
    for r, items in program.items():
        kept: list[Item] = []
        for x in items:
            if isinstance(x, Action):
                if x.kind == "F":
                    kept.append(x)
            else:
                batch = tuple(a for a in x if a.kind in ("SEND_F", "RECV_F"))
                if batch:
                    kept.append(batch)
        out[r] = kept
    return out


def _item(x: Item) -> str:
    return str(x) if isinstance(x, Action) else "[" + " ".join(str(a) for a in x) + "]"


def format_program(program: Program) -> str:
    """One line per rank: 'rank 0: 0F0 [0SEND_F0] 0F1 ...'."""
    return "\n".join(f"rank {r}: " + " ".join(_item(x) for x in program[r]) for r in sorted(program))


def parse_program(text: str) -> Program:
    """The inverse of format_program."""
    program: Program = {}
    for line in text.strip().splitlines():
        head, _, body = line.partition(":")
        rank = int(head.split()[1])
        items: list[Item] = []
        for batch, single in _ITEM_RE.findall(body):
            items.append(Action.from_str(single) if single else tuple(Action.from_str(a) for a in batch.split()))
        program[rank] = items
    return program


def needs(a: Action, place: Sequence[int], n_stages: int) -> Action | None:
    """The receive a compute action waits for, when its input comes from another rank."""
    r = place[a.stage]
    if a.kind == "F" and a.stage > 0 and place[a.stage - 1] != r:
        return Action(a.stage, "RECV_F", a.mb)
    if a.kind in ("B", "BW") and a.stage < n_stages - 1 and place[a.stage + 1] != r:
        return Action(a.stage, "RECV_B", a.mb)
    return None


Group = list[Action]


def walk(program: Program, n_stages: int, place: Sequence[int], *,
         compute: Callable[[int, Action, Action | None], None] | None = None,
         issue: Callable[[int, Batch], object] | None = None,
         match: Callable[[int, int, object, Group, object, Group, dict[int, int]], None] | None = None,
         ) -> tuple[dict[int, int], dict[tuple[int, int], list[tuple[object, Group]]]]:
    """Run every rank's program with NCCL's semantics, calling back what happens: the one walk
    `validate` and the simulator (pipe.simulate.simulate_program) share.

    A rank issues a batch and goes on (`issue(rank, batch)` gives a tag kept with each of its groups,
    e.g. the time it was posted); a compute action waits until the receive it needs is done (`compute(rank, action,
    the receive or None)`). The ops of a batch towards one peer form a group; per pair, the head
    groups of both ends complete together, in issue order (`match(a, b, tag_a, group_a, tag_b,
    group_b, positions)`). Returns each rank's position (its program's length when it finished)
    and the groups left unmatched.
    """
    ranks = sorted(program)
    pos = dict.fromkeys(ranks, 0)
    pending: dict[tuple[int, int], list[tuple[object, Group]]] = {}  # (rank, peer) -> groups in issue order
    done: set[tuple[int, Action]] = set()
    while True:
        moved = False
        for r in ranks:
            while pos[r] < len(program[r]):
                x = program[r][pos[r]]
                if isinstance(x, Action):
                    need = needs(x, place, n_stages)
                    if need is not None and (r, need) not in done:
                        break
                    if compute is not None:
                        compute(r, x, need)
                else:
                    tag = issue(r, x) if issue is not None else None
                    for peer in dict.fromkeys(peer_of(a, place) for a in x):
                        pending.setdefault((r, peer), []).append((tag, [a for a in x if peer_of(a, place) == peer]))
                pos[r] += 1
                moved = True
        for (a, b), groups in list(pending.items()):
            back = pending.get((b, a), [])
            if a < b and groups and back:
                if match is not None:
                    match(a, b, groups[0][0], groups[0][1], back[0][0], back[0][1], pos)
                done.update((a, x) for x in groups.pop(0)[1])
                done.update((b, x) for x in back.pop(0)[1])
                moved = True
        if not moved:
            return pos, {k: v for k, v in pending.items() if v}


def late_batches(program: Program, place: Sequence[int], starts: Mapping[int, Sequence[float]]
                 ) -> dict[int, list[bool]]:
    """Given when each rank began posting each of its batches (`starts[rank]`, program order), which
    batches receive a message whose sender began posting it earlier: on gloo such a message is taken in
    the posting thread (pipe.calibration's late_post_ms, the simulator's price for them)."""
    batches = {r: [x for x in items if not isinstance(x, Action)] for r, items in program.items()}
    sent = {(r, message(a)): t for r, ts in starts.items() for batch, t in zip(batches[r], ts)
            for a in batch if a.kind.startswith("SEND")}
    return {r: [any(a.kind.startswith("RECV") and sent.get((peer_of(a, place), message(a)), t) < t for a in batch)
                for batch, t in zip(batches[r], ts)] for r, ts in starts.items()}


def validate(program: Program, n_stages: int, place: Sequence[int] | None = None) -> None:
    """Run every rank's program with NCCL's semantics (`walk`); ScheduleError on a deadlock or a
    mismatch: the head groups of both ends of a pair must carry the same messages in the same
    order (the i-th send from a to b meets the i-th receive b posts for a)."""
    where = list(place) if place is not None else loop_placement(n_stages, len(program))

    def check(a: int, b: int, _ta: object, mine: Group, _tb: object, theirs: Group, pos: dict[int, int]) -> None:
        sent = [message(x) for x in mine if x.kind.startswith("SEND")]
        got = [message(x) for x in theirs if x.kind.startswith("RECV")]
        sent_back = [message(x) for x in theirs if x.kind.startswith("SEND")]
        got_back = [message(x) for x in mine if x.kind.startswith("RECV")]
        if sent != got or sent_back != got_back:
            raise ScheduleError(f"message mismatch between ranks {a} and {b}: rank {a} sends {sent} and "
                                f"receives {got_back}, rank {b} receives {got} and sends {sent_back}\n"
                                + _grid(program, pos))

    pos, left = walk(program, n_stages, where, match=check)
    stuck = [r for r in sorted(program) if pos[r] < len(program[r])]
    if stuck or left:
        raise ScheduleError(f"deadlock: ranks {stuck} cannot go on and {len(left)} pair(s) hold messages no one "
                            f"matches ({sorted(left)})\n" + _grid(program, pos))


def _grid(program: Program, pos: dict[int, int]) -> str:
    """The programs with each rank's next item in [[brackets]]."""
    lines = []
    for r in sorted(program):
        cells = [f"[[{_item(x)}]]" if i == pos[r] else _item(x) for i, x in enumerate(program[r])]
        lines.append(f"rank {r}: " + " ".join(cells))
    return "\n".join(lines) + "\nlegend: [[x]] is where the rank stands"
