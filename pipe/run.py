"""Train a model as a pipeline: torchrun --nproc-per-node 2 -m pipe.run gpt --schedule 1f1b --steps 50
(or mpirun -n 2 python -m pipe.run ...). Prints the plan, per-step loss, tokens/s and time, and
writes the measured timeline (Chrome trace JSON and PNG) with measured against predicted bubble."""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from partition.args import whole
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from partition.costs import COSTS
from pipe.ckpt_format import LATEST
from pipe.launch import DEFAULT_TIMEOUT_S, exit_process, timeout_setting
from pipe.schedules import SCHEDULES, default_stages_text

__all__ = ["main", "parse_args", "error_line", "say_error", "OUTPUTS"]

HELD_OUT = 1_000_000  # --eval-every: replica r evaluates batch HELD_OUT + r (training batches count from 0)
OUTPUTS = ("summary.json", "trace.json", "timeline.json", "timeline.png")  # what a run writes to --out
CHECKPOINT = "checkpoint"  # --out's folder of the checkpoints --save-every writes and --resume reads
_EPILOG = (f"--out: a folder that already holds a previous run's outputs ({', '.join(OUTPUTS)}) is refused "
           f"before anything runs, unless --overwrite is given. --timeout: also FXPIPE_TIMEOUT (seconds); "
           f"default {DEFAULT_TIMEOUT_S:g} s.")


def _whole(flag: str, least: int, example: int) -> Callable[[str], int]:
    """An argparse type: a whole number >= `least`, or an error naming the value and the fix."""
    return whole(least, flag, example)


