"""Tests for partition/plan.py and partition.plan(): memory budgets, JSON, the table, bad input."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import partition
from bench import models
from partition.plan import in_flight, parse_bytes
from tests.test_split import WORKLOADS


@pytest.fixture(scope="module")
def gpt() -> tuple[partition.Workload, partition.Analysis]:
    factory, kw = WORKLOADS["gpt"]
    w = factory(**kw)
    return w, partition.Analysis(w.model, w.example_args, cost="flops")


def test_plan_fields_add_up(gpt: tuple[partition.Workload, partition.Analysis]) -> None:
    w, a = gpt
    plan = partition.plan(w.model, w.example_args, 3, analysis=a, microbatches=6)
    assert plan.n_stages == 3 and plan.microbatches == 6 and plan.schedule == "1f1b"
    assert [sp.in_flight for sp in plan.stages] == [3, 2, 1]
    placed = [u for sp in plan.stages for u in sp.nodes]
    assert placed == [u for block in a.blocks.members for u in block]
    assert plan.bottleneck_ms >= max(sp.fwd_ms + sp.bwd_ms for sp in plan.stages)

    def link(n: int) -> float:  # activations forward and grads back, each one transfer
        return 2 * (plan.latency_ms + n / plan.bytes_per_ms) if n else 0.0
    times = [sp.fwd_ms + sp.bwd_ms + link(sp.recv_bytes) + link(sp.send_bytes) for sp in plan.stages]
    assert plan.bottleneck_ms == pytest.approx(max(times))
    assert plan.imbalance == pytest.approx(max(times) / (sum(times) / 3)) and plan.imbalance >= 1.0
    for prev, sp in zip(plan.stages, plan.stages[1:]):
        assert prev.send_bytes == sp.recv_bytes == sum(v.nbytes for v in sp.recv)
    for sp in plan.stages:
        assert sp.peak_bytes >= plan.state_factor * sp.param_bytes + sp.in_flight * sp.activation_bytes


def test_every_stage_fits_the_budget(gpt: tuple[partition.Workload, partition.Analysis]) -> None:
    w, a = gpt
    free = partition.plan(w.model, w.example_args, 3, analysis=a)
    with pytest.raises(partition.InfeasibleBudget) as err:
        partition.plan(w.model, w.example_args, 3, analysis=a, memory_budget=1)
    need, most = err.value.needed_bytes, max(sp.peak_bytes for sp in free.stages)
    assert need < most  # so the budget below binds
    budget = (need + most) / 2
    plan = partition.plan(w.model, w.example_args, 3, analysis=a, memory_budget=budget)
    assert plan.memory_budget == budget
    assert all(sp.peak_bytes <= budget for sp in plan.stages)
    assert plan.bottleneck_ms >= free.bottleneck_ms


def test_an_infeasible_budget_names_the_budget_that_works(
        gpt: tuple[partition.Workload, partition.Analysis]) -> None:
    w, a = gpt
    with pytest.raises(partition.InfeasibleBudget) as err:
        partition.plan(w.model, w.example_args, 2, analysis=a, memory_budget="64KiB")
    need = err.value.needed_bytes
    msg = str(err.value)
    assert f"{need:.0f}" in msg and "GPT" in msg and "64.0 KiB" in msg and "more stages" in msg
    plan = partition.plan(w.model, w.example_args, 2, analysis=a, memory_budget=need)
    assert max(sp.peak_bytes for sp in plan.stages) <= need
    with pytest.raises(partition.InfeasibleBudget):
        partition.plan(w.model, w.example_args, 2, analysis=a, memory_budget=need - 1)


def test_round_trip_through_json(gpt: tuple[partition.Workload, partition.Analysis], tmp_path: Path) -> None:
    w, a = gpt
    plan = partition.plan(w.model, w.example_args, 3, analysis=a, memory_budget="1GiB", schedule="gpipe",
                          microbatches=4)
    path = plan.save(tmp_path / "plan.json")
    assert path == tmp_path / "plan.json"
    assert partition.Plan.load(path) == plan
    lines = plan.table().splitlines()
    rows = [ln for ln in lines if re.match(r"^\s*\d+\s", ln)]
    assert [int(r.split()[0]) for r in rows] == [0, 1, 2]
    assert "tok_emb.weight" in plan.table()  # tied weights are listed
    # the ledger's measured peaks beside the predicted ones; a stage not measured shows "-"
    head, *rows = plan.table(measured={0: 3 * 2**20, 2: 2**20}).splitlines()[1:5]
    end = head.index("measured") + len("measured")  # columns are right-aligned
    assert head.index(" peak ") < end and [r[end - 7:end] for r in rows] == ["3.0 MiB", "      -", "1.0 MiB"], rows


@pytest.mark.parametrize("text, value", [("8GiB", 8 * 2**30), ("512MB", 512e6), ("1.5e9", 1.5e9),
                                         (" 2 kib ", 2048.0), (4096, 4096.0), (None, None)])
def test_parse_bytes(text: str | int | None, value: float | None) -> None:
    assert parse_bytes(text) == value


@pytest.mark.parametrize("budget, needle", [(0, "must be positive"), ("0GiB", "must be positive"),
                                            (-5, "must be positive"), ("lots", "is not a size"),
                                            ("8 parsecs", "is not a size"), ("1e", "is not a size"),
                                            ("1.2.3GB", "is not a size"), ("1e999", "must be positive and finite"),
                                            (float("nan"), "must be positive and finite")])
def test_bad_budgets_are_refused(budget: str | int, needle: str,
                                 gpt: tuple[partition.Workload, partition.Analysis]) -> None:
    w, a = gpt
    with pytest.raises(partition.PlanError, match=needle) as err:
        partition.plan(w.model, w.example_args, 2, analysis=a, memory_budget=budget)
    assert repr(budget) in str(err.value) and "8GiB" in str(err.value)


@pytest.mark.parametrize("n_stages", [0, -1, 1.5, True])
def test_stage_count_must_be_a_positive_integer(n_stages: object) -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(partition.PlanError, match="n_stages must be a positive integer") as err:
        partition.plan(model, (torch.randn(1, 2),), n_stages, cost="flops")  # type: ignore[arg-type]
    assert f"got {n_stages!r}" in str(err.value)


def test_more_stages_than_blocks_says_how_many_fit() -> None:
    w = models.mlp(depth=2, width=16)
    a = partition.Analysis(w.model, w.example_args, cost="flops")
    n = len(a.blocks.members)
    with pytest.raises(partition.PlanError, match=f"use at most {n} stages") as err:
        partition.plan(w.model, w.example_args, n + 1, analysis=a)
    assert f"{n + 1} stages" in str(err.value)
    assert partition.plan(w.model, w.example_args, n, analysis=a).n_stages == n


def test_bad_microbatches_and_schedule() -> None:
    w = models.mlp(depth=2, width=16)
    with pytest.raises(partition.PlanError, match="microbatches must be a positive integer"):
        partition.plan(w.model, w.example_args, 2, microbatches=0, cost="flops")
    with pytest.raises(partition.PlanError, match="known: 1f1b, 1f1b-overlap, zb-h1, gpipe"):
        partition.plan(w.model, w.example_args, 2, schedule="bogus", cost="flops")


def test_in_flight_rules() -> None:
    assert in_flight("1f1b", 4, 8) == [4, 3, 2, 1]
    assert in_flight("1f1b", 4, 2) == [2, 2, 2, 1]
    assert in_flight("gpipe", 3, 5) == [5, 5, 5]
    assert in_flight("zb-h1", 3, 8) == [3, 3, 3]
    assert in_flight("1f1b-overlap", 4, 8) == [5, 4, 3, 1]
    assert in_flight("1f1b-overlap", 4, 3) == [3, 3, 3, 1]
    from pipe.schedules import build, max_in_flight
    for name in ("1f1b", "1f1b-overlap", "gpipe"):  # the closed forms are what the built schedules keep
        for r in range(1, 6):
            for m in range(1, 9):
                built = build(name, r, m)
                assert in_flight(name, r, m) == [max_in_flight(built, s) for s in range(r)], (name, r, m)


def test_a_plan_for_another_model_is_refused(gpt: tuple[partition.Workload, partition.Analysis]) -> None:
    w, a = gpt
    plan = partition.plan(w.model, w.example_args, 2, analysis=a)
    other = models.mlp(depth=2, width=16)
    with pytest.raises(partition.PlanError, match="fingerprint"):
        partition.split(other.model, plan, other.example_args)
    with pytest.raises(partition.PlanError, match="fingerprint"):
        partition.split(other.model, plan)
    deeper = models.gpt(n_layer=4, d_model=64, seq_len=32, vocab=128)  # same class, other graph
    with pytest.raises(partition.PlanError, match="fingerprint"):
        partition.split(deeper.model, plan, deeper.example_args)


def test_a_plan_made_from_a_copy_of_the_trace_splits_the_trace() -> None:
    """pipe.Pipeline plans from a copy of its trace and splits the trace itself: a graph torch.export traced
    has used more names than it holds, and the copy keeps them, so the loss attached to each is named alike
    and the plan's fingerprint (node names included) is the trace's."""
    from partition.loss import attach_loss
    from partition.plan import fingerprint
    from partition.trace import graph_copy
    from tests import zoo
    w = zoo.workload("constants", "tensor")  # control flow on a value: torch.export traces it
    gm = partition.trace(w.model, w.example_args, w.example_kwargs)
    assert gm.meta["fxpipe_tracer"] == "torch.export.export"
    plan = partition.plan(w.model, w.example_args, 2, example_kwargs=w.example_kwargs, cost="flops",
                          loss_fn=w.loss_fn, example_target=w.example_target, traced=gm)
    copy = graph_copy(gm)
    assert attach_loss(copy, w.loss_fn) is None and attach_loss(gm, w.loss_fn) is None and plan.loss
    # the copy has the names the trace used (erased nodes' too): what it adds is named as in the trace
    assert [n.name for n in copy.graph.nodes] == [n.name for n in gm.graph.nodes]
    assert fingerprint(copy) == fingerprint(gm) == plan.fingerprint
    assert len(partition.split(w.model, plan, gm=gm)) == 2


def test_a_plan_file_that_is_not_json(tmp_path: Path) -> None:
    bad = tmp_path / "plan.json"
    bad.write_text("stages: 2\n")
    with pytest.raises(partition.PlanError, match="is not JSON") as err:
        partition.Plan.load(bad)
    assert "Plan.save" in str(err.value)
    bad.write_text("[1, 2]")
    with pytest.raises(partition.PlanError, match="not a plan"):
        partition.Plan.load(bad)
    with pytest.raises(partition.PlanError, match="cannot read plan file"):
        partition.Plan.load(tmp_path / "missing.json")
    bad.write_text('{"format": 1, "stages": [{"index": 0}]}')
    with pytest.raises(partition.PlanError, match="do not match this version"):
        partition.Plan.load(bad)


def test_baseline_bounds_become_plans_and_stages() -> None:
    """bench.quality's baselines: layers found by module path, each method's bounds a working plan."""
    from bench.quality import METHODS, layer_spans, quality
    w = models.mlp(depth=6, width=32)
    a = partition.Analysis(w.model, w.example_args, cost="flops")
    spans = layer_spans(a, w.layer_prefixes)
    assert len(spans) == 6 and all(lo < hi for lo, hi in spans)
    assert all(b[1] <= c[0] for b, c in zip(spans, spans[1:]))
    rows = quality(w, [2, 3], cost="flops", repeats=1)
    assert [(r["stages"], r["method"]) for r in rows] == [(S, m) for S in (2, 3) for m in METHODS]
    for r in rows:
        assert len(r["measured"]) == len(r["predicted"]) == r["stages"] and min(r["measured"]) > 0
    ours = {r["stages"]: r["predicted_bottleneck"] for r in rows if r["method"] == "fxpipe"}
    assert all(r["predicted_bottleneck"] >= ours[r["stages"]] - 1e-9 for r in rows)  # the solver is optimal
    assert torch.get_num_threads() >= 1


def test_a_slow_narrow_linear_layer_is_sliced_at_most_once_per_output_feature() -> None:
    """split_heavy_ops asks a slow linear layer for slices of about a quarter stage: here more than
    the last layer's 2 output features, which it gets at most (the planner once looked up slices that
    split_linear had not made)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    p = partition.plan(model, (torch.randn(4, 8),), 2, cost="flops")
    assert p.n_stages == 2 and all(s.nodes for s in p.stages)
