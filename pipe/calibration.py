"""What a plan's costs leave out of a step on this machine, measured once and applied to every
prediction (pipe.predict): each kind of action's duration in the runtime as a function of its
planned cost, the host's time between actions and posting each batch of messages, and each message's
latency beyond the link's figures.

A plan's stage costs price the stage's ops. In the runtime each action also has fixed costs (its
inputs made leaves, its outputs' messages issued, the memory manager's hooks, autograd's set-up),
the host spends time between actions (receiving, issuing batches), and under zero bubble the
backward runs as two passes (B then W), which together cost more than one. `observe` reads measured
steps against their plans; `fit` turns observations into a `Calibration`: per kind (F, the whole
backward B, B when W runs apart, W) a least-squares fit over the stages observed, whose sizes (one
and two stages per rank) and microbatches (1, 4 and 16 samples) differ, so that what an action costs
whatever its size shows apart: a part per fx node (dispatch, autograd's bookkeeping) and a
constant. Plans costed by FLOP count (cost="flops") make the best calibration on a machine whose
speed drifts: their costs do not move between candidates, so the fit carries the machine's speed
alone. A calibration applies to plans costed the way its own were (`cost`). `python -m bench
calibrate` runs it on a bundled model and writes the JSON file that `bench schedules
--calibration`, `bench auto`, `pipe.run --calibration` and pipe.Pipeline(calibration=) read.
"""
from __future__ import annotations

import dataclasses
import json
import math
import platform
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from pipe.lower import Program, late_batches, needs
from pipe.schedules import Action
from pipe.simulate import Timeline

__all__ = ["KINDS", "Calibration", "Line", "Observations", "fit", "observe", "typical", "step_scale"]

# F at the stage's fwd_ms; B (the whole backward: B without W, or BW) at bwd_ms; under zero bubble W at the
# stage's W part (planned_w) and B_split (B with W apart) at the rest of bwd_ms
KINDS = ("F", "B", "B_split", "W")
VERSION = 6  # 1: B_split and W fitted on the whole backward's cost, a stage's W taken as half of it;
# 2: plans costed by FLOP count priced each node's inputs and outputs as memory traffic (views too);
# 3: FLOP counts left out the work of exp, tanh, erf... beyond their traffic; 4: and CPU attention's products;
# 5: one post_ms for every batch, whether its messages had been sent before it was posted or not


def planned_w(bwd_ms: float, w_ms: float | None) -> float:
    """A stage's planned W per microbatch (StagePlan.w_ms; not priced: half the backward)."""
    return bwd_ms / 2 if w_ms is None else min(w_ms, bwd_ms)


@dataclass(frozen=True)
class Line:
    """An action's duration as scale x its planned cost + per_node x the stage's fx nodes + fixed (ms).
    The per-node part is what an op costs whatever its size (dispatch, autograd's bookkeeping), which a
    FLOP count leaves out and which weighs most on small microbatches."""

    scale: float = 1.0
    fixed: float = 0.0
    per_node: float = 0.0

    def __call__(self, planned_ms: float, nodes: int = 0) -> float:
        return self.scale * planned_ms + self.per_node * nodes + self.fixed


def _times(line: Line, k: float) -> Line:
    return Line(line.scale * k, line.fixed * k, line.per_node * k)


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _of_its_type(key: str, value: Any) -> bool:
    """Whether a calibration file's `value` for `key` is what Calibration.save writes there."""
    if key in ("f", "b", "b_split", "w"):
        return isinstance(value, dict) and set(value) == {"scale", "fixed", "per_node"} \
            and all(_number(v) for v in value.values())
    if key in ("late_post_ms", "pace_ms"):
        return value is None or _number(value)
    if key in ("cost", "machine"):
        return isinstance(value, str)
    if key in ("samples", "step_scales"):
        return isinstance(value, dict) and all(isinstance(k, str) and _number(v) for k, v in value.items())
    if key == "version":
        return isinstance(value, int)
    return _number(value)


