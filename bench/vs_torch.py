"""fxpipe against torch.distributed.pipelining, alternating in one session:
torchrun --nproc-per-node 2 -m bench.vs_torch [--model gpt] [--rounds 12] [--model-arg vocab=16000]

Candidates (same model, batch, schedule and microbatches; 1 thread per rank): torch with an even
split by layers (SplitPoint, what its users write), fxpipe with those same boundaries, fxpipe with
its own boundaries (the natural call: pipe.Pipeline(model, example_args, loss_fn=...)); plus one
process on the whole batch for the ideal (t1 / 2) x (M + 1) / M."""
from __future__ import annotations

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

__all__ = ["main", "layer_bounds"]

DEFAULTS = {"n_layer": 8, "d_model": 256, "n_head": 8, "seq_len": 128, "vocab": 1000, "microbatch_size": 4,
            "tie": False}


def layer_bounds(analysis: Any, layer_prefixes: tuple[str, ...], n_stages: int) -> tuple[int, ...]:
    """Block bounds of an even split by layers (what torch.distributed.pipelining users write)."""
    from bench.quality import layer_spans
    from partition.solve import even_split
    return even_split([s for s, _ in layer_spans(analysis, layer_prefixes)], n_stages,
                      n_blocks=len(analysis.blocks.members))


