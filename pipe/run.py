"""Train a model as a pipeline: torchrun --nproc-per-node 2 -m pipe.run gpt --schedule 1f1b --steps 50
(or mpirun -n 2 python -m pipe.run ...). Prints the plan, per-step loss, tokens/s and time, and
writes the measured timeline (Chrome trace JSON and PNG) with measured against predicted bubble."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipe.schedules import SCHEDULES

__all__ = ["main", "parse_args", "error_line"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pipe.run", description=__doc__)
    p.add_argument("model", help="bundled name (gpt, gpt_text, ...), package.module:factory or path/file.py:factory")
    p.add_argument("--model-arg", action="append", default=[], metavar="K=V", help="factory keyword, repeatable")
    p.add_argument("--schedule", default="1f1b", choices=sorted(SCHEDULES), help="the pipeline schedule")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--stages-per-rank", type=int, default=None,
                   help="stages per rank (default: 2 for interleaved-1f1b and zbv, else 1)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=None, help="default: microbatch size x microbatches")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--cost", default="measured", choices=["measured", "flops"])
    p.add_argument("--plan", default=None, help="a plan.json from python -m partition (default: plan now)")
    p.add_argument("--memory-budget", default=None, help="per-stage budget, e.g. 8GiB")
    p.add_argument("--recompute", default="none", choices=["none", "full", "selective", "auto"],
                   help="activation recomputation per stage (auto: chosen from --memory-budget)")
    p.add_argument("--offload", default="none", choices=["none", "activations", "states", "all"],
                   help="chunked offload to host memory of activations, model states, or both")
    p.add_argument("--loss-outside", action="store_true",
                   help="keep the loss out of the graph (by default it is traced into the last stage, which "
                        "lets a wide LM head and its cross entropy be spread over stages)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--out", default="out/run", help="folder for the trace, the PNG and the summary")
    p.add_argument("--seed", type=int, default=None, help="passed to the factory as seed= when given")
    return p.parse_args(argv)


def _memory_lines(pp: Any) -> str:
    """Every stage's memory (policy, predicted and measured peak by kind), gathered to every rank."""
    mine = pp.memory.describe() if hasattr(pp.memory, "describe") else ""
    parts: list[Any] = [None] * dist.get_world_size() if dist.is_initialized() else [mine]
    if dist.is_initialized():
        dist.all_gather_object(parts, mine)
    lines = [line for p in parts for line in str(p).splitlines() if line]
    return "\n".join(sorted(lines, key=lambda line: int(line.split()[1].rstrip(":"))))


def _measured_peaks(pp: Any) -> dict[int, float]:
    """Every stage's peak bytes as its ledger measured them (last step), gathered to every rank."""
    mine = {s: r["peak_total"] for s, r in pp.memory_report().items() if "peak_total" in r}
    parts: list[Any] = [None] * dist.get_world_size() if dist.is_initialized() else [mine]
    if dist.is_initialized():
        dist.all_gather_object(parts, mine)
    return {s: v for p in parts for s, v in p.items()}


def error_line(rank: int, e: BaseException) -> str:
    """How a command line reports an error: one line, with the notes fxpipe added (rank, stage, mb)."""
    notes = "; ".join(getattr(e, "__notes__", []))
    from partition.errors import FxpipeError
    kind = "" if isinstance(e, FxpipeError) else f"{type(e).__name__}: "  # fxpipe's own messages say what
    return f"error (rank {rank}): {kind}{e}" + (f" [{notes}]" if notes else "")


