"""The memory model against the ledger on 2 gloo ranks: every stage's predicted peak (memory.budget on
memory.timeline's walk of the lowered program) beside the peak the ledger measured over a step, for
each recompute policy and offload mode, 1F1B and interleaved, on the bundled GPT, the UNet and a
Hugging Face GPT-2 (one launch)."""
from __future__ import annotations

import itertools
from typing import Any

from tests.mp import run_ranks

MODELS = {"gpt": ("gpt", {"n_layer": 4, "d_model": 64, "n_head": 4, "seq_len": 64, "vocab": 256,
                          "microbatch_size": 8}),
          "unet": ("unet", {}),
          "gpt2": ("bench.hf_models:gpt2", {})}
SCHEDULES = [("1f1b", 1), ("interleaved-1f1b", 2)]
POLICIES = [("none", "none"), ("none", "activations"), ("none", "states"), ("full", "none"), ("full", "all"),
            ("selective", "none"), ("selective", "all")]


def body(rank: int, world: int, *, M: int = 4, steps: int = 2) -> dict[str, Any]:
    import torch
    import partition
    import pipe
    pipe.init()
    out: dict[str, Any] = {}
    for model, (name, kw) in MODELS.items():
        for (schedule, v), (recompute, offload) in itertools.product(SCHEDULES, POLICIES):
            w = partition.load(name, **kw)
            pp = pipe.Pipeline(w.model, w.example_args, example_kwargs=w.example_kwargs, loss_fn=w.loss_fn,
                               microbatches=M, schedule=schedule, stages_per_rank=v, cost="flops",
                               recompute=recompute, offload=offload, example_target=w.example_target)
            opt = torch.optim.Adam(list(pp.parameters()), lr=1e-3)
            for step in range(steps):
                args, kwargs, target = w.batch(w.microbatch_size * M, step)
                pp.step(*args, target=target, **kwargs)
                opt.step()
                opt.zero_grad()
            rep = pp.memory_report()
            for s, r in rep.items():
                out[f"{model}/{schedule}/{recompute}/{offload}/{s}"] = (r["peak_total"], r["predicted_peak"])
    return out


def test_predicted_peaks_against_the_ledger() -> None:
    res: dict[str, tuple[int, int]] = {}
    for r in run_ranks("tests.test_memory_prediction:body", 2, timeout=480):
        res.update(r)
    assert len(res) == len(MODELS) * len(POLICIES) * (2 + 4), sorted(res)  # 2 stages under 1F1B, 4 interleaved
    ratio = {k: predicted / measured for k, (measured, predicted) in res.items()}
    lines = "\n".join(f"{k}: measured {m}, predicted {p}, x{ratio[k]:.3f}" for k, (m, p) in sorted(res.items()))
    # never below what the ledger measured on the GPTs, for every policy (the UNet's first stage is
    # predicted up to 4.3% low with full recompute or offload: what its microbatches keep is undercounted)
    for k, x in ratio.items():
        if not k.startswith("unet/"):
            assert x >= 1.0, f"{k} predicted below the ledger\n{lines}"
    # within 5% on the GPT (both schedules) and on every model under 1F1B, without per-node recompute;
    # elsewhere within what was measured when this test was written (the prediction's known slack:
    # selective counts only the bytes it can prove freed; interleaved, the UNet's and GPT-2's first
    # stages come out up to 7% and 14% high), so that a regression still shows
    for k, x in ratio.items():
        model, schedule, recompute = k.split("/")[:3]
        if recompute == "selective":
            assert x <= 1.35, f"{k} predicted x{x:.3f} the ledger's peak\n{lines}"
        elif model == "gpt" or schedule == "1f1b":
            assert 0.95 <= x <= 1.05, f"{k} predicted x{x:.3f} the ledger's peak\n{lines}"
        else:
            assert 0.95 <= x <= 1.15, f"{k} predicted x{x:.3f} the ledger's peak\n{lines}"
