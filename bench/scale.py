"""python -m bench scale gpt --layers-per-stage 8 --pp 8,16 --ranks 64,128,256,512,1024 --global-batch 4096 \\
    --link-gbps 200 --allreduce-gbps 200
predicts the step of (pp, dp) layouts from a plan's stage costs (pipe.scale; one process, no torch.distributed).

Legend: pp pipeline ranks, dp replicas (ranks = pp x dp), v stages per rank, M microbatches per replica
and step (global batch / (dp x the workload's microbatch size)). Each pp is planned once on this
machine (its measured or FLOP-counted costs); every layout then simulates one replica's lowered
program with the grad all-reduce of its dp ranks (a ring at --allreduce-gbps) on top."""
from __future__ import annotations

from partition.args import whole
import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from partition.costs import COSTS
from pipe.schedules import (SCHEDULES, ScheduleError, build, default_stages_per_rank, default_stages_text,
                            in_flight_limit)

if TYPE_CHECKING:
    from partition.plan import Plan
    from pipe.scale import Layout

__all__ = ["GPT_MODELS", "Candidate", "candidates", "gbps_to_bytes_per_ms", "main", "markdown", "parser"]

GPT_MODELS = ("gpt", "gpt_wide_vocab", "gpt_text")  # the bundled models with n_layer, which --layers-per-stage sets
_COLUMNS = ("ranks", "pp", "dp", "M", "step ms", "bubble", "all-reduce ms", "exposed ms", "tokens/s")


def gbps_to_bytes_per_ms(gbps: float) -> float:
    """Gigabits per second -> bytes per millisecond."""
    return gbps * 1e9 / 8 / 1e3


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{flag} takes positive integers separated by commas, got {text!r}; "
                                         f"write it like {flag} 4,8")
    return values


def parser(add_help: bool = True) -> argparse.ArgumentParser:
    """The options of `python -m bench scale`."""
    p = argparse.ArgumentParser(prog="python -m bench scale", description=__doc__, add_help=add_help,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="bundled name (gpt, ...), package.module:factory or path/file.py:factory")
    p.add_argument("--model-arg", action="append", default=[], metavar="K=V", help="factory keyword, repeatable")
    p.add_argument("--layers-per-stage", type=whole(1), default=None, metavar="L",
                   help=f"for {', '.join(GPT_MODELS)}: build the model with n_layer = L x pp for each pp, L layers per "
                        "pipeline rank (L / v per stage); default 8 unless --model-arg n_layer= is given; other "
                        "models are planned as given")
    p.add_argument("--pp", default=None, metavar="LIST",
                   help="pipeline ranks, comma-separated, e.g. 4,8,16 (default 8; with --plan: the plan's); each "
                        "is planned once: a gpt of 8 x 16 = 128 layers (d_model 128) takes 12-50 s on 2 cores "
                        "(idle or busy), 256 layers about 2 min")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--dp", default=None, metavar="LIST", help="replicas, comma-separated, e.g. 16,128")
    group.add_argument("--ranks", default=None, metavar="LIST",
                       help="total ranks, comma-separated; dp = ranks / pp, layouts where it does not divide are "
                            "skipped (default 64,128,256,512,1024)")
    p.add_argument("--schedule", default=None, choices=sorted(SCHEDULES), help="default 1f1b (with --plan: the plan's)")
    p.add_argument("--stages-per-rank", type=whole(1), default=None, metavar="V",
                   help=f"v (default: the schedule's, {default_stages_text()})")
    p.add_argument("--global-batch", type=whole(1), default=4096, metavar="N",
                   help="sequences (samples) per step over all replicas (default 4096)")
    p.add_argument("--link-gbps", type=float, default=200.0,
                   help="pipeline link for the boundary messages, gigabits/s (default 200)")
    p.add_argument("--link-latency-us", type=float, default=5.0, help="its latency per message (default 5)")
    p.add_argument("--allreduce-gbps", type=float, default=200.0,
                   help="bandwidth of the data-parallel ring all-reduce, gigabits/s (default 200)")
    p.add_argument("--allreduce-latency-us", type=float, default=5.0,
                   help="its latency per ring step (default 5)")
    p.add_argument("--bucket-mb", type=float, default=None,
                   help="grad bucket size in MiB (default: pipe.scale.bucket_cap, an eighth of a stage within 1-25)")
    p.add_argument("--cost", default="measured", choices=COSTS)
    p.add_argument("--plan", default=None, metavar="FILE",
                   help="a saved partition.Plan (python -m partition ... --out FILE): no planning, pp from it")
    p.add_argument("--out", default="out/bench-scale", metavar="DIR",
                   help="writes scale.json, scale.md and each plan made (plan-ppN.json, for --plan) here")
    return p


