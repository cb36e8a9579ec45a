"""The step of a (pp, dp) layout at any scale (pure): one pipeline simulated, the data-parallel all-reduce on top.

Legend: pp pipeline ranks, dp replicas (pp x dp ranks in all), v stages per rank, M microbatches
per replica and step, s stage. Replicas run the same program at the same time, so one pipeline's
simulation (pipe.simulate.simulate_program over the lowered program the runtime runs) is the
step of all; what dp adds is each stage's grad all-reduce over its dp ranks, a ring costing
2(dp-1)/dp x bytes / bandwidth + 2(dp-1) x latency per bucket (Patarasuk and Yuan 2009; NCCL's
ring all-reduce), launched bucket by bucket as the stage's final backward finishes its grads
(pipe.lower.with_grad_reduction, as pipe.replicas does it) and waited for at the end of the step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from pipe.lower import lower, with_grad_reduction
from pipe.schedules import build, placement
from pipe.simulate import Timeline, simulate_program

__all__ = ["Layout", "LayoutCosts", "MIB", "bucket_cap", "predict_layout", "ring_allreduce_ms"]

MIB = 1 << 20


def bucket_cap(stage_bytes: int, cap: int | None = None) -> int:
    """Bytes per gradient bucket: `cap` when given, else an eighth of the stage's grads within
    [1, 25] MiB (25 MiB is DDP's default; with eight buckets the final backward hides all but
    about the last one)."""
    if cap is not None:
        if cap < 1:
            raise ValueError(f"a gradient bucket must hold at least one byte, got {cap!r} bytes; give a bucket "
                             "size in MiB such as 25, or none for the default")
        return int(cap)
    return int(min(25 * MIB, max(MIB, stage_bytes // 8)))


def ring_allreduce_ms(nbytes: float, n: int, bytes_per_ms: float, latency_ms: float = 0.0) -> float:
    """Time of a ring all-reduce of `nbytes` over `n` ranks: 2(n-1) steps, each moving nbytes/n."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bytes_per_ms + 2 * (n - 1) * latency_ms


@dataclass(frozen=True)
class LayoutCosts:
    """Per stage: forward, input-grad backward and weight-grad ms of one microbatch (w 0 without a W
    pass) and grad bytes (the stage's parameters); per boundary (stage s to s+1): the ms of one
    microbatch's message; the host's time posting one batch of messages (post_ms; late_post_ms: one
    receiving a message sent before it was posted, None: post_ms)."""

    f_ms: Sequence[float]
    b_ms: Sequence[float]
    w_ms: Sequence[float]
    comm_ms: Sequence[float]
    grad_bytes: Sequence[float]
    post_ms: float = 0.0
    late_post_ms: float | None = None


@dataclass(frozen=True)
class Layout:
    """One layout's predicted step. `exposed_ms`: how much later the step ends than its last
    compute action because of the all-reduce; `rank_exposed_ms`: the largest time a rank's
    collectives run past its own last compute action (hidden behind other ranks' work when the
    step's exposure is smaller); `allreduce_ms`: the largest collective time of a rank."""

    pp: int
    dp: int
    v: int
    schedule: str
    microbatches: int
    step_ms: float
    bubble: float
    allreduce_ms: float
    exposed_ms: float
    rank_exposed_ms: float
    timeline: Timeline

    @property
    def ranks(self) -> int:
        return self.pp * self.dp


def predict_layout(costs: LayoutCosts, *, pp: int, dp: int, schedule: str, microbatches: int, v: int = 1,
                   allreduce_bytes_per_ms: float,
                   allreduce_latency_ms: float = 0.0, bucket_bytes: int | None = None,
                   overhead_ms: float = 0.0) -> Layout:
    """Simulate one replica's lowered program with the grad reduction pass and the collectives'
    lane; `overhead_ms` is added to every compute action (the host's cost of running one)."""
    n_stages = pp * v
    for name, seq, want in (("f_ms", costs.f_ms, n_stages), ("b_ms", costs.b_ms, n_stages),
                            ("w_ms", costs.w_ms, n_stages), ("comm_ms", costs.comm_ms, n_stages - 1),
                            ("grad_bytes", costs.grad_bytes, n_stages)):
        if len(seq) != want:
            raise ValueError(f"{name} has {len(seq)} values but pp={pp} x v={v} = {n_stages} stages need {want}; "
                             "give one per stage (comm_ms: one per boundary)")
    sched = build(schedule, pp, microbatches, v)
    place = placement(schedule, n_stages, pp)
    program = lower(sched, n_stages, microbatches, place)
    if dp > 1:
        program = with_grad_reduction(program, range(n_stages))
    caps = [bucket_cap(int(g), bucket_bytes) for g in costs.grad_bytes]
    buckets = [max(1, math.ceil(g / c)) for g, c in zip(costs.grad_bytes, caps)]
    reduce = [n * ring_allreduce_ms(g / n, dp, allreduce_bytes_per_ms, allreduce_latency_ms)
              for g, n in zip(costs.grad_bytes, buckets)]
    has_w = any(a.kind == "W" for acts in sched.values() for a in acts)
    tl = simulate_program(program, n_stages, f_ms=[f + overhead_ms for f in costs.f_ms],
                          b_ms=[b + overhead_ms for b in costs.b_ms],
                          w_ms=[w + (overhead_ms if has_w else 0.0) for w in costs.w_ms], comm_ms=costs.comm_ms,
                          place=place, reduce_ms=reduce, buckets=buckets, post_ms=costs.post_ms,
                          late_post_ms=costs.late_post_ms)
    last_compute = max((e.end for e in tl.events), default=0.0)
    last = max([e.end for e in tl.collectives] + [last_compute])
    return Layout(pp=pp, dp=dp, v=v, schedule=schedule, microbatches=microbatches, step_ms=tl.makespan,
                  bubble=tl.bubble, allreduce_ms=max((tl.collective_time(r) for r in range(pp)), default=0.0),
                  exposed_ms=last - last_compute, rank_exposed_ms=max((tl.exposed(r) for r in range(pp)), default=0.0),
                  timeline=tl)