def _positive(flag: str, example: str) -> Callable[[str], float]:
    """An argparse type: a positive, finite number, or an error naming the value and the fix."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"must be a positive, finite number, got {text!r}; e.g. {flag} {example}")
        return value
    return parse


def _budget(text: str) -> str:
    from partition.plan import parse_bytes
    try:
        parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _timeout(text: str) -> float:
    try:
        return timeout_setting(text, "--timeout")
    except ValueError as e:  # argparse names the flag
        raise argparse.ArgumentTypeError(str(e).removeprefix("--timeout ")) from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, every value checked (a bad one: usage and one line naming it, exit 2)."""
    p = argparse.ArgumentParser(prog="python -m pipe.run", description=__doc__, epilog=_EPILOG)
    p.add_argument("model", help="bundled name (gpt, gpt_text, ...), package.module:factory or path/file.py:factory")
    p.add_argument("--model-arg", action="append", default=[], metavar="K=V", help="factory keyword, repeatable")
    p.add_argument("--schedule", default=None, choices=[*sorted(SCHEDULES), "auto"],
                   help="the pipeline schedule (default: --plan's, else 1f1b); auto: the schedule, microbatch count (a "
                        "divisor of --batch-size) and stages per rank the simulator predicts fastest (pipe.auto)")
    p.add_argument("--auto-schedules", default=None, metavar="S1,S2",
                   help="with --schedule auto: the schedules it weighs (default: all)")
    p.add_argument("--microbatches", type=_whole("--microbatches", 1, 8), default=None,
                   help="microbatches per step (default: --plan's, else 8)")
    p.add_argument("--data-parallel", type=_whole("--data-parallel", 1, 2), default=1, metavar="N",
                   help="replicas of the pipeline (a DeviceMesh (world / N, N) named pp, dp); each replica trains "
                        "on its own batches and the grads are averaged")
    p.add_argument("--dp-shard", default="none", choices=["none", "optimizer", "full"],
                   help="with --data-parallel: shard the optimizer state (ZeRO-1) or the parameters too (FSDP) "
                        "over the replicas")
    p.add_argument("--stages-per-rank", type=_whole("--stages-per-rank", 1, 2), default=None,
                   help=f"stages per rank (default: {default_stages_text()})")
    p.add_argument("--steps", type=_whole("--steps", 1, 20), default=20)
    p.add_argument("--batch-size", type=_whole("--batch-size", 1, 32), default=None,
                   help="default: microbatch size x microbatches")
    p.add_argument("--lr", type=_positive("--lr", "1e-3"), default=1e-3)
    p.add_argument("--clip-grad-norm", type=_positive("--clip-grad-norm", "1.0"), default=None, metavar="MAX",
                   help="clip the whole model's grads to this total norm before each optimizer step "
                        "(Pipeline.clip_grad_norm_: the norm over every stage and replica); each step prints it")
    p.add_argument("--eval-every", type=_whole("--eval-every", 1, 10), default=None, metavar="N",
                   help="every N steps, the loss of a held-out batch in eval mode (Pipeline.eval().evaluate; replica r "
                        f"evaluates batch {HELD_OUT:,} + r, never trained on), printed and in summary.json")
    p.add_argument("--cost", default="measured", choices=COSTS)
    p.add_argument("--calibration", default=None, metavar="FILE",
                   help="this machine's calibration for the predictions (python -m bench calibrate writes it)")
    p.add_argument("--plan", default=None, help="a plan.json from python -m partition, or a checkpoint's folder "
                   "(default: plan now); its schedule, microbatches, stages per rank and memory budget are the "
                   "defaults")
    p.add_argument("--memory-budget", type=_budget, default=None,
                   help="per-stage budget, e.g. 8GiB (default: --plan's, else none)")
    p.add_argument("--compile", action="store_true",
                   help="compile each stage with torch.compile (Pipeline(compile=True)); needs --recompute none and "
                        "--offload none or activations")
    p.add_argument("--recompute", default=None, choices=["none", "full", "selective", "auto"],
                   help="activation recomputation per stage (auto: chosen from --memory-budget); default none, "
                        "or auto under --schedule auto with --memory-budget (auto weighs it per candidate)")
    p.add_argument("--offload", default="none", choices=["none", "activations", "states", "all"],
                   help="chunked offload to host memory of activations, model states, or both")
    p.add_argument("--loss-outside", action="store_true",
                   help="keep the loss out of the graph (by default it is traced into the last stage, which "
                        "lets a wide LM head and its cross entropy be spread over stages)")
    p.add_argument("--skip-nonfinite", action="store_true",
                   help="drop a step whose loss is NaN or infinite (its grads cleared) instead of stopping")
    p.add_argument("--timeout", type=_timeout, default=None, metavar="SECONDS",
                   help=f"bound on every wait on another rank (default: $FXPIPE_TIMEOUT, else {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--threads", type=_whole("--threads", 1, 1), default=1, help="torch threads per process")
    p.add_argument("--out", default="out/run", help="folder for the trace, the PNG and the summary")
    p.add_argument("--overwrite", action="store_true", help="replace a previous run's outputs in --out")
    p.add_argument("--save-every", type=_whole("--save-every", 1, 10), default=None, metavar="N",
                   help=f"every N steps and at the last, save a checkpoint (Pipeline.save: the model, AdamW's state, "
                        f"the step, the random state, the losses so far) to --out's {CHECKPOINT}/ (the newest kept)")
    p.add_argument("--resume", action="store_true",
                   help=f"continue from the checkpoint in --out's {CHECKPOINT}/ at its step (any plan of the model, "
                        "another world size too), up to --steps; without one, start at step 1")
    p.add_argument("--seed", type=int, default=None, help="passed to the factory as seed= when given")
    args = p.parse_args(argv)
    env = os.environ.get("FXPIPE_TIMEOUT", "")
    if args.timeout is None and env.strip():
        try:
            args.timeout = timeout_setting(env, "FXPIPE_TIMEOUT")
        except ValueError as e:
            p.error(str(e))
    if args.plan is not None:  # the plan's settings, where the command line gives none
        try:
            from pipe import checkpoint
            plan = checkpoint.plan_at(args.plan)
        except (OSError, ValueError, KeyError) as e:
            p.error(f"--plan {args.plan}: {e}")
        args.schedule = plan.schedule if args.schedule is None else args.schedule
        args.microbatches = plan.microbatches if args.microbatches is None else args.microbatches
        args.memory_budget = plan.memory_budget if args.memory_budget is None else args.memory_budget
        if args.stages_per_rank is None and args.schedule == plan.schedule:  # (found by review: a plan of 2
            args.stages_per_rank = plan.stages_per_rank                      # stages per rank ran as 1, refused)
    if args.dp_shard != "none" and args.data_parallel == 1:  # (found by review: accepted, and nothing sharded)
        p.error(f"--dp-shard {args.dp_shard} shards over data-parallel replicas, but --data-parallel is 1; pass "
                "--data-parallel N (N > 1), or leave --dp-shard out")
    if args.schedule == "auto" and args.batch_size is not None and args.microbatches is not None \
            and args.plan is None:  # (found by review: ignored, the run took M=16 without a word)
        p.error(f"--schedule auto chooses the microbatch count among the divisors of --batch-size "
                f"{args.batch_size}, so --microbatches {args.microbatches} would be ignored; leave it out, or give "
                "a --schedule")
    args.schedule = "1f1b" if args.schedule is None else args.schedule
    args.microbatches = 8 if args.microbatches is None else args.microbatches
    from pipe.launch import _detect
    if _detect()[2] == 1:  # one process: refused at once (ranks of a job agree on it after starting: main)
        why = out_error(args)
        if why:
            p.error(why)
    return args