@dataclass(frozen=True)
class Calibration:
    """The runtime on one machine against the plans' costs. The default is no correction: the plan's
    costs as they are (a split backward's W the plan's W part, B the rest), no gaps, no extra latency."""

    f: Line = Line()
    b: Line = Line()
    b_split: Line = Line()
    w: Line = Line()
    gap_ms: float = 0.0  # host time before each compute action (receiving, hooks), outside its span
    message_ms: float = 0.0  # a message's latency beyond the plan's link figures
    post_ms: float = 0.0  # host time posting one batch of messages (the mean: the blocked posts add up)
    # host time posting a batch that receives a message its peer had posted before (gloo takes it in the posting
    # thread, paced by the peer's progress thread; 1.5-2 ms against 0.35-0.45 on 2 busy cores); None: post_ms
    late_post_ms: float | None = None
    cost: str = ""  # how the plans it was fitted on were costed ("flops", "measured"; "" = any)
    samples: dict[str, int] = field(default_factory=dict)  # the points behind each figure
    machine: str = ""
    version: int = VERSION
    # measured step / predicted step over the pipelines it was fitted on (the median): what the spread of
    # action times adds to a step, whose critical path waits for the slow runs, over their typical times
    step_scale: float = 1.0
    # the same per schedule it ran (the median over its pipelines): how much the slow runs cost a step depends
    # on the schedule's chains of actions (interleaved-1f1b's more than 1F1B's); others take step_scale
    step_scales: dict[str, float] = field(default_factory=dict)
    # the machine's pace while it was fitted (bench.pace: a fixed forward and backward, every rank at once, ms a
    # round); None: not measured. A benchmark that measures it again predicts at its own pace (`at_pace`)
    pace_ms: float | None = None

    def at_pace(self, pace_ms: float) -> Calibration:
        """This calibration on a machine that now runs the pace probe in `pace_ms` (its own: `self.pace_ms`): the
        host's work (actions, gaps, posts) scaled by their ratio, the wire's figures as they are. The
        calibration itself when it has no pace."""
        if not self.pace_ms or pace_ms <= 0:
            return self
        k = pace_ms / self.pace_ms
        return dataclasses.replace(self, step_scale=self.step_scale * k, pace_ms=pace_ms,
                                   step_scales={name: v * k for name, v in self.step_scales.items()})

    def predicting(self, schedule: str | None = None) -> Calibration:
        """The figures a prediction of `schedule` uses: the actions' lines, the gap and the posts times
        its step scale (step_scales[schedule], else step_scale)."""
        k = self.step_scales.get(schedule, self.step_scale) if schedule else self.step_scale
        return self if k == 1.0 else dataclasses.replace(self._scaled(k), step_scale=1.0, step_scales={})

    def _scaled(self, k: float) -> Calibration:
        return dataclasses.replace(self, f=_times(self.f, k), b=_times(self.b, k), b_split=_times(self.b_split, k),
                                   w=_times(self.w, k), gap_ms=self.gap_ms * k, post_ms=self.post_ms * k,
                                   late_post_ms=None if self.late_post_ms is None else self.late_post_ms * k)

    def stage_costs(self, fwd_ms: Sequence[float], bwd_ms: Sequence[float], has_w: bool,
                    nodes: Sequence[int] | None = None, w_ms: Sequence[float | None] | None = None,
                    w_nodes: Sequence[int] | None = None, memory_ms: Sequence[float] | None = None,
                    memory_nodes: Sequence[int] | None = None) -> tuple[list[float], list[float], list[float]]:
        """(f, b, w) per stage for the simulator, each compute action with the gap before it; `nodes`:
        each stage's fx node count; `w_ms`, `w_nodes`: its W part and the nodes W differentiates
        (StagePlan.w_ms, .w_nodes; default: half the backward, every node); `memory_ms`, `memory_nodes`:
        what its memory plan adds to the backward (StagePlan.memory_ms, .memory_nodes), the nodes it runs
        again priced as forward ones (each with its per-node part). Without a W pass, b is the whole
        backward and w is 0."""
        S = len(fwd_ms)
        n = list(nodes) if nodes is not None else [0] * S
        mem = [self.f.scale * x + self.f.per_node * k
               for x, k in zip(memory_ms or [0.0] * S, memory_nodes or [0] * S)]
        f = [self.gap_ms + self.f(x, k) for x, k in zip(fwd_ms, n)]
        if has_w:
            ws = [planned_w(x, y) for x, y in zip(bwd_ms, w_ms or [None] * S)]
            wn = list(w_nodes) if w_nodes is not None else n
            return (f, [self.gap_ms + self.b_split(x - y, k) + m for x, y, k, m in zip(bwd_ms, ws, n, mem)],
                    [self.gap_ms + (self.w(y, k) if y > 0 or k else 0.0) for y, k in zip(ws, wn)])  # W of nothing: 0
        return f, [self.gap_ms + self.b(x, k) + m for x, k, m in zip(bwd_ms, n, mem)], [0.0] * S

    def check_cost(self, cost: str) -> None:
        """Refuse plans costed otherwise than the plans this calibration was fitted on."""
        if self.cost and cost != self.cost:
            raise ValueError(f"this calibration was fitted on plans costed by {self.cost!r} and these are costed "
                             f"by {cost!r}: its lines convert one kind of cost only; plan with cost={self.cost!r}, "
                             f"or calibrate with python -m bench calibrate --cost {cost}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Calibration:
        known = {f.name for f in fields(cls)}
        if set(d) - known:
            raise ValueError(f"a calibration has the keys {sorted(known)}, got also {sorted(set(d) - known)}; "
                             "make it again with python -m bench calibrate")
        if d.get("version", 1) != VERSION:
            raise ValueError(f"this calibration is of version {d.get('version', 1)}, fitted when "
                             + {1: "a split backward's B and W were both priced at the whole backward's cost",
                                2: "FLOP-counted plans priced each node's inputs and outputs as memory traffic, "
                                   "views too",
                                3: "FLOP-counted plans left out the work of exp, tanh, erf and the like beyond "
                                   "their memory traffic",
                                4: "FLOP-counted plans priced CPU attention as its memory traffic alone",
                                5: "every batch of messages was priced alike, whether its messages had come "
                                   "before it was posted or not"}.get(
                                    d.get("version", 1), "by another fxpipe")
                             + f"; this fxpipe reads version {VERSION}: make it again with python -m bench calibrate")
        # the fitted lines are what a calibration is; a figure added later within a version may be absent (pace_ms:
        # not measured), as its default says
        missing = [k for k in ("f", "b", "b_split", "w") if k not in d]
        wrong = [k for k in sorted(set(d) & known) if not _of_its_type(k, d[k])]
        if missing or wrong:  # (found by review: {"version": 6} was read as the identity, silently)
            raise ValueError("this calibration is damaged: "
                             + "; ".join(([f"it lacks {', '.join(missing)}"] if missing else [])
                                         + [f"{k} is {d[k]!r}" for k in wrong])
                             + "; make it again with python -m bench calibrate")
        given: dict[str, Any] = dict(d)
        given.update({k: Line(**d[k]) for k in ("f", "b", "b_split", "w")})
        return cls(**given)

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return p

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"no calibration at {p}; make one with python -m bench calibrate --out {p}")
        return cls.from_dict(json.loads(p.read_text()))

    def describe(self) -> str:
        def line(name: str, x: Line) -> str:
            return f"{name} {x.scale:.2f} x planned + {x.per_node * 1e3:.1f} us x nodes + {x.fixed:.2f} ms"
        return (f"{line('F', self.f)}; {line('B', self.b)}; {line('B with W apart', self.b_split)}; "
                f"{line('W', self.w)}; {self.gap_ms:.2f} ms before each action; {self.message_ms:.2f} ms more per "
                f"message; {self.post_ms:.2f} ms posting each batch"
                + ("" if self.late_post_ms is None else f", {self.late_post_ms:.2f} ms one whose message had come")
                + f"; steps {self.step_scale:.3f}x the prediction with "
                f"those" + (" (" + ", ".join(f"{k} {v:.3f}x" for k, v in sorted(self.step_scales.items())) + ")"
                            if self.step_scales else "") + f" (plans costed by {self.cost or 'any'})"
                + ("" if self.pace_ms is None else f"; pace {self.pace_ms:.1f} ms"))


