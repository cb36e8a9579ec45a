"""schedule="auto" against the grid it chose from, measured (run through `python -m bench auto`):
pipe.Pipeline(schedule="auto") ranks every candidate (schedule, microbatch count, stages per rank) by
its simulated step; then every candidate that can run is built on the plan auto made for it and
timed, alternating round by round over the same batches (each round a few steps in a row, the last
timed); the table ranks them as measured, with each one's prediction. The fastest of dozens of noisy
medians is biased low (whichever the noise favoured), so a final runs the K fastest and auto's choice
again, alternating over more rounds, and the note says how auto's choice measures against the fastest
there (and in the grid):
torchrun --nproc-per-node 2 -m bench.auto gpt --batch-size 32 --calibration out/calibration.json --cost flops"""
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

__all__ = ["main", "parser"]


def parser(add_help: bool = True) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench auto", description=__doc__, add_help=add_help,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="bundled name (gpt, ...), package.module:factory or path/file.py:factory")
    p.add_argument("--model-arg", action="append", default=[], metavar="K=V", help="factory keyword, repeatable")
    p.add_argument("--batch-size", type=whole(1), default=None,
                   help="samples per step (default: the workload's microbatch x 8); auto picks M among its divisors")
    p.add_argument("--schedules", default=None, help="comma-separated candidates' schedules (default: all)")
    p.add_argument("--memory-budget", default=None, help="per-rank budget, e.g. 40MB: candidates over it are refused")
    p.add_argument("--calibration", metavar="FILE", help="predict with this machine's calibration (bench calibrate)")
    p.add_argument("--cost", default="measured", choices=COSTS)
    p.add_argument("--steps", type=whole(1), default=6, help="timed steps per candidate")
    p.add_argument("--warmup", type=whole(0), default=1)
    p.add_argument("--back-to-back", type=whole(1), default=2, metavar="K",
                   help="steps a candidate runs in a row each round, the last one timed (the earlier ones bring its "
                        "weights back into the caches the other candidates used)")
    p.add_argument("--finalists", type=whole(0), default=4, metavar="K",
                   help="the K fastest of the grid run again beside auto's choice (0: no final)")
    p.add_argument("--final-steps", type=whole(1), default=8, help="timed steps per finalist")
    p.add_argument("--ranks", type=whole(1), default=2, help="processes to launch")
    p.add_argument("--launcher", default="torchrun", choices=["torchrun", "mpirun"])
    p.add_argument("--threads", type=whole(1), default=1, help="torch threads per process")
    p.add_argument("--out", default="out/bench")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    import partition
    import pipe
    from bench.schedules import timed_step
    from partition.workload import parse_overrides
    from pipe import auto

    ctx = pipe.init()
    say = print if ctx.rank == 0 else (lambda *a, **k: None)
    overrides = parse_overrides(args.model_arg)
    w = partition.load(args.model, **overrides)
    batch = args.batch_size or w.microbatch_size * 8
    common = dict(loss_fn=w.loss_fn, example_kwargs=w.example_kwargs, leaf_modules=w.leaf_modules, cost=args.cost,
                  memory_budget=args.memory_budget)
    chooser = pipe.Pipeline(w.model, w.example_args, example_target=w.example_target, schedule="auto",
                            batch_size=batch, calibration=args.calibration,
                            auto_schedules=args.schedules.split(",") if args.schedules else None, **common)
    chosen = chooser.candidates[0]
    say(auto.table(chooser.candidates), flush=True)
    runs: list[dict[str, Any]] = []
    for c in chooser.candidates:
        if c.refused:
            continue
        m = partition.load(args.model, **overrides)  # a model of its own (same seed, same weights)
        ex_args, ex_kwargs, ex_target = auto.resize_batch((m.example_args, m.example_kwargs, m.example_target),
                                                          batch // c.microbatches)
        pp = pipe.Pipeline(m.model, ex_args, **{**common, "example_kwargs": ex_kwargs, "loss_fn": m.loss_fn},
                           recompute=c.recompute or chooser.recompute,  # as auto planned it
                           example_target=ex_target, schedule=c.schedule, microbatches=c.microbatches,
                           stages_per_rank=c.stages_per_rank, plan=chooser.candidate_plans[c.label])
        params = list(pp.parameters())
        runs.append({"candidate": c, "pp": pp, "times": [],
                     "opt": pp.build_optimizer(torch.optim.AdamW, lr=1e-4) if params else None})
        say(f"built {c.label}", flush=True)

    def rounds(group: list[dict[str, Any]], key: str, steps: int, warmup: int, first_batch: int) -> None:
        for step in range(warmup + steps):
            b_args, b_kwargs, target = w.batch(batch, first_batch + step)
            for k in range(len(group)):  # rotated each round so the machine's drift hits all alike
                r = group[(k + step) % len(group)]
                for _ in range(args.back_to_back):
                    dt, _ = timed_step(r["pp"], r["opt"], b_args, b_kwargs, target)
                if step >= warmup:
                    r.setdefault(key, []).append(dt)  # every rank's alike: timed_step takes the slowest rank's
            say(f"{key} round {step + 1}/{warmup + steps}{' (warm-up)' if step < warmup else ''}", flush=True)

    rounds(runs, "times", args.steps, args.warmup, 0)
    ranked = sorted(runs, key=lambda r: statistics.median(r["times"]))
    final = ranked[:args.finalists] + [r for r in ranked[args.finalists:] if r["candidate"].label == chosen.label]
    if args.finalists > 0:
        rounds(final, "final", args.final_steps, 0, args.warmup + args.steps)
    if ctx.rank == 0:
        rows = sorted(({**r["candidate"].to_dict(), "label": r["candidate"].label,
                        "measured_ms": 1e3 * statistics.median(r["times"]), "samples_s": r["times"],
                        "final_ms": 1e3 * statistics.median(r["final"]) if "final" in r else None,
                        "final_samples_s": r.get("final", [])} for r in runs),
                      key=lambda x: x["measured_ms"])
        fastest = rows[0]
        mine = next(x for x in rows if x["label"] == chosen.label)
        weighed = any(x["memory"] for x in rows)  # each one's recompute policy and memory plan per stage
        lines = ["| measured rank | schedule | M | v |" + (" recompute | memory |" if weighed else "")
                 + " step measured (ms) | step predicted (ms) | predicted rank | measured / predicted |",
                 "|---:|---|---:|---:|" + ("---|---|" if weighed else "") + "---:|---:|---:|---:|"]
        by_prediction = {c.label: i for i, c in enumerate((c for c in chooser.candidates if not c.refused), 1)}
        for i, x in enumerate(rows, 1):
            tag = " (auto)" if x["label"] == chosen.label else ""
            lines.append(f"| {i} | {x['schedule']}{tag} | {x['microbatches']} | {x['stages_per_rank']} "
                         + (f"| {x['recompute'] or '-'} | {x['memory'] or '-'} " if weighed else "")
                         + f"| {x['measured_ms']:.1f} | {x['step_ms']:.1f} | {by_prediction[x['label']]} "
                         f"| {x['measured_ms'] / x['step_ms']:.2f} |")
        table = "\n".join(lines)
        verdict = (f"auto chose {chosen.label}: measured {mine['measured_ms']:.1f} ms, "
                   f"{mine['measured_ms'] / fastest['measured_ms']:.3f}x the fastest measured candidate "
                   f"({fastest['label']}, {fastest['measured_ms']:.1f} ms), batch {batch}; predicted "
                   + (f"with the calibration {args.calibration}" if args.calibration else
                      "from the plans' costs uncalibrated (no --calibration)"))
        finals = sorted((x for x in rows if x["final_ms"] is not None), key=lambda x: x["final_ms"])
        final_ratio = None
        if finals:
            final_ratio = mine["final_ms"] / finals[0]["final_ms"]
            table += "\n\nfinal, " + f"{args.final_steps} more rounds:\n" + "\n".join(
                f"- {x['label']}{' (auto)' if x is mine else ''}: {x['final_ms']:.1f} ms" for x in finals)
            verdict += (f"; in the final ({len(finals)} candidates, {args.final_steps} rounds) "
                        f"{final_ratio:.3f}x the fastest ({finals[0]['label']}, {finals[0]['final_ms']:.1f} ms)")
        print(table)
        print(verdict)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "auto.md").write_text(table + "\n\n" + verdict + "\n")
        (out / "auto.json").write_text(json.dumps({
            "command": " ".join(["python -m bench auto"] + (argv if argv is not None else sys.argv[1:])),
            "model": args.model, "model_args": overrides, "batch_size": batch, "ranks": ctx.world_size,
            "chosen": chosen.label, "chosen_over_fastest": mine["measured_ms"] / fastest["measured_ms"],
            "chosen_over_fastest_final": final_ratio,
            "calibration": args.calibration, "results": rows,
            "refused": [c.to_dict() for c in chooser.candidates if c.refused]}, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
