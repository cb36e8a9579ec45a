"""OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 -m bench.memory_bench [--budget 32MiB] [--rounds 8] [--config long]

Memory features: the largest gpt trained under a per-stage budget, and step times at a fraction of the plain peak.

Part 1 grows a gpt (4 layers, seq 32, microbatch 2, 4 microbatches) in width until it no longer
trains within `--budget` per stage, once plain (recompute none, offload none) and once with
recompute auto and offload of states and activations; "trains" means the pipeline accepts the
budget and two Adam steps keep the ledger's peak within it on every stage.
Part 2 measures a gpt's plain peak, then times plain, auto (budget = `--fraction` of that peak, half by
default; recompute alone where it reaches it, else with offload too), selective and
full recompute on the plain boundaries, one step of each in turn per round (medians; 1 thread per
rank), and prints each stage's peak split into model state, activations and message buffers.

The time target (auto <= 1.15x at half the plain peak) presumes recomputation is what halves the
peak: activations dominate it, as with long sequences and several microbatches in flight. So the
default timed config (`--config long`) is a 16-layer gpt (d 128, seq 512, microbatch 2, batch 16 in
8 microbatches) under interleaved 1F1B with 2 stages per rank: stage 0 holds 4 microbatches and
activations are about 85% of its peak. `--config short` is the earlier one (8 layers, d 256, seq
128, 1F1B on 2 stages): there model state and buffers are about half the peak and stage 0 holds only
2 microbatches, so recomputation cannot halve the peak and auto must also stream model state."""
from __future__ import annotations

from partition.args import whole
import argparse
import os
import platform
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from bench import save_json
from bench.memory_budgets import GPT as BUDGETS_GPT

__all__ = ["main", "train_steps"]

SCAN = {"n_layer": 4, "n_head": 4, "seq_len": 32, "vocab": 512, "microbatch_size": 2, "tie": False}
WIDTHS = [64, 96, 128, 160, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1280]
TIMED = {"n_layer": 8, "d_model": 256, "n_head": 8, "seq_len": 128, "vocab": 1000, "microbatch_size": 2,
         "tie": False}
LONG = {"n_layer": 16, "d_model": 128, "n_head": 4, "seq_len": 512, "vocab": 1000, "microbatch_size": 2,
        "tie": False}
# gpt, schedule, stages per rank; "budgets" is bench.memory_budgets' GPT (batch 32 in 8 microbatches of 4)
CONFIGS = {"long": (LONG, "interleaved-1f1b", 2), "short": (TIMED, "1f1b", 1), "budgets": (BUDGETS_GPT, "1f1b", 1)}


def _build(args: dict[str, Any], M: int, schedule: str = "1f1b", *, v: int = 1, **kw: Any) -> tuple[Any, Any]:
    import partition
    import pipe
    w = partition.load("gpt", **args)
    pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=M, cost="flops",
                       schedule=schedule, stages_per_rank=v, **kw)
    return w, pp


def _peaks(pp: Any) -> dict[int, int]:
    mine = {s: r["peak_total"] for s, r in pp.memory_report().items()}
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return {s: v for p in parts for s, v in p.items()}


def train_steps(w: Any, pp: Any, M: int, steps: int, warmup: int = 0) -> float:
    """`warmup` then `steps` Adam steps of pipeline `pp` on workload `w`'s batches 0, 1, ...; seconds per
    step of the last `steps` (on CUDA once the device has finished them)."""
    opt = torch.optim.Adam(list(pp.parameters()), lr=1e-4)
    cuda = pp.ctx.device.type == "cuda"
    t0 = time.perf_counter()
    for step in range(warmup + steps):
        if step == warmup:
            if cuda:
                torch.cuda.synchronize(pp.ctx.device)
            t0 = time.perf_counter()
        b, _, target = w.batch(w.microbatch_size * M, step)
        pp.step(*b, target=target)
        opt.step()
        opt.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize(pp.ctx.device)
    return (time.perf_counter() - t0) / steps


