"""Memory features on 2 and 4 gloo ranks: parity of every recompute policy and offload mode (alone and
combined, 1F1B, interleaved, ZB-H1) with the plain model over 3 Adam steps; budgets met by the ledger."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.mp import run_ranks

# activations dominate the model state, so recomputation has something to save
GPT = {"n_layer": 4, "d_model": 64, "n_head": 4, "seq_len": 64, "vocab": 256, "microbatch_size": 8}
Config = tuple[str, int, str, str, Any]  # schedule, stages per rank, recompute, offload, budget (x peak)


def one_config(rank: int, world: int, cfg: Config, M: int, steps: int, budget: float | None,
               nccl_like: bool = False, trace_loss: bool = True) -> dict[str, Any]:
    import partition
    import pipe
    from tests.nccl_like import NcclLike
    from pipe.schedules import Action
    from tests.parity import check_step
    schedule, v, recompute, offload, _ = cfg
    w = partition.load("gpt", **GPT)
    ref = partition.load("gpt", **GPT)
    pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=M, schedule=schedule,
                       stages_per_rank=v, cost="flops", recompute=recompute, offload=offload, memory_budget=budget,
                       transport=NcclLike() if nccl_like else None, trace_loss=trace_loss)
    opt = torch.optim.Adam(list(pp.parameters()), lr=1e-3)
    ref_opt = torch.optim.Adam(ref.model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        args, kwargs, target = w.batch(w.microbatch_size * M, step)
        loss = pp.step(*args, target=target, **kwargs)
        check_step(pp, loss, ref, args, kwargs, target, M, opt, ref_opt, str(cfg))
        losses.append(loss)
    report = pp.memory_report()
    choices = pp.memory.choices  # type: ignore[attr-defined]
    return {"losses": losses, "peak": {s: r["peak_total"] for s, r in report.items()},
            "comm": {s: (r["peak_comm"], r.get("predicted_comm")) for s, r in report.items()},
            "predicted": {s: r.get("predicted_peak") for s, r in report.items()}, "budget": budget,
            "labels": [choices[s].label() for s in sorted(choices)],
            "recompute_ms": [choices[s].recompute_ms for s in sorted(choices)],
            "kinds": sorted({x.kind for x in pp.program if isinstance(x, Action)}),
            "fallbacks": [n for n in pp.plan.notes if "autograd call per node, not matrix products" in n],
            # zero bubble: which stages' W takes the matrix products (the stage module returns the linear
            # layers' inputs and their versions as a third and a fourth output), against the memory plan's
            # label of each
            "w_direct": {s: (len(pp._zb[s][0].graph.output_node().args[0]) == 4, choices[s].label())
                         for s in pp._zb},
            "reload_stalls": sum(r["reload_stalls"] for r in report.values()),
            "per stage": [n for n in pp.plan.notes if n.startswith("memory_budget is per stage")]}


def memory_body(rank: int, world: int, *, configs: list[Config], M: int, steps: int = 3,
                nccl_like: bool = False, trace_loss: bool = True) -> dict[str, Any]:
    """Each config in parity with the plain model. A budget below 1 is that fraction of the measured
    peak of the latest plain config before it (the first config must be plain); errors are returned as text.
    `nccl_like`: messages through tests.nccl_like (NCCL's matching and per-pair order); `trace_loss`:
    the loss in the graph (the natural call's target inferred), else outside."""
    import torch.distributed as dist
    import pipe
    pipe.init()
    out: dict[str, Any] = {}
    base, prev = None, None
    for cfg in configs:
        budget = cfg[4]
        if budget == "named":  # the least budget the config before named in its refusal
            import re
            budget = int(re.search(r"memory_budget >= (\d+)", out["/".join(map(str, prev or ()))]["error"]).group(1))
        elif budget is not None and budget < 1:
            assert base is not None, "put the plain config first"
            budget = int(budget * base)
        try:
            res = one_config(rank, world, cfg, M, steps, budget, nccl_like, trace_loss)
        except ValueError as e:
            out["/".join(map(str, cfg))] = {"error": str(e)}
            prev = cfg
            continue
        if cfg[2:4] == ("none", "none"):
            peaks: list[Any] = [None] * world
            dist.all_gather_object(peaks, max(res["peak"].values()))
            base = max(peaks)
        out["/".join(map(str, cfg))] = res
        prev = cfg
    return out


def _check(results: list[dict[str, Any]]) -> dict[str, Any]:
    for r in results[1:]:
        assert {k: v.get("losses", v.get("error")) for k, v in r.items()} == \
               {k: v.get("losses", v.get("error")) for k, v in results[0].items()}
    merged = dict(results[0])
    for name, res in merged.items():
        if "error" in res:
            continue
        res["peak"] = {s: p for r in results for s, p in r[name]["peak"].items()}
        res["predicted"] = {s: p for r in results for s, p in r[name]["predicted"].items()}
        res["fallbacks"] = [n for r in results for n in r[name]["fallbacks"]]
        res["w_direct"] = {s: d for r in results for s, d in r[name]["w_direct"].items()}
        assert len(res["losses"]) == 3
        for r in results:  # the buffers the ledger counted as the program ran are the ones planned from it
            for s, (peak, planned) in r[name]["comm"].items():
                assert planned is None or peak == planned, (name, s, peak, planned)
        for s, peak in res["peak"].items():  # the predicted peak (made when a feature is on) bounds the measured
            assert res["predicted"][s] is None or peak <= res["predicted"][s], (name, s, peak, res["predicted"][s])
            if res["budget"] is not None:
                assert peak <= res["budget"], (name, s, peak, res["budget"])
    return merged


def test_parity_and_budgets_on_2_ranks() -> None:
    configs: list[Config] = [
        ("1f1b", 1, "none", "none", None),
        ("1f1b", 1, "full", "none", None),
        ("1f1b", 1, "selective", "activations", None),
        ("1f1b", 1, "auto", "none", 0.8),
        ("1f1b", 1, "selective", "none", None),
        ("1f1b", 1, "auto", "none", 0.62),  # the partitioner's least budget is 0.60x (issue 13: one memory model)
        ("1f1b", 1, "none", "states", None),
        ("interleaved-1f1b", 2, "selective", "all", None),
        ("interleaved-1f1b", 2, "full", "activations", None),
        ("zb-h1", 1, "full", "states", None),
        ("zb-h1", 1, "none", "all", None),
        ("zb-h1", 1, "auto", "all", 0.7),
        ("1f1b", 1, "auto", "all", 0.3),
        ("1f1b", 1, "auto", "all", 0.05),
        ("zb-h1", 1, "none", "none", None),  # the base of the budget after it
        ("zb-h1", 1, "auto", "none", 0.9),
        # found by review: the partitioner's least budget (a bound that leaves memory/'s buffers out) was then
        # refused by memory/ for the stages it cuts; the refusal names the least at which both fit
        ("1f1b", 1, "none", "none", 0.3),
        ("1f1b", 1, "none", "none", "named"),
    ]
    # the budgets and the policies they lead to were set with the loss outside the graph; the nccl test
    # below runs the natural call, the loss in the graph
    res = _check(run_ranks("tests.test_memory_parity:memory_body", 2, timeout=240, configs=configs, M=4,
                           trace_loss=False))
    auto = res["1f1b/1/auto/none/0.8"]
    assert auto["recompute_ms"][0] > auto["recompute_ms"][-1]  # stage 0 holds 2 microbatches, stage 1 one
    assert res["1f1b/1/auto/none/0.62"]["labels"][0].startswith("ckpt")  # checkpoint regions, not the whole stage
    sel = res["1f1b/1/selective/none/None"]  # recomputing on unpack frees memory on every stage
    assert all(sel["peak"][s] < res["1f1b/1/none/none/None"]["peak"][s] for s in sel["peak"])
    assert res["zb-h1/1/auto/all/0.7"]["budget"] is not None
    # a stage the budget leaves plain keeps W's matrix products beside one that recomputes (and runs BW)
    assert res["zb-h1/1/none/none/None"]["w_direct"] == {0: (True, "none"), 1: (True, "none")}
    direct = res["zb-h1/1/auto/none/0.9"]["w_direct"]
    assert sorted(label == "none" for _, label in direct.values()) == [False, True], direct
    assert all(d == (label == "none") for d, label in direct.values()), direct
    # checkpoint regions with streamed model state: each region's chunks come back when it is recomputed
    assert all(x.startswith("ckpt") and x.endswith("+states") for x in res["1f1b/1/auto/all/0.3"]["labels"])
    err = res["1f1b/1/none/none/0.3"]["error"]
    assert "is the least budget at which both the cut and its memory plan fit" in err, err
    assert "losses" in res["1f1b/1/none/none/named"], res["1f1b/1/none/none/named"]
    err = res["1f1b/1/auto/all/0.05"]["error"]  # the partitioner or memory/ refuses, naming the least budget
    assert "memory_budget >= " in err and ("least budget" in err or "smallest feasible" in err), err


def test_memory_features_with_nccl_matching() -> None:
    """Recompute and offload with the messages through a transport with NCCL's semantics."""
    configs: list[Config] = [
        ("1f1b", 1, "none", "none", None),
        ("1f1b", 1, "auto", "all", 0.6),
        ("interleaved-1f1b", 2, "selective", "all", None),
        ("zb-h1", 1, "full", "activations", None),
        ("zbv", 2, "full", "activations", None),
        ("dualpipev", 2, "selective", "all", None),
        ("interleaved-zb", 2, "auto", "activations", 0.65),
        ("1f1b-overlap", 1, "selective", "all", None),
    ]
    res = _check(run_ranks("tests.test_memory_parity:memory_body", 2, timeout=240, configs=configs, M=4,
                           nccl_like=True))
    assert not any("error" in r for r in res.values()), res
    # recomputing under zero-bubble (a checkpoint, or saves recomputed on unpack): the program's backward is
    # BW (no W); offloaded activations RELOAD
    for key in ("zb-h1/1/full/activations/None", "zbv/2/full/activations/None", "dualpipev/2/selective/all/None"):
        assert res[key]["kinds"] == ["BW", "F", "RELOAD"], (key, res[key]["kinds"])
    offloading = ("interleaved-1f1b/2/selective/all/None", "1f1b-overlap/1/selective/all/None",
                  "zb-h1/1/full/activations/None",
                  "zbv/2/full/activations/None", "dualpipev/2/selective/all/None")
    for key in offloading:
        assert res[key]["reload_stalls"] == 0, (key, res[key])  # every backward found its RELOAD done
    assert res["1f1b/1/none/none/None"]["kinds"] == ["B", "F"]
    # an offloading stage keeps the graph for its W by design: no fallback is said (that is autocast's)
    assert all(r["fallbacks"] == [] for r in res.values()), res
    # found by review: a budget met per stage is exceeded per rank holding two; the notes say so where it applies
    assert res["interleaved-zb/2/auto/activations/0.65"]["per stage"] == [
        "memory_budget is per stage, and each rank holds 2 stages: a rank may hold up to 2x it at once (for a "
        "device's memory, give that memory / 2)"], res["interleaved-zb/2/auto/activations/0.65"]
    assert res["1f1b/1/auto/all/0.6"]["per stage"] == [] and res["zbv/2/full/activations/None"]["per stage"] == []


def test_parity_and_budgets_on_4_ranks() -> None:
    configs: list[Config] = [
        ("1f1b", 1, "none", "none", None),
        ("1f1b", 1, "auto", "none", 0.7),
        ("interleaved-1f1b", 2, "auto", "all", 0.5),
        ("zb-h1", 1, "selective", "activations", None),
    ]
    res = _check(run_ranks("tests.test_memory_parity:memory_body", 4, timeout=300, configs=configs, M=4,
                           trace_loss=False))
    auto = res["1f1b/1/auto/none/0.7"]["recompute_ms"]
    assert auto[0] > auto[-1] and auto == sorted(auto, reverse=True), auto


def cuda_body(rank: int, world: int) -> dict[int, dict[str, int]]:
    import partition
    import pipe
    pipe.init()
    w = partition.load("gpt", **GPT)
    pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=4, cost="flops",
                       recompute="selective", offload="activations")
    opt = torch.optim.Adam(list(pp.parameters()), lr=1e-3)
    for step in range(3):
        args, kwargs, target = w.batch(w.microbatch_size * 4, step)
        pp.step(*args, target=target, **kwargs)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return pp.memory_report()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the ledger is checked on CPU above)")
