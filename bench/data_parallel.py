"""Replicated pipelines measured: how much of the grad all-reduce the backward hides, and pipe.scale's
predicted step against the measured one (run through `python -m bench data-parallel`):
OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 -m bench.data_parallel gpt --data-parallel 2 --steps 8 \\
    --model-arg n_layer=8 --model-arg d_model=256 --model-arg seq_len=128 --model-arg vocab=1000"""
from __future__ import annotations

from partition.args import whole
import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from partition.costs import COSTS
from pipe.schedules import SCHEDULES, default_stages_per_rank
from pipe.simulate import Event, Timeline

__all__ = ["main", "parser", "shares", "exposure"]


def parser(add_help: bool = True) -> argparse.ArgumentParser:
    """The options of `python -m bench data-parallel` (the launcher's too, so --help lists them all)."""
    p = argparse.ArgumentParser(prog="python -m bench data-parallel", description=__doc__, add_help=add_help,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="bundled name (gpt, ...), package.module:factory or path/file.py:factory")
    p.add_argument("--model-arg", action="append", default=[], metavar="K=V", help="factory keyword, repeatable")
    p.add_argument("--data-parallel", type=whole(1), default=2, help="replicas of the pipeline")
    p.add_argument("--schedule", default="1f1b", choices=sorted(SCHEDULES))
    p.add_argument("--stages-per-rank", type=whole(1), default=None)
    p.add_argument("--microbatches", type=whole(1), default=8)
    p.add_argument("--dp-shard", default="none", choices=["none", "optimizer", "full"])
    p.add_argument("--bucket-mb", type=float, default=None, help="grad bucket size (default: pipe.scale.bucket_cap)")
    p.add_argument("--steps", type=whole(1), default=8, help="timed steps")
    p.add_argument("--warmup", type=whole(0), default=2)
    p.add_argument("--cost", default="measured", choices=COSTS)
    p.add_argument("--ranks", type=whole(1), default=4, help="processes to launch")
    p.add_argument("--launcher", default="torchrun", choices=["torchrun", "mpirun"])
    p.add_argument("--threads", type=whole(1), default=1, help="torch threads per process")
    p.add_argument("--out", default="out/bench-dp")
    return p


def shares(tl: Any) -> dict[str, float]:
    """Of one measured timeline: per pipeline rank, the exposed share of its grad collectives' time
    (after its own last compute action), and the step's (after the step's last compute action)."""
    out = {}
    last = max((e.end for e in tl.events), default=0.0)
    for r in range(tl.n_ranks):
        total = tl.collective_time(r)
        if total > 0:
            out[f"rank {r}"] = tl.exposed(r) / total
            mine = [e.end for e in tl.collectives if e.rank == r]
            out[f"rank {r} past the step's compute"] = max(0.0, max(mine) - last) / total
    return out