@dataclass
class Observations:
    """Measured steps against their plans: per kind, (planned ms, fx nodes, measured ms) points, one per
    pipeline and stage, typical over steps (`typical`); the host's gaps between actions whose input was there; and the
    latency of messages beyond the plan's pricing of them."""

    points: dict[str, list[tuple[float, int, float]]] = field(default_factory=dict)
    gaps: list[float] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)
    posts: list[float] = field(default_factory=list)
    late_posts: list[float] = field(default_factory=list)  # posts of batches receiving what was sent before
    cost: set[str] = field(default_factory=set)

    def extend(self, other: Observations) -> None:
        for k, v in other.points.items():
            self.points.setdefault(k, []).extend(v)
        self.gaps += other.gaps
        self.latency += other.latency
        self.posts += other.posts
        self.late_posts += other.late_posts
        self.cost |= other.cost


def observe(timelines: Iterable[Timeline], fwd_ms: Sequence[float], bwd_ms: Sequence[float],
            comm_ms: Sequence[float], place: Sequence[int], cost: str = "",
            nodes: Sequence[int] | None = None, w_ms: Sequence[float | None] | None = None,
            w_nodes: Sequence[int] | None = None, program: Program | None = None) -> Observations:
    """Observations from measured steps of one pipeline: its stages' planned costs (and how they were
    costed), the plan's price of a message across each boundary (comm_ms), its placement, each
    stage's fx node count, and its W part and the nodes W differentiates (as Calibration.stage_costs);
    with the lowered `program` the steps ran, the posts of batches receiving a message its peer had posted
    before (late_posts) apart from the others."""
    n_nodes = list(nodes) if nodes is not None else [0] * len(place)
    ws = [planned_w(x, y) for x, y in zip(bwd_ms, w_ms or [None] * len(bwd_ms))]
    wn = list(w_nodes) if w_nodes is not None else n_nodes
    n_stages = len(place)
    durations: dict[tuple[str, int], list[float]] = {}
    obs = Observations(cost={cost} if cost else set())
    for tl in timelines:
        end = {e.action: e.end for e in tl.events}
        posts = {r: sorted((e.start, e.end) for e in tl.posts if e.rank == r) for r in range(tl.n_ranks)}
        late = _late_posts(program, posts, place)
        for r, spans in posts.items():
            for (t0, t1), x in zip(spans, late.get(r, [False] * len(spans))):
                (obs.late_posts if x else obs.posts).append(t1 - t0)

        def posting(r: int, lo: float, hi: float) -> float:  # rank r's time posting batches within [lo, hi]
            return sum(min(b, hi) - max(a, lo) for a, b in posts[r] if b > lo and a < hi)
        for r in range(tl.n_ranks):
            mine = sorted((e for e in tl.events if e.rank == r), key=lambda e: e.start)
            for i, e in enumerate(mine):
                a = e.action
                durations.setdefault((a.kind, a.stage), []).append(e.end - e.start)
                if i == 0:
                    continue
                before = mine[i - 1].end
                recv = needs(a, place, n_stages)
                dep = None if recv is None else (Action(a.stage - 1, "F", a.mb) if a.kind == "F" else
                                                 Action(a.stage + 1, "B", a.mb))
                arrived = None if dep is None else end.get(dep, end.get(Action(dep.stage, "BW", dep.mb)))
                if arrived is None or arrived <= before:  # nothing to wait for: the host's own time, less posting
                    obs.gaps.append(e.start - before - posting(r, before, e.start))
                else:  # waited for a message: its latency past the plan's price and the posting around it
                    assert dep is not None
                    sender = place[dep.stage]
                    sent = next((b - a for a, b in posts[sender] if a >= arrived - 1e-9), 0.0)  # the batch after dep
                    obs.latency.append(e.start - arrived - comm_ms[min(dep.stage, a.stage)] - sent
                                       - posting(r, arrived, e.start))
    split = any(kind == "W" for kind, _ in durations)
    for (kind, s), ms in durations.items():
        key = {"F": "F", "W": "W", "BW": "B", "B": "B_split" if split else "B"}[kind]
        planned = {"F": fwd_ms[s], "B": bwd_ms[s], "B_split": bwd_ms[s] - ws[s], "W": ws[s]}[key]
        obs.points.setdefault(key, []).append((planned, wn[s] if key == "W" else n_nodes[s], typical(ms)))
    return obs


