"""OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 -m bench.memory_budgets [--fractions auto:none:0.75,...]

Budgets as fractions of the plain peak, on the 8-layer GPT of issue 13 (d 256, seq 128, vocab 1000,
batch 32 in 8 microbatches, 1F1B on 2 ranks). The plain pipeline (no recompute, no offload) runs two
Adam steps and its ledger peak on the busier stage (model state, optimizer state included, and
activations and message buffers) is the reference; then each `recompute:offload:fraction` is
planned for that fraction of it and run two steps. Per config and stage: the measured peak, the
predicted one, the message buffers and the policy, or the error that refused the budget (with the
figure it needs). Rank 0 prints a table and writes out/memory_budgets/memory_budgets.json."""
from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist

from bench import save_json

GPT = {"n_layer": 8, "d_model": 256, "n_head": 8, "seq_len": 128, "vocab": 1000, "microbatch_size": 4}
M = 8


def run_config(recompute: str, offload: str, budget: int | None, world: int) -> dict[str, Any]:
    """Two Adam steps under one config; every stage's peaks, gathered on every rank."""
    import partition
    import pipe
    w = partition.load("gpt", **GPT)
    try:
        pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=M, schedule="1f1b",
                           cost="flops", recompute=recompute, offload=offload, memory_budget=budget)
    except ValueError as e:
        return {"budget": budget, "error": f"{type(e).__name__}: {e}"}
    opt = torch.optim.Adam(list(pp.parameters()), lr=1e-3)
    for step in range(2):
        args, kwargs, target = w.batch(w.microbatch_size * M, step)
        pp.step(*args, target=target, **kwargs)
        opt.step()
        opt.zero_grad()
    mine = {s: {"peak": r["peak_total"], "predicted": r.get("predicted_peak"), "comm": r["peak_comm"],
                "label": pp.memory.choices[s].label() if hasattr(pp.memory, "choices") else "none"}
            for s, r in pp.memory_report().items()}
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, mine)
    return {"budget": budget, "stages": {s: v for p in parts for s, v in p.items()}}


def main() -> None:
    import pipe
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fractions", default="auto:none:0.75,auto:none:0.6,auto:all:0.5,auto:all:0.4,auto:all:0.3",
                   help="recompute:offload:fraction of the plain peak, comma-separated")
    p.add_argument("--out", default="out/memory_budgets")
    a = p.parse_args()
    torch.set_num_threads(1)
    ctx = pipe.init()
    plain = run_config("none", "none", None, ctx.world_size)
    base = max(v["peak"] for v in plain["stages"].values())
    rows = {"none/none": plain}
    for item in a.fractions.split(","):
        recompute, offload, frac = item.split(":")
        rows[f"{recompute}/{offload}/{frac}"] = run_config(recompute, offload, int(float(frac) * base), ctx.world_size)
    if ctx.rank != 0:
        return
    mib = 2 ** 20
    print(f"gpt {GPT}, batch {GPT['microbatch_size'] * M} in {M} microbatches, 1F1B, {ctx.world_size} ranks; "
          f"plain peak {base / mib:.1f} MiB")
    print("| config | budget MiB | stage | peak MiB | predicted MiB | buffers MiB | policy |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for name, r in rows.items():
        budget = "-" if r["budget"] is None else f"{r['budget'] / mib:.1f}"
        if "error" in r:
            print(f"| {name} | {budget} | - | refused: {r['error'][:240]} | | | |")
            continue
        for s, v in sorted(r["stages"].items()):
            pred = "-" if v["predicted"] is None else f"{v['predicted'] / mib:.1f}"
            print(f"| {name} | {budget} | {s} | {v['peak'] / mib:.1f} | {pred} | {v['comm'] / mib:.2f} "
                  f"| {v['label']} |")
    save_json(a.out, "memory_budgets.json", {"plain_peak": base, "configs": rows})


if __name__ == "__main__":
    main()
