"""Pipeline schedules as pure data: per-rank lists of F/B/W actions, their validator and grid."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import NamedTuple

from partition.errors import FxpipeError
from partition.flights import closed_form

__all__ = [
    "SCHEDULES",
    "Action",
    "Schedule",
    "ScheduleError",
    "ScheduleFn",
    "build",
    "default_stages_per_rank",
    "default_stages_text",
    "dependencies",
    "execution_order",
    "gpipe",
    "grid",
    "in_flight_limit",
    "dualpipev",
    "interleaved_1f1b",
    "interleaved_zb",
    "looped_bfs",
    "lock_step",
    "loop_placement",
    "v_placement",
    "max_in_flight",
    "one_f_one_b",
    "one_f_one_b_overlap",
    "placement",
    "register",
    "validate",
    "zb_h1",
    "zbv",
]

_ACTION_RE = re.compile(r"(\d+)(F|BW|B|W|SEND_F|RECV_F|SEND_B|RECV_B|RELOAD|REDUCE_GRAD|POST)(\d+)")


class Action(NamedTuple):
    """One unit of work on one stage: F forward, B backward, W weight gradient; prints "2F0".
    Lowered programs (pipe.lower) add messages: SEND_F, RECV_F, SEND_B, RECV_B ("1RECV_F3"),
    memory actions: RELOAD (offloaded activations back on the device, "1RELOAD3"), BW (a B
    that computes the weight grads too, for a stage whose W it replaces: "1BW3"), and REDUCE_GRAD
    (the stage's grads become final in its next backward, mb m's: reduce them over the data-parallel
    replicas as they do, "0REDUCE_GRAD7"). Measured timelines add POST: the host's time posting one
    batch of messages, named by the batch's first message ("1POST3")."""

    stage: int
    kind: str
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"

    @classmethod
    def from_str(cls, text: str) -> Action:
        """Parse "{stage}{kind}{mb}", e.g. "2F0", "12B3" or "1RECV_F3"."""
        match = _ACTION_RE.fullmatch(text)
        if match is None:
            raise ValueError(
                f"cannot parse action {text!r}: expected '{{stage}}{{kind}}{{mb}}' with kind "
                "F, B, W (or BW, SEND_F, RECV_F, SEND_B, RECV_B, RELOAD, REDUCE_GRAD, POST) and non-negative "
                "integers, e.g. '2F0' or '12B3'"
            )
        return cls(int(match[1]), match[2], int(match[3]))


Schedule = dict[int, list[Action]]
ScheduleFn = Callable[[int, int, int], Schedule]
PlacementFn = Callable[[int, int], list[int]]


def loop_placement(n_stages: int, n_ranks: int) -> list[int]:
    """Stage s on rank s % R (1F1B, GPipe, interleaved: rank r holds stages r, r+R, ...)."""
    return [s % n_ranks for s in range(n_stages)]


def v_placement(n_stages: int, n_ranks: int) -> list[int]:
    """The V shape of two stages per rank: stage s and 2R-1-s on one rank (ZBV, DualPipeV)."""
    if n_stages != 2 * n_ranks:
        raise ScheduleError(f"the V placement holds exactly two stages per rank (n_stages = 2 x n_ranks), got "
                            f"n_stages={n_stages} for n_ranks={n_ranks}; use n_stages={2 * n_ranks}")
    return [s if s < n_ranks else 2 * n_ranks - 1 - s for s in range(n_stages)]


class ScheduleError(FxpipeError, ValueError):
    """A schedule cannot be built, or is inconsistent, or deadlocks."""


SCHEDULES: dict[str, ScheduleFn] = {}
_PLACEMENTS: dict[str, PlacementFn] = {}
_STAGES_PER_RANK: dict[str, int] = {}


