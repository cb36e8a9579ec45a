"""How a Pipeline gets its plan: costed (measured on each rank's device, shared between ranks with devices
of their own), planned on rank 0 or on every rank at once, broadcast so that every rank holds the same plan
(or the same error); for schedule="auto" every candidate planned and the fastest predicted one chosen."""
from __future__ import annotations

import dataclasses

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.fx

from partition.errors import first_line
import partition
from partition.plan import Plan, parse_bytes
from partition.planner import qualnames
from partition.measure import Share
import memory
from pipe import launch
from pipe.errors import PipelineError
from pipe.schedules import ScheduleError, in_flight_limit

if TYPE_CHECKING:
    from pipe.runtime import Pipeline

__all__ = ["agree_on_plan", "calibrating", "choose", "costing", "gather", "plan_here", "plan_within", "state_factor"]


def gather(obj: Any) -> list[Any]:
    """Every rank's `obj`, on every rank (all ranks of the job)."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class _Broadcast:
    """Run `fn` on rank 0 and give every rank its result, or the same error, so no rank hangs."""

    @staticmethod
    def run(fn: Callable[[], Any], rank: int, everyone: bool = False) -> Any:
        """With `everyone`, all ranks run `fn` at once (rank 0's result counts): measurements then
        see the load the pipeline puts on shared cores, caches and memory bandwidth."""
        box: list[Any] = [None]
        if rank == 0 or everyone:
            result: tuple[Any, ...]
            try:
                result = ("ok", fn())
            except Exception as e:  # re-raised on every rank below
                result = ("error", type(e).__name__, str(e))
            box[0] = result if rank == 0 else None
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(box, src=0)
        status, *rest = box[0]
        if status == "error":
            raise PipelineError(f"rank 0 failed to plan the pipeline: {rest[0]}: {rest[1]}")
        return rest[0]


def calibrating(share: Share | None, features: tuple[str, str]) -> bool:
    """Whether one plan (not schedule="auto"'s candidates, whose analyses are shared and may get a memory plan)
    has its stages timed whole (partition.plan's calibrate): where the ranks measured the costs unit by unit on
    devices of their own (`share`), and no memory plan is asked for (`features`: recompute, offload), which
    might keep less than a stage timed whole holds (its weights, and the activations of the few calls timed
    back to back, at most a quarter of the free device memory). On the H200 the costs measured unit by unit
    came to 1.09x the step's actions, and 0.99-1.00x once the stages were timed whole (README, Results on one GPU)."""
    return share is not None and features == ("none", "none")


def agree_on_plan(pp: Pipeline, model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                  plan: Plan | str | Path | None, cost: str, budget: float | str | None,
                  features: tuple[str, str] = ("none", "none"), example_target: Any = None,
                  traced: torch.fx.GraphModule | None = None) -> Plan:
    if isinstance(plan, (str, Path)):
        from pipe import checkpoint
        plan = checkpoint.plan_at(plan)
    given = plan is not None
    if plan is None:
        link, share, everyone = costing(pp, model, cost)
        d = _Broadcast.run(lambda: plan_within(
            pp, model, args, kwargs, cost, budget, features, example_target, link, share, traced=traced,
            calibrate=calibrating(share, features)).to_dict(), pp.ctx.rank, everyone=everyone)
        plan = Plan.from_dict(d)
    if not pp.trace_loss and plan.loss:
        raise PipelineError("trace_loss=False keeps the loss outside the graph, but the plan given puts it in the "
                            "last stage; pass a plan made without the loss in the graph, or leave trace_loss out")
    if sorted(plan.leaf_modules) != sorted(qualnames(pp.leaf_modules)):
        raise PipelineError(f"the plan was made with leaf_modules={plan.leaf_modules} but this pipeline traces "
                            f"with leaf_modules={qualnames(pp.leaf_modules)}; pass the plan's leaf_modules= "
                            "to pipe.Pipeline (the graph differs otherwise), or re-plan")
    if plan.n_stages != pp.S:
        raise PipelineError(f"the plan has {plan.n_stages} stages but world size {pp.world} x "
                            f"stages_per_rank {pp.v} = {pp.S}; launch as many processes as the plan has "
                            "stages (divided by stages_per_rank), or re-plan for this world size")
    return _as_run(pp, plan, budget) if given else plan


def _as_run(pp: Pipeline, plan: Plan, budget: float | str | None) -> Plan:
    """A plan given (plan=) whose schedule, microbatch count or memory budget are not this pipeline's: its cuts
    run under this pipeline's, which its record then gives (the plan table, its in-flight counts), with a note
    of what it was made for (found by review: the table named the file's schedule and budget beside a run of
    another, 2.4x over that budget). The others: the plan as given."""
    from memory.budget import human
    mine = parse_bytes(budget)
    differ = [f"{what} {theirs}" for what, theirs, ours in (
        ("schedule", repr(plan.schedule), repr(pp.schedule_name)), ("microbatches", plan.microbatches, pp.M),
        ("memory_budget", "none" if plan.memory_budget is None else human(plan.memory_budget),
         "none" if mine is None else human(mine))) if theirs != ours]
    if not differ:
        return plan
    flights = [in_flight_limit(pp.schedule_name, plan.n_stages, pp.M, s, pp.v, pp._compile is not None)
               for s in range(plan.n_stages)]
    ran = dataclasses.replace(plan, schedule=pp.schedule_name, microbatches=pp.M, memory_budget=mine,
                              stages=[dataclasses.replace(st, in_flight=n) for st, n in zip(plan.stages, flights)],
                              notes=list(plan.notes))
    ran.notes.append(f"the plan given was made for {', '.join(differ)}: its cuts run here with schedule "
                     f"{pp.schedule_name!r}, {pp.M} microbatches and memory_budget "
                     f"{'none' if mine is None else human(mine)}, as the table gives them (its per-stage figures "
                     "stay those planned for the other)")
    return ran


def costing(pp: Pipeline, model: torch.nn.Module, cost: str) -> tuple[tuple[float, float], Share | None, bool]:
    """How plans are costed here: the link's (bytes/ms, latency ms), the share of block timing each rank
    takes, and whether every rank measures at once."""
    # measured costs: the link measured too (ranks 0 and 1), so cuts weigh real transfer times
    neighbour = pp._rows[0][1] if pp.world > 1 else 0  # global rank 0's next pipeline rank
    link = launch.measure_link(pp.ctx.device, peer=neighbour) if cost == "measured" else None
    # a model that cannot run whole on this device (on the meta device, or its weights elsewhere)
    # is timed block by block here (partition.measure); ranks with devices of their own measure a
    # share each, gathered; ranks sharing the host's cores all measure every block at once, as
    # they will run (a rank that finished its share early would leave the others a faster machine)
    here = next((t.device for t in (*model.parameters(), *model.buffers())), pp.ctx.device)
    blockwise = cost == "measured" and (pp.meta or here != pp.ctx.device)
    own_device = pp.ctx.device.type != "cpu"
    share = Share(pp.ctx.rank, pp.ctx.world_size, gather) if blockwise and own_device else None
    # products priced by shape are timed on every rank at once on a CPU host too, as they will run
    return link or (1e6, 0.05), share, (cost == "measured" and (pp.ctx.device.type == "cpu" or blockwise)
                                        or cost == "shaped" and pp.ctx.device.type == "cpu")


def plan_here(pp: Pipeline, model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], cost: str,
              budget: float | str | None, features: tuple[str, str], example_target: Any,
              link: tuple[float, float], share: Share | None, schedule: str, M: int, v: int,
              analysis: Any = None, analysis_out: list[Any] | None = None,
              traced: torch.fx.GraphModule | None = None, calibrate: bool = False) -> Plan:
    """partition.plan for `schedule` with M microbatches and v stages per rank on this pipeline's ranks
    (`traced`: the model's trace for these args, planned from; `calibrate`: partition.plan's)."""
    S = pp.world * v
    plan = partition.plan(
        model, args, S, example_kwargs=kwargs, cost=cost, schedule=schedule, microbatches=M,
        memory_budget=budget, stages_per_rank=v,
        in_flight_counts=[in_flight_limit(schedule, S, M, s, v, pp._compile is not None) for s in range(S)],
        recompute=features[0], offload=features[1], loss_fn=pp.loss_fn if pp.trace_loss else None,
        example_target=example_target, bytes_per_ms=link[0], latency_ms=link[1], leaf_modules=pp.leaf_modules,
        progress=pp.progress, state_factor=2.0 + state_factor(pp), device=pp.ctx.device, share=share,
        analysis=analysis, analysis_out=analysis_out, traced=traced, calibrate=calibrate)
    if not pp.trace_loss:
        plan.loss_note = "trace_loss=False"
    return plan


def plan_within(pp: Pipeline, model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], cost: str,
                budget: float | str | None, features: tuple[str, str], example_target: Any,
                link: tuple[float, float], share: Share | None, traced: torch.fx.GraphModule | None = None,
                calibrate: bool = False) -> Plan:
    """The pipeline's plan (plan_here), its stages' memory plan checked under a budget. A budget the partitioner
    or memory/ refuses names, in the refusal, the least budget at which both fit: each one's figure bounds what
    it sees (the partitioner's leaves memory/'s recompute/offload and buffers out; memory/'s is for the stages cut
    at the budget given, and a larger one cuts them otherwise), so that following one led to the other's refusal
    (found by review). The least is found by planning at each figure named in turn."""
    from pipe import auto
    out: list[Any] = []

    def plan_at(b: float | str | None, **reuse: Any) -> Plan:
        return plan_here(pp, model, args, kwargs, cost, b, features, example_target, link, share, pp.schedule_name,
                         pp.M, pp.v, traced=traced, **reuse)

    sizes = {n: (p.numel(), p.element_size()) for n, p in model.named_parameters()}

    def fits(p: Plan, b: float) -> None:  # memory/'s verdict, as the stages' memory manager will give it
        auto.memory_plan(Plan.from_dict(p.to_dict()), out[0], pp.world, recompute=features[0],
                         offload=features[1], budget=b, param_sizes=sizes, compiled=pp._compile is not None)
    try:
        plan = plan_at(budget, analysis_out=out, calibrate=calibrate)
        if budget is not None and out:
            fits(plan, float(parse_bytes(budget) or 0))
        return plan
    except (partition.InfeasibleBudget, memory.BudgetError) as e:
        if budget is None:
            raise
        tried, b, least = [], float(e.needed_bytes), None
        for _ in range(8):
            tried.append(b)
            try:  # (the partitioner refused before its rewrites: planned afresh once, as a launch at b would plan)
                fits(plan_at(b, analysis=out[0]) if out else plan_at(b, analysis_out=out, calibrate=calibrate), b)
                least = b
                break
            except (partition.InfeasibleBudget, memory.BudgetError) as again:
                b = max(float(again.needed_bytes), b + 1.0)
        if least is None or least == float(e.needed_bytes):
            raise
        import re
        from memory.budget import human
        said = re.sub(r"memory_budget >= \d+( plus what the activations need \(this is a lower bound: the memory "
                      r"plan then names the least for the stages it cuts\))?", f"memory_budget >= {least:.0f}", str(e),
                      count=1)
        raise type(e)(f"{said} ({least:.0f} bytes, {human(least)}, is the least budget at which both the cut and "
                      "its memory plan fit these options, found by planning at each figure named in turn: "
                      f"{', '.join(f'{t:.0f}' for t in tried)})", least) from None


def choose(pp: Pipeline, model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], cost: str,
           budget: float | str | None, features: tuple[str, str], example_target: Any,
           batch_size: int | None, microbatches: int, schedules: Sequence[str] | None
           ) -> tuple[Plan, tuple[tuple[Any, ...], dict[str, Any], Any]]:
    """schedule="auto" (pipe.auto): every candidate planned and simulated on rank 0 (every rank
    measuring at once, as for one plan), the fastest predicted one's plan, with the example resized
    to its microbatch; the ranking in pp.candidates and the plan's notes."""
    from pipe import auto
    cal = pp.calibration
    # recompute='auto' is weighed against none: a plan cut for recomputation may be slower than one without
    weigh = features != ("none", "none")  # each candidate's stages get their memory plan, its cost counted
    try:
        counts = auto.microbatch_counts(pp.world, batch_size, microbatches)
        cands = auto.grid(pp.world, counts, schedules, ("none", "auto") if features[0] == "auto" else ("",))
    except (auto.NoCandidate, ScheduleError) as e:
        raise PipelineError(str(e)) from None

    given = (args, kwargs, example_target)
    link, share, everyone = costing(pp, model, cost)

    def plan_one(c: auto.Candidate, a_args: tuple[Any, ...], a_kwargs: dict[str, Any], a_target: Any,
                 **reuse: Any) -> Plan:
        return plan_here(pp, model, a_args, a_kwargs, cost, budget, (c.recompute or features[0], features[1]),
                         a_target, link, share, c.schedule, c.microbatches, c.stages_per_rank, **reuse)

    sizes = {n: (p.numel(), p.element_size()) for n, p in model.named_parameters()}

    def memory_fn(c: auto.Candidate, p: Plan, a: Any) -> Plan:
        try:
            q = auto.memory_plan(p, a, pp.world, recompute=c.recompute or features[0], offload=features[1],
                                 budget=parse_bytes(budget), param_sizes=sizes, compiled=pp._compile is not None)
        except memory.BudgetError as e:
            raise PipelineError(f"memory/ cannot fit it: {first_line(e, 400)}") from None
        if not weigh:  # memory/'s peaks alone, as the pipeline's own plan gives them (message buffers too; found
            for st in q.stages:  # by review: the ranking showed the partitioner's, 4.4 MiB for a 4.55 MiB measured)
                st.memory, st.memory_ms, st.memory_nodes = "", 0.0, 0
        return q

    def run() -> dict[str, Any]:
        ranked, plans = auto.choose(cands, pp.world, given, batch_size, plan_one, cal, memory_fn,
                                    compiled=pp._compile is not None)
        return {"ranked": [c.to_dict() for c in ranked], "plans": {k: p.to_dict() for k, p in plans.items()}}
    d = _Broadcast.run(run, pp.ctx.rank, everyone=everyone)
    pp.candidates = [auto.Candidate(**c) for c in d["ranked"]]
    pp.candidate_plans = {k: Plan.from_dict(p) for k, p in d["plans"].items()}
    plan = Plan.from_dict(d["plans"][pp.candidates[0].label])
    best = pp.candidates[0]
    runner_up = next((c for c in pp.candidates[1:] if not c.refused), None)
    plan.notes.append(
        f"schedule='auto' chose {best.label}"
        + (f" (memory plan per stage: {best.memory}, recompute={best.recompute or features[0]!r}, "
           f"offload={features[1]!r})" if best.memory else "")
        + f" of {len(pp.candidates)} candidates: predicted {best.step_ms:.1f} ms "
        f"per step ({'calibrated' if cal is not None else 'uncalibrated: no calibration= given'})"
        + (f", the next {runner_up.label} {runner_up.step_ms:.1f} ms" if runner_up else "")
        + "; pp.candidates ranks them all (pipe.auto.table)")
    return plan, given if batch_size is None else auto.resize_batch(given, batch_size // best.microbatches)


def state_factor(pp: Pipeline) -> float:
    """Optimizer state bytes per parameter byte on this rank: the optimizer's (Adam's two copies
    unless optimizer= says), a dp-th of it when the replicas shard it (dp_shard)."""
    f = 2.0 if pp._optim_factor is None else pp._optim_factor
    if pp.dp_shard == "full":  # a dp-th of the parameters and the state kept; the gathered parameters
        return (1.0 + f) / pp.dp  # and their grads in a step are the 2 every plan counts
    return f / pp.dp if pp.dp_shard == "optimizer" else f
