"""What a plan's costs leave out of a step on this machine, measured once and applied to every
prediction (pipe.predict): what the backward costs when split in B and W, the host's time between
actions, and each message's latency beyond what the link's figures price.

A plan's stage costs come from timing its blocks alone. In the runtime the host also receives and
issues messages and runs the memory manager's hooks between actions, and under zero bubble it splits
the backward in two passes (B then W), which together cost more than one. `observe` reads measured
steps; `fit` turns observations into a `Calibration`; `python -m bench calibrate` does both on a
bundled model and writes the JSON file that `bench schedules --calibration` reads.
"""
from __future__ import annotations

import json
import platform
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from pipe.lower import needs
from pipe.schedules import Action
from pipe.simulate import Timeline

__all__ = ["Calibration", "Observations", "fit", "observe"]

@dataclass(frozen=True)
class Calibration:
    """The runtime on one machine against the plans' costs. The default is no correction: the plan's
    costs as they are, a split backward halved between B and W, no gaps, no extra latency."""

    b_share: float = 0.5  # B's time when W runs apart, as a share of the whole backward
    w_share: float = 0.5  # W's, likewise
    gap_ms: float = 0.0  # host time before each compute action (receiving, hooks), outside its span
    message_ms: float = 0.0  # a message's latency beyond the plan's link figures
    samples: dict[str, int] = field(default_factory=dict)  # what each figure was fitted from
    machine: str = ""

    def stage_costs(self, fwd_ms: Sequence[float], bwd_ms: Sequence[float], has_w: bool
                    ) -> tuple[list[float], list[float], list[float]]:
        """(f, b, w) per stage for the simulator, each compute action with the gap before it. Without
        a W pass, b is the whole backward and w is 0."""
        f = [self.gap_ms + x for x in fwd_ms]
        if has_w:
            return f, [self.gap_ms + self.b_share * x for x in bwd_ms], [self.gap_ms + self.w_share * x for x in bwd_ms]
        return f, [self.gap_ms + x for x in bwd_ms], [0.0] * len(bwd_ms)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Calibration:
        known = {f.name for f in fields(cls)}
        if set(d) - known:
            raise ValueError(f"a calibration has the keys {sorted(known)}, got also {sorted(set(d) - known)}; "
                             "make it again with python -m bench calibrate")
        return cls(**d)

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
        return (f"B {self.b_share:.2f} and W {self.w_share:.2f} of the whole backward when apart; "
                f"{self.gap_ms:.2f} ms before each action; {self.message_ms:.2f} ms more per message")


@dataclass
class Observations:
    """Measured steps: each backward's duration, the median over steps, by (pipeline's stage count,
    stage) and whether W ran apart; the host's gaps between actions whose input was there; and the
    latency of messages beyond the plan's pricing of them."""

    full: dict[tuple[int, int], list[float]] = field(default_factory=dict)  # B without W, or BW
    split_b: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    split_w: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    gaps: list[float] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)

    def extend(self, other: Observations) -> None:
        for mine, theirs in ((self.full, other.full), (self.split_b, other.split_b), (self.split_w, other.split_w)):
            for k, v in theirs.items():
                mine.setdefault(k, []).extend(v)
        self.gaps += other.gaps
        self.latency += other.latency


def observe(timelines: Iterable[Timeline], comm_ms: Sequence[float], place: Sequence[int]) -> Observations:
    """Observations from measured steps of one pipeline: the plan's price of a message across each
    boundary (comm_ms, one per boundary) and its placement (stage -> rank)."""
    n_stages = len(place)
    durations: dict[tuple[str, int], list[float]] = {}
    obs = Observations()
    for tl in timelines:
        end = {e.action: e.end for e in tl.events}
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
                if arrived is None or arrived <= before:  # nothing to wait for: the host's own time
                    obs.gaps.append(e.start - before)
                else:  # waited for a message: its latency past the plan's price
                    assert dep is not None
                    obs.latency.append(e.start - arrived - comm_ms[min(dep.stage, a.stage)])
    split = any(kind == "W" for kind, _ in durations)
    for (kind, s), ms in durations.items():
        into = {"W": obs.split_w, "B": obs.split_b if split else obs.full, "BW": obs.full}.get(kind)
        if into is not None:
            into.setdefault((n_stages, s), []).append(statistics.median(ms))
    return obs


def fit(obs: Observations) -> Calibration:
    """The calibration the observations give. B's and W's shares of the whole backward compare
    runtimes alone, never a plan's costs (a plan's costing happened at another moment, on a machine
    whose speed may have moved since): the summed durations of split B (and W) over the stages that
    also ran whole in a pipeline of as many stages. The gap is the median host gap; a message's extra
    latency the median wait past the plan's price, less that gap (the simulator puts the gap before the
    action). What was not observed keeps its default."""
    base = Calibration()
    both = [k for k in obs.full if k in obs.split_b and k in obs.split_w]
    whole = sum(statistics.median(obs.full[k]) for k in both)
    b_share, w_share = base.b_share, base.w_share
    if both and whole > 0:
        b_share = sum(statistics.median(obs.split_b[k]) for k in both) / whole
        w_share = sum(statistics.median(obs.split_w[k]) for k in both) / whole
    gap = max(0.0, statistics.median(obs.gaps)) if obs.gaps else 0.0
    extra = max(0.0, statistics.median(obs.latency) - gap) if obs.latency else 0.0
    return Calibration(b_share=b_share, w_share=w_share, gap_ms=gap, message_ms=extra,
                       samples={"stages_split_and_whole": len(both), "gaps": len(obs.gaps),
                                "messages": len(obs.latency)},
                       machine=f"{platform.node()} {platform.processor() or platform.machine()}")
