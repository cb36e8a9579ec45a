"""Schedules side by side in one launch, alternating step by step (run through `python -m bench schedules`);
per schedule the step the simulator predicts for the lowered program (pipe.predict) against the
measured one (the span of the timed actions, device time), and their ratio; beside, the step replayed
over the actions' typical times and the mean post, and each step replayed over its own times (the
simulator's model of the schedule alone). With --calibration or --calibrate (or --pace), each round also
times the machine's pace (bench.pace): a calibration that recorded its own pace predicts at this run's
(the table shows the ratio at the calibration's pace beside), and --calibrate records it:
torchrun --nproc-per-node 2 -m bench.schedules gpt --microbatches 4,8 --schedules gpipe,1f1b --out out/bench
(with --data-parallel N, N replicas of a pipeline over --ranks / N ranks, each on its own batches)"""
from __future__ import annotations

from partition.args import whole, wholes
import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from partition.costs import COSTS
from pipe.schedules import SCHEDULES, default_stages_per_rank

__all__ = ["main", "parse_args", "parser", "slowest_rank_s", "timed_step"]


def parser(add_help: bool = True) -> argparse.ArgumentParser:
    """The options of `python -m bench schedules` (the launcher's too, so --help lists them all)."""
    p = argparse.ArgumentParser(prog="python -m bench schedules", description=__doc__, add_help=add_help)
    p.add_argument("model", help="bundled name (gpt, ...), package.module:factory or path/file.py:factory")
    p.add_argument("--model-arg", action="append", default=[], metavar="K=V", help="factory keyword, repeatable")
    p.add_argument("--microbatches", default="4,8", type=wholes(1), help="comma-separated microbatch counts")
    p.add_argument("--microbatch-sizes", default=None, metavar="B1,B2", type=wholes(1),
                   help="comma-separated samples per microbatch (default: the workload's); each size runs every "
                        "schedule and count")
    p.add_argument("--schedules", default="gpipe,1f1b,interleaved-1f1b,zb-h1,zbv",
                   help=f"comma-separated schedules, of: {', '.join(sorted(SCHEDULES))}")
    p.add_argument("--stages-per-rank", type=whole(1), default=2,
                   help="v for interleaved-1f1b and interleaved-zb (the others run their own)")
    p.add_argument("--compile", default="off", choices=["off", "on", "both"],
                   help="compile the stages (Pipeline(compile=True), torch.compile's inductor): on, or both "
                        "each schedule plain and compiled, alternating")
    p.add_argument("--steps", type=whole(1), default=8, help="timed steps per candidate")
    p.add_argument("--warmup", type=whole(0), default=2)
    p.add_argument("--cost", default="measured", choices=COSTS)
    p.add_argument("--loss-outside", action="store_true",
                   help="keep the loss out of the graph (by default it is traced into the last stage)")
    p.add_argument("--ranks", type=whole(1), default=2, help="processes to launch")
    p.add_argument("--data-parallel", type=whole(1), default=1, metavar="N",
                   help="replicas of the pipeline (each of --ranks / N ranks); the prediction adds the grad "
                        "all-reduce, measured on this machine")
    p.add_argument("--launcher", default="torchrun", choices=["torchrun", "mpirun"])
    p.add_argument("--threads", type=whole(1), default=1, help="torch threads per process")
    p.add_argument("--calibration", metavar="FILE",
                   help="predict with this machine's calibration (python -m bench calibrate writes it); the table "
                        "shows the uncalibrated ratio beside")
    p.add_argument("--calibrate", metavar="FILE",
                   help="fit a calibration (pipe.calibration) from this run's measured steps and write it to FILE")
    p.add_argument("--pace", action=argparse.BooleanOptionalAction, default=None,
                   help="time a fixed piece of work on every rank at once in each round (bench.pace): a calibration "
                        "made with it predicts at this run's pace, and --calibrate records it (default: on with "
                        "--calibration or --calibrate)")
    p.add_argument("--out", default="out/bench")
    return p


def skip_reason(name: str, M: int, ranks: int) -> str | None:
    """Why schedule `name` is not run at M microbatches on a pipeline of `ranks` ranks, or None."""
    if name.startswith("interleaved") and M % ranks:
        return f"needs M divisible by {ranks}"
    if name == "dualpipev" and M < 2 * ranks:
        return f"needs M >= {2 * ranks}"
    return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return parser().parse_args(argv)