def _trains(d: int, budget: float, features: dict[str, str], M: int, base: dict[str, Any],
            schedule: str) -> dict[str, Any] | None:
    """Two Adam steps of gpt width d within the budget, or None (refused or over budget)."""
    args = dict(base, d_model=d)
    try:
        kw: dict[str, Any] = dict(features, memory_budget=budget)
        w, pp = _build(args, M, schedule, **kw)
    except ValueError as e:
        return {"refused": str(e).splitlines()[0][:160]}
    s_per_step = train_steps(w, pp, M, 2)
    peaks = _peaks(pp)
    return {"d_model": d, "params": sum(p.numel() for p in w.model.parameters()), "peaks": peaks,
            "within": max(peaks.values()) <= budget, "s_per_step": s_per_step,
            "plan": [st.memory or "none" for st in pp.plan.stages]}


def largest(budget: float, features: dict[str, str], M: int, say: Any, base: dict[str, Any] = SCAN,
            widths: list[int] = WIDTHS, schedule: str = "1f1b", seconds: float = float("inf")) -> dict[str, Any]:
    """The widest gpt that trains within `budget` per stage (widths in order, until one fails or
    `seconds` have passed)."""
    best: dict[str, Any] = {}
    t0 = time.perf_counter()
    for d in widths:
        if time.perf_counter() - t0 > seconds:
            say(f"    stopped before d_model {d}: the scan's {seconds:.0f} s are up")
            break
        got = _trains(d, budget, features, M, base, schedule)
        if got is None or "refused" in got or not got["within"]:
            say(f"    d_model {d}: does not train within the budget ({(got or {}).get('refused', 'over budget')})")
            break
        say(f"    d_model {d}: {got['params'] / 1e6:.2f} M params, peak {max(got['peaks'].values()) / 2**20:.1f} "
            f"MiB, {got['s_per_step']:.2f} s/step, plan {got['plan']}")
        best = got
    return best


def _shares(pp: Any, say: Any) -> dict[int, dict[str, int]]:
    """Each stage's peak, and what holds it: model state (params, grads, optimizer), activations (their
    peak; with recomputation), message buffers."""
    mine = {s: {"peak": r["peak_total"], "state": r["params"] + r["grads"] + r["optimizer"],
                "activations": r["peak_activations"], "comm": r["peak_comm"]} for s, r in pp.memory_report().items()}
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    rows = {s: v for p in parts for s, v in sorted(p.items())}
    for s, r in sorted(rows.items()):
        say(f"    stage {s}: plain peak {r['peak'] / 2**20:6.1f} MiB = state {r['state'] / 2**20:5.1f} "
            f"({r['state'] / r['peak']:4.0%}) + activations {r['activations'] / 2**20:6.1f} "
            f"({r['activations'] / r['peak']:4.0%}) + buffers {r['comm'] / 2**20:5.1f} ({r['comm'] / r['peak']:4.0%})")
    return rows


