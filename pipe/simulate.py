"""Simulate a schedule with per-stage costs: timeline, makespan, bubble, trace and pictures."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipe.lower import Program, late_batches, walk
from pipe.schedules import (
    Action,
    Schedule,
    ScheduleError,
    dependencies,
    execution_order,
    loop_placement,
)

__all__ = ["COLLECTIVE_TID", "Event", "Timeline", "simulate", "simulate_program", "textbook_bubble"]

_COLOURS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868", "BW": "#c44e52", "REDUCE_GRAD": "#8172b3"}
_NAMES = {"F": "forward", "B": "backward", "W": "weight grad", "BW": "backward with weight grads",
          "REDUCE_GRAD": "grad all-reduce (data parallel)"}
COLLECTIVE_TID = 1000  # Chrome trace: rank r's grad collectives on this tid + r


@dataclass(frozen=True)
class Event:
    """One action run by one rank from `start` to `end` (milliseconds)."""

    rank: int
    action: Action
    start: float
    end: float


@dataclass
class Timeline:
    """Events of one pipeline step on `n_ranks` ranks, simulated or measured. `collectives`: the
    data-parallel grad reductions (REDUCE_GRAD, mb = bucket), each from its launch to its end, in a
    lane of their own beside each rank's compute; the step ends with the last of either. `posts`: the
    host's time posting each batch of messages (POST), between a rank's compute actions."""

    events: list[Event]
    n_ranks: int
    collectives: list[Event] = field(default_factory=list)
    posts: list[Event] = field(default_factory=list)

    @property
    def makespan(self) -> float:
        """Time from the first start to the last end (collectives included), in ms."""
        every = self.events + self.collectives
        if not every:
            return 0.0
        return max(e.end for e in every) - min(e.start for e in every)

    def busy(self, rank: int) -> float:
        """Time `rank` spends running actions, in ms."""
        return sum(e.end - e.start for e in self.events if e.rank == rank)

    def idle(self, rank: int) -> float:
        """Time `rank` waits within the makespan, in ms."""
        return self.makespan - self.busy(rank)

    @property
    def bubble(self) -> float:
        """Idle fraction: sum of idle time over n_ranks * makespan (0 for an empty timeline)."""
        span = self.makespan
        if span <= 0:
            return 0.0
        return sum(self.idle(r) for r in range(self.n_ranks)) / (self.n_ranks * span)

    def collective_time(self, rank: int) -> float:
        """How long `rank` had a grad collective in flight (the union of their spans), in ms."""
        spans = sorted((e.start, e.end) for e in self.collectives if e.rank == rank)
        total, reach = 0.0, float("-inf")
        for lo, hi in spans:
            if hi > reach:
                total += hi - max(lo, reach)
                reach = hi
        return total

    def exposed(self, rank: int) -> float:
        """The grad collectives' time on `rank` not hidden behind its compute: from its last compute
        action's end to its last collective's end (0 when they end first), in ms."""
        mine = [e.end for e in self.collectives if e.rank == rank]
        last = max((e.end for e in self.events if e.rank == rank), default=0.0)
        return max(0.0, max(mine) - last) if mine else 0.0

    def to_json(self) -> dict[str, Any]:
        """Plain dict (json.dumps-able); Timeline.from_json reads it back."""
        def rows(events: list[Event]) -> list[dict[str, Any]]:
            return [{"rank": e.rank, "action": str(e.action), "start": e.start, "end": e.end} for e in events]
        return {"n_ranks": self.n_ranks, "events": rows(self.events), "collectives": rows(self.collectives),
                "posts": rows(self.posts)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Timeline:
        """Inverse of to_json."""
        def events(rows: list[dict[str, Any]]) -> list[Event]:
            return [Event(int(e["rank"]), Action.from_str(e["action"]), float(e["start"]), float(e["end"]))
                    for e in rows]
        return cls(events(data["events"]), int(data["n_ranks"]), events(data.get("collectives", [])),
                   events(data.get("posts", [])))

    def to_chrome_trace(self) -> dict[str, Any]:
        """Chrome/Perfetto trace-event JSON: one complete ("X") event per action and per batch posted,
        tid = rank; the grad collectives of rank r on tid COLLECTIVE_TID + r ("rank r grad all-reduce")."""
        lanes = [(r, f"rank {r}") for r in range(self.n_ranks)]
        lanes += [(COLLECTIVE_TID + r, f"rank {r} grad all-reduce")
                  for r in sorted({e.rank for e in self.collectives})]
        names = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": t, "args": {"name": n}} for t, n in lanes]
        events = [
            {
                "name": str(e.action),
                "cat": e.action.kind,
                "ph": "X",
                "pid": 0,
                "tid": e.rank + (COLLECTIVE_TID if lane else 0),
                "ts": e.start * 1000.0,
                "dur": (e.end - e.start) * 1000.0,
                "args": {"stage": e.action.stage, ("bucket" if lane else "mb"): e.action.mb},
            }
            for lane, group in ((False, self.events), (False, self.posts), (True, self.collectives)) for e in group
        ]
        return {"traceEvents": names + events, "displayTimeUnit": "ms"}

    def lanes(self) -> list[tuple[str, list[Event]]]:
        """The rows of a picture: each rank's compute, then its grad collectives when it has any."""
        out = []
        for r in range(self.n_ranks):
            out.append((f"rank {r}", [e for e in self.events if e.rank == r]))
            coll = [e for e in self.collectives if e.rank == r]
            if coll:
                out.append((f"rank {r} all-reduce", coll))
        return out

    def to_text(self, width: int = 100) -> str:
        """One row per lane, one column per makespan/width slice: F, B, W, R (grad all-reduce) or '.' idle."""
        if width < 1:
            raise ValueError(f"width must be >= 1 (got {width})")
        t0 = min((e.start for e in self.events + self.collectives), default=0.0)
        step = self.makespan / width
        lanes = self.lanes()
        pad = max((len(name) for name, _ in lanes), default=0)
        rows = []
        for name, mine in lanes:
            row = (_slice_char(mine, t0 + i * step, t0 + (i + 1) * step) for i in range(width))
            rows.append(f"{name:<{pad}} |{''.join(row)}|")
        rows.append(
            "legend: F forward, B backward, W weight grad, R grad all-reduce, . idle; "
            f"one column = {step:.3g} ms, makespan {self.makespan:.3g} ms"
        )
        return "\n".join(rows)

    def to_png(self, path: str, title: str = "") -> None:
        """Draw the timeline (a row per rank, F/B/W coloured, idle grey; a rank's grad collectives in
        a row of their own below it) into a PNG file."""
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
            from matplotlib.patches import Patch
        except ImportError as err:
            raise RuntimeError(
                "Timeline.to_png needs matplotlib; install it with `pip install fxpipe[plot]`"
            ) from err
        t0 = min((e.start for e in self.events + self.collectives), default=0.0)
        span = self.makespan or 1.0
        lanes = self.lanes()
        fig = Figure(figsize=(12, 0.6 * len(lanes) + 1.4))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        for row, (_, mine) in enumerate(lanes):
            ax.barh(row, span, left=0.0, height=0.8, color="#e6e6e6", hatch="//", edgecolor="#c8c8c8")
            for e in mine:
                left, dur = e.start - t0, e.end - e.start
                thin = e.action.kind == "REDUCE_GRAD"  # short and many: no white edge to hide them
                ax.barh(row, dur, left=left, height=0.8, color=_COLOURS.get(e.action.kind, "grey"),
                        edgecolor="white", linewidth=0.0 if thin else 0.5)
                label = str(e.action) if e.action.kind != "REDUCE_GRAD" else f"s{e.action.stage}b{e.action.mb}"
                if dur >= span * (len(label) + 1) / 180:  # about the label's width at 7 pt
                    ax.text(left + dur / 2, row, label, ha="center", va="center", fontsize=7, color="white")
        ax.set_yticks(range(len(lanes)), [name for name, _ in lanes])
        ax.invert_yaxis()
        ax.set_xlim(0, span)
        ax.set_xlabel("time (ms)")
        ax.set_title(title or f"makespan {self.makespan:.3g} ms, bubble {self.bubble:.1%}")
        kinds = {e.action.kind for e in self.events + self.collectives}
        handles = [Patch(color=c, label=_NAMES[k]) for k, c in _COLOURS.items() if k in kinds]
        handles.append(Patch(facecolor="#e6e6e6", hatch="//", edgecolor="#c8c8c8", label="idle"))
        ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=4,
                  frameon=False)
        fig.tight_layout()
        fig.savefig(path, format="png", dpi=120)


