"""The simulator fed with a plan's predicted stage costs: the predicted timeline of one step."""
from __future__ import annotations

from collections.abc import Sequence

from partition.plan import Plan
from pipe.calibration import Calibration
from pipe.lower import fuse_backward, lower
from pipe.schedules import Action, build, placement
from pipe.scale import LayoutCosts
from pipe.simulate import Timeline, simulate_program

__all__ = ["layout_costs", "predicted_timeline", "replayed_step", "replayed_timeline", "simulate_schedule",
           "stage_costs"]


def stage_costs(plan: Plan, has_w: bool, calibration: Calibration | None = None, schedule: str | None = None
                ) -> tuple[list[float], list[float], list[float], list[float]]:
    """(f_ms, b_ms, w_ms, comm_ms) per stage from the plan, corrected by `calibration` (pipe.calibration;
    default none). A W pass takes the stage's W part (StagePlan.w_ms: the linear layers' weight grads),
    B the rest of the backward. A stage's memory plan (recompute, offload copies: StagePlan.memory_ms)
    adds to its backward (to B), the nodes it runs again (StagePlan.memory_nodes) priced as forward ones."""
    cal = (calibration or Calibration()).predicting(schedule or plan.schedule)
    # the memory plan's recompute (and copies) run with the backward
    f, b, w = cal.stage_costs([s.fwd_ms for s in plan.stages], [s.bwd_ms for s in plan.stages], has_w,
                              [len(s.nodes) for s in plan.stages], *w_parts(plan),
                              [s.memory_ms for s in plan.stages], [s.memory_nodes for s in plan.stages])
    comm = [(plan.latency_ms + s.send_bytes / plan.bytes_per_ms + cal.message_ms) if s.send_bytes else 0.0
            for s in plan.stages[:-1]]
    return f, b, w, comm


def w_parts(plan: Plan) -> tuple[list[float | None], list[int]]:
    """Each stage's planned W per microbatch (None: not priced) and the nodes W differentiates (where
    not priced: all the stage's)."""
    return ([s.w_ms for s in plan.stages], [s.w_nodes if s.w_ms is not None else len(s.nodes) for s in plan.stages])