def _torch_pipeline(w: Any, rank: int, world: int, M: int) -> tuple[Callable[..., float], list[Any]]:
    from torch.distributed.pipelining import Schedule1F1B, SplitPoint, pipeline
    L = len(w.layer_prefixes)
    spec = {w.layer_prefixes[(k * L) // world]: SplitPoint.BEGINNING for k in range(1, world)}
    pp = pipeline(w.model, mb_args=w.example_args, split_spec=spec)
    stage = pp.build_stage(rank, torch.device("cpu"))
    sched = Schedule1F1B(stage, n_microbatches=M, loss_fn=w.loss_fn)
    params = list(stage.submod.parameters())

    def step(args: tuple[Any, ...], target: Any) -> float:
        if rank == 0:
            sched.step(*args)
            return float("nan")
        losses: list[torch.Tensor] = []
        sched.step(target=target, losses=losses)
        return float(torch.stack(losses).detach().mean())
    return step, params


def parser(add_help: bool = True) -> argparse.ArgumentParser:
    """The options of `python -m bench vs-torch` (the launcher's too, so --help lists them all)."""
    p = argparse.ArgumentParser(prog="python -m bench vs-torch", description=__doc__, add_help=add_help)
    p.add_argument("model", nargs="?", default="gpt", help="bundled name or package.module:factory (default gpt)")
    p.add_argument("--model-arg", action="append", default=[], metavar="K=V", help="factory keyword, repeatable")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--rounds", type=int, default=12, help="alternating rounds of every candidate")
    p.add_argument("--cost", default="measured", choices=["measured", "flops"])
    p.add_argument("--ranks", type=int, default=2, help="processes to launch")
    p.add_argument("--launcher", default="torchrun", choices=["torchrun", "mpirun"])
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--out", default="out/vs_torch")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    torch.set_num_threads(1)
    import partition
    import pipe
    from partition.planner import Analysis, plan_from_bounds
    from partition.solve import CostModel
    from partition.workload import parse_overrides
    from pipe.schedules import in_flight_limit

    ctx = pipe.init()
    rank, world, M = ctx.rank, ctx.world_size, args.microbatches
    margs = dict(DEFAULTS) if args.model == "gpt" else {}
    margs.update(parse_overrides(args.model_arg))

    def fresh() -> Any:
        return partition.load(args.model, **margs)

    w = fresh()
    batch_size = w.microbatch_size * M
    candidates: dict[str, tuple[Callable[..., float], list[Any]]] = {}
    candidates["torch-even"] = _torch_pipeline(fresh(), rank, world, M)
    wf = fresh()
    a = Analysis(wf.model, wf.example_args, wf.example_kwargs, cost=args.cost)
    flights = tuple(in_flight_limit("1f1b", world, M, s) for s in range(world))
    even = plan_from_bounds(a, layer_bounds(a, wf.layer_prefixes, world), CostModel(in_flight=flights),
                            schedule="1f1b", microbatches=M, stages_per_rank=1, memory_budget=None)
    pipes: dict[str, Any] = {}
    for name, plan, wl in (("fxpipe-even", even, wf), ("fxpipe-auto", None, fresh())):
        # fxpipe's own plan from the natural call: no example_target, the loss traced in with an inferred one
        pl = pipe.Pipeline(wl.model, wl.example_args, loss_fn=wl.loss_fn, microbatches=M, schedule="1f1b",
                           plan=plan, cost=args.cost)
        candidates[name] = ((lambda pl: lambda b, t: pl.step(*b, target=t))(pl), list(pl.parameters()))
        pipes[name] = pl
        if rank == 0 and plan is None:
            auto_plan = pl.plan
    opts = {k: torch.optim.AdamW(v[1], lr=1e-4) for k, v in candidates.items()}
    samples: dict[str, list[float]] = {k: [] for k in candidates}
    samples["one-process"] = []
    losses: dict[str, list[float]] = {k: [] for k in candidates}
    single = fresh() if rank == 0 else None
    names = list(candidates)
    for r in range(args.rounds + 1):  # round 0 warms up
        b_args, _, target = w.batch(batch_size, r)
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            dist.barrier()
            t0 = time.perf_counter()
            loss = candidates[name][0](b_args, target)
            opts[name].step()
            opts[name].zero_grad(set_to_none=True)
            dt = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if r:
                samples[name].append(float(dt))
                losses[name].append(loss)
        dist.barrier()
        if single is not None:
            t0 = time.perf_counter()
            single.loss_fn(single.model(*b_args), target).backward()
            if r:
                samples["one-process"].append(time.perf_counter() - t0)
            single.model.zero_grad(set_to_none=True)
        dist.barrier()
    timelines = {k: pipes[k].gather_timeline() for k in ("fxpipe-even", "fxpipe-auto")}
    if rank == world - 1 and rank != 0:
        dist.send(torch.tensor([losses["torch-even"][0]], dtype=torch.float64), 0)
    if rank == 0:
        torch_loss = torch.zeros(1, dtype=torch.float64)
        if world > 1:
            dist.recv(torch_loss, world - 1)
        med = {k: statistics.median(v) for k, v in samples.items() if v}
        ideal = med["one-process"] / world * (M + 1) / M
        rows = [("torch.distributed.pipelining, even layer split", med["torch-even"]),
                ("fxpipe, the same boundaries", med["fxpipe-even"]),
                ("fxpipe, its own boundaries", med["fxpipe-auto"]),
                (f"ideal: one process / {world} x (M+1)/M", ideal),
                ("one process, one thread, whole batch", med["one-process"])]
        print(f"{args.model} {margs}, batch {batch_size} in {M} microbatches, 1F1B, {world} ranks x 1 thread, "
              f"{args.rounds} alternating rounds (median s/step)")
        for label, v in rows:
            print(f"  {label:48s} {v:7.3f} s")
        print(f"  ratio fxpipe-even / torch-even   {med['fxpipe-even'] / med['torch-even']:.3f}")
        print(f"  ratio fxpipe-auto / torch-even   {med['fxpipe-auto'] / med['torch-even']:.3f}")
        print(f"  ratio fxpipe-even / ideal        {med['fxpipe-even'] / ideal:.3f}")
        print(f"  ratio fxpipe-auto / ideal        {med['fxpipe-auto'] / ideal:.3f}")
        print(f"  first-step loss: torch {float(torch_loss):.5f}, fxpipe-even {losses['fxpipe-even'][0]:.5f}")
        print("  fxpipe auto boundaries: nodes per stage", [len(s.nodes) for s in auto_plan.stages],
              "even:", [len(s.nodes) for s in even.stages])
        print("  fxpipe auto " + next(x for x in auto_plan.table().splitlines() if x.startswith("loss: ")))
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        for k, tl in timelines.items():
            if tl is not None:
                tl.to_png(str(out / f"timeline-{k}.png"), title=f"{args.model} {k} 1F1B M={M} (measured)")
                (out / f"trace-{k}.json").write_text(json.dumps(tl.to_chrome_trace()))
        (out / "vs_torch.json").write_text(json.dumps({
            "command": " ".join(sys.argv), "model": args.model, "model_args": margs, "microbatches": M,
            "ranks": world, "samples_s": samples, "median_s": med, "ideal_s": ideal,
            "machine": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__}, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