def _slice_char(events: list[Event], lo: float, hi: float) -> str:
    """Kind letter of the event covering most of [lo, hi), or '.' when mostly idle."""
    best, best_overlap, covered = ".", 0.0, 0.0
    for e in events:
        overlap = min(e.end, hi) - max(e.start, lo)
        if overlap > 0:
            covered += overlap
            if overlap > best_overlap:
                best, best_overlap = "R" if e.action.kind == "REDUCE_GRAD" else e.action.kind, overlap
    return best if covered * 2 >= hi - lo else "."


def _check_len(name: str, values: Sequence[float], expected: int, meaning: str) -> None:
    if len(values) != expected:
        raise ValueError(
            f"{name} needs {expected} values ({meaning}), got {len(values)}; pass one per "
            f"{'boundary' if name == 'comm_ms' else 'stage'}"
        )


def simulate(
    schedule: Schedule,
    *,
    f_ms: Sequence[float],
    b_ms: Sequence[float],
    w_ms: Sequence[float] | None = None,
    comm_ms: Sequence[float] | None = None,
    place: Sequence[int] | None = None,
) -> Timeline:
    """Run `schedule` with per-stage costs; each rank follows its list in order.

    f_ms, b_ms, w_ms: per stage forward, input-grad backward and weight-grad times (w_ms None
    means 0). A B whose (stage, mb) has no W in the schedule takes b_ms + w_ms. comm_ms[i]:
    transfer time across boundary i (stage i <-> i+1), charged to activations and gradients
    alike, and only when the two stages sit on different ranks (`place`: stage -> rank, default
    loop_placement). An action starts at
    max(its rank is free, each dependency's end + transfer). Deadlock raises ScheduleError.
    """
    n_stages = len(f_ms)
    _check_len("b_ms", b_ms, n_stages, "one per stage, like f_ms")
    w = list(w_ms) if w_ms is not None else [0.0] * n_stages
    _check_len("w_ms", w, n_stages, "one per stage, like f_ms")
    comm = list(comm_ms) if comm_ms is not None else [0.0] * max(n_stages - 1, 0)
    _check_len("comm_ms", comm, max(n_stages - 1, 0), "one per boundary: n_stages - 1")
    n_ranks = len(schedule)
    n_microbatches = 1 + max((a.mb for acts in schedule.values() for a in acts), default=-1)
    where = list(place) if place is not None else loop_placement(n_stages, n_ranks)
    order = execution_order(schedule, n_stages, n_microbatches, where)
    has_w = {a.stage for acts in schedule.values() for a in acts if a.kind == "W"}
    end: dict[Action, float] = {}
    free = [0.0] * n_ranks
    events = []
    for rank, a in order:
        start = free[rank]
        for d in dependencies(a, n_stages):
            hop = 0.0
            if d.stage != a.stage and where[d.stage] != where[a.stage]:
                hop = comm[min(d.stage, a.stage)]
            start = max(start, end[d] + hop)
        if a.kind == "F":
            cost = f_ms[a.stage]
        elif a.kind == "W":
            cost = w[a.stage]
        else:
            cost = b_ms[a.stage] + (0.0 if a.stage in has_w else w[a.stage])
        end[a] = free[rank] = start + cost
        events.append(Event(rank, a, start, start + cost))
    return Timeline(events, n_ranks)