def out_error(args: argparse.Namespace) -> str | None:
    """Why --out cannot take this run's outputs (rank 0 writes them), or None."""
    out = Path(args.out)
    blocked = next((q for q in (out, *out.parents) if q.exists() and not q.is_dir()), None)
    if blocked is not None:  # (found by review: refused only after the whole run, its results lost)
        return f"--out {args.out} cannot be a folder: {blocked} is a file; give another --out"
    previous = [name for name in OUTPUTS if (Path(args.out) / name).exists()]
    if previous and not args.overwrite:
        return (f"--out {args.out} already holds a previous run's outputs ({', '.join(previous)}); "
                "give another --out, or --overwrite to replace them")
    if (out / CHECKPOINT / LATEST).exists() and not args.resume and not args.overwrite:  # nothing saved is lost
        return (f"--out {args.out} holds a checkpoint ({out / CHECKPOINT}); pass --resume to continue from it, or "
                "--overwrite to start again (its first save then replaces it)")
    return None


_LOCAL = ("threads",)  # options each node may set apart (its cores); every other one is the job's


def _agreed(rank: int, args: argparse.Namespace) -> str | None:
    """Why the ranks cannot run together, on every rank alike, or None: options that differ between the ranks
    (found by review: --lr 1e-3 on one node and 0.5 on the other trained without a word, the loss climbing to
    33.9; --steps apart crashed in gloo, naming neither), or an --out rank 0 cannot write to."""
    grouped = dist.is_initialized() and dist.get_world_size() > 1  # (else each rank's own: no group to agree in)
    options = {k: sorted(v) if k == "model_arg" else v for k, v in sorted(vars(args).items()) if k not in _LOCAL}
    mine = (options,  # (the factory's keywords in any order: found by review of the change, refused)
            out_error(args) if rank == 0 or not grouped else None)
    everyone: list[Any] = [mine]
    if grouped:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    if everyone[0][1]:
        return everyone[0][1]
    for key, value in everyone[0][0].items():
        apart = [r for r, (opts, _) in enumerate(everyone) if opts.get(key) != value]
        if apart:
            flag = "--" + key.replace("_", "-")
            return (f"the ranks were started with different options: {flag} {value!r} on rank 0, "
                    f"{everyone[apart[0]][0].get(key)!r} on rank {apart[0]}; give every rank (every node) the same "
                    "command line")
    return None


def _gather(pp: Any, mine: Any) -> list[Any]:
    """`mine` from every rank of this rank's pipeline (its replica's, with --data-parallel)."""
    if not dist.is_initialized() or pp.world == 1:
        return [mine]
    parts: list[Any] = [None] * pp.world
    dist.all_gather_object(parts, mine, group=pp.pp_group)
    return parts


def _memory_lines(pp: Any) -> str:
    """Every stage's memory (policy, predicted and measured peak by kind), gathered to every rank."""
    mine = pp.memory.describe() if hasattr(pp.memory, "describe") else ""
    parts = _gather(pp, mine)
    lines = [line for p in parts for line in str(p).splitlines() if line]
    return "\n".join(sorted(lines, key=lambda line: int(line.split()[1].rstrip(":"))))


def _measured_peaks(pp: Any) -> dict[int, float]:
    """Every stage's peak bytes as its ledger measured them (last step), gathered to every rank."""
    mine = {s: r["peak_total"] for s, r in pp.memory_report().items() if "peak_total" in r}
    parts = _gather(pp, mine)
    return {s: v for p in parts for s, v in p.items()}


def error_line(rank: int, e: BaseException) -> str:
    """How a command line reports an error: one line, with the notes fxpipe added (rank, stage, mb)."""
    notes = "; ".join(getattr(e, "__notes__", []))
    from partition.errors import FxpipeError
    kind = "" if isinstance(e, FxpipeError) else f"{type(e).__name__}: "  # fxpipe's own messages say what
    return f"error (rank {rank}): {kind}{e}" + (f" [{notes}]" if notes else "")


