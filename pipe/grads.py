"""The grad norm of the whole pipelined model, and clipping by it: torch.nn.utils.clip_grad_norm_ over ranks.

Each rank computes its part with torch's own get_total_norm (||g||_p^p of the grads it counts, or the
largest |g| for p = inf), the ranks add their parts up (or take the largest) in one all-gather per
process group, and torch's clip_grads_with_norm_ scales every grad the rank holds by the same factor.
Which grads a rank counts: a weight held on several ranks of a pipeline (tied, or a layer cut into
slices on several stages) counts on the lowest of them; replicas (data parallel) hold the same grads
after the step, so only the pipeline's ranks add up, unless the replicas hold shards of them
(dp_shard="full"), which then add up too.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from partition.errors import FxpipeError
from pipe import comm
from pipe.errors import PipelineError

__all__ = ["NonFiniteGrads", "Reduction", "clip_grad_norm_", "clip_pipeline", "local_part", "combine"]


class NonFiniteGrads(FxpipeError, FloatingPointError):
    """clip_grad_norm_(..., error_if_nonfinite=True) found the total grad norm inf or nan."""


@dataclass(frozen=True)
class Reduction:
    """One process group the parts travel over: its global ranks in group order, and whether its ranks'
    parts add up (stages of a pipeline, shards of replicas) or are copies that only must agree (replicas)."""
    group: Any
    ranks: list[int]
    adds: bool


def local_part(grads: Sequence[torch.Tensor], norm_type: float) -> float:
    """This rank's part of the total norm of order `norm_type`: the sum of |g|^p over `grads`, or for
    p = inf the largest |g| (0.0 without grads); parts combine by `combine`."""
    if not grads:
        return 0.0
    norm = float(torch.nn.utils.get_total_norm([_local(g) for g in grads], norm_type))
    return norm if math.isinf(norm_type) else norm ** norm_type


def combine(parts: Iterable[float], norm_type: float) -> float:
    """The parts of several ranks as one part (their sum, or their largest for p = inf; NaN where any is, as
    torch's norm of them all is: max() keeps a finite value that comes before a NaN)."""
    values = list(parts)
    if any(math.isnan(v) for v in values):
        return math.nan
    return max(values) if math.isinf(norm_type) else sum(values)


def clip_grad_norm_(params: Sequence[torch.nn.Parameter], counted: Sequence[torch.nn.Parameter],
                    max_norm: float, norm_type: float, *, reductions: Sequence[Reduction], rank: int,
                    device: torch.device, error: type[Exception] = ValueError, error_if_nonfinite: bool = False,
                    foreach: bool | None = None, names: dict[int, str] | None = None) -> torch.Tensor:
    """Scale the grads of `params` (this rank's) in place so that the total norm over every rank is at
    most `max_norm`; returns that total norm before scaling (a float32 scalar on `device`, the same on every
    rank). `counted`: the parameters whose grads this rank adds to the total. Collective over
    `reductions`, in order; bad arguments, or ranks calling it with different max_norm or norm_type, raise
    `error` on every rank."""
    max_norm, norm_type = float(max_norm), float(norm_type)
    refused = None  # raised after the gathers, so that the other ranks learn of it rather than wait
    if math.isnan(max_norm) or max_norm < 0 or math.isnan(norm_type) or norm_type <= 0:
        refused = error(f"clip_grad_norm_ needs max_norm >= 0 (inf: no clipping, only the norm) and a norm order "
                        f"> 0 (2.0, 1.0, inf, ...); got max_norm={max_norm}, norm_type={norm_type} on rank {rank}")
    part = 0.0 if refused else local_part([p.grad for p in counted if p.grad is not None], norm_type)
    seen: dict[tuple[float, float], list[int]] = {(max_norm, norm_type): [rank]}
    not_finite = [] if math.isfinite(part) else [rank]
    mismatch = False
    for red in reductions:
        mine = torch.tensor([part, max_norm, norm_type, float(mismatch)], dtype=torch.float64, device=device)
        every = [torch.empty_like(mine) for _ in red.ranks]
        with comm.guarded("the all-gather of the grad norm"):
            dist.all_gather(every, mine, group=red.group)
        rows = torch.stack(every).cpu().tolist()
        for r, (theirs, m, n, flag) in zip(red.ranks, rows):
            if r != rank:
                seen.setdefault((m, n), []).append(r)
            mismatch = mismatch or bool(flag) or (m, n) != (max_norm, norm_type)
            if not math.isfinite(theirs) and r not in not_finite and red.adds:
                not_finite.append(r)
        # replicas: the first one's, so that no rounding of their own sets them apart
        part = combine([row[0] for row in rows], norm_type) if red.adds else rows[0][0]
    if refused is not None:
        raise refused
    if mismatch:
        found = "; ".join(f"max_norm={m}, norm_type={n} on rank{'s' if len(rs) > 1 else ''} "
                          f"{', '.join(map(str, sorted(rs)))}" for (m, n), rs in seen.items())
        others = "" if len(seen) > 1 else " and other values on a rank of another stage or replica"
        raise error(f"the ranks called clip_grad_norm_ with different arguments ({found}{others}); every rank "
                    "of the job clips by the same norm, so pass the same max_norm and norm_type on every rank")
    total = part if math.isinf(norm_type) else part ** (1.0 / norm_type)
    total_t = torch.tensor(total, dtype=torch.float32, device=device)
    if not math.isfinite(total) and error_if_nonfinite:
        mine_names = [(names or {}).get(id(p), "?") for p in params
                      if p.grad is not None and not bool(torch.isfinite(_local(p.grad)).all())]
        here = f"; on this rank (rank {rank}): {', '.join(mine_names[:5])}" if mine_names else ""
        raise NonFiniteGrads(f"the total grad norm of order {norm_type} is {total}, so the grads cannot be "
                             f"clipped: they are not finite on rank{'s' if len(not_finite) > 1 else ''} "
                             f"{', '.join(map(str, sorted(not_finite))) or '?'}{here}; check the data and the learning "
                             "rate, or pass error_if_nonfinite=False to scale them anyway (as torch does)")
    if max_norm < total or not math.isfinite(total):  # a factor of 1 would leave every grad as it is
        torch.nn.utils.clip_grads_with_norm_([p for p in params if p.grad is not None], max_norm, total_t,
                                             foreach=foreach)
    return total_t


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def clip_pipeline(pp: Any, max_norm: float, norm_type: float, *, error_if_nonfinite: bool,
                  foreach: bool | None) -> torch.Tensor:
    """pp.clip_grad_norm_: the whole model's grads clipped by their total norm over the pipeline's ranks
    (and the replicas' shards under dp_shard="full"), a weight held on several ranks counted on the lowest."""
    owner: dict[str, int] = {}
    for st in pp.plan.stages:
        for name in st.params:
            owner[name] = min(owner.get(name, pp.world), pp.place[st.index])
    named = list(pp.named_parameters())
    reductions = [Reduction(pp.pp_group, pp._global, adds=True)] if pp.world > 1 else []
    if pp.dp_group is not None:
        reductions.append(Reduction(pp.dp_group, dist.get_process_group_ranks(pp.dp_group),
                                    adds=pp.dp_shard == "full"))
    counted = [p for n, p in named if owner.get(n, pp.rank) == pp.rank]  # held elsewhere too: once
    from pipe import calls  # first the call itself, as step() and evaluate() agree on theirs: a rank or a replica
    calls.agree_on_kind(pp, "clip_grad_norm_")  # making another call (clipping on one alone) is named on every
    # rank, where the gathers below would pair with its call's and read garbage, abort or wait
    return clip_grad_norm_([p for _, p in named], counted, max_norm, norm_type, reductions=reductions,
                           rank=pp.ctx.rank, device=pp.ctx.device, error=PipelineError,
                           error_if_nonfinite=error_if_nonfinite, foreach=foreach,
                           names={id(p): n for n, p in named})
