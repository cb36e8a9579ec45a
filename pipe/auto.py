"""schedule="auto": the schedule, microbatch count and stages per rank that the simulator predicts
fastest within the memory budget, each candidate planned (cut) for itself.

`grid` lists the candidates: every schedule at its stages per rank (two for the interleaved ones),
for every microbatch count (with `batch_size`, the divisors of the batch from the number of ranks up;
without, the count given). A schedule's own rules (interleaved: M a multiple of the ranks; dualpipev:
M >= 2 x ranks) refuse some, with their reason. `search` plans each candidate (`plan_fn`: a Plan or
an FxpipeError, e.g. the budget), predicts its step (`predict_fn`), and ranks them: fastest first,
the smaller peak memory on a tie, the refused ones last with why. `table` prints the ranking.
`choose` runs it with partition.plan (through `plan_one`) and pipe.predict, one trace and costing per
microbatch size and stage count, for pipe.Pipeline(schedule="auto") and `python -m partition
--schedule auto`; the pipeline's plan records the choice in its notes. With recompute or offload
(`memory_plan`), each candidate's stages get the memory plan memory/ would give them within the
budget (the least costly that fits), its cost counted in the step and its peak in the ranking: so
auto weighs, e.g., a larger microbatch with recomputation against a smaller one without.
"""
from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Sequence, Sized
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from partition.errors import FxpipeError, first_line
from partition.plan import Plan, human_bytes
from partition.split import param_nodes_of
from pipe.schedules import SCHEDULES, ScheduleError, build, default_stages_per_rank

__all__ = ["Candidate", "NoCandidate", "choose", "grid", "memory_plan", "microbatch_counts", "resize_batch", "search",
           "table", "w_part_managed"]


class NoCandidate(FxpipeError, ValueError):
    """No candidate of the grid can run (every one refused by its schedule or the memory budget)."""


@dataclass
class Candidate:
    schedule: str
    microbatches: int
    stages_per_rank: int
    step_ms: float = math.inf  # predicted, once planned
    peak_bytes: float = 0.0  # the plan's largest stage peak
    refused: str = ""  # why it cannot run ("" when it can)
    memory: str = ""  # each stage's memory plan (recompute, offload), when weighed: "none|ckpt 2/6"
    recompute: str = ""  # the recompute policy it is planned with, when auto weighs several ("" otherwise)

    @property
    def label(self) -> str:
        return (f"{self.schedule} M={self.microbatches} v={self.stages_per_rank}"
                + (f" recompute={self.recompute}" if self.recompute else ""))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def microbatch_counts(world: int, batch_size: int | None, microbatches: int, most: int = 32) -> list[int]:
    """The microbatch counts to weigh: with `batch_size`, its divisors from `world` to `most` (a
    count below the ranks leaves some idle); else just `microbatches`."""
    if batch_size is None:
        return [microbatches]
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < world:
        raise NoCandidate(f"batch_size={batch_size!r}: schedule='auto' splits each step's batch in microbatches, "
                          f"at least one per rank; pass the samples per step, an integer >= {world} ranks")
    counts = [m for m in range(world, min(batch_size, most) + 1) if batch_size % m == 0]
    if not counts:
        raise NoCandidate(f"batch_size={batch_size} has no divisor between {world} (the ranks) and {most}; "
                          f"pass a batch_size with one (e.g. {world * (batch_size // world)})")
    return counts


def grid(world: int, counts: Sequence[int], schedules: Sequence[str] | None = None,
         recomputes: Sequence[str] = ("",)) -> list[Candidate]:
    """Every schedule (default: all registered) at its stages per rank, at every count, with every
    recompute policy of `recomputes` ("": the one given, not weighed); a candidate its schedule
    cannot build carries the reason."""
    out = []
    for m in counts:
        for name in schedules or sorted(SCHEDULES):
            v = default_stages_per_rank(name)
            for r in recomputes:
                c = Candidate(name, m, max(v, 2) if name.startswith("interleaved") else v, recompute=r)
                try:
                    build(name, world, m, c.stages_per_rank)
                except ScheduleError as e:
                    c.refused = first_line(e)
                out.append(c)
    return out