def timed(rounds: int, M: int, say: Any, base: dict[str, Any] = LONG, schedule: str = "interleaved-1f1b",
          v: int = 2, fraction: float = 0.5) -> dict[str, Any]:
    """Step times of plain, auto at `fraction` of the plain peak, selective and full, alternating."""
    w, plain = _build(base, M, schedule, v=v)
    opt = torch.optim.Adam(list(plain.parameters()), lr=1e-4)
    for step in range(2):  # the peak with the optimizer state present
        b, _, target = w.batch(w.microbatch_size * M, step)
        plain.step(*b, target=target)
        opt.step()
        opt.zero_grad(set_to_none=True)
    peak = max(_peaks(plain).values())
    shares = _shares(plain, say)
    budget = peak * fraction
    runs: dict[str, Any] = {"none": (w, plain, opt)}
    notes = {}
    from partition.plan import Plan
    for name, kw in (("auto", {"recompute": "auto", "memory_budget": budget}),
                     ("selective", {"recompute": "selective"}), ("full", {"recompute": "full"})):
        same = Plan.from_dict(plain.plan.to_dict())  # the plain boundaries: only the memory plan differs
        try:
            wl, pp = _build(base, M, schedule, v=v, plan=same, **kw)
        except ValueError as e:  # recompute alone cannot reach the budget: let auto offload too
            notes[name] = str(e).splitlines()[0][:300]
            say(f"    {name} without offload: {notes[name]}")
            wl, pp = _build(base, M, schedule, v=v, plan=same, offload="all", **kw)
            name += "+offload"
        runs[name] = (wl, pp, torch.optim.Adam(list(pp.parameters()), lr=1e-4))
    from bench.schedules import slowest_rank_s
    samples: dict[str, list[float]] = {k: [] for k in runs}
    names = list(runs)
    for r in range(rounds + 1):  # round 0 warms up
        b, _, target = w.batch(w.microbatch_size * M, 100 + r)
        for name in names[r % len(names):] + names[:r % len(names)]:
            wl, pp, o = runs[name]
            dt = slowest_rank_s(lambda: (pp.step(*b, target=target), o.step(), o.zero_grad(set_to_none=True)),
                                pp.ctx.device)
            if r:
                samples[name].append(dt)
    med = {k: statistics.median(v) for k, v in samples.items()}
    peaks = {k: max(_peaks(v[1]).values()) for k, v in runs.items()}
    plans = {k: [st.memory or "none" for st in v[1].plan.stages] for k, v in runs.items()}
    for k in runs:
        say(f"    {k:16s} {med[k]:6.3f} s/step  x{med[k] / med['none']:.3f}  peak {peaks[k] / 2**20:7.1f} MiB "
            f"(budget {budget / 2**20:.1f} MiB)  plan {plans[k]}")
    return {"budget": budget, "plain_peak": peak, "shares": shares, "median_s": med,
            "ratio": {k: med[k] / med["none"] for k in med},
            "peaks": peaks, "plans": plans, "samples_s": samples, "notes": notes}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.memory_bench", description=__doc__)
    p.add_argument("--budget", default="32MiB", help="per-stage budget of part 1")
    p.add_argument("--rounds", type=whole(1), default=4)
    p.add_argument("--skip", default="", help="'scan' or 'time' to skip that part")
    p.add_argument("--fraction", type=float, default=0.5, help="auto's budget in part 2, of the plain peak")
    p.add_argument("--config", default="long", choices=sorted(CONFIGS),
                   help="timed gpt: 'long' (activations dominate; default), 'short' (the earlier config) or "
                        "'budgets' (bench.memory_budgets' GPT, issue 13's)")
    p.add_argument("--out", default="out/memory_bench")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    import pipe
    from partition.plan import parse_bytes
    ctx = pipe.init()
    say = print if ctx.rank == 0 else (lambda *a, **k: None)
    budget = float(parse_bytes(args.budget) or 0)
    result: dict[str, Any] = {"command": " ".join(sys.argv), "ranks": ctx.world_size, "torch": torch.__version__,
                              "machine": platform.platform(), "cpus": os.cpu_count()}
    if args.skip != "scan":
        say(f"part 1: largest gpt {SCAN} trained within {args.budget} per stage, {ctx.world_size} ranks, M=4")
        say("  plain (recompute none, offload none):")
        plain = largest(budget, {}, 4, say)
        say("  recompute auto, offload all (states and activations):")
        feat = largest(budget, {"recompute": "auto", "offload": "all"}, 4, say)
        ratio = feat.get("params", 0) / max(plain.get("params", 1), 1)
        say(f"  largest: plain {plain.get('params', 0) / 1e6:.2f} M params (d {plain.get('d_model')}), with memory "
            f"features {feat.get('params', 0) / 1e6:.2f} M (d {feat.get('d_model')}): x{ratio:.2f}")
        result["scan"] = {"budget": budget, "plain": plain, "features": feat, "ratio": ratio}
    if args.skip != "time":
        base, schedule, v = CONFIGS[args.config]
        say(f"part 2 ({args.config}): step time of gpt {base}, batch {8 * base['microbatch_size']} in 8 microbatches, "
            f"{schedule} with {v} "
            f"stage(s) per rank, {args.rounds} alternating rounds")
        result["time"] = timed(args.rounds, 8, say, base, schedule, v, args.fraction)
    if ctx.rank == 0:
        say(f"wrote {save_json(args.out, 'memory_bench.json', result)}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