def _late_posts(program: Program | None, posts: dict[int, list[tuple[float, float]]], place: Sequence[int]
                ) -> dict[int, list[bool]]:
    """Per rank, which of its measured posts (program order) received a message whose sender had begun
    posting it before (pipe.lower.late_batches); none told apart without the program, or where a rank's
    posts do not match its batches one to one."""
    if program is None or any(sum(not isinstance(x, Action) for x in program.get(r, [])) != len(spans)
                              for r, spans in posts.items()):
        return {}
    return late_batches(program, place, {r: [a for a, _ in spans] for r, spans in posts.items()})


def step_scale(pairs: Iterable[tuple[float, float]]) -> float:
    """Calibration.step_scale from (measured step, predicted step) pairs, one per pipeline: the median
    ratio (1 without pairs)."""
    ratios = [m / p for m, p in pairs if p > 0]
    return statistics.median(ratios) if ratios else 1.0


def typical(values: Sequence[float], cut: float = 0.1) -> float:
    """What an action costs over many runs of it: the mean less the lowest and highest `cut` of them. A
    mean, not a median: the slow runs lengthen a step (a pipeline's critical path adds them up); over the
    steps of one run of eight schedules (gpt, M=8), the simulator fed medians missed the measured steps by
    11-29%, fed means by 2-10%; trimmed,
    so that a rare stall (a 183 ms forward among 5 ms ones) does not count."""
    xs = sorted(values)
    k = int(len(xs) * cut)
    return statistics.fmean(xs[k:len(xs) - k] if len(xs) > 2 * k else xs)