def say_error(line: str) -> None:
    """`line` and its newline on stderr in one write, so that ranks sharing the stream do not run their lines into
    each other (found by review: "...compile=Falseerror (rank 0): ...", print's text and newline two writes)."""
    sys.stderr.flush()
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a stream without a file (captured): one write call
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        return
    data = (line + "\n").encode()
    while data:
        data = data[os.write(fd, data):]


def _bar(done: int, total: int, width: int = 20) -> str:
    k = width * done // max(1, total)
    return "[" + "#" * k + "." * (width - k) + "]"


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 done, 2 an error of the input or the model (every rank names it), 3 a lost rank."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    import partition
    import pipe
    from partition.workload import WorkloadError, parse_overrides
    from pipe.comm import PeerLost
    from pipe.runtime import NonFiniteLoss

    from pipe.launch import LaunchError, _detect
    try:
        ctx = pipe.init(timeout_s=args.timeout)
    except (LaunchError, ValueError, RuntimeError) as e:  # (found by review: a traceback, e.g. MASTER_ADDR unset)
        say_error(error_line(_detect()[1], e))
        return 2
    why = _agreed(ctx.rank, args)
    if why:
        say_error(error_line(ctx.rank, ValueError(why)))
        return 2
    say = print if ctx.rank == 0 else (lambda *a, **k: None)
    try:
        extra = {} if args.seed is None else {"seed": args.seed}
        w = partition.load(args.model, **extra, **parse_overrides(args.model_arg))
    except (WorkloadError, TypeError) as e:
        say_error(error_line(ctx.rank, e))
        return 2
    ex_args, ex_kwargs, ex_target = w.example_args, w.example_kwargs, w.example_target
    if args.batch_size and args.schedule != "auto":  # (auto weighs the microbatch counts dividing the batch)
        if args.batch_size % args.microbatches:
            say_error(error_line(ctx.rank, ValueError(
                f"a batch of {args.batch_size} samples is not divisible into {args.microbatches} microbatches; pass "
                "a --batch-size that is a multiple of --microbatches")))
            return 2
        ex_args, ex_kwargs, ex_target = w.batch(args.batch_size // args.microbatches, 0)  # one microbatch
    try:
        pp = pipe.Pipeline(w.model, ex_args, example_kwargs=ex_kwargs, loss_fn=w.loss_fn,
                           microbatches=args.microbatches, schedule=args.schedule, plan=args.plan,
                           stages_per_rank=args.stages_per_rank, cost=args.cost, memory_budget=args.memory_budget,
                           recompute=args.recompute, offload=args.offload, leaf_modules=w.leaf_modules,
                           example_target=None if args.loss_outside else ex_target,
                           trace_loss=not args.loss_outside,
                           skip_nonfinite=args.skip_nonfinite, data_parallel=args.data_parallel,
                           dp_shard=args.dp_shard, compile=args.compile, calibration=args.calibration,
                           batch_size=(args.batch_size or w.microbatch_size * args.microbatches)
                           if args.schedule == "auto" else None,
                           auto_schedules=args.auto_schedules.split(",") if args.auto_schedules else None,
                           progress=lambda line: say(f"[plan] {line}", flush=True))
    except (ValueError, TypeError) as e:
        say_error(error_line(ctx.rank, e))
        return 2
    say(pp.plan.table())
    if pp.candidates:
        from pipe.auto import table
        say("schedule=auto, the candidates:\n" + table(pp.candidates))
    try:
        run = _train(pp, w, args, say)
    except Exception as e:  # this rank's own error (the model's too), another rank's, or a lost rank
        if isinstance(e, NonFiniteLoss):
            e.add_note("pipe.run: --skip-nonfinite drops such steps")
        say_error(error_line(ctx.rank, e))
        return 3 if isinstance(e, PeerLost) else 2
    code = _report(pp, args, ctx, run, say)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return code


def _train(pp: Any, w: Any, args: argparse.Namespace, say: Callable[..., None]) -> dict[str, Any]:
    """The training loop: per-step line, losses (a step dropped by --skip-nonfinite: skipped) and times."""
    params = list(pp.parameters())  # a rank may hold none (a stage computing only the loss, say)
    opt = pp.build_optimizer(torch.optim.AdamW, lr=args.lr) if params else None
    batch_size = args.batch_size or w.microbatch_size * args.microbatches
    tokens = batch_size * w.tokens_per_sample * pp.dp  # every replica's
    times: list[float] = []
    ckpt = Path(args.out) / CHECKPOINT
    start, before = _resume(pp, opt, ckpt, args, say)
    losses: list[float] = list(before.get("losses", []))
    norms: list[float] = list(before.get("grad_norms", []))
    evaluated: list[tuple[int, float]] = [(int(s), float(x)) for s, x in before.get("eval_losses", [])]
    skipped = int(before.get("skipped", 0))
    for step in range(start, args.steps):  # replica r of N trains on batch step * N + r
        b_args, b_kwargs, target = w.batch(batch_size, step * pp.dp + pp.dp_rank)
        t0 = time.perf_counter()
        loss = pp.step(*b_args, target=target, **b_kwargs)
        skipped_now = pp.skipped  # (--skip-nonfinite: a loss or a grad not finite; else step raised NonFiniteLoss)
        if args.clip_grad_norm is not None:  # collective: on every rank, one without parameters too
            norm = float(pp.clip_grad_norm_(args.clip_grad_norm))
            if not skipped_now:  # (a skipped step's grads were cleared: its norm of 0 is no grad's)
                norms.append(norm)
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        times.append(dt)
        if skipped_now:
            skipped += 1
        else:
            losses.append(loss)
        clipped = f"  grad norm {norms[-1]:.4g}" if norms and not skipped_now else ""
        if args.eval_every is not None and (step + 1) % args.eval_every == 0:  # untimed, after the update
            evaluated.append((step + 1, _held_out_loss(pp, w, batch_size, say)))
        held = f"  eval loss {evaluated[-1][1]:.4f}" if evaluated and evaluated[-1][0] == step + 1 else ""
        say(f"step {step + 1:4d}/{args.steps} {_bar(step + 1, args.steps)} loss {loss:.4f}{clipped}{held}  "
            f"{tokens / dt:9.0f} tok/s  {dt * 1e3:7.1f} ms" + ("  (skipped: not finite)" if skipped_now else ""),
            flush=True)
        if args.save_every is not None and ((step + 1) % args.save_every == 0 or step + 1 == args.steps):
            run = {"losses": losses, "grad_norms": norms, "eval_losses": evaluated, "skipped": skipped}
            folder = pp.save(ckpt, optimizer=opt, extra={"run": run})
            say(f"saved step {step + 1} to {folder}", flush=True)
    return {"times": times, "losses": losses, "grad_norms": norms, "eval_losses": evaluated, "tokens": tokens,
            "skipped": skipped, "resumed_at": start}


def _resume(pp: Any, opt: Any, ckpt: Path, args: argparse.Namespace, say: Callable[..., None]
            ) -> tuple[int, dict[str, Any]]:
    """With --resume: the step the checkpoint in `ckpt` (rank 0's view of it, on every rank) was saved at and the
    run's records until then, the pipeline and the optimizer loaded from it; (0, {}) without."""
    if not args.resume:
        return 0, {}
    found = [(ckpt / LATEST).exists()]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(found, src=0)
    if not found[0]:
        say(f"--resume: no checkpoint in {ckpt}; starting at step 1", flush=True)
        return 0, {}
    pp.load(ckpt, optimizer=opt)
    loaded = pp.loaded
    if loaded.step >= args.steps:
        raise ValueError(f"the checkpoint in {ckpt} was saved at step {loaded.step}, and --steps is {args.steps}: "
                         f"nothing is left to train; give --steps above {loaded.step}")
    say(f"resumed from {loaded.folder} at step {loaded.step}; training steps {loaded.step + 1} to {args.steps}",
        flush=True)
    return loaded.step, dict(loaded.extra.get("run", {}))


def _held_out_loss(pp: Any, w: Any, batch_size: int, say: Callable[..., None]) -> float:
    """The loss of this replica's held-out batch in eval mode; in training mode, said once and in the plan's
    notes, where the model traces otherwise in eval mode than the plan's graph (pipe.runtime.ModeError)."""
    from pipe.runtime import ModeError
    e_args, e_kwargs, e_target = w.batch(batch_size, HELD_OUT + pp.dp_rank)
    if not any(n.startswith("--eval-every: ") for n in pp.plan.notes):
        try:
            return float(pp.eval().evaluate(*e_args, target=e_target, **e_kwargs))
        except ModeError as e:
            note = f"--eval-every: the held-out loss in training mode, not eval mode: {e}"
            pp.plan.notes.append(note)
            say(note, flush=True)
        finally:
            pp.train()
    return float(pp.evaluate(*e_args, target=e_target, **e_kwargs))


def _report(pp: Any, args: argparse.Namespace, ctx: Any, run: dict[str, Any], say: Callable[..., None]) -> int:
    """Rank 0 writes the trace, the PNG and the summary to --out and prints the summary; 0, or 2 when
    another run wrote its outputs to --out meanwhile (they are kept, this run's are not written)."""
    from pipe.predict import predicted_timeline
    memory_lines = _memory_lines(pp)
    peaks = _measured_peaks(pp)
    measured = pp.gather_timeline()
    link = None
    if pp.dp > 1:  # the replicas' all-reduce, measured on every rank at once, prices the prediction's grad sync
        from pipe.launch import measure_allreduce
        link = measure_allreduce(ctx.device, pp.dp_group)
    if ctx.rank != 0 or measured is None:
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    warm = run["times"][1:] or run["times"]
    first, last = (run["losses"][0], run["losses"][-1]) if run["losses"] else (math.nan, math.nan)
    predicted = predicted_timeline(pp.plan, pp.world, calibration=pp.calibration, compiled=pp._compile is not None)
    predicted_ms, synced = predicted.makespan, ""
    if link is not None:  # (found by review: the prediction left the replicas' grad all-reduce out)
        from pipe.predict import layout_costs
        from pipe.scale import predict_layout
        layout = predict_layout(layout_costs(pp.plan, any(a.kind == "W" for a in pp.actions),
                                             calibration=pp.calibration),
                                pp=pp.world, dp=pp.dp, schedule=pp.schedule_name, microbatches=pp.M, v=pp.v,
                                allreduce_bytes_per_ms=link[0], allreduce_latency_ms=link[1])
        predicted_ms, synced = layout.step_ms, f", with the {pp.dp} replicas' grad all-reduce"
    summary: dict[str, Any] = {
        "model": args.model, "schedule": pp.schedule_name, "microbatches": pp.M, "stages_per_rank": pp.v,
        "ranks": ctx.world_size, "data_parallel": pp.dp, "dp_shard": pp.dp_shard, "launcher": ctx.launcher,
        "losses": run["losses"], "grad_norms": run["grad_norms"], "eval_losses": run["eval_losses"],
        "first_loss": first, "last_loss": last,
        "skipped_steps": run["skipped"],
        "resumed_at_step": run["resumed_at"],
        "median_step_s": statistics.median(warm), "tokens_per_s": run["tokens"] / statistics.median(warm),
        "measured_bubble": measured.bubble, "predicted_bubble": predicted.bubble,
        "measured_step_ms": measured.makespan, "predicted_step_ms": predicted_ms,
        "calibrated": pp.calibration is not None}
    try:  # the summary first, created only if absent (unless --overwrite): a concurrent run's is kept
        with open(out / "summary.json", "w" if args.overwrite else "x") as f:
            f.write(json.dumps(summary, indent=1))
    except FileExistsError:
        print(f"error (rank 0): another run wrote its outputs to --out {out} while this one ran; they are "
              "kept and this run's are not written: give each run its own --out (or --overwrite)",
              file=sys.stderr, flush=True)
        return 2
    (out / "trace.json").write_text(json.dumps(measured.to_chrome_trace()))
    (out / "timeline.json").write_text(json.dumps(measured.to_json()))
    png = ""
    try:
        measured.to_png(str(out / "timeline.png"), title=f"{args.model} {pp.schedule_name} M={pp.M}")
        png = f", {out / 'timeline.png'}"
    except RuntimeError as e:
        say(f"(no PNG: {e})")
    skipped = f"; {run['skipped']} step(s) skipped (a loss or a grad not finite)" if run["skipped"] else ""
    # (found by review: with no calibration, the plan's costs as they are, FLOP counts priced on a notional device,
    # gave 414 ms where 150 ms were measured, unsaid)
    how = f"with the calibration {args.calibration}" if pp.calibration is not None else \
        "from the plan's costs, uncalibrated: pass --calibration FILE from python -m bench calibrate"
    say(f"loss {first:.4f} -> {last:.4f}{skipped}; median step {summary['median_step_s'] * 1e3:.1f} ms, "
        f"{summary['tokens_per_s']:.0f} tok/s")
    say(f"bubble: measured {measured.bubble:.3f}, predicted {predicted.bubble:.3f}; last step "
        f"{measured.makespan:.1f} ms measured, {predicted_ms:.1f} ms predicted{synced} ({how})")
    say(measured.to_text(width=80))
    say(f"wrote {out / 'trace.json'} (open in ui.perfetto.dev or chrome://tracing){png}")
    say("memory per stage (last step):\n" + memory_lines)
    say("the plan with each stage's peak as measured (last step):\n" + pp.plan.table(measured=peaks))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    exit_process(main())