def register(name: str, placement: PlacementFn | None = None, stages_per_rank: int = 1
             ) -> Callable[[ScheduleFn], ScheduleFn]:
    """Decorator adding `fn(n_ranks, n_microbatches, stages_per_rank)` to SCHEDULES as `name`, with
    its placement (stage -> rank; loop_placement by default) and its default stages per rank.
    A new schedule is this function and a placement; every consumer reads both from here."""

    def add(fn: ScheduleFn) -> ScheduleFn:
        if name in SCHEDULES:
            raise ValueError(f"schedule {name!r} is already registered; pick another name")
        SCHEDULES[name] = fn
        _PLACEMENTS[name] = placement or loop_placement
        _STAGES_PER_RANK[name] = stages_per_rank
        return fn

    return add


def _known(name: str) -> None:
    if name not in SCHEDULES:
        known = ", ".join(sorted(SCHEDULES))
        raise ScheduleError(f"unknown schedule {name!r}; known schedules: {known}")


def placement(name: str, n_stages: int, n_ranks: int) -> list[int]:
    """Where schedule `name` puts each stage: the one function that maps stage -> rank."""
    _known(name)
    return _PLACEMENTS[name](n_stages, n_ranks)


def default_stages_per_rank(name: str) -> int:
    """Stages per rank schedule `name` runs unless told otherwise (2 for interleaved-1f1b and zbv)."""
    _known(name)
    return _STAGES_PER_RANK[name]


def default_stages_text() -> str:
    """The registered defaults for command-line help: "2 for dualpipev, ... and zbv, else 1"."""
    by: dict[int, list[str]] = {}
    for name in sorted(SCHEDULES):
        by.setdefault(_STAGES_PER_RANK[name], []).append(name)
    parts = [f"{v} for {', '.join(names[:-1])} and {names[-1]}" if len(names) > 1 else f"{v} for {names[0]}"
             for v, names in sorted(by.items()) if v != 1]
    return ", ".join(parts) + ", else 1"


def build(name: str, n_ranks: int, n_microbatches: int, stages_per_rank: int = 1) -> Schedule:
    """Build the registered schedule `name`; ScheduleError for unknown names or bad sizes."""
    _known(name)
    return SCHEDULES[name](n_ranks, n_microbatches, stages_per_rank)


def _check_sizes(name: str, n_ranks: int, n_microbatches: int, stages_per_rank: int) -> None:
    if n_ranks < 1:
        raise ScheduleError(f"{name}: n_ranks must be >= 1 (got R={n_ranks}); use one rank or more")
    if n_microbatches < 1:
        raise ScheduleError(
            f"{name}: n_microbatches must be >= 1 (got M={n_microbatches}); "
            "split the batch into at least one microbatch"
        )
    if stages_per_rank < 1:
        raise ScheduleError(
            f"{name}: stages_per_rank must be >= 1 (got v={stages_per_rank}); use v=1 or more"
        )


def _one_stage_per_rank(name: str, stages_per_rank: int) -> None:
    if stages_per_rank != 1:
        raise ScheduleError(
            f"{name} runs one stage per rank (got stages_per_rank={stages_per_rank}); "
            "use stages_per_rank=1, or 'interleaved-1f1b' / 'gpipe' for several stages per rank"
        )


@register("gpipe")
def gpipe(n_ranks: int, n_microbatches: int, stages_per_rank: int = 1) -> Schedule:
    """GPipe: every forward, then every backward; with v>1 stages per rank, breadth first."""
    return _breadth_first("gpipe", n_ranks, n_microbatches, stages_per_rank)


@register("looped-bfs", stages_per_rank=2)
def looped_bfs(n_ranks: int, n_microbatches: int, stages_per_rank: int = 2) -> Schedule:
    """Looped BFS (Lamy-Poirier 2023, "Breadth-First Pipeline Parallelism"): v stages per rank in the
    loop placement, each rank runs every microbatch through its first stage, then its next, and the
    backwards in reverse: GPipe breadth first, with two stages per rank unless told otherwise."""
    return _breadth_first("looped-bfs", n_ranks, n_microbatches, stages_per_rank)