def test_ledger_against_cuda_allocator() -> None:
    (report,) = run_ranks("tests.test_memory_parity:cuda_body", 1, timeout=180)
    for s, r in report.items():
        # the ledger counts what the pipeline holds, not the allocator's temporaries and workspaces
        assert r["peak_total"] <= r["cuda_peak_allocated"] <= 3 * r["peak_total"] + (64 << 20), (s, r)


def over_body(rank: int, world: int) -> dict[str, Any]:
    """A measured peak over the budget the plan claims to meet. Found by review: on Hugging Face graphs memory/
    predicts some plans (offloaded activations, checkpoint regions) up to 12% below the measurement, so a budget
    the plan met on paper was exceeded with no word. The step that measures it says so once, in a warning and the
    plan's notes. Here the budget is lowered under the measured peak after the build, as such a prediction
    would leave it."""
    import warnings
    import partition
    import pipe
    pipe.init()
    w = partition.load("gpt", **GPT)
    pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=4, cost="flops", recompute="auto",
                       memory_budget="1GiB")
    args, kwargs, target = w.batch(w.microbatch_size * 4, 0)
    with warnings.catch_warnings(record=True) as first:
        warnings.simplefilter("always")
        pp.step(*args, target=target, **kwargs)
    peak = max(r["peak_total"] for r in pp.memory_report().values())
    pp.memory.budget = peak - 1000  # type: ignore[attr-defined]
    said = []
    for _ in range(2):  # said once
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pp.step(*args, target=target, **kwargs)
        said.append([str(c.message) for c in caught if issubclass(c.category, RuntimeWarning)])
    return {"first": [str(c.message) for c in first if issubclass(c.category, RuntimeWarning)], "said": said,
            "notes": [n for n in pp.plan.notes if "over memory_budget" in n], "peak": peak}


def _human(n: int) -> str:
    from memory.budget import human
    return human(n)


def test_a_measured_peak_over_the_budget_is_said() -> None:
    for r in run_ranks("tests.test_memory_parity:over_body", 2, timeout=120):
        assert r["first"] == [] and len(r["said"][0]) == 1 and r["said"][1] == [], r
        said = r["said"][0][0]
        assert said.startswith("stage ") and f"measured a peak of {_human(r['peak'])} ({r['peak']} B), over " \
            "memory_budget=" in said and "give memory_budget=" in said, said
        assert r["notes"] == r["said"][0], r