def predicted_timeline(plan: Plan, n_ranks: int, schedule: str | None = None,
                       microbatches: int | None = None, calibration: Calibration | None = None,
                       compiled: bool = False) -> Timeline:
    """Simulate the lowered program the runtime runs for `schedule` (default: the plan's) over
    the plan's per-stage costs (corrected by `calibration`): its messages in their batches, matched
    per pair in order. Under zero bubble a stage whose memory plan recomputes runs BW, as in the
    runtime (memory.fused_backward), and so does every stage when `compiled` (compile=: a compiled
    backward is one function)."""
    name = schedule or plan.schedule
    M = microbatches or plan.microbatches
    has_w = any(a.kind == "W" for acts in build(name, n_ranks, M, plan.n_stages // n_ranks).values() for a in acts)
    f, b, w, comm = stage_costs(plan, has_w, calibration, name)
    fused = [s.index for s in plan.stages if s.memory_nodes or compiled] if has_w else []
    whole = stage_costs(plan, False, calibration, name)[1] if fused else []
    for s in fused:  # its BW is one whole backward
        b[s], w[s] = whole[s], 0.0
    cal = (calibration or Calibration()).predicting(name)
    return simulate_schedule(name, n_ranks, M, f, b, w, comm, cal.post_ms, fused=fused, late_post_ms=cal.late_post_ms)


def replayed_timeline(plan: Plan, n_ranks: int, action_ms: dict[tuple[str, int], float],
                      calibration: Calibration | None = None, post_ms: float | None = None) -> Timeline:
    """The plan's schedule simulated over the durations its actions took in the runtime (`action_ms`:
    (kind, stage) -> ms, e.g. pipe.calibration.typical over measured steps), with the calibration's gap
    before each action and its extra latency per message, and `post_ms` per batch posted (default: the
    calibration's): what the simulator's model of the schedule (order, waits, messages) adds to the
    actions' own times. A fused BW counts as B."""
    cal = calibration or Calibration()
    S = plan.n_stages
    f = [cal.gap_ms + action_ms.get(("F", s), 0.0) for s in range(S)]
    b = [cal.gap_ms + action_ms.get(("B", s), action_ms.get(("BW", s), 0.0)) for s in range(S)]
    w = [cal.gap_ms + action_ms[("W", s)] if ("W", s) in action_ms else 0.0 for s in range(S)]
    comm = stage_costs(plan, False, cal)[3]
    return simulate_schedule(plan.schedule, n_ranks, plan.microbatches, f, b, w, comm,
                             cal.post_ms if post_ms is None else post_ms)


def replayed_step(plan: Plan, n_ranks: int, measured: Timeline, calibration: Calibration | None = None) -> Timeline:
    """One measured step of the plan's schedule simulated over its own times: each action's duration
    (with the calibration's gap before it) and each rank's posts in order, the messages priced by the
    plan's link and the calibration's latency. What remains between it and the measured step is the
    simulator's model of the schedule alone (its order, waits and message matching). A fused BW stands
    for its B, whose W costs nothing then."""
    cal = calibration or Calibration()
    own: dict[Action, float] = {}
    for e in measured.events:
        a = Action(e.action.stage, "B", e.action.mb) if e.action.kind == "BW" else e.action
        own[a] = cal.gap_ms + e.end - e.start
        if e.action.kind == "BW":
            own[Action(a.stage, "W", a.mb)] = 0.0
    posts = {r: [e.end - e.start for e in sorted((e for e in measured.posts if e.rank == r), key=lambda e: e.start)]
             for r in range(n_ranks)}
    zero = [0.0] * plan.n_stages
    return simulate_schedule(plan.schedule, n_ranks, plan.microbatches, zero, zero, zero,
                             stage_costs(plan, False, cal)[3], cal.post_ms, action_ms=own, posts_ms=posts)


def simulate_schedule(name: str, n_ranks: int, microbatches: int, f: list[float], b: list[float], w: list[float],
                      comm: list[float], post_ms: float = 0.0, action_ms: dict[Action, float] | None = None,
                      posts_ms: dict[int, list[float]] | None = None, fused: Sequence[int] = (),
                      late_post_ms: float | None = None) -> Timeline:
    """The lowered program of schedule `name` on n_ranks for len(f) stages, simulated with these costs
    (`post_ms`: the host's time posting each batch of messages, `late_post_ms` one receiving a message
    sent before; `action_ms`, `posts_ms`: one step's own times, as pipe.simulate.simulate_program takes
    them)."""
    S = len(f)
    sched = build(name, n_ranks, microbatches, S // n_ranks)
    place = placement(name, S, n_ranks)
    program = lower(sched, S, microbatches, place)
    if fused:  # B computes the weight grads too (BW: B's time plus W's), W leaves the program
        program = fuse_backward(program, fused)
    return simulate_program(program, S, f_ms=f, b_ms=b, w_ms=w, comm_ms=comm, place=place, post_ms=post_ms,
                            action_ms=action_ms, posts_ms=posts_ms, late_post_ms=late_post_ms)


def layout_costs(plan: Plan, has_w: bool, bytes_per_ms: float | None = None, latency_ms: float | None = None,
                 calibration: Calibration | None = None) -> LayoutCosts:
    """The plan's per-stage costs for pipe.scale (corrected by `calibration`), the link's (default: the
    plan's) pricing messages."""
    f, b, w, comm = stage_costs(plan, has_w, calibration)
    if bytes_per_ms is not None or latency_ms is not None:
        bw = plan.bytes_per_ms if bytes_per_ms is None else bytes_per_ms
        lat = (plan.latency_ms if latency_ms is None else latency_ms) + (calibration or Calibration()).message_ms
        comm = [(lat + s.send_bytes / bw) if s.send_bytes else 0.0 for s in plan.stages[:-1]]
    cal = (calibration or Calibration()).predicting(plan.schedule)
    return LayoutCosts(f_ms=f, b_ms=b, w_ms=w, comm_ms=comm, grad_bytes=[float(s.param_bytes) for s in plan.stages],
                       post_ms=cal.post_ms, late_post_ms=cal.late_post_ms)