def _breadth_first(name: str, n_ranks: int, n_microbatches: int, stages_per_rank: int) -> Schedule:
    _check_sizes(name, n_ranks, n_microbatches, stages_per_rank)
    schedule: Schedule = {}
    for rank in range(n_ranks):
        local = [rank + chunk * n_ranks for chunk in range(stages_per_rank)]
        mbs = range(n_microbatches)
        forwards = [Action(s, "F", m) for s in local for m in mbs]
        backwards = [Action(s, "B", m) for s in reversed(local) for m in mbs]
        schedule[rank] = forwards + backwards
    return schedule


def _warmup_steady_cooldown(warmup: int, n: int) -> list[tuple[str, int]]:
    """The 1F1B skeleton over n items: `warmup` F, then (F, B) pairs, then the remaining B."""
    order = [("F", i) for i in range(warmup)]
    for i in range(n - warmup):
        order += [("F", warmup + i), ("B", i)]
    order += [("B", i) for i in range(n - warmup, n)]
    return order


@register("1f1b")
def one_f_one_b(n_ranks: int, n_microbatches: int, stages_per_rank: int = 1) -> Schedule:
    """1F1B (PipeDream-flush): S-s-1 warm-up forwards, alternate F and B, drain the B."""
    _check_sizes("1f1b", n_ranks, n_microbatches, stages_per_rank)
    _one_stage_per_rank("1f1b", stages_per_rank)
    schedule: Schedule = {}
    for s in range(n_ranks):
        warmup = min(n_ranks - s - 1, n_microbatches)
        pairs = _warmup_steady_cooldown(warmup, n_microbatches)
        schedule[s] = [Action(s, kind, m) for kind, m in pairs]
    return schedule


@register("1f1b-overlap")
def one_f_one_b_overlap(n_ranks: int, n_microbatches: int, stages_per_rank: int = 1) -> Schedule:
    """1F1B with one more warm-up forward on every rank but the last: stage s < S-1 runs S-s+1
    forwards before its first B (1F1B: S-s), the last stage F, B alternately as in 1F1B.
    In 1F1B's steady state both ends of a boundary trade an F's output for a B's input grads at
    the same moment, so every step waits for that exchange; one microbatch ahead, a rank's F
    output is sent a whole step before its peer needs it and the peer runs its F and B back to
    back: only the grads' arrival, on the rank with slack, remains. The cost is one more
    microbatch of activations on those stages (min(M, S-s+1)). With equal costs and no
    communication the step is 1F1B's; pipe.simulate prices the messages that decide between them.
    """
    _check_sizes("1f1b-overlap", n_ranks, n_microbatches, stages_per_rank)
    _one_stage_per_rank("1f1b-overlap", stages_per_rank)
    return {s: [Action(s, kind, m) for kind, m in
                _warmup_steady_cooldown(min(n_ranks - s - (s == n_ranks - 1), n_microbatches), n_microbatches)]
            for s in range(n_ranks)}


