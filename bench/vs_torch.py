"""fxpipe against torch.distributed.pipelining, alternating in one session:
torchrun --nproc-per-node 2 -m bench.vs_torch [--model gpt] [--rounds 12] [--model-arg vocab=16000]

Candidates (same model, batch, schedule and microbatches; 1 thread per rank): torch with an even
split by layers (SplitPoint, what its users write), fxpipe with those same boundaries, fxpipe with
its own boundaries (the natural call: pipe.Pipeline(model, example_args, loss_fn=...)), and under
1f1b-overlap (1F1B with one more warm-up forward on every rank but the last); plus one
process on the whole batch for the ideal on S ranks: its forward and backward t1 as (t1 / S) x
(M + S - 1) / M (1F1B's bubble), and its optimizer step (AdamW, as every candidate's) over S, each rank
stepping 1/S of the parameters (`pipeline_ideal`); and every rank computing a copy of the model on 1/S
of the batch at the same moment, which the ideal leaves out: the ranks' processes share this
machine's caches and memory (that time x (M + S - 1) / M, with the optimizer's share timed alone as
above, is "the ranks' ideal at once").
With --torch-schedules all, torch runs each of its seven schedules (those with two stages per rank on
an even split into twice as many stages, placed as the schedule requires), and with --auto fxpipe
runs schedule="auto" on the same batch (it chooses the schedule, the microbatch count among the
batch's divisors and the stages per rank); the table then says how fxpipe's choice measures against
torch's fastest schedule."""
from __future__ import annotations

from partition.args import whole
import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from partition.costs import COSTS

__all__ = ["main", "layer_bounds", "stage_actions"]

DEFAULTS = {"n_layer": 8, "d_model": 256, "n_head": 8, "seq_len": 128, "vocab": 1000, "microbatch_size": 4,
            "tie": False}


def layer_bounds(analysis: Any, layer_prefixes: tuple[str, ...], n_stages: int) -> tuple[int, ...]:
    """Block bounds of an even split by layers (what torch.distributed.pipelining users write)."""
    from bench.quality import layer_spans
    from partition.solve import even_split
    return even_split([s for s, _ in layer_spans(analysis, layer_prefixes)], n_stages,
                      n_blocks=len(analysis.blocks.members))


# torch.distributed.pipelining's seven schedules by fxpipe's names: (class name, stages per rank, placement)
TORCH_SCHEDULES = {"gpipe": ("ScheduleGPipe", 1, "loop"), "1f1b": ("Schedule1F1B", 1, "loop"),
                   "interleaved-1f1b": ("ScheduleInterleaved1F1B", 2, "loop"),
                   "looped-bfs": ("ScheduleLoopedBFS", 2, "loop"),
                   "interleaved-zb": ("ScheduleInterleavedZeroBubble", 2, "loop"),
                   "zbv": ("ScheduleZBVZeroBubble", 2, "v"), "dualpipev": ("ScheduleDualPipeV", 2, "v")}


def stage_actions(times: dict[str, list[float]]) -> dict[int, tuple[float, float]]:
    """Each stage's median F and B (ms) from action times by name ("F0", "B1", ...), of a 1F1B pipeline."""
    stages = sorted({int(k[1:]) for k in times if k[:1] in "FB" and k[1:].isdigit()})
    return {s: (statistics.median(times[f"F{s}"]), statistics.median(times[f"B{s}"])) for s in stages
            if f"F{s}" in times and f"B{s}" in times}


def torch_stages(rank: int, world: int, v: int, placement: str) -> tuple[int, ...]:
    """The stages torch places on `rank`: round robin ("loop"), or down then back up ("v")."""
    if placement == "v":
        return (rank, 2 * world - 1 - rank)
    return tuple(rank + k * world for k in range(v))


