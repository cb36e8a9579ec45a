"""python -m partition MODEL --stages N: plan a model's pipeline stages, print the table, write the plan."""
from __future__ import annotations

from partition.args import OneLineParser, file_to_write, whole
import argparse
import json
import sys
from typing import Any, Sequence

from partition.costs import COSTS
from partition.errors import first_line
from partition.plan import PlanError, parse_bytes, per_stage_note
from partition.planner import plan
from partition.solve import PartitionError
from partition.trace import TraceError
from partition.workload import BUNDLED, WorkloadError, load, parse_overrides

# The command line reads the schedules' in-flight counts from pipe.schedules, the pure table of
# schedules; the partition library itself takes them as data (in_flight_counts=) and never imports pipe.
from pipe.schedules import (SCHEDULES, ScheduleError, build, default_stages_per_rank, default_stages_text,  # noqa: E402
                            in_flight_limit)

USAGE_ERRORS = (WorkloadError, PlanError, PartitionError, TraceError, ScheduleError)


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="python -m partition",
        description="Trace MODEL on one example microbatch, cost it, and cut it into balanced pipeline "
                    "stages under an optional per-stage memory budget.")
    p.add_argument("model", metavar="MODEL",
                   help=f"package.module:factory, path/file.py:factory or a bundled name ({', '.join(BUNDLED)})")
    p.add_argument("--stages", type=whole(1), default=None, metavar="N",
                   help="number of pipeline stages (required, but with --schedule auto)")
    p.add_argument("--cost", choices=COSTS, default="measured",
                   help="time each op on this machine (default), count FLOPs (deterministic), or count FLOPs "
                        "with each matrix product priced by its shape's measured speed (shaped)")
    p.add_argument("--memory-budget", default=None, metavar="BYTES",
                   help="per-stage memory limit, e.g. 8GiB, 512MB or a number of bytes")
    p.add_argument("--schedule", choices=[*sorted(SCHEDULES), "auto"], default="1f1b",
                   help="the schedule whose microbatches in flight the memory limit counts; auto: plan every "
                        "schedule, microbatch count (a divisor of --batch-size) and stages per rank for --ranks ranks, "
                        "print them ranked by simulated step and keep the fastest (pipe.auto)")
    p.add_argument("--ranks", type=whole(1), default=None, metavar="R",
                   help="with --schedule auto: the pipeline's ranks")
    p.add_argument("--batch-size", type=whole(1), default=None, metavar="B",
                   help="with --schedule auto: samples per step (default: the example microbatch x 8)")
    p.add_argument("--calibration", default=None, metavar="FILE",
                   help="with --schedule auto: this machine's calibration (python -m bench calibrate)")
    p.add_argument("--recompute", choices=("none", "auto"), default=None,
                   help="plan for activation recomputation (auto: memory/ recomputes what the budget needs); with "
                        "--schedule auto, weigh every candidate with and without it and give each its memory plan "
                        "(default: auto under --memory-budget, else none)")
    p.add_argument("--stages-per-rank", type=whole(1), default=None, metavar="V",
                   help=f"stages per rank (default: {default_stages_text()}); --stages counts all")
    p.add_argument("--microbatches", type=whole(1), default=None, metavar="M",
                   help="microbatches per step (default: the number of stages)")
    p.add_argument("--out", default=None, metavar="PATH", type=file_to_write, help="write the plan as JSON to PATH")
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of the table")
    p.add_argument("--loss-outside", action="store_true",
                   help="keep the workload's loss out of the graph (by default it is traced into the last "
                        "stage, which lets a wide LM head and its cross entropy be spread over stages)")
    p.add_argument("--model-arg", action="append", default=[], metavar="K=V",
                   help="keyword argument for the model factory, e.g. --model-arg n_layer=8 (repeatable)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parser().parse_args(argv)
    except SystemExit as e:  # a usage error (printed) or --help
        return int(e.code or 0)
    if args.schedule == "auto":
        return _auto(args)
    if args.stages is None:
        print("python -m partition: error: --stages N is required (the pipeline's stages), but with --schedule auto "
              "(which takes --ranks)", file=sys.stderr)
        return 2
    given = [f"--{k.replace('_', '-')}" for k in ("ranks", "batch_size", "calibration")
             if getattr(args, k) is not None]
    if given:  # (found by review: ignored without a word, a calibration file never opened)
        print(f"python -m partition: error: {' and '.join(given)} {'is' if len(given) == 1 else 'are'} read only "
              f"with --schedule auto, and --schedule {args.schedule} plans --stages {args.stages} as given; leave "
              f"{given[0]} out, or pass --schedule auto", file=sys.stderr)
        return 2
    v = args.stages_per_rank or default_stages_per_rank(args.schedule)
    M = args.microbatches or args.stages
    try:
        if args.stages % v:
            raise PlanError(f"--stages {args.stages} is not a multiple of --stages-per-rank {v}; the stages are "
                            f"spread evenly over the ranks: use --stages {args.stages - args.stages % v + v}")
        build(args.schedule, args.stages // v, M, v)  # a schedule the pipeline runs (found by review: 1f1b with
        # --stages-per-rank 2 was planned, and pipe.run refused the plan)
        w = load(args.model, **parse_overrides(args.model_arg))
        flights = [in_flight_limit(args.schedule, args.stages, M, s, v) for s in range(args.stages)]
        found: list[Any] = []  # the analysis the plan was cut from (its memory plans are made on it)
        result = plan(w.model, w.example_args, args.stages, example_kwargs=w.example_kwargs, cost=args.cost,
                      schedule=args.schedule, microbatches=M, stages_per_rank=v, in_flight_counts=flights,
                      memory_budget=args.memory_budget, recompute=args.recompute or "none",
                      loss_fn=None if args.loss_outside else w.loss_fn,
                      example_target=None if args.loss_outside else w.example_target,
                      leaf_modules=w.leaf_modules, analysis_out=found,
                      progress=lambda line: print(f"[plan] {line}", file=sys.stderr, flush=True))
        if args.loss_outside:
            result.loss_note = "--loss-outside"
        if args.recompute == "auto":  # the memory plan each stage gets within the budget, as in the pipeline
            result = _memory_plans(result, found[0], args.stages // v, "auto", args.memory_budget,
                                   {n: (p.numel(), p.element_size()) for n, p in w.model.named_parameters()})
    except USAGE_ERRORS as e:
        print(f"python -m partition: error: {e}", file=sys.stderr)
        return 2
    if args.memory_budget is not None and v > 1:
        result.notes.append(per_stage_note(v))
    if args.out:
        result.save(args.out)
    if args.json:
        print(json.dumps(result.to_dict(), indent=1))
    else:
        print(result.table())
        if args.out:
            print(f"plan written to {args.out}")
    return 0


def _memory_plans(result: Any, analysis: Any, ranks: int, recompute: str, budget: str | None,
                  sizes: dict[str, tuple[int, int]]) -> Any:
    """The plan with each stage's memory plan (pipe.auto.memory_plan); PlanError when one cannot fit."""
    import memory
    from pipe import auto
    try:
        return auto.memory_plan(result, analysis, ranks, recompute=recompute, offload="none",
                                budget=parse_bytes(budget), param_sizes=sizes)
    except memory.BudgetError as e:
        raise PlanError(f"memory/ cannot fit it: {first_line(e, 400)}") from None


def _auto(args: argparse.Namespace) -> int:
    """--schedule auto: every candidate planned on this process, ranked by simulated step; the fastest's plan kept."""
    from pipe import auto
    from pipe.calibration import Calibration
    fixed = [f for f, x in (("--stages", args.stages), ("--stages-per-rank", args.stages_per_rank),
                            ("--microbatches", args.microbatches)) if x is not None]
    try:
        if fixed:
            raise PlanError(f"--schedule auto chooses the stages per rank and the microbatch count, but "
                            f"{', '.join(fixed)} fixes one; leave it out, or name a schedule")
        if args.ranks is None or args.ranks < 1:
            raise PlanError(f"--schedule auto plans for a number of ranks: pass --ranks R (R >= 1), got {args.ranks}")
        cal = Calibration.load(args.calibration) if args.calibration else None
        if cal is not None:
            cal.check_cost(args.cost)
        w = load(args.model, **parse_overrides(args.model_arg))
        batch = args.batch_size or w.microbatch_size * 8
        # as pipe.Pipeline(schedule="auto") weighs it: recomputation by default under a budget
        recompute = args.recompute or ("auto" if args.memory_budget is not None else "none")
        cands = auto.grid(args.ranks, auto.microbatch_counts(args.ranks, batch, 8), None,
                          ("none", "auto") if recompute == "auto" else ("",))
        target = None if args.loss_outside else w.example_target

        def plan_one(c: auto.Candidate, a_args: Any, a_kwargs: Any, a_target: Any, **reuse: Any) -> Any:
            S = args.ranks * c.stages_per_rank
            return plan(w.model, a_args, S, example_kwargs=a_kwargs, cost=args.cost, schedule=c.schedule,
                        microbatches=c.microbatches, stages_per_rank=c.stages_per_rank,
                        in_flight_counts=[in_flight_limit(c.schedule, S, c.microbatches, s, c.stages_per_rank)
                                          for s in range(S)], memory_budget=args.memory_budget,
                        recompute=c.recompute or recompute, loss_fn=None if args.loss_outside else w.loss_fn,
                        example_target=a_target, leaf_modules=w.leaf_modules, **reuse)
        sizes = {n: (p.numel(), p.element_size()) for n, p in w.model.named_parameters()}

        def memory_fn(c: auto.Candidate, p: Any, a: Any) -> Any:
            return _memory_plans(p, a, args.ranks, c.recompute or recompute, args.memory_budget, sizes)
        ranked, plans = auto.choose(cands, args.ranks, (w.example_args, w.example_kwargs, target), batch, plan_one,
                                    cal, memory_fn if recompute == "auto" else None)
    except (*USAGE_ERRORS, auto.NoCandidate, OSError, ValueError) as e:
        print(f"python -m partition: error: {e}", file=sys.stderr)
        return 2
    best = plans[ranked[0].label]
    best.notes.append(f"schedule='auto' chose {ranked[0].label} for {args.ranks} ranks at batch {batch}"
                      + (f" (memory plan per stage: {ranked[0].memory})" if ranked[0].memory else "") + ": "
                      f"predicted {ranked[0].step_ms:.1f} ms per step ({'calibrated' if cal else 'uncalibrated'})")
    if args.memory_budget is not None and best.stages_per_rank > 1:  # (found by review: the pipeline's note only)
        best.notes.append(per_stage_note(best.stages_per_rank))
    if args.out:
        best.save(args.out)
    if args.json:
        print(json.dumps({"candidates": [c.to_dict() for c in ranked], "plan": best.to_dict()}, indent=1))
    else:
        print(auto.table(ranked))
        print(best.table())
        if args.out:
            print(f"plan written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
