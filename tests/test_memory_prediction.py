"""The memory model against the ledger on 2 gloo ranks: every stage's predicted peak (memory.budget on
memory.timeline's walk of the lowered program) beside the peak the ledger measured over a step, for
recompute policies and offload modes, 1F1B and interleaved, on the bundled GPT, the UNet and a
Hugging Face GPT-2 (one launch); the least budget named met; pp.attach_optimizer and optimizer=."""
from __future__ import annotations

from typing import Any

import pytest

from tests.mp import run_ranks
# every recompute policy and offload mode on some model and schedule, spread over the three models,
# 1F1B and interleaved (the whole product, 72 configs, is bench.memory_prediction's: it met the same
# limits when this was written; it takes 3 minutes)
CONFIGS = [("gpt", "1f1b", 1, r, o) for r, o in (("none", "none"), ("full", "all"))] + \
    [("unet", "1f1b", 1, r, o) for r, o in (("full", "activations"), ("selective", "all"))] + \
    [("gpt2", "1f1b", 1, "selective", "states")] + \
    [("gpt", "interleaved-1f1b", 2, "full", "states")] + \
    [("gpt", "zb-h1", 1, "none", "states"),  # zero bubble: streamed state bounded, not walked (never below)
     ("gpt2", "zbv", 2, "none", "none")]  # the tied embedding and head on one rank: counted once, on stage 0


def body(rank: int, world: int, *, M: int = 4, steps: int = 2) -> dict[str, Any]:
    import torch
    import pipe
    from bench.memory_prediction import measure
    pipe.init()
    out: dict[str, Any] = {}

    def sgd(config: tuple[str, str, int, str, str], w: Any, pp: Any) -> None:
        if config[:2] + config[3:] != ("gpt", "1f1b", "none", "none"):
            return
        # plain SGD keeps no state: the prediction drops by Adam's two copies of the parameters
        rep = pp.memory_report()
        pp.attach_optimizer(torch.optim.SGD(list(pp.parameters()), lr=0.1))
        params = sum(p.numel() * p.element_size() for p in pp.parameters())
        for s, r in pp.memory_report().items():
            out[f"sgd/{s}"] = (rep[s]["predicted_peak"] - r["predicted_peak"], 2 * params,
                               pp.plan.stages[s].memory_peak == r["predicted_peak"])
    out.update(measure(CONFIGS, M, steps, sgd))
    out["floor"] = _floor(M, steps)
    out["optimizer="] = _planned_for_sgd(M, steps)
    return out


def _planned_for_sgd(M: int, steps: int) -> tuple[float, list[str], list[str], int, list[float]]:
    """A budget plain SGD fits without recompute but Adam's state does not: planned by default (for
    Adam) auto recomputes; with optimizer=SGD it plans none, and SGD steps stay within the budget."""
    import functools
    import torch
    import torch.distributed as dist
    import partition
    import pipe
    from bench.memory_prediction import MODELS, train
    name, kw = MODELS["gpt"]
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    w = partition.load(name, **kw)
    plain = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=M, cost="flops",
                          optimizer=sgd, recompute="auto")  # the plan's figures with the memory model's costs
    peaks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, [c.predicted_peak for c in plain.memory.choices.values()])
    budget = 1.001 * max(x for p in peaks for x in p)
    labels = {}
    for key, factory in (("adam", None), ("sgd", sgd)):
        w = partition.load(name, **kw)
        pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=M, cost="flops",
                           recompute="auto", memory_budget=budget, optimizer=factory)
        labels[key] = [c.label() for c in pp.memory.choices.values()]
    train(w, pp, M, steps, optimizer=sgd)
    return budget, labels["adam"], labels["sgd"], max(r["peak_total"] for r in pp.memory_report().values()), \
        [c.predicted_peak for c in pp.memory.choices.values()]


def _floor(M: int, steps: int) -> tuple[int, int, list[str]]:
    """(the least budget fxpipe names for the GPT with recompute='auto', offload='all', the peak the
    ledger measures when run at it): the figure a refusal names is asked for until one is met."""
    import re
    import partition
    import pipe
    from bench.memory_prediction import MODELS, train
    name, kw = MODELS["gpt"]
    budget, tried = 1 << 20, []
    for _ in range(4):
        w = partition.load(name, **kw)
        try:
            pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=M, schedule="1f1b",
                               cost="flops", recompute="auto", offload="all", memory_budget=budget,
                               example_target=w.example_target)
        except ValueError as e:
            tried.append(str(e))
            found = re.search(r"memory_budget >= (\d+)", str(e))
            assert found, e
            budget = int(found.group(1))
            continue
        train(w, pp, M, steps)
        import torch.distributed as dist
        peaks: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(peaks, max(r["peak_total"] for r in pp.memory_report().values()))
        return budget, max(peaks), tried
    raise AssertionError(f"no budget named was met: {tried}")


def test_predicted_peaks_against_the_ledger() -> None:
    res: dict[str, Any] = {}
    ranks = run_ranks("tests.test_memory_prediction:body", 2, timeout=480)
    run_result = [r.pop("optimizer=") for r in ranks]
    for r in ranks:
        res.update(r)
    floor, reached, refusals = res.pop("floor")
    # the least budget named is met, and the best plan comes within 10% of it
    assert refusals and floor / 1.10 <= reached <= floor, (floor, reached, refusals)
    # optimizer=: planned for SGD's (no) state, where Adam's would need recomputing on some stage
    assert any(x != "none" for r in run_result for x in r[1]), run_result
    for budget, adam, sgd, peak, predicted in run_result:
        assert set(sgd) == {"none"} and peak <= max(predicted) <= budget, run_result
    for s in (0, 1):  # pp.attach_optimizer: the state the optimizer keeps, in the report and the plan
        dropped, adam, in_plan = res.pop(f"sgd/{s}")
        assert dropped == pytest.approx(adam, abs=2) and in_plan, (s, dropped, adam, in_plan)
    assert len(res) == sum(2 * v for _, _, v, _, _ in CONFIGS), sorted(res)  # 2 stages per rank interleaved
    ratio = {k: predicted / measured for k, (measured, predicted) in res.items()}
    lines = "\n".join(f"{k}: measured {m}, predicted {p}, x{ratio[k]:.3f}" for k, (m, p) in sorted(res.items()))
    for k, x in ratio.items():
        model, schedule, recompute, offload = k.split("/")[:4]
        assert 1.0 <= x <= 1.05, f"{k} predicted x{x:.3f} the ledger's peak (within 5%, never below)\n{lines}"