def search(cands: Sequence[Candidate], plan_fn: Callable[[Candidate], Plan],
           predict_fn: Callable[[Plan], float]) -> tuple[list[Candidate], dict[str, Plan]]:
    """Plan and predict every candidate not refused; return them ranked (fastest first, then the
    smaller peak, the refused last) and the plans by label. Raises NoCandidate, with the table, when
    none can run."""
    plans: dict[str, Plan] = {}
    for c in cands:
        if c.refused:
            continue
        try:
            p = plan_fn(c)
        except FxpipeError as e:
            c.refused = first_line(e, 300)
            continue
        plans[c.label] = p
        c.step_ms = predict_fn(p)
        c.peak_bytes = max((s.memory_peak or s.peak_bytes for s in p.stages), default=0.0)
        c.memory = "|".join(s.memory for s in p.stages) if any(s.memory for s in p.stages) else ""
    ranked = sorted(cands, key=lambda c: (bool(c.refused), c.step_ms, c.peak_bytes, c.microbatches,
                                          c.stages_per_rank, c.schedule, c.recompute != "none"))
    if not plans:
        raise NoCandidate("schedule='auto' found no candidate that can run:\n" + table(ranked)
                          + "\nfix: a larger memory_budget, recompute/offload, or another batch_size")
    return ranked, plans


def table(ranked: Sequence[Candidate]) -> str:
    """The ranking as text: rank, schedule, M, v, predicted step, peak memory, against the best."""
    best = next((c.step_ms for c in ranked if not c.refused), math.inf)
    policies = any(c.recompute for c in ranked)  # a column of the recompute policy each is planned with
    weighed = any(c.memory for c in ranked)  # and of each stage's memory plan
    rows = [["#", "schedule", "M", "v"] + (["recompute"] if policies else []) + ["step (ms)", "vs best", "peak"]
            + (["memory"] if weighed else []) + ["note"]]
    for i, c in enumerate(ranked, 1):
        head = [c.schedule, str(c.microbatches), str(c.stages_per_rank)] + ([c.recompute] if policies else [])
        mem = [c.memory or "-"] if weighed else []
        if c.refused:
            rows.append(["-"] + head + ["-", "-", "-"] + mem + [c.refused])
        else:
            rows.append([str(i)] + head + [f"{c.step_ms:.1f}", f"{c.step_ms / best:.2f}x", human_bytes(c.peak_bytes)]
                        + mem + ["chosen" if i == 1 else ""])
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(r, widths)) + "  " + r[-1] for r in rows).rstrip()