def nothing_to_measure(args: argparse.Namespace, world: int) -> str | None:
    """Why a grid runs nothing on `world` ranks (every schedule and microbatch count skipped), or None."""
    ranks = max(1, world // args.data_parallel)
    asked = [(n, int(m)) for n in args.schedules.split(",") for m in args.microbatches.split(",")]
    if not all(skip_reason(n, m, ranks) for n, m in asked):
        return None
    return ("nothing to measure: " + "; ".join(f"{n} M={m} {skip_reason(n, m, ranks)}" for n, m in asked[:4]) +
            "; pick microbatch counts the schedules take")


def check_grid(argv: list[str]) -> None:
    """python -m bench schedules, before it launches --ranks processes: a grid with nothing to run is a usage
    error."""
    p = parser()
    args = p.parse_args(argv)
    # (found by review: each of these took ~30 s of launching ranks, then a traceback on every rank)
    unknown = [n for n in args.schedules.split(",") if n not in SCHEDULES]
    if unknown:
        p.error(f"--schedules names {', '.join(unknown)}, which fxpipe does not have; pick from {', '.join(SCHEDULES)}")
    if args.ranks % args.data_parallel:
        p.error(f"--ranks {args.ranks} is not a multiple of --data-parallel {args.data_parallel}: each replica is a "
                f"pipeline of --ranks / --data-parallel ranks; use e.g. --ranks {2 * args.data_parallel}")
    why = nothing_to_measure(args, args.ranks)
    if why:
        p.error(why)


def thin_fit(cal: Any, asked: list[str], sizes: int) -> list[str]:
    """What a calibration fitted by --calibrate could not determine (found by review: a grid of one microbatch
    size, and schedules it could not run, gave a fit written without a word): lines fitted as a scale alone, and
    the schedules asked for that it has no step scale of."""
    said = []
    alone = [(k, cal.samples.get(k, 0)) for k in ("F", "B", "B_split", "W")
             if cal.samples.get(k, 0) and getattr(cal, k.lower()).fixed == 0 and getattr(cal, k.lower()).per_node == 0]
    if alone:
        said.append(", ".join(f"{k} ({n} points)" for k, n in alone) + " fitted as a scale of the planned cost alone"
                    + (" (one microbatch size: nothing tells an op's fixed cost from its FLOPs): predictions at other "
                       "microbatch sizes may miss; calibrate at several --microbatch-sizes" if sizes < 2 else
                       " (the points gave no fixed or per-node part of 0 or more)"))
    unseen = [n for n in asked if n not in cal.step_scales]
    if unseen:
        said.append(f"{', '.join(unseen)} did not run, so their predictions take the step scale of the others "
                    f"({cal.step_scale:.3f}x)")
    return said


def _versions() -> dict[str, Any]:
    return {"python": platform.python_version(), "torch": torch.__version__, "machine": platform.platform(),
            "cpus": os.cpu_count(), "processor": platform.processor()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    import partition
    import pipe
    from partition.workload import parse_overrides
    from pipe.launch import measure_allreduce
    from pipe.auto import resize_batch
    from pipe.calibration import Calibration, Observations, fit, observe, step_scale, typical
    from pipe.predict import (layout_costs, predicted_timeline, replayed_step, replayed_timeline, stage_costs,
                              w_parts)
    from pipe.scale import predict_layout
    from pipe.simulate import textbook_bubble
    from partition.costs import measure_once

    calibration = Calibration.load(args.calibration) if args.calibration else None
    if calibration is not None:
        calibration.check_cost(args.cost)
    ctx = pipe.init()
    rank, world = ctx.rank, ctx.world_size
    say = print if rank == 0 else (lambda *a, **k: None)
    overrides = parse_overrides(args.model_arg)
    cands: list[dict[str, Any]] = []
    sizes = [int(x) for x in args.microbatch_sizes.split(",")] if args.microbatch_sizes else [None]
    # the candidates of one model and microbatch size priced by one measurement, as schedule="auto" prices its
    # candidates: their predictions then differ by their schedules, not by the machine's speed while each was built
    with measure_once():
        for mb, M in [(mb, int(m)) for mb in sizes for m in args.microbatches.split(",")]:
            for name in args.schedules.split(","):
                v = args.stages_per_rank if name.startswith("interleaved") else default_stages_per_rank(name)
                why = skip_reason(name, M, world // args.data_parallel)
                if why:
                    say(f"skip {name} M={M}: {why}")
                    continue
                for compiled in {"off": [False], "on": [True], "both": [False, True]}[args.compile]:
                    w = partition.load(args.model, **overrides)
                    size = mb or w.microbatch_size
                    ex_args, ex_kwargs, ex_target = resize_batch((w.example_args, w.example_kwargs, w.example_target),
                                                                 size)
                    pp = pipe.Pipeline(w.model, ex_args, example_kwargs=ex_kwargs, loss_fn=w.loss_fn,
                                       microbatches=M, schedule=name, stages_per_rank=v, cost=args.cost,
                                       leaf_modules=w.leaf_modules, data_parallel=args.data_parallel,
                                       example_target=None if args.loss_outside else ex_target,
                                       trace_loss=not args.loss_outside, compile=compiled)
                    params = list(pp.parameters())
                    cands.append({"schedule": name, "M": M, "v": v, "w": w, "pp": pp, "compiled": compiled, "mb": size,
                                  "sized": mb is not None and len(sizes) > 1,
                                  "opt": pp.build_optimizer(torch.optim.AdamW, lr=1e-4) if params else None,
                                  "times": [], "timelines": []})
                    say(f"built {name} M={M} v={v} microbatch {size}{' compiled' if compiled else ''}", flush=True)
    why = nothing_to_measure(args, world)
    if why:  # launched by torchrun itself, on another world than --ranks says
        say(why, flush=True)
        return 2
    allreduce = (1.0, 0.0)
    if args.data_parallel > 1 and cands:
        allreduce = measure_allreduce(ctx.device, cands[0]["pp"].dp_group)
        say(f"grad all-reduce over {args.data_parallel} replicas: {allreduce[0] / 1e3:.0f} MB/s, "
            f"latency {allreduce[1] * 1e3:.0f} us", flush=True)
    from bench.pace import Pace
    on = args.pace if args.pace is not None else bool(args.calibration or args.calibrate)
    pace = Pace(ctx.device) if on else None
    total = args.warmup + args.steps
    agreeing: list[float] = []  # seconds per call the ranks take to agree on it, a median each round
    clipping: list[float] = []  # seconds of the whole model's clip_grad_norm_, one each round
    evaluating: list[tuple[float, float]] = []  # seconds of pp.evaluate, and of pp.forward then the loss
    for step in range(total):
        if pace is not None:
            pace.measure()
        for k in range(len(cands)):  # rotate the order each round so drift hits all alike
            c = cands[(k + step) % len(cands)]
            w, pp = c["w"], c["pp"]
            b_args, b_kwargs, target = w.batch(c["mb"] * c["M"], step * pp.dp + pp.dp_rank)
            dt, tl = timed_step(pp, c["opt"], b_args, b_kwargs, target)
            if step >= args.warmup:
                c["times"].append(dt)
                if tl is not None:  # rank 0's
                    c["timelines"].append(tl)
        if cands and step >= args.warmup:
            agreeing.append(agreement_s(cands[0]["pp"], cands[0]["w"], cands[0]["mb"] * cands[0]["M"], step))
            clipping.append(clipping_s(cands[0]["pp"], cands[0]["w"], cands[0]["mb"] * cands[0]["M"], step))
            evaluating.append(evaluation_s(cands[0]["pp"], cands[0]["w"], cands[0]["mb"] * cands[0]["M"], step))
        say(f"round {step + 1}/{total} {'(warm-up)' if step < args.warmup else ''}", flush=True)
    if pace is not None:
        del pace.times[:args.warmup]
    # the calibration at this run's pace, when both were measured (else as it is)
    paced = calibration.at_pace(pace.ms) if calibration is not None and pace is not None and pace.ms else calibration
    if rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        rows = []
        seen = Observations()

        def predicted(c: dict[str, Any], cal: Calibration | None) -> Any:
            """The candidate's simulated step under `cal`: with replicas, the pipeline and its grad all-reduce
            (pipe.scale)."""
            pp = c["pp"]
            if pp.dp == 1:
                return predicted_timeline(pp.plan, pp.world, calibration=cal, compiled=c["compiled"])
            has_w = any(a.kind == "W" for a in pp.actions) and not c["compiled"]  # (compiled: W in B)
            return predict_layout(layout_costs(pp.plan, has_w, calibration=cal), pp=pp.world, dp=pp.dp,
                                  schedule=c["schedule"], microbatches=c["M"], v=c["v"],
                                  allreduce_bytes_per_ms=allreduce[0], allreduce_latency_ms=allreduce[1]).timeline

        for c in cands:
            pp, w = c["pp"], c["w"]
            pred = predicted(c, paced)
            unpaced = pred if paced is calibration else predicted(c, calibration)
            raw = predicted(c, None) if calibration is not None else pred
            if args.calibrate:
                comm = stage_costs(pp.plan, False)[3]
                seen.extend(observe(c["timelines"], [st.fwd_ms for st in pp.plan.stages],
                                    [st.bwd_ms for st in pp.plan.stages], comm, pp.place, pp.plan.cost,
                                    [len(st.nodes) for st in pp.plan.stages], *w_parts(pp.plan),
                                    program=pp.programs))
            med = statistics.median(c["times"])
            durations: dict[tuple[str, int], list[float]] = {}  # each action's, over the timed steps (and mbs)
            for t in c["timelines"]:
                for e in t.events:
                    durations.setdefault((e.action.kind, e.action.stage), []).append(e.end - e.start)
            typicals = {k: typical(v) for k, v in durations.items()}
            posts = [e.end - e.start for t in c["timelines"] for e in t.posts]
            post_ms = statistics.fmean(posts) if posts else 0.0  # the host's, per batch of messages
            replay = replayed_timeline(pp.plan, pp.world, typicals, calibration, post_ms) if pp.dp == 1 else None
            # each step against itself replayed: the schedule's model alone (order, waits, matching)
            own = (statistics.median(t.makespan / replayed_step(pp.plan, pp.world, t, calibration).makespan
                                     for t in c["timelines"]) if pp.dp == 1 else None)
            simulated: dict[str, float] = {}
            for e in pred.events:
                simulated.setdefault(f"{e.action.kind}{e.action.stage}", e.end - e.start)  # every mb's alike
            sized = f"-mb{c['mb']}" if c["sized"] else ""
            tag = f"{c['schedule']}-M{c['M']}{'-compiled' if c['compiled'] else ''}{sized}"
            tl = c["timelines"][-1]
            measured_ms = statistics.median(t.makespan for t in c["timelines"])
            # the step's compute: every rank's actions (F, B, W, BW) summed, messages and waits left out
            compute_ms = statistics.median(sum(t.busy(r) for r in range(t.n_ranks)) for t in c["timelines"])
            tl.to_png(str(out / f"timeline-{tag}.png"), title=f"{args.model} {tag} (measured)")
            (out / f"trace-{tag}.json").write_text(json.dumps(tl.to_chrome_trace()))
            report = pp.memory_report()
            rows.append({
                "schedule": c["schedule"], "microbatches": c["M"], "stages_per_rank": c["v"], "compiled": c["compiled"],
                "microbatch_size": c["mb"], "sized": c["sized"],
                "median_step_s": med, "samples_s": c["times"],
                "tokens_per_s": c["mb"] * c["M"] * w.tokens_per_sample * pp.dp / med,
                "measured_bubble": statistics.median(t.bubble for t in c["timelines"]), "predicted_bubble": pred.bubble,
                "textbook_bubble": textbook_bubble(c["schedule"], pp.S, c["M"], c["v"]),
                "measured_step_ms": measured_ms, "predicted_step_ms": pred.makespan, "compute_ms": compute_ms,
                "measured_over_simulated": measured_ms / pred.makespan,
                "uncalibrated_step_ms": raw.makespan, "calibrated": calibration is not None,
                "paced": paced is not calibration, "unpaced_step_ms": unpaced.makespan,
                "replayed_step_ms": None if replay is None else replay.makespan, "post_ms": post_ms,
                "measured_over_step_replays": own,
                "peak_bytes_by_stage": {str(s): max([v for k, v in r.items() if "peak" in k] or [0])
                                        for s, r in report.items()},
                "predicted_peak_bytes_by_stage": {str(s.index): s.peak_bytes for s in pp.plan.stages},
                "action_ms": {f"{k}{s}": {"measured": ms, "simulated": simulated.get(f"{k}{s}")}
                              for (k, s), ms in sorted(typicals.items())},
            })
        for r in rows:  # the split backward's price: compute against 1F1B's on the same microbatches
            ref = [q["compute_ms"] for q in rows if q["schedule"] == "1f1b" and not q["compiled"]
                   and (q["microbatches"], q["microbatch_size"]) == (r["microbatches"], r["microbatch_size"])]
            r["compute_over_1f1b"] = r["compute_ms"] / ref[0] if ref else None
        result = {"command": " ".join(["python -m bench schedules"] + (argv or sys.argv[1:])),
                  "model": args.model, "model_args": overrides, "ranks": world, "data_parallel": args.data_parallel,
                  "launcher": ctx.launcher,
                  "threads_per_rank": args.threads, "versions": _versions(), "results": rows,
                  "pace_ms": None if pace is None else pace.ms, "pace_samples_s": [] if pace is None else pace.times,
                  "agree_ms": statistics.median(agreeing) * 1e3 if agreeing else None,
                  "clip_ms": statistics.median(clipping) * 1e3 if clipping else None,
                  "evaluate_ms": statistics.median(e for e, _ in evaluating) * 1e3 if evaluating else None,
                  "forward_loss_ms": statistics.median(f for _, f in evaluating) * 1e3 if evaluating else None}
        if calibration is not None:
            result["calibration"] = calibration.to_dict()
        if args.calibrate:
            fitted = fit(seen)
            # what the spread of action times adds to a step: the fitted prediction against each step measured,
            # over all the pipelines and per schedule (with replicas, each with its grad all-reduce; found by
            # review: those were left out, and a run of replicas alone wrote no step correction, silently)
            pairs = [(c["schedule"], statistics.median(t.makespan for t in c["timelines"]),
                      predicted(c, fitted).makespan) for c in cands if c["timelines"]]
            names = sorted({n for n, _, _ in pairs})
            fitted = dataclasses.replace(fitted, step_scale=step_scale((m, p) for _, m, p in pairs), step_scales={
                name: step_scale((m, p) for n, m, p in pairs if n == name) for name in names},
                pace_ms=None if pace is None else pace.ms)
            print(f"calibration written to {fitted.save(args.calibrate)}: {fitted.describe()}")
            for said in thin_fit(fitted, args.schedules.split(","), len(set(sizes))):
                print(f"calibration: {said}", flush=True)
        (out / "schedules.json").write_text(json.dumps(result, indent=1))
        table = markdown_table(rows)
        (out / "schedules.md").write_text(table + "\n")
        if pace is not None:
            print(pace.describe(calibration))
        if agreeing:
            fastest = min(r["median_step_s"] for r in rows)
            print(f"the ranks' agreement on each call (pipe.calls, part of every step): {result['agree_ms']:.2f} ms, "
                  f"{result['agree_ms'] / 1e3 / fastest:.2%} of the fastest step")
            print(f"pp.clip_grad_norm_ of {rows[0]['schedule']}'s grads (the whole model's norm, then scaled): "
                  f"{result['clip_ms']:.2f} ms, {result['clip_ms'] / 1e3 / fastest:.2%} of the fastest step")
            print(f"the loss of a batch without grads, {rows[0]['schedule']}: pp.evaluate "
                  f"{result['evaluate_ms']:.1f} ms, pp.forward then the loss on every rank "
                  f"{result['forward_loss_ms']:.1f} ms (a step: {rows[0]['median_step_s'] * 1e3:.1f} ms)")
        print(table)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def agreement_s(pp: Any, w: Any, batch_size: int, step: int, repeats: int = 9) -> float:
    """What each step spends for its ranks to agree on its call (pipe.calls: the call's digest, then one
    all-gather over the pipeline's group), on batch `step` of `w`: the median of `repeats`, the slowest rank's."""
    args, kwargs, target = w.batch(batch_size, step * pp.dp + pp.dp_rank)
    from pipe.calls import agree_on_call
    return statistics.median(slowest_rank_s(lambda: agree_on_call(pp, (args, kwargs), target, "step"), pp.ctx.device)
                             for _ in range(repeats))


def clipping_s(pp: Any, w: Any, batch_size: int, step: int) -> float:
    """What pp.clip_grad_norm_ takes after a step of batch `step` of `w` (run untimed first): the norm over
    every rank, then every grad scaled (max_norm 0 scales them all); the slowest rank's seconds."""
    args, kwargs, target = w.batch(batch_size, step * pp.dp + pp.dp_rank)
    pp.step(*args, target=target, **kwargs)
    took = slowest_rank_s(lambda: pp.clip_grad_norm_(0.0), pp.ctx.device)
    for p in pp.parameters():
        p.grad = None
    return took


def evaluation_s(pp: Any, w: Any, batch_size: int, step: int) -> tuple[float, float]:
    """The loss of batch `step` of `w` without grads: pp.evaluate's seconds, and those of pp.forward (the
    output on every rank) then the loss function on it; the slowest rank's each. None of the model's
    state changes (a plan with the loss in its graph builds its inference stages at the first forward)."""
    args, kwargs, target = w.batch(batch_size, step * pp.dp + pp.dp_rank)
    evaluate = slowest_rank_s(lambda: pp.evaluate(*args, target=target, **kwargs), pp.ctx.device)
    with torch.no_grad():
        on = target.to(pp.ctx.device)  # pp.forward's output is on the rank's device
        forward = slowest_rank_s(lambda: pp.loss_fn(pp.forward(*args, **kwargs), on), pp.ctx.device)
    return evaluate, forward


def slowest_rank_s(work: Callable[[], Any], device: torch.device | str) -> float:
    """`work` run on every rank, all starting together: the slowest rank's seconds (on CUDA, once the
    device has finished it)."""
    if dist.is_initialized():
        dist.barrier()
    t0 = time.perf_counter()
    work()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    dt = torch.tensor([time.perf_counter() - t0], device=device)  # NCCL reduces device tensors only
    if dist.is_initialized():
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return float(dt)


def timed_step(pp: Any, opt: torch.optim.Optimizer | None, args: Any, kwargs: dict[str, Any], target: Any
               ) -> tuple[float, Any]:
    """One training step of pipeline `pp` (and its optimizer's), all ranks starting together: the
    slowest rank's seconds, and the measured timeline (on rank 0)."""
    def step() -> None:
        pp.step(*args, target=target, **kwargs)
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return slowest_rank_s(step, pp.ctx.device), pp.gather_timeline()


def markdown_table(rows: list[dict[str, Any]]) -> str:
    cal = any(r.get("calibrated") for r in rows)
    paced = any(r.get("paced") for r in rows)
    head = ("| schedule | M | step (s) | tokens/s | bubble measured | bubble simulated | bubble textbook "
            f"| step simulated (ms) | step measured (ms) | measured / simulated |"
            f"{' at the calibration pace |' if paced else ''}{' uncalibrated |' if cal else ''}"
            " measured / replayed | measured / step replayed | compute (ms) | compute / 1F1B's |\n"
            f"|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|{'---:|' if paced else ''}{'---:|' if cal else ''}"
            "---:|---:|---:|---:|")
    lines = [head]
    for r in rows:
        name = (r["schedule"] + (" (compiled)" if r.get("compiled") else "")
                + (f" (microbatch {r['microbatch_size']})" if r.get("sized") else ""))
        lines.append(f"| {name} | {r['microbatches']} | {r['median_step_s']:.3f} | {r['tokens_per_s']:.0f} "
                     f"| {r['measured_bubble']:.3f} | {r['predicted_bubble']:.3f} | {r['textbook_bubble']:.3f} "
                     f"| {r['predicted_step_ms']:.1f} | {r['measured_step_ms']:.1f} "
                     f"| {r['measured_over_simulated']:.2f} |"
                     + (f" {r['measured_step_ms'] / r['unpaced_step_ms']:.2f} |" if paced else "")
                     + (f" {r['measured_step_ms'] / r['uncalibrated_step_ms']:.2f} |" if cal else "")
                     + (f" {r['measured_step_ms'] / r['replayed_step_ms']:.2f} |" if r.get("replayed_step_ms")
                        else " - |")
                     + (f" {r['measured_over_step_replays']:.2f} |" if r.get("measured_over_step_replays")
                        else " - |")
                     + f" {r['compute_ms']:.1f} |"
                     + (f" {r['compute_over_1f1b']:.3f} |" if r.get("compute_over_1f1b") else " - |"))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