def exposure(parts: list[tuple[int, int, list[Any], list[Any]]]) -> dict[int, dict[str, float]]:
    """Per global rank, from every rank's events of one step ((global rank, replica's pipeline rank,
    compute events, collective events), host clock, one machine): its grad collectives' time (the
    union of their spans), the exposed share of it (after its own last compute action), and the share
    exposed after the later of its data-parallel peers' last compute actions (what is left once the
    wait for a slower replica is taken out)."""
    last = {g: max((e.end for e in ev), default=0.0) for g, _, ev, _ in parts}
    peers: dict[int, list[int]] = {}
    for g, r, _, _ in parts:
        peers.setdefault(r, []).append(g)
    out = {}
    for g, r, _, coll in parts:
        if not coll:
            continue
        total = Timeline([], 1, [Event(0, e.action, e.start, e.end) for e in coll]).collective_time(0)
        end = max(e.end for e in coll)
        slowest = max(last[p] for p in peers[r])
        out[g] = {"collective_ms": total, "exposed": max(0.0, end - last[g]) / total,
                  "exposed_after_slowest_peer": max(0.0, end - slowest) / total}
    return out


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    import partition
    import pipe
    from bench.schedules import timed_step
    from partition.workload import parse_overrides
    from pipe.launch import measure_allreduce
    from pipe.predict import layout_costs
    from pipe.scale import predict_layout

    ctx = pipe.init()
    say = print if ctx.rank == 0 else (lambda *a, **k: None)
    w = partition.load(args.model, **parse_overrides(args.model_arg))
    v = args.stages_per_rank or default_stages_per_rank(args.schedule)
    pp = pipe.Pipeline(w.model, w.example_args, example_kwargs=w.example_kwargs, loss_fn=w.loss_fn,
                       microbatches=args.microbatches, schedule=args.schedule, stages_per_rank=v, cost=args.cost,
                       example_target=w.example_target, leaf_modules=w.leaf_modules,
                       data_parallel=args.data_parallel, dp_shard=args.dp_shard, dp_bucket_mb=args.bucket_mb)
    say(pp.plan.table(), flush=True)
    ar_bytes_per_ms, ar_latency = measure_allreduce(ctx.device, pp.dp_group)
    opt = pp.build_optimizer(torch.optim.AdamW, lr=1e-4)
    walls: list[float] = []
    timelines: list[Any] = []
    exposures: list[dict[int, dict[str, float]]] = []
    for step in range(args.warmup + args.steps):
        b_args, b_kwargs, target = w.batch(w.microbatch_size * args.microbatches, step * pp.dp + pp.dp_rank)
        dt, tl = timed_step(pp, opt, b_args, b_kwargs, target)
        parts: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(parts, (ctx.rank, pp.rank, pp.timeline, pp.collectives))
        if step >= args.warmup:
            walls.append(dt)
            timelines.append(tl)
            exposures.append(exposure(parts))
        say(f"step {step + 1}/{args.warmup + args.steps}{' (warm-up)' if step < args.warmup else ''}: "
            f"{dt * 1e3:.0f} ms", flush=True)
    if ctx.rank == 0:
        has_w = any(a.kind == "W" for a in pp.actions)
        pred = predict_layout(layout_costs(pp.plan, has_w), pp=pp.world, dp=pp.dp, schedule=args.schedule,
                              microbatches=args.microbatches, v=v, allreduce_bytes_per_ms=ar_bytes_per_ms,
                              allreduce_latency_ms=ar_latency,
                              bucket_bytes=None if args.bucket_mb is None else int(args.bucket_mb * (1 << 20)))
        per_step = [shares(tl) for tl in timelines]
        median_share = {f"global rank {g} {k}": statistics.median(e[g][k] for e in exposures)
                        for g in sorted(exposures[0]) for k in ("exposed", "exposed_after_slowest_peer")}
        makespans = [tl.makespan for tl in timelines]
        mid = sorted(range(len(timelines)), key=lambda i: makespans[i])[len(timelines) // 2]
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        tag = f"{args.schedule}-pp{pp.world}-dp{pp.dp}"
        timelines[mid].to_png(str(out / f"timeline-{tag}.png"),
                              title=f"{args.model} {tag}, measured (the median step; collectives below each rank)")
        (out / f"trace-{tag}.json").write_text(json.dumps(timelines[mid].to_chrome_trace()))
        pred.timeline.to_png(str(out / f"timeline-{tag}-predicted.png"), title=f"{args.model} {tag}, predicted")
        result = {
            "command": " ".join(["python -m bench data-parallel"] + (argv if argv is not None else sys.argv[1:])),
            "model": args.model, "ranks": ctx.world_size, "pp": pp.world, "dp": pp.dp, "schedule": args.schedule,
            "microbatches": args.microbatches, "buckets": [len(pp.reducer.buckets)] if pp.reducer else [],
            "allreduce_bytes_per_ms": ar_bytes_per_ms, "allreduce_latency_ms": ar_latency,
            "median_wall_step_ms": statistics.median(walls) * 1e3,
            "median_measured_step_ms": statistics.median(makespans), "predicted_step_ms": pred.step_ms,
            "predicted_over_measured": pred.step_ms / statistics.median(makespans),
            "exposed_share_median": median_share, "exposed_share_per_step": per_step, "exposure_per_step": exposures,
            "predicted_exposed_ms": pred.exposed_ms, "predicted_allreduce_ms": pred.allreduce_ms}
        (out / f"data-parallel-{tag}.json").write_text(json.dumps(result, indent=1))
        print(timelines[mid].to_text(100))
        print(f"measured step (median of {len(makespans)}, timeline) {result['median_measured_step_ms']:.1f} ms, "
              f"predicted {pred.step_ms:.1f} ms: predicted / measured {result['predicted_over_measured']:.3f}")
        print(f"all-reduce measured: {ar_bytes_per_ms / 1e3:.0f} MB/s, latency {ar_latency * 1e3:.0f} us")
        for k, val in median_share.items():
            print(f"exposed share of the grad collectives, {k}: {val:.1%} (median over steps)")
        print(f"wrote {out / f'timeline-{tag}.png'}, {out / f'trace-{tag}.json'}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