def resize_batch(tree: Any, size: int) -> Any:
    """The example `tree` (args, kwargs, target) with every tensor whose first dimension is the
    first tensor's resized to `size` along it (rows repeated, then cut): one microbatch of `size`."""
    leaves, spec = pytree.tree_flatten(tree)
    first = next((x for x in leaves if isinstance(x, torch.Tensor) and x.dim()), None)
    if first is None:
        return tree
    b0 = first.shape[0]

    def one(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or not x.dim() or x.shape[0] != b0 or b0 == size:
            return x
        return x.repeat(-(-size // b0), *[1] * (x.dim() - 1))[:size]
    return pytree.tree_unflatten([one(x) for x in leaves], spec)


def w_part_managed(stage: Any, choice: Any, param_nodes: Sized) -> tuple[float, int]:
    """(ms, nodes) of the zero-bubble W of a stage whose memory plan (`choice`) recomputes or offloads:
    nothing where it recomputes (its B computes the weight grads: memory.fused_backward), else (offload)
    every parameter node differentiated over the graph B keeps, priced at half the stage's backward."""
    return (0.0, 0) if choice.recomputes else (stage.bwd_ms / 2, len(param_nodes))


def memory_plan(plan: Plan, analysis: Any, world: int, *, recompute: str, offload: str, budget: float | None,
                param_sizes: dict[str, tuple[int, int]], compiled: bool = False) -> Plan:
    """`plan` with each stage's memory plan (memory.plan_choices: the least costly recompute/offload
    policy that fits `budget`, on the analysis's graph and costs, for the schedule's lowered program)
    in its `memory`, `memory_peak`, `memory_ms` (in the plan's cost units) and `memory_nodes`. memory.BudgetError
    when a stage cannot fit."""
    import memory
    from pipe.lower import fuse_backward, lower
    from pipe.options import COMPILED_MOST
    from pipe.schedules import placement
    place = placement(plan.schedule, plan.n_stages, world)
    sched = build(plan.schedule, world, plan.microbatches, plan.stages_per_rank)
    programs = lower(sched, plan.n_stages, plan.microbatches, place)
    if compiled:  # a compiled stage's backward is one BW at its B (found by review: W's hold was counted, 36% over)
        programs = fuse_backward(programs, range(plan.n_stages))
    costs = {n: memory.NodeCost(c.fwd_ms, c.out_bytes, c.saved_bytes, tuple(c.params), tuple(c.saved.items()),
                                c.storage) for n, c in analysis.costs.items()}
    choices = memory.plan_choices(recompute=recompute, offload=offload, budget=budget,
                                  stages=[asdict(st) for st in plan.stages], costs=costs, gm=analysis.gm,
                                  param_sizes=param_sizes, programs=programs, place=place,
                                  microbatches=plan.microbatches, optim_factor=max(plan.state_factor - 2.0, 0.0),
                                  output_bytes=plan.output_bytes, most=COMPILED_MOST if compiled else ("auto", "all"))
    zero_bubble = not compiled and any(a.kind == "W" for acts in sched.values() for a in acts)
    for ch in choices:
        st = plan.stages[ch.stage]
        st.memory, st.memory_peak, st.memory_ms = ch.label(), ch.predicted_peak, ch.cost_ms
        st.memory_nodes = ch.recomputed_nodes(len(st.nodes))
        if zero_bubble and not ch.plain:
            st.w_ms, st.w_nodes = w_part_managed(st, ch, param_nodes_of(analysis.gm, st.nodes))
    return plan


def choose(cands: Sequence[Candidate], world: int, example: tuple[Any, Any, Any], batch_size: int | None,
           plan_one: Callable[..., Plan], calibration: Any = None,
           memory_fn: Callable[[Candidate, Plan, Any], Plan] | None = None, compiled: bool = False
           ) -> tuple[list[Candidate], dict[str, Plan]]:
    """`search` over partition plans (`compiled`: each predicted with compiled stages, whose zero-bubble
    backward is BW): `plan_one(candidate, args, kwargs, target, analysis=, analysis_out=)`
    plans one candidate (partition.plan with its schedule, M, v), on the example (args, kwargs, target)
    resized to batch_size / M (as given without a batch size). The first candidate of each (M, v)
    traces and costs the model; the others reuse that analysis (pipe.calibration `calibration`
    corrects the simulated steps). `memory_fn(candidate, plan, analysis)` (e.g. memory_plan) gives
    each plan its stages' memory plans, whose cost the prediction counts."""
    from pipe.predict import predicted_timeline
    analyses: dict[tuple[int, int], Any] = {}

    def plan_fn(c: Candidate) -> Plan:
        key = (c.microbatches, c.stages_per_rank)
        found: list[Any] = []
        a = None
        if key in analyses:  # the same trace and costs, with notes of its own
            a = copy.copy(analyses[key])
            a.notes = list(a.notes)
        ex = example if batch_size is None else resize_batch(example, batch_size // c.microbatches)
        p = plan_one(c, *ex, analysis=a, analysis_out=found)  # found: what this plan was cut from
        analyses.setdefault(key, found[0])
        return p if memory_fn is None else memory_fn(c, p, found[0])
    ranked, plans = search(cands, plan_fn, lambda p: predicted_timeline(p, world, calibration=calibration,
                                                                        compiled=compiled).makespan)
    return _without_twins(ranked, plans)


def _without_twins(ranked: list[Candidate], plans: dict[str, Plan]) -> tuple[list[Candidate], dict[str, Plan]]:
    """Drop a candidate planned with recompute='auto' that recomputes nothing on the cuts its
    recompute='none' twin has: the same plan, and 'none' runs it (its zero-bubble W stays direct)."""
    def same(c: Candidate) -> bool:
        twin = dataclasses.replace(c, recompute="none")
        p, q = plans.get(c.label), plans.get(twin.label)
        return (c.recompute == "auto" and p is not None and q is not None
                and all(s.memory in ("", "none") for s in p.stages)
                and [s.nodes for s in p.stages] == [s.nodes for s in q.stages])
    gone = {c.label for c in ranked if same(c)}
    return [c for c in ranked if c.label not in gone], {k: v for k, v in plans.items() if k not in gone}