def _solve(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float] | None:
    """Least squares by the normal equations; None when they are (nearly) singular."""
    import numpy as np
    a, y = np.asarray(rows, dtype=float), np.asarray(ys, dtype=float)
    gram = a.T @ a
    if np.linalg.cond(gram) > 1e8:
        return None
    return [float(c) for c in np.linalg.solve(gram, a.T @ y)]


_ROUNDING = 1e-9  # a fitted part this close below 0 is 0 (a solve's rounding), not a negative part


def _line(points: Sequence[tuple[float, int, float]], default: Line) -> Line:
    """Least squares of measured on planned, nodes and a constant. Where that is not determined (the
    planned costs and node counts do not vary apart, as at one microbatch size) or gives a negative
    part: on planned and nodes; then on planned and a constant; then a scale alone (the median ratio)."""
    pts = [(x, n, y) for x, n, y in points if x > 0]
    if not pts:
        return default
    ys = [y for _, _, y in pts]
    xs = [x for x, _, _ in pts]
    if len(pts) >= 4 and len({n for _, n, _ in pts}) > 1:
        full = _solve([(x, n, 1.0) for x, n, _ in pts], ys)
        if full is not None and full[0] > 0 and min(full[1:]) >= -_ROUNDING:
            return Line(full[0], max(full[2], 0.0), max(full[1], 0.0))
        two = _solve([(x, n) for x, n, _ in pts], ys)
        if two is not None and two[0] > 0 and two[1] >= -_ROUNDING:
            return Line(two[0], 0.0, max(two[1], 0.0))
    if len(pts) >= 3 and max(xs) >= 1.25 * min(xs):
        one = _solve([(x, 1.0) for x in xs], ys)
        if one is not None and one[0] > 0 and one[1] >= -_ROUNDING:
            return Line(one[0], max(one[1], 0.0))
    return Line(statistics.median(y / x for x, _, y in pts), 0.0)


def fit(obs: Observations) -> Calibration:
    """The calibration the observations give: a line per kind of action (the default where none was
    seen), the median host gap, a message's extra latency: the median wait past the plan's price,
    less that gap (the simulator puts the gap before the action), neither below 0, and the mean time
    posting a batch (a mean: the posts that block behind a busy peer add up over a step), apart for the
    batches that receive a message sent before they were posted (late_post_ms; None: none seen)."""
    if len(obs.cost) > 1:
        raise ValueError(f"observations of plans costed by {sorted(obs.cost)}: a calibration fits one kind of "
                         "cost; calibrate on plans costed alike")
    base = Calibration()
    lines = {k.lower(): _line(obs.points.get(k, []), getattr(base, k.lower())) for k in KINDS}
    gap = max(0.0, statistics.median(obs.gaps)) if obs.gaps else 0.0
    return Calibration(f=lines["f"], b=lines["b"], b_split=lines["b_split"], w=lines["w"], gap_ms=gap,
                       message_ms=max(0.0, statistics.median(obs.latency) - gap) if obs.latency else 0.0,
                       post_ms=statistics.fmean(obs.posts) if obs.posts else 0.0,
                       late_post_ms=statistics.fmean(obs.late_posts) if obs.late_posts else None,
                       cost=next(iter(obs.cost), ""),
                       samples={**{k: len(v) for k, v in sorted(obs.points.items())}, "gaps": len(obs.gaps),
                                "messages": len(obs.latency), "posts": len(obs.posts),
                                "late_posts": len(obs.late_posts)},
                       machine=f"{platform.node()} {platform.processor() or platform.machine()}")