def simulate_program(
    program: Program,
    n_stages: int,
    *,
    f_ms: Sequence[float],
    b_ms: Sequence[float],
    w_ms: Sequence[float] | None = None,
    comm_ms: Sequence[float] | None = None,
    place: Sequence[int] | None = None,
    reload_ms: Sequence[float] | None = None,
    reduce_ms: Sequence[float] | None = None,
    buckets: Sequence[int] | None = None,
    post_ms: float = 0.0,
    action_ms: Mapping[Action, float] | None = None,
    posts_ms: Mapping[int, Sequence[float]] | None = None,
    late_post_ms: float | None = None,
) -> Timeline:
    """Run the lowered programs (pipe.lower) the runtime runs, with per-stage costs.

    A rank walks its program in order. A compute action starts when the rank is free and the
    receive it needs is done (f_ms, b_ms, w_ms as in `simulate`). A batch holds its rank for post_ms
    (the host posting its messages; default 0) and is issued when that ends; its ops towards one peer
    form a group, and per
    pair of ranks the groups run one at a time in issue order, as on NCCL: a group starts when both
    ends have issued it and the pair's previous group is done, and takes the longer of its two
    directions, each the sum of comm_ms[boundary] over the messages it moves (comm_ms[i]: one
    message across the boundary of stages i and i+1). A memory action (RELOAD) holds its rank
    for reload_ms[stage] (the copy time of a microbatch's offloaded activations; default 0).
    A replay of one measured step: `action_ms` gives the actions it names their own times (others keep
    their stage's), `posts_ms[rank]` that rank's batches theirs, in program order (post_ms past the end).
    `late_post_ms`: a batch that receives a message its peer posted before this batch's post began
    holds its rank that long instead (gloo takes such a message in the posting thread, at the pace of
    the peer's, busy, progress thread: pipe.calibration measures both). Which batches those are depends
    on the times, so the program is simulated again with the late ones priced so, until they stay the
    same (at most 4 runs).
    Returns the timeline of the compute actions (F, B, W, BW), with the posts (POST) beside.
    """
    kw: dict[str, Any] = dict(f_ms=f_ms, b_ms=b_ms, w_ms=w_ms, comm_ms=comm_ms, place=place, reload_ms=reload_ms,
                              reduce_ms=reduce_ms, buckets=buckets, post_ms=post_ms, action_ms=action_ms)
    if late_post_ms is None or late_post_ms == post_ms or posts_ms is not None:
        return _simulate_program(program, n_stages, posts_ms=posts_ms, **kw)[0]
    late: dict[int, list[bool]] = {}
    where = list(place) if place is not None else loop_placement(n_stages, len(program))
    for _ in range(4):
        own = {r: [late_post_ms if x else post_ms for x in late.get(r, [])] for r in program}
        tl, starts = _simulate_program(program, n_stages, posts_ms=own, **kw)
        now = late_batches(program, where, starts)
        if now == late:
            break
        late = now
    return tl