@register("interleaved-1f1b", stages_per_rank=2)
def interleaved_1f1b(n_ranks: int, n_microbatches: int, stages_per_rank: int = 1) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021, as in Megatron-LM): v chunks per rank.

    Microbatches go in groups of R; each rank runs a group through chunk 0, then chunk 1, ...
    Warm-up is (v-1)*R + 2*(R-1-r) forwards (Megatron's count, made for paired send/receive
    steps; with asynchronous sends (R-1-r) gives the same bubble and fewer mbs in flight),
    then 1F1B over the M*v (chunk, mb) items, backwards visiting chunks in reverse.
    Requires M % R == 0.
    """
    return _interleaved_order("interleaved-1f1b", n_ranks, n_microbatches, stages_per_rank)


@register("interleaved-zb", stages_per_rank=2)
def interleaved_zb(n_ranks: int, n_microbatches: int, stages_per_rank: int = 2) -> Schedule:
    """Interleaved zero bubble: interleaved 1F1B's order of F and B (v stages per rank, loop
    placement), with each B split into B and W and the W deferred into the bubbles.

    Built by running that order with unit times (T_F = T_B = T_W): at each step a rank runs its next
    F or B if it is ready and it holds at most `R - 1` deferred W, else its oldest deferred W, else
    waits; the W left at the end close the step. A microbatch stays alive on a stage from its F to
    its W, so a rank holds at most R more than interleaved 1F1B keeps from F to B. With equal costs
    the step is 3vM + R - 1 units: only the start-up is idle. Requires M % R == 0 (the interleaved
    order's groups)."""
    name = "interleaved-zb"
    order = _interleaved_order(name, n_ranks, n_microbatches, stages_per_rank)
    R, S = n_ranks, n_ranks * stages_per_rank
    end: dict[Action, int] = {}
    pos = [0] * R
    deferred: list[list[Action]] = [[] for _ in range(R)]
    schedule: Schedule = {r: [] for r in range(R)}
    step = 0
    while any(pos[r] < len(order[r]) or deferred[r] for r in range(R)):
        chosen: dict[int, Action] = {}
        for r in range(R):
            nxt = order[r][pos[r]] if pos[r] < len(order[r]) else None
            if nxt is not None and len(deferred[r]) < R and all(
                    end.get(d, step + 1) <= step for d in dependencies(nxt, S)):
                chosen[r] = nxt
                pos[r] += 1
                if nxt.kind == "B":
                    deferred[r].append(Action(nxt.stage, "W", nxt.mb))
            elif deferred[r]:
                chosen[r] = deferred[r].pop(0)
        if not chosen and all(end.get(a, 0) <= step for acts in schedule.values() for a in acts):
            raise ScheduleError(f"{name}: no rank can run at step {step} (R={R}, M={n_microbatches}, "
                                f"v={stages_per_rank}); this is a bug in the builder")
        for r, a in chosen.items():
            schedule[r].append(a)
            end[a] = step + 1
        step += 1
    return schedule


@register("dualpipev", placement=v_placement, stages_per_rank=2)
def dualpipev(n_ranks: int, n_microbatches: int, stages_per_rank: int = 2) -> Schedule:
    """DualPipeV (DeepSeek-AI 2025, DualPipe's "cut-in-half" V form): two stages per rank in the V
    placement (rank r holds stage r, its chunk 0, and stage 2R-1-r, its chunk 1), in eight phases:
    1. 2(R-1-r) forwards of chunk 0;  2. r+1 times F chunk 0, F chunk 1;
    3. R-1-r times B chunk 1 (W deferred), the oldest deferred W, F chunk 1;
    4. M-2R+r+1 times F chunk 0, B chunk 1, F chunk 1, B chunk 0 (the pairs DualPipe overlaps);
    5. R-1-r times B chunk 1, F chunk 1, B chunk 0;  6. r+1 times B chunk 1, B chunk 0, whose W are
    deferred from the middle on (odd ranks from a chunk 1 B, even ranks from the chunk 0 B after it);
    7. R-1-r times the oldest deferred W, B chunk 0 (W deferred);  8. the r+1 deferred W left.
    Each chunk takes its microbatches in order; a B whose W is not deferred has its W right after
    it (the full backward DualPipe runs there). Here F and B of a pair run one after the other:
    DualPipe's overlap hides expert-parallel all-to-all inside them, which stages of one device do
    not have. With equal costs the step is 6M + R - 1 units: only the start-up is idle. Requires
    M >= 2R.
    """
    name = "dualpipev"
    _check_sizes(name, n_ranks, n_microbatches, stages_per_rank)
    if stages_per_rank != 2:
        raise ScheduleError(f"{name} runs exactly two stages per rank in the V placement (got stages_per_rank="
                            f"{stages_per_rank}); use stages_per_rank=2, or 'interleaved-zb' for other counts")
    R, M = n_ranks, n_microbatches
    if M < 2 * R:
        raise ScheduleError(f"{name} needs at least two microbatches per rank (got M={M}, R={R}); use M >= {2 * R}, "
                            "or 'zbv' (the same placement) for fewer")
    schedule: Schedule = {}
    for r in range(R):
        half = (r + 1) // 2  # phase 6 defers W from its middle on
        phases = [(2 * (R - 1 - r), ["F0"]), (r + 1, ["F0", "F1"]), (R - 1 - r, ["B1w", "W", "F1"]),
                  (M - 2 * R + r + 1, ["F0", "B1", "F1", "B0"]), (R - 1 - r, ["B1", "F1", "B0"])]
        phases += [(1, ["B1w" if i > half or (i == half and r % 2) else "B1", "B0w" if i >= half else "B0"])
                   for i in range(r + 1)]
        phases += [(R - 1 - r, ["W", "B0w"])]
        schedule[r] = _dualpipev_rank((r, 2 * R - 1 - r), phases)
    return schedule


def _dualpipev_rank(stages: tuple[int, int], phases: list[tuple[int, list[str]]]) -> list[Action]:
    """One rank's DualPipeV actions from its phases: (repeats, ops), an op "F{c}" or "B{c}" of chunk c
    (its W right after it, or deferred with a trailing "w"), or "W" (the oldest deferred W); the W
    still deferred at the end close the list."""
    count = {"F": [0, 0], "B": [0, 0]}
    acts: list[Action] = []
    deferred: list[Action] = []
    for repeats, ops in phases:
        for _ in range(repeats):
            for op in ops:
                if op == "W":
                    acts.append(deferred.pop(0))
                    continue
                kind, c = op[0], int(op[1])
                m = count[kind][c]
                count[kind][c] += 1
                acts.append(Action(stages[c], kind, m))
                if kind == "B":
                    (deferred if op.endswith("w") else acts).append(Action(stages[c], "W", m))
    return acts + deferred


def _interleaved_order(name: str, n_ranks: int, n_microbatches: int, stages_per_rank: int) -> Schedule:
    """Interleaved 1F1B's per-rank order of F and B (see interleaved_1f1b), checked under `name`."""
    _check_sizes(name, n_ranks, n_microbatches, stages_per_rank)
    if n_microbatches % n_ranks:
        raise ScheduleError(
            f"{name} needs n_microbatches divisible by n_ranks (got M={n_microbatches}, "
            f"R={n_ranks}); use M a multiple of {n_ranks}, "
            f"e.g. M={_round_up(n_microbatches, n_ranks)}"
        )
    v = stages_per_rank
    total = n_microbatches * v
    schedule: Schedule = {}
    for rank in range(n_ranks):
        warmup = min((v - 1) * n_ranks + 2 * (n_ranks - 1 - rank), total)
        actions = []
        for kind, k in _warmup_steady_cooldown(warmup, total):
            group, within = divmod(k, n_ranks * v)
            chunk = within // n_ranks
            if kind == "B":
                chunk = v - 1 - chunk
            mb = group * n_ranks + within % n_ranks
            actions.append(Action(chunk * n_ranks + rank, kind, mb))
        schedule[rank] = actions
    return schedule


def _round_up(value: int, multiple: int) -> int:
    return max(multiple, -(-value // multiple) * multiple)


@register("zb-h1")
def zb_h1(n_ranks: int, n_microbatches: int, stages_per_rank: int = 1) -> Schedule:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", sec. 2.1, fig. 3 top).

    The 1F1B order with B split into B (input grad) and W (weight grad). Stage s runs its
    first s steady-state (F, B) pairs without W, then (F, B, W) with W trailing by s
    microbatches, then (B, W) in the cool-down and its s late W last: the deferred W fill
    the cool-down bubbles. Counting a microbatch in flight from its F to its W (the runtime
    frees activations after W), every stage holds min(M, S): the first stage's 1F1B peak.
    Later stages hold more than under 1F1B, none more than 1F1B's busiest stage, which is
    the paper's memory claim.
    """
    _check_sizes("zb-h1", n_ranks, n_microbatches, stages_per_rank)
    _one_stage_per_rank("zb-h1", stages_per_rank)
    schedule: Schedule = {}
    for s in range(n_ranks):
        warmup = min(n_ranks - s - 1, n_microbatches)
        actions: list[Action] = []
        n_w = 0
        for kind, m in _warmup_steady_cooldown(warmup, n_microbatches):
            actions.append(Action(s, kind, m))
            if kind == "B" and m >= s:
                actions.append(Action(s, "W", n_w))
                n_w += 1
        actions += [Action(s, "W", m) for m in range(n_w, n_microbatches)]
        schedule[s] = actions
    return schedule


@register("zbv", placement=v_placement, stages_per_rank=2)
def zbv(n_ranks: int, n_microbatches: int, stages_per_rank: int = 2) -> Schedule:
    """ZB-V (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", sec. 6): two stages per rank in
    the V placement (rank r holds stages r and 2R-1-r), B split into B and W.

    Built by running the pipeline with unit times (T_F = T_B = T_W, the paper's setting): at each
    step a rank runs, of what is ready, an F (the returning chunk first; a new microbatch enters
    chunk 0 only while its two pairs fit: the (stage, mb) pairs alive on the rank, F to W, plus
    those its entered microbatches will still open in chunk 1, at most 2R), else the oldest B
    (the chunk nearer the loss first), else the oldest W. So at most 2R pairs are alive on a
    rank: with stages half the size, the activations 1F1B keeps on its first rank. For M >= 2R
    the makespan is within R units of 6M + R - 1, where only the start-up is idle.
    """
    _check_sizes("zbv", n_ranks, n_microbatches, stages_per_rank)
    if stages_per_rank != 2:
        raise ScheduleError(f"zbv runs exactly two stages per rank in the V placement (got stages_per_rank="
                            f"{stages_per_rank}); use stages_per_rank=2, or 'interleaved-1f1b' for other counts")
    R, M, S = n_ranks, n_microbatches, 2 * n_ranks
    end: dict[Action, int] = {}  # action -> the step after the one it ran in
    alive = [0] * R
    entered = [0] * R  # microbatches that entered chunk 0 on each rank
    returned = [0] * R  # ... and that ran their F in chunk 1
    todo = {r: {Action(s, k, m) for s in (r, S - 1 - r) for k in "FBW" for m in range(M)} for r in range(R)}
    schedule: Schedule = {r: [] for r in range(R)}
    step = 0
    while any(todo.values()):
        chosen: dict[int, Action] = {}
        for r in range(R):
            ready = [a for a in todo[r] if all(end.get(d, step + 1) <= step for d in dependencies(a, S))]
            bs = sorted((a for a in ready if a.kind == "B"), key=lambda a: (a.mb, -a.stage))
            fs = sorted((a for a in ready if a.kind == "F" and (a.stage != r or (
                a.mb == entered[r] and alive[r] + entered[r] - returned[r] + 2 <= 2 * R))),
                        key=lambda a: (-a.stage, a.mb))
            ws = sorted((a for a in ready if a.kind == "W"), key=lambda a: (a.mb, -a.stage))
            for group in (fs, bs, ws):
                if group:
                    chosen[r] = group[0]
                    break
        if not chosen and all(end.get(a, 0) <= step for acts in schedule.values() for a in acts):
            raise ScheduleError(f"zbv: no rank can run at step {step} (R={R}, M={M}); this is a bug in the builder")
        for r, a in chosen.items():
            todo[r].discard(a)
            schedule[r].append(a)
            end[a] = step + 1
            alive[r] += 1 if a.kind == "F" else -1 if a.kind == "W" else 0
            entered[r] += a.kind == "F" and a.stage == r
            returned[r] += a.kind == "F" and a.stage != r
        step += 1
    return schedule


def dependencies(action: Action, n_stages: int) -> list[Action]:
    """What must run before `action`: the one place the dependency rule lives.

    F(s,m) after F(s-1,m); B(s,m) after F(s,m) and B(s+1,m) (the last stage only after its
    F); W(s,m) after B(s,m). Whether (s,m) has a W does not change these edges.
    """
    s, kind, m = action
    if kind == "F":
        return [Action(s - 1, "F", m)] if s > 0 else []
    if kind == "B":
        before = [Action(s, "F", m)]
        return [*before, Action(s + 1, "B", m)] if s < n_stages - 1 else before
    if kind == "W":
        return [Action(s, "B", m)]
    raise ScheduleError(f"action {action} has kind {kind!r}; expected 'F', 'B' or 'W'")


def grid(schedule: Schedule, mark: set[tuple[int, int]] | None = None) -> str:
    """Rank x step text grid, one row per rank; cells in `mark` ((rank, step)) get [brackets]."""
    marked = mark or set()
    ranks = sorted(schedule)
    cells = {
        (r, i): f"[{a}]" if (r, i) in marked else f" {a} "
        for r in ranks
        for i, a in enumerate(schedule[r])
    }
    width = max((len(c) for c in cells.values()), default=3)
    n_steps = max((len(schedule[r]) for r in ranks), default=0)
    label = max((len(f"rank {r}") for r in ranks), default=4)
    lines = ["step".ljust(label) + " |" + "".join(f" {i}".ljust(width) for i in range(n_steps))]
    for r in ranks:
        row = "".join(cells[r, i].ljust(width) for i in range(len(schedule[r])))
        lines.append(f"rank {r}".ljust(label) + " |" + row)
    lines.append("legend: {stage}{F forward|B backward|W weight grad}{mb}; [x] marks the problem")
    return "\n".join(line.rstrip() for line in lines)


def _fail(
    schedule: Schedule, headline: str, problems: list[str], mark: set[tuple[int, int]]
) -> None:
    shown = problems[:12] + ([f"... and {len(problems) - 12} more"] if len(problems) > 12 else [])
    body = "\n".join(f"  {p}" for p in shown)
    raise ScheduleError(f"{headline}\n{body}\n{grid(schedule, mark=mark)}")


def _check_structure(schedule: Schedule, n_stages: int, n_microbatches: int,
                     place: Sequence[int] | None = None) -> None:
    """Exactly one F and one B per (stage, mb), W for all or none of a stage's mbs, right rank."""
    n_ranks = len(schedule)
    place = list(place) if place is not None else loop_placement(n_stages, n_ranks)
    if sorted(schedule) != list(range(n_ranks)):
        raise ScheduleError(f"schedule ranks must be 0..{n_ranks - 1}, got {sorted(schedule)}")
    problems: list[str] = []
    mark: set[tuple[int, int]] = set()
    seen: dict[Action, tuple[int, int]] = {}
    for r in range(n_ranks):
        for i, a in enumerate(schedule[r]):
            where = f"rank {r} step {i}: {a}"
            if a.kind not in ("F", "B", "W") or not (0 <= a.stage < n_stages):
                problems.append(f"{where} is outside kinds F/B/W and stages 0..{n_stages - 1}")
            elif not 0 <= a.mb < n_microbatches:
                problems.append(f"{where} is outside microbatches 0..{n_microbatches - 1}")
            elif place[a.stage] != r:
                problems.append(f"{where} is on the wrong rank: stage {a.stage} lives on "
                                f"rank {place[a.stage]} (placement {place})")
            elif a in seen:
                problems.append(f"{where} is a duplicate of rank {seen[a][0]} step {seen[a][1]}")
            else:
                seen[a] = (r, i)
                continue
            mark.add((r, i))
    for s in range(n_stages):
        n_w = sum(Action(s, "W", m) in seen for m in range(n_microbatches))
        for m in range(n_microbatches):
            kinds = ("F", "B", "W") if n_w else ("F", "B")
            problems += [f"missing {Action(s, k, m)} (stage {s} lives on rank {place[s]})"
                         for k in kinds if Action(s, k, m) not in seen]
    if problems:
        _fail(schedule, f"invalid schedule: {len(problems)} problem(s)", problems, mark)


def execution_order(
    schedule: Schedule, n_stages: int, n_microbatches: int, place: Sequence[int] | None = None
) -> list[tuple[int, Action]]:
    """Run all ranks in lock-step with asynchronous sends; return (rank, action) in run order.

    In each step every rank whose next action has all its dependencies done (on any rank,
    in earlier steps) runs it; a rank whose next action is not ready waits. Raises
    ScheduleError on a structural problem or a deadlock, with the blocked actions marked.
    """
    return [(r, a) for _, r, a in lock_step(schedule, n_stages, n_microbatches, place)]


def lock_step(
    schedule: Schedule, n_stages: int, n_microbatches: int, place: Sequence[int] | None = None
) -> list[tuple[int, int, Action]]:
    """(step, rank, action) of execution_order: the step is the lock-step round it runs in.
    `place` maps stage -> rank (default loop_placement)."""
    _check_structure(schedule, n_stages, n_microbatches, place)
    ranks = sorted(schedule)
    pos = dict.fromkeys(ranks, 0)
    done: set[Action] = set()
    order: list[tuple[int, int, Action]] = []
    step = 0
    while True:
        ready = [
            (r, schedule[r][pos[r]])
            for r in ranks
            if pos[r] < len(schedule[r])
            and all(d in done for d in dependencies(schedule[r][pos[r]], n_stages))
        ]
        if not ready:
            break
        for r, a in ready:
            done.add(a)
            pos[r] += 1
            order.append((step, r, a))
        step += 1
    blocked = [r for r in ranks if pos[r] < len(schedule[r])]
    if blocked:
        where = {a: (r, i) for r in ranks for i, a in enumerate(schedule[r])}
        problems = []
        for r in blocked:
            a = schedule[r][pos[r]]
            waits = [d for d in dependencies(a, n_stages) if d not in done]
            desc = ", ".join(f"{d} (rank {where[d][0]} step {where[d][1]})" for d in waits)
            problems.append(f"rank {r} step {pos[r]}: {a} waits for {desc}")
        _fail(schedule, "deadlock: no rank can run its next action", problems,
              {(r, pos[r]) for r in blocked})
    return order


def validate(schedule: Schedule, n_stages: int, n_microbatches: int, place: Sequence[int] | None = None) -> None:
    """Raise ScheduleError unless the schedule is complete, on the right ranks and deadlock-free."""
    execution_order(schedule, n_stages, n_microbatches, place)


def max_in_flight(schedule: Schedule, stage: int, fused: bool = False) -> int:
    """Peak number of mbs alive on `stage`: F opens, W closes if the stage has W (and its backward is not
    `fused` into one BW at its B, as compiled stages run it), else B."""
    actions = [a for acts in schedule.values() for a in acts if a.stage == stage]
    closer = "W" if not fused and any(a.kind == "W" for a in actions) else "B"
    alive = peak = 0
    for a in actions:
        if a.kind == "F":
            alive += 1
            peak = max(peak, alive)
        elif a.kind == closer:
            alive -= 1
    return peak


def in_flight_limit(
    name: str, n_stages: int, n_microbatches: int, stage: int, stages_per_rank: int = 1, fused: bool = False
) -> int:
    """Peak mbs whose activations schedule `name` keeps alive on `stage` (see max_in_flight; `fused`: each B runs
    with its W, as a compiled stage's backward)."""
    if not 0 <= stage < n_stages:
        raise ScheduleError(f"stage {stage} is outside 0..{n_stages - 1}")
    if n_stages % stages_per_rank:
        raise ScheduleError(
            f"n_stages={n_stages} is not a multiple of stages_per_rank={stages_per_rank}; "
            "use n_stages = n_ranks * stages_per_rank"
        )
    got = None if fused else closed_form(name, n_stages, n_microbatches)
    if got is not None:
        return got[stage]
    n_ranks = n_stages // stages_per_rank
    return max_in_flight(build(name, n_ranks, n_microbatches, stages_per_rank), stage, fused)