def _torch_pipeline(w: Any, rank: int, world: int, M: int, schedule: str = "1f1b",
                    device: torch.device = torch.device("cpu")) -> tuple[Callable[..., float], list[Any]]:
    import torch.distributed.pipelining as tpp
    cls, v, placement = TORCH_SCHEDULES[schedule]
    L, S = len(w.layer_prefixes), world * v
    spec = {w.layer_prefixes[(k * L) // S]: tpp.SplitPoint.BEGINNING for k in range(1, S)}
    pp = tpp.pipeline(w.model, mb_args=w.example_args, split_spec=spec)
    mine = torch_stages(rank, world, v, placement)
    # torch's traced stages warm up by sending to each neighbouring stage's rank, which under V placement is
    # this rank itself between its two stages (gloo refuses a send to self); its PipelineStage, over the same
    # traced submodules, does not
    stages = [pp.build_stage(i, device) if placement == "loop"
              else tpp.PipelineStage(pp.get_stage_module(i).to(device), i, S, device) for i in mine]
    sched = getattr(tpp, cls)(stages[0] if v == 1 else stages, n_microbatches=M, loss_fn=w.loss_fn)
    params = [p for st in stages for p in st.submod.parameters()]
    first, last = 0 in mine, S - 1 in mine

    def step(args: tuple[Any, ...], target: Any) -> float:
        losses: list[torch.Tensor] = []
        args, target = tuple(a.to(device) for a in args), target.to(device)  # torch's stages take them there
        sched.step(*(args if first else ()), **({"target": target, "losses": losses} if last else {}))
        return float(torch.stack(losses).detach().mean()) if last else float("nan")
    return step, params


def uneven_batch(microbatches: int, microbatch_size: int, world: int) -> str | None:
    """Why `world` ranks cannot share the batch evenly for the ideal at once, or None."""
    batch = microbatches * microbatch_size
    if batch % world == 0:
        return None
    return (f"the batch ({microbatches} microbatches of {microbatch_size}) is {batch} samples, which {world} ranks "
            f"cannot share evenly for the ideal at once: pass --microbatches a multiple of {world}")


def parser(add_help: bool = True) -> argparse.ArgumentParser:
    """The options of `python -m bench vs-torch` (the launcher's too, so --help lists them all)."""
    p = argparse.ArgumentParser(prog="python -m bench vs-torch", description=__doc__, add_help=add_help)
    p.add_argument("model", nargs="?", default="gpt", help="bundled name or package.module:factory (default gpt)")
    p.add_argument("--model-arg", action="append", default=[], metavar="K=V", help="factory keyword, repeatable")
    p.add_argument("--microbatches", type=whole(1), default=8)
    p.add_argument("--rounds", type=whole(1), default=12, help="alternating rounds of every candidate")
    p.add_argument("--cost", default="measured", choices=COSTS)
    p.add_argument("--torch-schedules", default="1f1b", metavar="LIST",
                   help=f"torch's schedules to run, comma-separated, or all ({', '.join(TORCH_SCHEDULES)}); "
                        "default 1f1b")
    p.add_argument("--auto", action="store_true",
                   help='add fxpipe with schedule="auto" on the same batch (its own schedule, M and stages per rank)')
    p.add_argument("--calibration", metavar="FILE", help="auto's predictions with this calibration (bench calibrate)")
    p.add_argument("--ranks", type=whole(1), default=2, help="processes to launch")
    p.add_argument("--launcher", default="torchrun", choices=["torchrun", "mpirun"])
    p.add_argument("--threads", type=whole(1), default=1, help="torch threads per process")
    p.add_argument("--out", default="out/vs_torch")
    return p


def pipeline_ideal(compute_s: float, optimizer_s: float, world: int, microbatches: int) -> float:
    """A pipeline's ideal step on `world` ranks: each rank's share of the compute (`compute_s`, its
    forward and backward) stretched by 1F1B's bubble, (M + S - 1) / M, and 1/S of the optimizer's step
    over the whole model (`optimizer_s`)."""
    return compute_s * (microbatches + world - 1) / microbatches + optimizer_s / world


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    torch.set_num_threads(1)
    import partition
    import pipe
    from partition.planner import Analysis, plan_from_bounds
    from partition.solve import CostModel
    from partition.workload import parse_overrides
    from pipe.schedules import in_flight_limit
    from bench.schedules import slowest_rank_s

    ctx = pipe.init()
    rank, world, M, dev = ctx.rank, ctx.world_size, args.microbatches, ctx.device
    margs = dict(DEFAULTS) if args.model == "gpt" else {}
    margs.update(parse_overrides(args.model_arg))

    def fresh() -> Any:
        return partition.load(args.model, **margs)

    w = fresh()
    batch_size = w.microbatch_size * M
    uneven = uneven_batch(M, w.microbatch_size, world)
    if uneven:
        raise SystemExit(uneven)
    wanted = list(TORCH_SCHEDULES) if args.torch_schedules == "all" else args.torch_schedules.split(",")
    unknown = [x for x in wanted if x not in TORCH_SCHEDULES]
    if unknown:
        raise SystemExit(f"--torch-schedules: unknown {unknown}; torch's are {', '.join(TORCH_SCHEDULES)} (or all)")
    wanted = ["1f1b"] + [x for x in wanted if x != "1f1b"]  # 1F1B: what fxpipe's own 1F1B is compared with
    candidates: dict[str, tuple[Callable[..., float], list[Any]]] = {}
    for name in wanted:
        candidates[f"torch-{name}"] = _torch_pipeline(fresh(), rank, world, M, name, dev)
    wf = fresh()
    a = Analysis(wf.model, wf.example_args, wf.example_kwargs, cost=args.cost)
    flights = tuple(in_flight_limit("1f1b", world, M, s) for s in range(world))
    even = plan_from_bounds(a, layer_bounds(a, wf.layer_prefixes, world), CostModel(in_flight=flights),
                            schedule="1f1b", microbatches=M, stages_per_rank=1, memory_budget=None)
    pipes: dict[str, Any] = {}
    fx = [("fxpipe-even", even, "1f1b"), ("fxpipe-auto", None, "1f1b"), ("fxpipe-overlap", None, "1f1b-overlap")]
    if args.auto:
        fx.append(("fxpipe-auto-schedule", None, "auto"))
    for name, plan, schedule in fx:
        wl = wf if plan is not None else fresh()
        # fxpipe's own plan from the natural call: no example_target, the loss traced in with an inferred one
        kw: dict[str, Any] = ({"schedule": "auto", "batch_size": batch_size, "calibration": args.calibration}
                              if schedule == "auto" else {"schedule": schedule, "microbatches": M, "plan": plan})
        pl = pipe.Pipeline(wl.model, wl.example_args, loss_fn=wl.loss_fn, cost=args.cost, **kw)
        candidates[name] = ((lambda pl: lambda b, t: pl.step(*b, target=t))(pl), list(pl.parameters()))
        pipes[name] = pl
    opts = {k: torch.optim.AdamW(v[1], lr=1e-4) for k, v in candidates.items()}
    samples: dict[str, list[float]] = {k: [] for k in candidates}
    samples["one-process"] = []  # forward and backward of the whole batch
    samples["one-process-optimizer"] = []  # and its optimizer's step
    samples["every-rank-at-once"] = []  # every rank its own copy on 1/world of the batch, all at once
    losses: dict[str, list[float]] = {k: [] for k in candidates}
    actions: dict[str, dict[str, list[float]]] = {"fxpipe-even": {}, "fxpipe-auto": {}}  # rank 0's: ms by action
    single = fresh() if rank == 0 else None
    if single is not None:
        single.model.to(dev)
    single_opt = torch.optim.AdamW(single.model.parameters(), lr=1e-4) if single is not None else None
    share = fresh()  # what the ranks' processes cost computing together: they share the machine's caches
    share.model.to(dev)

    def on(*xs: Any) -> Any:
        return tuple(x.to(dev) if isinstance(x, torch.Tensor) else on(*x) for x in xs)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    names = list(candidates)
    for r in range(args.rounds + 1):  # round 0 warms up
        b_args, _, target = w.batch(batch_size, r)
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            got: list[Any] = []

            def step() -> None:
                got.append(candidates[name][0](b_args, target))
                opts[name].step()
                opts[name].zero_grad(set_to_none=True)
            dt = slowest_rank_s(step, dev)
            if r:
                samples[name].append(dt)
                if name in ("fxpipe-even", "fxpipe-auto"):  # their stages' actions, to compare the two cuts
                    tl = pipes[name].gather_timeline()
                    for e in tl.events if tl is not None else []:
                        actions[name].setdefault(f"{e.action.kind}{e.action.stage}", []).append(e.end - e.start)
            losses[name].append(float(got[0]))
        dist.barrier()
        if single is not None and single_opt is not None:
            d_args, d_target = on(b_args, target)
            sync()
            t0 = time.perf_counter()
            single.loss_fn(single.model(*d_args), d_target).backward()
            sync()
            t1 = time.perf_counter()
            single_opt.step()
            single_opt.zero_grad(set_to_none=True)
            sync()
            if r:
                samples["one-process"].append(t1 - t0)
                samples["one-process-optimizer"].append(time.perf_counter() - t1)
        dist.barrier()
        s_args, _, s_target = w.batch(batch_size // world, r)
        s_args, s_target = on(s_args, s_target)
        dt = slowest_rank_s(lambda: share.loss_fn(share.model(*s_args), s_target).backward(), dev)
        share.model.zero_grad(set_to_none=True)
        if r:
            samples["every-rank-at-once"].append(dt)
        dist.barrier()
    first_loss = {}  # each candidate's loss on the first (warm-up) batch, from the rank that computed it
    for name in names:
        t = torch.tensor([losses[name][0] if losses[name][0] == losses[name][0] else float("-inf")],
                         dtype=torch.float64, device=dev)  # (NCCL reduces device tensors only)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        first_loss[name] = float(t)
    timelines = {k: pipes[k].gather_timeline() for k in pipes}
    if rank == 0:
        med = {k: statistics.median(v) for k, v in samples.items() if v}
        ideal = pipeline_ideal(med["one-process"] / world, med["one-process-optimizer"], world, M)
        together = pipeline_ideal(med["every-rank-at-once"], med["one-process-optimizer"], world, M)
        base = med["torch-1f1b"]
        rows = [(f"torch.distributed.pipelining {n}, even layer split", med[f"torch-{n}"]) for n in wanted]
        rows += [("fxpipe 1f1b, the same boundaries", med["fxpipe-even"]),
                 ("fxpipe 1f1b, its own boundaries", med["fxpipe-auto"]),
                 ("fxpipe 1f1b-overlap, its own boundaries", med["fxpipe-overlap"])]
        if args.auto:
            rows.append((f"fxpipe schedule='auto' ({pipes['fxpipe-auto-schedule'].plan.schedule} "
                         f"M={pipes['fxpipe-auto-schedule'].M} v={pipes['fxpipe-auto-schedule'].v})",
                         med["fxpipe-auto-schedule"]))
        rows += [(f"ideal: one process / {world}, fwd+bwd x (M+{world - 1})/M", ideal),
                 (f"the same with the {world} ranks computing at once: their share x (M+{world - 1})/M", together),
                 ("one process, one thread, whole batch: fwd+bwd", med["one-process"]),
                 ("  and its optimizer step", med["one-process-optimizer"]),
                 (f"every rank at once, 1/{world} of the batch each: fwd+bwd", med["every-rank-at-once"])]
        print(f"{args.model} {margs}, batch {batch_size}, {M} microbatches unless said, {world} ranks x 1 thread, "
              f"{args.rounds} alternating rounds (median s/step; ratio to torch 1f1b)")
        for label, v in rows:
            print(f"  {label:58s} {v:7.3f} s  {v / base:6.3f}")
        print(f"  ratio fxpipe-even / torch-1f1b   {med['fxpipe-even'] / base:.3f}")
        print(f"  ratio fxpipe-auto / torch-1f1b   {med['fxpipe-auto'] / base:.3f}")
        print(f"  ratio fxpipe-even / ideal        {med['fxpipe-even'] / ideal:.3f}")
        print(f"  ratio fxpipe-auto / ideal        {med['fxpipe-auto'] / ideal:.3f}")
        print(f"  ratio fxpipe-overlap / torch-1f1b {med['fxpipe-overlap'] / base:.3f}")
        print(f"  ratio fxpipe-overlap / ideal     {med['fxpipe-overlap'] / ideal:.3f}")
        print(f"  ratio fxpipe-auto / the ranks' ideal at once     {med['fxpipe-auto'] / together:.3f}")
        print(f"  ratio fxpipe-overlap / the ranks' ideal at once  {med['fxpipe-overlap'] / together:.3f}")
        best_torch = min(wanted, key=lambda n: med[f"torch-{n}"])
        if args.auto:
            print(f"  ratio fxpipe schedule='auto' / torch's fastest ({best_torch}) "
                  f"{med['fxpipe-auto-schedule'] / med[f'torch-{best_torch}']:.3f}")
        print("  first-step loss: " + ", ".join(f"{k} {v:.5f}" for k, v in first_loss.items()))
        auto_plan = pipes["fxpipe-auto"].plan
        print("  fxpipe auto boundaries: nodes per stage", [len(s.nodes) for s in auto_plan.stages],
              "even:", [len(s.nodes) for s in even.stages])
        print("  fxpipe auto " + next(x for x in auto_plan.table().splitlines() if x.startswith("loss: ")))
        per_stage = {k: stage_actions(v) for k, v in actions.items()}
        for k, label in (("fxpipe-even", "the same boundaries"), ("fxpipe-auto", "its own boundaries")):
            print(f"  fxpipe 1f1b, {label}: each stage's F/B, median ms a microbatch: "
                  + ", ".join(f"stage {s} {f:.1f}/{b:.1f}" for s, (f, b) in sorted(per_stage[k].items()))
                  + f"; the slower stage's F+B {max(f + b for f, b in per_stage[k].values()):.1f}")
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        for k, tl in timelines.items():
            if tl is not None:
                tl.to_png(str(out / f"timeline-{k}.png"), title=f"{args.model} {k} (measured)")
                (out / f"trace-{k}.json").write_text(json.dumps(tl.to_chrome_trace()))
        (out / "vs_torch.json").write_text(json.dumps({
            "command": " ".join(sys.argv), "model": args.model, "model_args": margs, "microbatches": M,
            "ranks": world, "samples_s": samples, "median_s": med, "ideal_s": ideal,
            "ideal_at_once_s": together, "first_loss": first_loss, "stage_f_b_ms": per_stage,
            "torch_fastest": best_torch, "auto_choice": (pipes["fxpipe-auto-schedule"].plan.schedule,
                                                          pipes["fxpipe-auto-schedule"].M,
                                                          pipes["fxpipe-auto-schedule"].v) if args.auto else None,
            "machine": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__}, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
