"""schedule="auto" (pipe.auto): the grid, the ranking, the refusals, the example resized per
microbatch count; and a pipeline it chose, in parity with the plain model on 2 ranks."""
from __future__ import annotations

from typing import Any

import pytest
import torch

import partition
from partition.plan import PlanError
from pipe import auto
from pipe.schedules import SCHEDULES
from tests.mp import run_ranks
from tests.test_calibration import plan_of

SMALL_GPT = {"n_layer": 4, "d_model": 64, "n_head": 4, "seq_len": 32, "vocab": 256}


def test_microbatch_counts_are_the_batch_divisors_from_the_ranks_up() -> None:
    assert auto.microbatch_counts(2, 32, 8) == [2, 4, 8, 16, 32]
    assert auto.microbatch_counts(4, 24, 8) == [4, 6, 8, 12, 24]
    assert auto.microbatch_counts(2, 128, 8, most=16) == [2, 4, 8, 16]
    assert auto.microbatch_counts(2, None, 6) == [6]  # no batch size: the count given
    with pytest.raises(auto.NoCandidate, match=r"batch_size=1: .* an integer >= 2 ranks"):
        auto.microbatch_counts(2, 1, 8)
    with pytest.raises(auto.NoCandidate, match="batch_size=37 has no divisor between 2 .* and 32"):
        auto.microbatch_counts(2, 37, 8)


def test_the_grid_holds_every_schedule_at_every_count_and_says_what_a_schedule_refuses() -> None:
    cands = auto.grid(2, [2, 4])
    assert {(c.schedule, c.microbatches) for c in cands} == {(s, m) for s in SCHEDULES for m in (2, 4)}
    by = {c.label: c for c in cands}
    assert by["dualpipev M=2 v=2"].refused.startswith("dualpipev needs at least two microbatches per rank")
    assert not by["dualpipev M=4 v=2"].refused
    assert by["interleaved-1f1b M=2 v=2"].stages_per_rank == 2 and by["1f1b M=2 v=1"].stages_per_rank == 1
    assert [c.schedule for c in auto.grid(2, [4], ["1f1b", "zbv"])] == ["1f1b", "zbv"]


def test_search_ranks_by_predicted_step_then_peak_and_keeps_why_a_candidate_was_refused() -> None:
    cands = auto.grid(2, [4], ["1f1b", "zb-h1", "gpipe", "interleaved-1f1b"])
    predicted = {"1f1b": 10.0, "zb-h1": 9.0, "gpipe": 10.0}

    def plan_fn(c: auto.Candidate) -> Any:
        if c.schedule == "interleaved-1f1b":
            raise PlanError("does not fit the budget")
        p = plan_of(c.schedule, 1)
        for s in p.stages:
            s.peak_bytes = 100.0 if c.schedule == "gpipe" else 50.0
        return p
    ranked, plans = auto.search(cands, plan_fn, lambda p: predicted[p.schedule])
    assert [c.schedule for c in ranked] == ["zb-h1", "1f1b", "gpipe", "interleaved-1f1b"]
    assert ranked[-1].refused == "does not fit the budget" and ranked[-1].label not in plans
    assert set(plans) == {"zb-h1 M=4 v=1", "1f1b M=4 v=1", "gpipe M=4 v=1"}
    text = auto.table(ranked)
    assert text.splitlines()[1].split()[:2] == ["1", "zb-h1"] and "chosen" in text.splitlines()[1]
    assert "1.11x" in text.splitlines()[2] and text.splitlines()[-1].endswith("does not fit the budget")


