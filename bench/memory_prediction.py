"""OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 -m bench.memory_prediction [--models gpt,unet,gpt2]

The memory model against the ledger: for every model, schedule (1F1B, interleaved with 2 stages per
rank), recompute policy (none, full, selective) and offload mode (none, activations, states, all),
a pipeline of 4 microbatches runs two Adam steps and each stage's predicted peak (memory.budget on
memory.timeline's walk of the lowered program) is set beside the peak the ledger measured. Rank 0
prints one row per stage, sorted by the ratio, and writes out/memory_prediction/memory_prediction.json.
tests/test_memory_prediction.py checks a spread of these configurations with `measure`."""
from __future__ import annotations

import argparse
import itertools
from typing import Any, Sequence

import torch

from bench import save_json

__all__ = ["MODELS", "measure", "train", "main"]

MODELS = {"gpt": ("gpt", {"n_layer": 4, "d_model": 64, "n_head": 4, "seq_len": 64, "vocab": 256,
                          "microbatch_size": 8}),
          "unet": ("unet", {}),
          "gpt2": ("bench.hf_models:gpt2", {})}
SCHEDULES = (("1f1b", 1), ("interleaved-1f1b", 2))
POLICIES = ("none", "full", "selective")
OFFLOADS = ("none", "activations", "states", "all")


def train(w: Any, pp: Any, M: int, steps: int, optimizer: Any = torch.optim.Adam) -> None:
    """`steps` optimizer steps of pipeline `pp` on workload `w`'s batches 0, 1, ..."""
    opt = optimizer(list(pp.parameters()), lr=1e-3)
    for step in range(steps):
        args, kwargs, target = w.batch(w.microbatch_size * M, step)
        pp.step(*args, target=target, **kwargs)
        opt.step()
        opt.zero_grad()


def measure(configs: Sequence[tuple[str, str, int, str, str]], M: int = 4, steps: int = 2,
            each: Any = None) -> dict[str, tuple[int, int]]:
    """{"model/schedule/recompute/offload/stage": (measured peak, predicted peak)} for this rank's
    stages, per (model, schedule, stages per rank, recompute, offload); `each(config, w, pp)` is called
    after each config's steps."""
    import partition
    import pipe
    out: dict[str, tuple[int, int]] = {}
    for config in configs:
        model, schedule, v, recompute, offload = config
        name, kw = MODELS[model]
        w = partition.load(name, **kw)
        pp = pipe.Pipeline(w.model, w.example_args, example_kwargs=w.example_kwargs, loss_fn=w.loss_fn,
                           microbatches=M, schedule=schedule, stages_per_rank=v, cost="flops",
                           recompute=recompute, offload=offload, example_target=w.example_target)
        train(w, pp, M, steps)
        for s, r in pp.memory_report().items():
            out[f"{model}/{schedule}/{recompute}/{offload}/{s}"] = (r["peak_total"], r["predicted_peak"])
        if each is not None:
            each(config, w, pp)
    return out


def main() -> None:
    import torch.distributed as dist
    import pipe
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--out", default="out/memory_prediction")
    a = p.parse_args()
    torch.set_num_threads(1)
    ctx = pipe.init()
    configs = [(m, s, v, r, o) for m in a.models.split(",") for (s, v), r, o in
               itertools.product(SCHEDULES, POLICIES, OFFLOADS)]
    parts: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(parts, measure(configs))
    if ctx.rank:
        return
    rows = {k: v for part in parts for k, v in part.items()}
    ratio = {k: p / m for k, (m, p) in rows.items()}
    for k in sorted(rows, key=ratio.__getitem__):
        m, p = rows[k]
        print(f"{k:48s} measured {m / 2**20:8.3f} MiB  predicted {p / 2**20:8.3f} MiB  x{ratio[k]:.3f}")
    print(f"{len(rows)} stages of {len(configs)} configurations: predicted / measured from "
          f"x{min(ratio.values()):.3f} to x{max(ratio.values()):.3f}")
    print(f"wrote {save_json(a.out, 'memory_prediction.json', {'rows': rows, 'ratio': ratio})}")


if __name__ == "__main__":
    main()