def _bar(done: int, total: int, width: int = 20) -> str:
    k = width * done // max(1, total)
    return "[" + "#" * k + "." * (width - k) + "]"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    import partition
    import pipe
    from partition.workload import WorkloadError, parse_overrides
    from pipe.comm import PeerLost
    from pipe.predict import predicted_timeline

    ctx = pipe.init()
    say = print if ctx.rank == 0 else (lambda *a, **k: None)
    try:
        extra = {} if args.seed is None else {"seed": args.seed}
        w = partition.load(args.model, **extra, **parse_overrides(args.model_arg))
    except (WorkloadError, TypeError) as e:
        print(error_line(ctx.rank, e), file=sys.stderr)
        return 2
    try:
        pp = pipe.Pipeline(w.model, w.example_args, example_kwargs=w.example_kwargs, loss_fn=w.loss_fn,
                           microbatches=args.microbatches, schedule=args.schedule, plan=args.plan,
                           stages_per_rank=args.stages_per_rank, cost=args.cost, memory_budget=args.memory_budget,
                           recompute=args.recompute, offload=args.offload, leaf_modules=w.leaf_modules,
                           example_target=None if args.loss_outside else w.example_target,
                           progress=lambda line: say(f"[plan] {line}", flush=True))
    except (ValueError, TypeError) as e:
        print(error_line(ctx.rank, e), file=sys.stderr)
        return 2
    say(pp.plan.table())
    params = list(pp.parameters())  # a rank may hold none (a stage computing only the loss, say)
    opt = torch.optim.AdamW(params, lr=args.lr) if params else None
    batch_size = args.batch_size or w.microbatch_size * args.microbatches
    tokens = batch_size * w.tokens_per_sample
    times: list[float] = []
    first = last = float("nan")
    for step in range(args.steps):
        b_args, b_kwargs, target = w.batch(batch_size, step)
        t0 = time.perf_counter()
        try:
            loss = pp.step(*b_args, target=target, **b_kwargs)
        except Exception as e:  # this rank's own error (the model's too), another rank's, or a lost rank
            print(error_line(ctx.rank, e), file=sys.stderr, flush=True)
            return 3 if isinstance(e, PeerLost) else 2
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        times.append(dt)
        first = loss if step == 0 else first
        last = loss
        say(f"step {step + 1:4d}/{args.steps} {_bar(step + 1, args.steps)} loss {loss:.4f}  "
            f"{tokens / dt:9.0f} tok/s  {dt * 1e3:7.1f} ms", flush=True)
    memory_lines = _memory_lines(pp)
    peaks = _measured_peaks(pp)
    measured = pp.gather_timeline()
    if ctx.rank == 0 and measured is not None:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        predicted = predicted_timeline(pp.plan, ctx.world_size)
        (out / "trace.json").write_text(json.dumps(measured.to_chrome_trace()))
        (out / "timeline.json").write_text(json.dumps(measured.to_json()))
        png = ""
        try:
            measured.to_png(str(out / "timeline.png"), title=f"{args.model} {args.schedule} M={args.microbatches}")
            png = f", {out / 'timeline.png'}"
        except RuntimeError as e:
            say(f"(no PNG: {e})")
        warm = times[1:] or times
        summary: dict[str, Any] = {
            "model": args.model, "schedule": args.schedule, "microbatches": args.microbatches,
            "ranks": ctx.world_size, "launcher": ctx.launcher, "first_loss": first, "last_loss": last,
            "median_step_s": statistics.median(warm), "tokens_per_s": tokens / statistics.median(warm),
            "measured_bubble": measured.bubble, "predicted_bubble": predicted.bubble,
            "measured_step_ms": measured.makespan, "predicted_step_ms": predicted.makespan}
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        say(f"loss {first:.4f} -> {last:.4f}; median step {summary['median_step_s'] * 1e3:.1f} ms, "
            f"{summary['tokens_per_s']:.0f} tok/s")
        say(f"bubble: measured {measured.bubble:.3f}, predicted {predicted.bubble:.3f}; last step "
            f"{measured.makespan:.1f} ms measured, {predicted.makespan:.1f} ms predicted")
        say(measured.to_text(width=80))
        say(f"wrote {out / 'trace.json'} (open in ui.perfetto.dev or chrome://tracing){png}")
        say("memory per stage (last step):\n" + memory_lines)
        say("the plan with each stage's peak as measured (last step):\n" + pp.plan.table(measured=peaks))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