def test_auto_weighs_each_candidates_recompute_within_the_budget() -> None:
    """Under a budget the smaller microbatch counts cannot fit even with recomputation, the larger fit
    with it or without: each candidate is planned with and without recompute, gets the memory plan
    memory/ would give it, its cost in the prediction and its peak under the budget."""
    import memory
    from pipe.calibration import Calibration, Line
    from pipe.predict import predicted_timeline
    from pipe.schedules import in_flight_limit
    w = partition.load("gpt", **dict(SMALL_GPT, seq_len=64, microbatch_size=8))
    sizes = {n: (p.numel(), p.element_size()) for n, p in w.model.named_parameters()}
    budget = 3 * 2**20
    cal = Calibration(f=Line(1.0, 2.0), b=Line(1.0, 2.0), gap_ms=0.5, cost="flops")  # a fixed cost per action

    def plan_one(c: auto.Candidate, a_args: Any, a_kwargs: Any, a_target: Any, **reuse: Any) -> partition.Plan:
        S = 2 * c.stages_per_rank
        return partition.plan(w.model, a_args, S, example_kwargs=a_kwargs, cost="flops", schedule=c.schedule,
                              microbatches=c.microbatches, stages_per_rank=c.stages_per_rank, memory_budget=budget,
                              in_flight_counts=[in_flight_limit(c.schedule, S, c.microbatches, s, c.stages_per_rank)
                                                for s in range(S)], recompute=c.recompute, loss_fn=w.loss_fn,
                              example_target=a_target, **reuse)

    def memory_fn(c: auto.Candidate, p: partition.Plan, a: Any) -> partition.Plan:
        try:
            return auto.memory_plan(p, a, 2, recompute=c.recompute, offload="none", budget=budget, param_sizes=sizes)
        except memory.BudgetError as e:
            raise PlanError(str(e)) from None

    cands = auto.grid(2, [4, 16, 32], ["1f1b", "gpipe"], ("none", "auto"))
    assert len(cands) == 12 and cands[1].label == "1f1b M=4 v=1 recompute=auto"
    ranked, plans = auto.choose(cands, 2, (w.example_args, {}, w.example_target), 32, plan_one, cal, memory_fn)
    fits = {c.label: c for c in ranked if not c.refused}
    assert not any(c.microbatches == 4 for c in fits.values()), auto.table(ranked)  # not even with recompute
    assert {"1f1b M=16 v=1 recompute=auto", "1f1b M=32 v=1 recompute=none"} <= set(fits), auto.table(ranked)
    assert "1f1b M=16 v=1 recompute=none" not in fits  # 16 microbatches fit only with recomputation
    assert all(c.peak_bytes <= budget for c in fits.values())
    chosen = plans[ranked[0].label]
    assert ranked[0].label == "1f1b M=16 v=1 recompute=auto", auto.table(ranked)  # the fixed cost per action
    assert any(s.memory.startswith(("ckpt", "remat", "full")) and s.memory_ms > 0 for s in chosen.stages)
    for s in chosen.stages:  # the nodes run again: none where nothing is recomputed, at most the stage's
        assert (s.memory_nodes > 0) == s.memory.startswith(("ckpt", "remat", "full")) and s.memory_nodes <= len(
            s.nodes), (s.memory, s.memory_nodes)
    bare = partition.Plan.from_dict(chosen.to_dict())  # its prediction counts the recompute: without, faster
    for s in bare.stages:
        s.memory_ms, s.memory_nodes = 0.0, 0
    assert predicted_timeline(bare, 2, calibration=cal).makespan < ranked[0].step_ms == pytest.approx(
        predicted_timeline(chosen, 2, calibration=cal).makespan)
    text = auto.table(ranked)
    assert "memory" in text.splitlines()[0] and ranked[0].memory in text.splitlines()[1]
    for c in fits.values():  # a recompute='auto' plan that recomputes nothing on its twin's cuts is left out
        twin = plans.get(c.label.replace("recompute=auto", "recompute=none"))
        if c.recompute == "auto" and twin is not None:
            assert set(c.memory.split("|")) != {"none"} or [s.nodes for s in plans[c.label].stages] != [s.nodes for s in
                                                                                           twin.stages], c.label


def test_search_with_no_candidate_says_why_each_was_refused() -> None:
    def refuse(c: auto.Candidate) -> Any:
        raise PlanError(f"{c.schedule} needs 9 GB")
    with pytest.raises(auto.NoCandidate, match=r"(?s)found no candidate that can run.*1f1b needs 9 GB.*fix: a larger"):
        auto.search(auto.grid(2, [4], ["1f1b", "gpipe"]), refuse, lambda p: 1.0)


def test_resize_batch_resizes_the_batch_dimension_only() -> None:
    ids = torch.arange(8).reshape(2, 4)
    mask = torch.ones(2, 4)
    scale = torch.tensor(3.0)
    other = torch.zeros(5, 2)
    args, kwargs, target = auto.resize_batch(((ids, other), {"mask": mask, "n": 7, "s": scale}, ids + 1), 5)
    assert args[0].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]] * 2 + [[0, 1, 2, 3]]
    assert args[1] is other and kwargs["s"] is scale and kwargs["n"] == 7
    assert kwargs["mask"].shape == (5, 4) and target.shape == (5, 4)
    assert auto.resize_batch(((ids,), {}, None), 1)[0][0].tolist() == [[0, 1, 2, 3]]


def test_auto_refuses_what_it_would_override_and_its_options_without_it() -> None:
    from pipe.runtime import Pipeline, PipelineError
    w = partition.load("gpt", **SMALL_GPT)
    with pytest.raises(PipelineError, match="schedule='auto' chooses the schedule and plans for it, but plan="):
        Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, schedule="auto", plan=plan_of("1f1b", 1))
    with pytest.raises(PipelineError, match="batch_size=32 is for schedule='auto'"):
        Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, schedule="1f1b", batch_size=32)
    with pytest.raises(PipelineError, match="auto_schedules= lists the schedules schedule='auto' weighs"):
        Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, schedule="1f1b", auto_schedules=["1f1b"])
    with pytest.raises(PipelineError, match="stages_per_rank=2 fixes it"):
        Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, schedule="auto", stages_per_rank=2)