def _simulate_program(
    program: Program,
    n_stages: int,
    *,
    f_ms: Sequence[float],
    b_ms: Sequence[float],
    w_ms: Sequence[float] | None,
    comm_ms: Sequence[float] | None,
    place: Sequence[int] | None,
    reload_ms: Sequence[float] | None,
    reduce_ms: Sequence[float] | None,
    buckets: Sequence[int] | None,
    post_ms: float,
    action_ms: Mapping[Action, float] | None,
    posts_ms: Mapping[int, Sequence[float]] | None,
) -> tuple[Timeline, dict[int, list[float]]]:
    """simulate_program's one run, and when each rank began posting each of its batches (program order)."""
    n_ranks = len(program)
    where = list(place) if place is not None else loop_placement(n_stages, n_ranks)
    _check_len("b_ms", b_ms, n_stages, "one per stage, like f_ms")
    w = list(w_ms) if w_ms is not None else [0.0] * n_stages
    _check_len("w_ms", w, n_stages, "one per stage, like f_ms")
    comm = list(comm_ms) if comm_ms is not None else [0.0] * max(n_stages - 1, 0)
    _check_len("comm_ms", comm, max(n_stages - 1, 0), "one per boundary: n_stages - 1")
    has_w = {x.stage for items in program.values() for x in items if isinstance(x, Action) and x.kind == "W"}
    free = dict.fromkeys(program, 0.0)
    pair_free: dict[tuple[int, int], float] = {}
    arrived: dict[tuple[int, Action], float] = {}  # (rank, receive) -> when it completed
    events: list[Event] = []
    reload = list(reload_ms) if reload_ms is not None else [0.0] * n_stages
    reduce = list(reduce_ms) if reduce_ms is not None else [0.0] * n_stages
    n_buckets = list(buckets) if buckets is not None else [1] * n_stages
    _check_len("reload_ms", reload, n_stages, "one per stage, like f_ms")
    _check_len("reduce_ms", reduce, n_stages, "one per stage, like f_ms")
    _check_len("buckets", n_buckets, n_stages, "one per stage, like f_ms")
    armed: dict[tuple[int, int], int] = {}  # (rank, stage) -> buckets its next backward finishes
    lane_free = dict.fromkeys(program, 0.0)
    collectives: list[Event] = []
    posts: list[Event] = []

    own = {r: iter(v) for r, v in (posts_ms or {}).items()}

    starts: dict[int, list[float]] = {r: [] for r in program}

    def post(r: int, batch: tuple[Action, ...]) -> float:
        start = free[r]
        starts[r].append(start)
        free[r] += next(own[r], post_ms) if r in own else post_ms
        if free[r] > start:
            posts.append(Event(r, Action(batch[0].stage, "POST", batch[0].mb), start, free[r]))
        return free[r]

    def cost(a: Action) -> float:
        if action_ms is not None and a in action_ms:
            return action_ms[a]
        if a.kind == "RELOAD":
            return reload[a.stage]
        if a.kind == "F":
            return f_ms[a.stage]
        if a.kind == "W":
            return w[a.stage]
        if a.kind == "BW":
            return b_ms[a.stage] + w[a.stage]
        return b_ms[a.stage] + (0.0 if a.stage in has_w else w[a.stage])

    def moves(group: list[Action]) -> float:  # the time of what this end sends
        return sum(comm[a.stage if a.kind == "SEND_F" else a.stage - 1] for a in group if a.kind.startswith("SEND"))

    def run(r: int, x: Action, need: Action | None) -> None:
        if x.kind == "REDUCE_GRAD":
            armed[(r, x.stage)] = max(1, n_buckets[x.stage])
            return
        start = max(free[r], arrived[(r, need)] if need is not None else 0.0)
        free[r] = start + cost(x)
        if x.kind in _COLOURS:
            events.append(Event(r, x, start, free[r]))
        n = armed.pop((r, x.stage), 0) if x.kind in ("B", "W", "BW") else 0
        for k in range(n):
            launch = max(start + (k + 1) / n * (free[r] - start), lane_free[r])
            lane_free[r] = launch + reduce[x.stage] / n
            collectives.append(Event(r, Action(x.stage, "REDUCE_GRAD", k), launch, lane_free[r]))

    def complete(a: int, b: int, t_a: object, mine: list[Action], t_b: object, theirs: list[Action],
                 _pos: dict[int, int]) -> None:
        assert isinstance(t_a, float) and isinstance(t_b, float)
        end = max(t_a, t_b, pair_free.get((a, b), 0.0)) + max(moves(mine), moves(theirs))
        pair_free[(a, b)] = end
        arrived.update(((a, x), end) for x in mine)
        arrived.update(((b, x), end) for x in theirs)

    pos, _ = walk(program, n_stages, where, compute=run, issue=post, match=complete)
    if any(pos[r] < len(program[r]) for r in program):
        stuck = {r: str(program[r][pos[r]]) for r in program if pos[r] < len(program[r])}
        raise ScheduleError(f"the program deadlocks: ranks wait at {stuck}; run pipe.lower.validate on it for the grid")
    return Timeline(events, n_ranks, collectives, posts), starts


