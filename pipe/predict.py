"""The simulator fed with a plan's predicted stage costs: the predicted timeline of one step."""
from __future__ import annotations

from partition.plan import Plan
from pipe.lower import lower
from pipe.schedules import build, placement
from pipe.scale import LayoutCosts
from pipe.simulate import Timeline, simulate_program

__all__ = ["layout_costs", "predicted_timeline", "stage_costs"]


def stage_costs(plan: Plan, has_w: bool) -> tuple[list[float], list[float], list[float], list[float]]:
    """(f_ms, b_ms, w_ms, comm_ms) per stage from the plan. With a W pass, backward is split in
    half between input and weight grads (each is one matmul per weight matmul of forward)."""
    f = [s.fwd_ms for s in plan.stages]
    b = [s.bwd_ms / 2 if has_w else s.bwd_ms for s in plan.stages]
    w = [s.bwd_ms / 2 if has_w else 0.0 for s in plan.stages]
    comm = [(plan.latency_ms + s.send_bytes / plan.bytes_per_ms) if s.send_bytes else 0.0
            for s in plan.stages[:-1]]
    return f, b, w, comm


def predicted_timeline(plan: Plan, n_ranks: int, schedule: str | None = None,
                       microbatches: int | None = None) -> Timeline:
    """Simulate the lowered program the runtime runs for `schedule` (default: the plan's) over
    the plan's per-stage costs: its messages in their batches, matched per pair in order."""
    name = schedule or plan.schedule
    M = microbatches or plan.microbatches
    sched = build(name, n_ranks, M, plan.n_stages // n_ranks)
    place = placement(name, plan.n_stages, n_ranks)
    has_w = any(a.kind == "W" for acts in sched.values() for a in acts)
    f, b, w, comm = stage_costs(plan, has_w)
    program = lower(sched, plan.n_stages, M, place)
    return simulate_program(program, plan.n_stages, f_ms=f, b_ms=b, w_ms=w, comm_ms=comm, place=place)


def layout_costs(plan: Plan, has_w: bool, bytes_per_ms: float | None = None, latency_ms: float | None = None
                 ) -> LayoutCosts:
    """The plan's per-stage costs for pipe.scale, the link's (default: the plan's) pricing messages."""
    f, b, w, comm = stage_costs(plan, has_w)
    if bytes_per_ms is not None or latency_ms is not None:
        bw = plan.bytes_per_ms if bytes_per_ms is None else bytes_per_ms
        lat = plan.latency_ms if latency_ms is None else latency_ms
        comm = [(lat + s.send_bytes / bw) if s.send_bytes else 0.0 for s in plan.stages[:-1]]
    return LayoutCosts(f_ms=f, b_ms=b, w_ms=w, comm_ms=comm, grad_bytes=[float(s.param_bytes) for s in plan.stages])