def auto_body(rank: int, world: int) -> dict[str, Any]:
    """schedule='auto' over four schedules at batch 16 (M in 2, 4, 8, 16), costed by FLOPs with a
    calibration; the pipeline it chose trains in parity with the plain model."""
    import pipe
    from pipe.calibration import Calibration, Line
    from tests.parity import check_step
    pipe.init()
    w = partition.load("gpt", **SMALL_GPT)
    ref = partition.load("gpt", **SMALL_GPT)
    batch = 16
    cal = Calibration(f=Line(1.0, 2.0), b=Line(1.0, 2.0), gap_ms=0.5, cost="flops")  # a fixed cost per action
    pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, example_target=w.example_target,
                       schedule="auto", batch_size=batch, cost="flops", calibration=cal,
                       auto_schedules=["1f1b", "gpipe", "zb-h1", "interleaved-1f1b"])
    best, ranked = pp.candidates[0], pp.candidates
    assert (pp.schedule_name, pp.M, pp.v, pp.S) == (best.schedule, best.microbatches, best.stages_per_rank,
                                                    world * best.stages_per_rank)
    assert (pp.plan.schedule, pp.plan.microbatches) == (best.schedule, best.microbatches)
    assert pp.plan.inputs[0] is not None and pp.plan.inputs[0].shape[0] == batch // pp.M  # the resized example
    assert any(n.startswith(f"schedule='auto' chose {best.label} of 16 candidates") for n in pp.plan.notes)
    assert len(pp.candidate_plans) == sum(not c.refused for c in pp.candidates)
    opt = torch.optim.Adam(list(pp.parameters()), lr=1e-3, eps=1e-6)
    ref_opt = torch.optim.Adam(ref.model.parameters(), lr=1e-3, eps=1e-6)
    for step in range(2):
        args, kwargs, target = w.batch(batch, step)
        loss = pp.step(*args, target=target, **kwargs)
        check_step(pp, loss, ref, args, kwargs, target, pp.M, opt, ref_opt, f"rank {rank}")
    # within a budget (the natural call: no example_target), recompute weighed: the chosen pipeline recomputes
    # as auto planned it, in parity
    gpt = dict(SMALL_GPT, seq_len=64, microbatch_size=8)
    w, ref = partition.load("gpt", **gpt), partition.load("gpt", **gpt)
    pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, schedule="auto", batch_size=32, cost="flops",
                       calibration=cal, memory_budget=3 * 2**20, auto_schedules=["1f1b"])
    tight = pp.candidates[0]
    assert tight.label == "1f1b M=16 v=1 recompute=auto" and pp.recompute == "auto", auto.table(pp.candidates)
    assert "|".join(s.memory for s in pp.plan.stages) == tight.memory, (pp.plan.table(), tight.memory)
    opt = torch.optim.Adam(list(pp.parameters()), lr=1e-3, eps=1e-6)
    ref_opt = torch.optim.Adam(ref.model.parameters(), lr=1e-3, eps=1e-6)
    args, kwargs, target = w.batch(32, 0)
    loss = pp.step(*args, target=target, **kwargs)
    check_step(pp, loss, ref, args, kwargs, target, pp.M, opt, ref_opt, f"tight rank {rank}")
    return {"chosen": best.label, "ranked": [(c.label, c.step_ms, c.refused) for c in ranked]}


def test_auto_chooses_plans_and_trains_in_parity_on_two_ranks() -> None:
    results = run_ranks("tests.test_auto:auto_body", 2, timeout=240)
    assert results[0] == results[1], "every rank must agree on the choice"
    ranked = results[0]["ranked"]
    assert len(ranked) == 16 and results[0]["chosen"] == ranked[0][0]
    times = [t for _, t, why in ranked if not why]
    assert times == sorted(times) and len(times) == 16  # at batch 16 on 2 ranks every candidate can run
    # a fixed 2 ms per action and FLOP costs: 16 microbatches of one sample each predict slowest per schedule
    by = {label: t for label, t, _ in ranked}
    assert by["1f1b M=16 v=1"] > by["1f1b M=4 v=1"]


def test_microbatches_is_a_whole_number_unless_auto_chooses_it() -> None:
    """Found by review: microbatches='auto' ended in a TypeError from the schedule's check ('<' between str and
    int), naming neither the argument nor the fix."""
    from pipe import options
    from pipe.errors import PipelineError
    base = dict(loss_fn=lambda o, t: o, plan=None, stages_per_rank=None, cost="flops", memory_budget=None,
                recompute=None, offload="none", optimizer=None, compile=False, dynamic_shapes=False, calibration=None,
                auto_schedules=None, dp_shard="none", dp_bucket_mb=None)
    for schedule, batch, m in (("1f1b", None, "auto"), ("auto", None, "auto"), ("1f1b", None, 0),
                               ("1f1b", None, 2.0), ("1f1b", None, True)):
        with pytest.raises(PipelineError, match=f"microbatches= must be a whole number >= 1, got {m!r}; to have it "
                                                "chosen, pass schedule='auto' with batch_size="):
            options.check(schedule=schedule, batch_size=batch, microbatches=m, **base)
    assert options.check(schedule="auto", batch_size=16, microbatches="auto", **base).stages_per_rank == 1
    assert options.check(schedule="1f1b", batch_size=None, microbatches=4, **base).stages_per_rank == 1