def textbook_bubble(
    name: str, n_stages: int, n_microbatches: int, stages_per_rank: int = 1
) -> float:
    """Bubble fraction from the literature, for equal per-stage costs and no communication.

    gpipe, 1f1b, 1f1b-overlap (v=1): (S-1)/(M+S-1) (Huang et al. 2019, GPipe; Narayanan et al. 2021,
    "Efficient Large-Scale Language Model Training on GPU Clusters", sec. 2.2).
    interleaved-1f1b, and gpipe breadth first, with v stages per rank on R = S/v ranks:
    (R-1)/(v*M+R-1), from the bubble time (R-1)(f+b)/v of Narayanan et al. 2021, sec. 2.2.2.
    zb-h1: (S-1)/(3M+S-1), from Qi et al. 2023, "Zero Bubble Pipeline Parallelism",
    sec. 2.1: the bubble time is (S-1)(T_F+T_B-T_W) against M(T_F+T_B+T_W) of work per
    rank, so with T_F = T_B = T_W it is a third of 1F1B's (S-1)(T_F+T_B+T_W).
    zbv (v=2, R = S/2 ranks): (R-1)/(6M+R-1), the idle of the start-up alone with T_F = T_B =
    T_W per stage (the first microbatch reaches rank R-1 after R-1 steps; ZB-V fills the other
    bubbles with W, Qi et al. 2024, sec. 6): a lower bound, which fxpipe's zbv comes within R
    steps of.
    interleaved-zb (any v) and dualpipev (v=2): (R-1)/(3vM+R-1), the same start-up bound, which
    both reach with T_F = T_B = T_W.
    looped-bfs: as gpipe breadth first.
    The v>1 and zb-h1 formulas assume M >= R (resp. M >= S); with fewer mbs the real
    bubble is larger.
    """
    s, m, v = n_stages, n_microbatches, stages_per_rank
    if s < 1 or m < 1 or v < 1 or s % v:
        raise ScheduleError(
            f"textbook_bubble needs n_stages >= 1, n_microbatches >= 1 and n_stages a multiple "
            f"of stages_per_rank (got S={s}, M={m}, v={v})"
        )
    r = s // v
    if name in ("interleaved-1f1b", "looped-bfs") or (name == "gpipe" and v > 1):
        return (r - 1) / (v * m + r - 1)
    if name in ("gpipe", "1f1b", "1f1b-overlap") and v == 1:
        return (s - 1) / (m + s - 1)
    if name == "zb-h1" and v == 1:
        return (s - 1) / (3 * m + s - 1)
    if name == "interleaved-zb" or (name in ("zbv", "dualpipev") and v == 2):
        return (r - 1) / (3 * v * m + r - 1)
    raise ScheduleError(
        f"no textbook bubble for schedule {name!r} with stages_per_rank={v}; known: gpipe, looped-bfs, "
        "interleaved-1f1b and interleaved-zb (any v), 1f1b, 1f1b-overlap and zb-h1 (v=1), zbv and dualpipev (v=2)"
    )