@dataclass(frozen=True)
class Candidate:
    """One layout to predict: pp x dp ranks, M microbatches per replica."""

    pp: int
    dp: int
    microbatches: int


def candidates(pps: Sequence[int], *, dps: Sequence[int] | None = None, ranks: Sequence[int] | None = None,
               global_batch: int, microbatch_size: int) -> tuple[list[Candidate], list[str]]:
    """The layouts of every pp with each dp (or each total `ranks`, dp = ranks / pp), and why the
    others are skipped: dp not a divisor, the global batch not a multiple of dp x microbatch_size,
    or fewer microbatches per replica than pipeline ranks."""
    if (dps is None) == (ranks is None):
        raise ValueError(f"give exactly one of dps and ranks (got dps={dps}, ranks={ranks})")
    kept: list[Candidate] = []
    skipped: list[str] = []
    for pp in pps:
        if dps is not None:
            pairs = [(pp * d, d) for d in dps]
        else:  # dp 0: the ranks are not a multiple of pp
            pairs = [(n, n // pp if n % pp == 0 else 0) for n in ranks or ()]
        for n, dp in pairs:
            if dp == 0:
                skipped.append(f"ranks={n} pp={pp}: {n} ranks are not a multiple of pp={pp}")
                continue
            per_replica = dp * microbatch_size
            if global_batch % per_replica:
                skipped.append(f"ranks={n} pp={pp} dp={dp}: global batch {global_batch} is not a multiple of "
                               f"dp x microbatch size = {dp} x {microbatch_size} = {per_replica}")
                continue
            M = global_batch // per_replica
            if M < pp:
                skipped.append(f"ranks={n} pp={pp} dp={dp}: M={M} microbatches per replica < pp={pp} "
                               "(the pipeline never fills); use a larger --global-batch or a smaller dp")
                continue
            kept.append(Candidate(pp, dp, M))
    return kept, skipped


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The layouts' table, one row per layout (keys as `_row` writes them)."""
    lines = ["| " + " | ".join(_COLUMNS) + " |", "|" + "|".join("---:" for _ in _COLUMNS) + "|"]
    for r in rows:
        cells = [str(r["ranks"]), str(r["pp"]), str(r["dp"]), str(r["microbatches"]), f"{r['step_ms']:.2f}",
                 f"{r['bubble']:.1%}", f"{r['allreduce_ms']:.2f}", f"{r['exposed_ms']:.2f}",
                 f"{r['tokens_per_s']:,.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _row(layout: Layout, tokens_per_step: int) -> dict[str, Any]:
    return {"ranks": layout.ranks, "pp": layout.pp, "dp": layout.dp, "v": layout.v, "schedule": layout.schedule,
            "microbatches": layout.microbatches, "step_ms": layout.step_ms, "bubble": layout.bubble,
            "allreduce_ms": layout.allreduce_ms, "exposed_ms": layout.exposed_ms,
            "rank_exposed_ms": layout.rank_exposed_ms, "tokens_per_s": tokens_per_step / (layout.step_ms / 1e3)}


def _model_args(args: argparse.Namespace, pp: int, overrides: dict[str, Any]) -> dict[str, Any]:
    """The factory's keywords for one pp: n_layer = L x pp for the bundled gpt models."""
    if args.model not in GPT_MODELS or args.plan is not None:
        return dict(overrides)
    if "n_layer" in overrides and args.layers_per_stage is None:
        return dict(overrides)
    return dict(overrides, n_layer=(args.layers_per_stage or 8) * pp)


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    from partition.plan import Plan, PlanError
    from partition.solve import PartitionError
    from partition.trace import TraceError
    from partition.workload import WorkloadError, parse_overrides

    try:
        pps = _ints(args.pp, "--pp") if args.pp is not None else None
        dps = _ints(args.dp, "--dp") if args.dp is not None else None
        ranks = _ints(args.ranks, "--ranks") if args.ranks is not None else None
    except argparse.ArgumentTypeError as e:
        p.error(str(e))
    if dps is None and ranks is None:
        ranks = [64, 128, 256, 512, 1024]
    for flag, value in (("--global-batch", args.global_batch), ("--link-gbps", args.link_gbps),
                        ("--allreduce-gbps", args.allreduce_gbps), ("--bucket-mb", args.bucket_mb)):
        if value is not None and value <= 0:
            p.error(f"{flag} must be > 0, got {value}")
    for flag, value in (("--link-latency-us", args.link_latency_us),
                        ("--allreduce-latency-us", args.allreduce_latency_us)):
        if value < 0:
            p.error(f"{flag} must be >= 0, got {value}")
    try:
        overrides = parse_overrides(args.model_arg)
        if args.layers_per_stage is not None and "n_layer" in overrides and args.model in GPT_MODELS:
            raise WorkloadError(f"--layers-per-stage {args.layers_per_stage} sets n_layer = L x pp, and --model-arg "
                                f"n_layer={overrides['n_layer']} sets it too; give one of them")
        saved = Plan.load(args.plan) if args.plan is not None else None
        schedule = args.schedule or (saved.schedule if saved is not None else "1f1b")
        v = args.stages_per_rank or default_stages_per_rank(schedule)
        if saved is not None:
            if saved.n_stages % v:
                raise PlanError(f"the plan has {saved.n_stages} stages, not a multiple of v={v} stages per rank "
                                f"({schedule}); give --stages-per-rank dividing {saved.n_stages}")
            if pps is not None and pps != [saved.n_stages // v]:
                raise PlanError(f"--pp {args.pp} differs from the plan's {saved.n_stages} stages / v={v} = "
                                f"{saved.n_stages // v} pipeline ranks; leave --pp out with --plan")
            pps = [saved.n_stages // v]
        return _run(args, argv, pps or [8], dps, ranks, schedule, v, overrides, saved)
    except (WorkloadError, PlanError, PartitionError, TraceError, ScheduleError) as e:
        print(f"python -m bench scale: error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace, argv: list[str] | None, pps: list[int], dps: list[int] | None,
         ranks: list[int] | None, schedule: str, v: int, overrides: dict[str, Any], saved: Plan | None) -> int:
    import partition
    from pipe.predict import layout_costs
    from pipe.scale import MIB, predict_layout

    w0 = partition.load(args.model, **_model_args(args, pps[0], overrides))
    todo, skipped = candidates(pps, dps=dps, ranks=ranks, global_batch=args.global_batch,
                               microbatch_size=w0.microbatch_size)
    link = gbps_to_bytes_per_ms(args.link_gbps)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plans: dict[int, dict[str, Any]] = {}
    rows: list[dict[str, Any]] = []
    for pp in pps:
        mine: list[Candidate] = []
        has_w = False
        for c in [c for c in todo if c.pp == pp]:  # the schedule's own sizes (interleaved-1f1b: M % pp == 0)
            try:
                sched = build(schedule, pp, c.microbatches, v)
            except ScheduleError as e:
                skipped.append(f"ranks={c.pp * c.dp} pp={pp} dp={c.dp}: {e}")
                continue
            has_w = any(a.kind == "W" for acts in sched.values() for a in acts)
            mine.append(c)
        if not mine:
            continue
        # the plan's microbatches only count activations in flight, for memory; the fewest of these layouts
        M_plan = min(c.microbatches for c in mine)
        t0 = time.perf_counter()
        if saved is not None:
            plan, w, note = saved, w0, f"plan {args.plan}"
        else:
            kwargs = _model_args(args, pp, overrides)
            w = w0 if kwargs == _model_args(args, pps[0], overrides) else partition.load(args.model, **kwargs)
            flights = [in_flight_limit(schedule, pp * v, M_plan, s, v) for s in range(pp * v)]
            plan = partition.plan(w.model, w.example_args, pp * v, cost=args.cost, schedule=schedule,
                                  microbatches=M_plan, stages_per_rank=v, in_flight_counts=flights,
                                  example_kwargs=w.example_kwargs,
                                  example_target=w.example_target, loss_fn=w.loss_fn, leaf_modules=w.leaf_modules)
            note = ", ".join(f"{k}={val}" for k, val in kwargs.items()) or "as given"
            plan.save(out / f"plan-pp{pp}.json")  # for --plan: the same costs again without planning
        secs = time.perf_counter() - t0
        costs = layout_costs(plan, has_w, link, args.link_latency_us / 1e3)
        print(f"pp={pp}: {args.model} ({note}), {plan.n_stages} stages, bottleneck {plan.bottleneck_ms:.2f} ms, "
              f"largest stage grads {max(costs.grad_bytes) / MIB:.1f} MiB ({plan.cost} costs, {secs:.1f} s)",
              flush=True)
        plans[pp] = {"model_args": _model_args(args, pp, overrides), "plan_s": secs, "n_stages": plan.n_stages,
                     "bottleneck_ms": plan.bottleneck_ms, "f_ms": list(costs.f_ms), "b_ms": list(costs.b_ms),
                     "w_ms": list(costs.w_ms), "comm_ms": list(costs.comm_ms), "grad_bytes": list(costs.grad_bytes)}
        for c in mine:
            layout = predict_layout(costs, pp=pp, dp=c.dp, schedule=schedule, microbatches=c.microbatches, v=v,
                                    allreduce_bytes_per_ms=gbps_to_bytes_per_ms(args.allreduce_gbps),
                                    allreduce_latency_ms=args.allreduce_latency_us / 1e3,
                                    bucket_bytes=None if args.bucket_mb is None else int(args.bucket_mb * MIB))
            rows.append(_row(layout, args.global_batch * w.tokens_per_sample))
    rows.sort(key=lambda r: (r["ranks"], r["pp"]))
    table = markdown(rows)
    print(table)
    for line in skipped:
        print(f"skipped {line}")
    command = " ".join(["python -m bench scale"] + (list(argv) if argv is not None else sys.argv[1:]))
    result = {"command": command, "model": args.model, "schedule": schedule, "v": v, "cost": args.cost,
              "global_batch": args.global_batch, "microbatch_size": w0.microbatch_size,
              "tokens_per_sample": w0.tokens_per_sample, "link_gbps": args.link_gbps,
              "link_latency_us": args.link_latency_us, "allreduce_gbps": args.allreduce_gbps,
              "allreduce_latency_us": args.allreduce_latency_us, "bucket_mb": args.bucket_mb,
              "plans": {str(k): val for k, val in plans.items()}, "layouts": rows, "skipped": skipped}
    (out / "scale.json").write_text(json.dumps(result, indent=1))
    (out / "scale.md").write_text(f"`{command}`\n\n{table}\n" + "".join(f"\nskipped {s}" for s in skipped) + "\n")
    print(f"wrote {out / 'scale.json'}, {out / 'scale.md'}")
    if not rows:
        print("python -m bench scale: error: no layout left to predict (see the skipped lines); change --pp, "
              "--dp/--ranks or --global-batch", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
