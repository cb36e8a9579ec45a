"""The partitioner's memory check and memory/'s planner are one model: the partitioner refuses a split
only when no policy memory/ may use fits it (pure: no processes)."""
from __future__ import annotations

import dataclasses
import random

import pytest

import memory
import partition
from memory.budget import _least
from memory.buffers import comm_peaks
from memory.build import stage_infos
from partition.costs import node_costs
from partition.planner import Analysis, memory_check, plan_from_bounds
from partition.solve import CostModel, InfeasibleBudget, stage_bytes
from pipe.lower import lower
from pipe.schedules import build, in_flight_limit

S, M = 2, 4
COMBOS = [("none", "states"), ("full", "none"), ("selective", "none"), ("auto", "none"), ("none", "activations"),
          ("auto", "all")]
MODELS = [("gpt", {"n_layer": 4, "d_model": 64, "n_head": 4, "seq_len": 64, "vocab": 256, "microbatch_size": 8}),
          ("unet", {})]


@pytest.mark.parametrize("spec,kw", MODELS, ids=[m for m, _ in MODELS])
def test_the_partitioner_never_refuses_a_split_memory_can_fit(spec: str, kw: dict) -> None:
    w = partition.load(spec, **kw)
    a = Analysis(w.model, w.example_args, cost="flops", loss_fn=w.loss_fn, example_target=w.example_target)
    found = node_costs(a.gm, a.flat, cost="flops")
    costs = {n: memory.NodeCost(c.fwd_ms, c.out_bytes, c.saved_bytes, tuple(c.params), tuple(c.saved.items()),
                                c.storage)
             for n, c in found.items()}
    sizes = {n: (p.numel(), p.element_size()) for n, p in w.model.named_parameters()}
    flights = tuple(in_flight_limit("1f1b", S, M, s) for s in range(S))
    cm = CostModel(state_factor=4.0, in_flight=flights)
    place = [0, 1]
    programs = lower(build("1f1b", S, M), S, M, place)
    best = {c: float("inf") for c in COMBOS}  # the least budget memory/ meets, over every split
    splits = [(0, b, a.chain.n) for b in range(1, a.chain.n)]
    for bounds in splits:
        plan = plan_from_bounds(a, bounds, cm, schedule="1f1b", microbatches=M, stages_per_rank=1,
                                memory_budget=None)
        stages = [dataclasses.asdict(st) for st in plan.stages]
        recv, send = [st["recv_bytes"] for st in stages], [st["send_bytes"] for st in stages]
        infos = stage_infos(stages=stages, costs=costs, gm=a.gm, param_sizes=sizes, microbatches=M,
                               comm=comm_peaks(programs, place, recv, send, False))
        for recompute, offload in COMBOS:
            checked = stage_bytes(a.chain, bounds, memory_check(cm, recompute, offload))
            floors = [_least(st, recompute, offload, 2.0).predicted_peak for st in infos]
            for s, (c, f) in enumerate(zip(checked, floors)):
                assert c <= f, (spec, bounds, recompute, offload, s, c, f)
            best[(recompute, offload)] = min(best[(recompute, offload)], max(floors))
    rng = random.Random(0)
    refused = 0
    for recompute, offload in COMBOS:  # random budgets around what memory/ meets: refused only below it
        for _ in range(4):
            budget = best[(recompute, offload)] * rng.uniform(0.3, 1.3)
            try:
                partition.plan(w.model, w.example_args, S, cost="flops", microbatches=M, memory_budget=budget,
                               recompute=recompute, offload=offload, analysis=a, in_flight_counts=flights)
            except InfeasibleBudget:
                refused += 1
                assert budget < best[(recompute, offload)], (spec, recompute, offload, budget)
    assert refused > 0  # some budgets were too small for the partitioner too


# ----- memory.timeline: what a stage holds at each point of its rank's program -----
def test_timeline_points_follow_the_program_of_1f1b() -> None:
    from memory.timeline import Point, peak_of, room_per_mb, stage_points
    from pipe.lower import lower
    from pipe.schedules import build
    programs = lower(build("1f1b", 2, 4), 2, 4)
    recv, send = [0, 100], [100, 0]
    pts = stage_points(programs, [0, 1], recv, send, zero_bubble=False)
    # stage 0 keeps 2 microbatches (1F1B's warm-up on 2 stages), stage 1 one; an offloaded microbatch
    # comes back one at a time (its RELOAD follows the action before its backward)
    assert max(p.kept for p in pts[0]) == 2 and max(p.kept for p in pts[1]) == 1
    assert max(p.bundles for p in pts[0]) == 1 and max(p.bundles for p in pts[1]) == 1
    # stage 0's outputs wait for their grads: 2 microbatches' worth, plus one grad received for B
    assert max(p.comm for p in pts[0]) == 300
    assert Point(2, 0, 0, 200, 0, 1, 0) in pts[0]  # after F1: two microbatches kept, both outputs held, no grads yet
    # B0 of stage 0 runs with both microbatches kept, mb 0's offloaded copy back, the outputs of both
    # and mb 0's grad held: its peak; stage 1 holds one microbatch at a time
    assert peak_of(pts[0], 1000, 500, 50) == (2 * 1000 + 500 + 50 + 300, 2 * 1000 + 500 + 50, 300, 0)
    assert peak_of(pts[0], 1000, 500, 50, grads=10)[0] == 2 * 1000 + 500 + 50 + 300 + 10  # B0 makes grads
    assert peak_of(pts[0], 1000, 0, 0, grads=5000)[0] == 2 * 1000 + 5000 + 300  # F2: two kept, B0's grads
    assert peak_of(pts[1], 1000, 0, 0)[1] == 1000
    # the most a microbatch may keep to fit a room is what peak_of then reaches
    room = room_per_mb(pts[0], 5000, 0, 50)
    assert peak_of(pts[0], room, 0, 50)[0] == pytest.approx(5000)
    assert room_per_mb(pts[0], 10, 0, 50) < 0  # the buffers alone do not fit: no microbatch can
    # without a program: one point, the backward running (its whole working set, not what its end holds)
    from memory.timeline import default_points
    assert peak_of(default_points(2, 10), 1000, 0, 100, work_end=5)[0] == 2 * 1000 + 100 + 10



def test_a_recomputing_stage_under_zero_bubble_is_walked_with_its_backward_fused() -> None:
    """Under zb-h1 a stage keeps its microbatches until their W; one that recomputes runs BW instead
    (memory.fused_backward) and frees them there, keeping S - s as under 1F1B. memory.timeline walks the
    fused program as pipe.lower.fuse_backward makes it, and memory.budget predicts a recomputing plan on
    those points (a plain one on the program's own)."""
    from memory.budget import StageInfo, _candidates
    from memory.timeline import stage_points
    from pipe.lower import fuse_backward, lower
    from pipe.schedules import build
    S, M = 4, 8
    programs = lower(build("zb-h1", S, M), S, M)
    place, recv, send = list(range(S)), [0] + [100] * (S - 1), [100] * (S - 1) + [0]
    plain = stage_points(programs, place, recv, send, True)
    for s in range(S):
        fused = stage_points(programs, place, recv, send, True, fused=(s,))[s]
        assert set(fused) == set(stage_points(fuse_backward(programs, [s]), place, recv, send, True)[s])
        assert max(p.kept for p in plain[s]) == S and max(p.kept for p in fused) == S - s
    last = S - 1
    fused = stage_points(programs, place, recv, send, True, fused=(last,))[last]
    st = StageInfo(index=last, nodes=(), act_bytes=10_000, loss_bytes=1_000, in_flight=S, param_bytes=0,
                   comm_bytes=0, points=plain[last])
    # a whole-stage checkpoint keeps the loss's saves of its one microbatch and recomputes the rest in BW;
    # a plain stage keeps all it saves for S microbatches
    for recompute, acts in (("full", 1_000 + 10_000), ("none", S * 11_000)):
        walked = _candidates(StageInfo(**{**vars(st), "fused_points": fused}), recompute, "none", None, 2.0)[0]
        assert walked.recomputes == (recompute == "full")
        assert walked.parts["activations"] == pytest.approx(acts)
        unfused = _candidates(st, recompute, "none", None, 2.0)[0]
        assert (walked.predicted_peak < unfused.predicted_peak) == (recompute == "full")

def test_a_zero_bubble_stage_that_fits_once_its_backward_is_fused_recomputes_one_node() -> None:
    """zb-h1's last stage holds its microbatches until their W; recomputing anything fuses its backward
    (BW frees them), which is all this budget needs of it: its cheapest node that frees memory, not the
    larger set or the whole-stage checkpoint the unfused walk asked for."""
    import pipe.auto as auto
    from pipe.schedules import in_flight_limit
    from tests.test_memory_parity import GPT
    w = partition.load("gpt", **GPT)
    S, M = 2, 4
    a: list = []
    plan = partition.plan(w.model, w.example_args, S, cost="flops", schedule="zb-h1", microbatches=M,
                          in_flight_counts=[in_flight_limit("zb-h1", S, M, s, 1) for s in range(S)],
                          loss_fn=w.loss_fn, analysis_out=a)
    sizes = {k: (p.numel(), p.element_size()) for k, p in w.model.named_parameters()}
    plain = [st.memory_peak for st in auto.memory_plan(plan, a[0], S, recompute="none", offload="none", budget=None,
                                                       param_sizes=sizes).stages]
    budget = 0.8 * max(plain)
    got = auto.memory_plan(plan, a[0], S, recompute="auto", offload="none", budget=budget, param_sizes=sizes).stages
    assert got[-1].memory == "remat 1" and got[-1].memory_nodes == 1, [st.memory for st in got]
    assert got[-1].memory_peak <= budget < plain[-1]
    assert got[-1].w_ms == 0.0  # it runs BW: no W of its own
    # compiled stages run BW everywhere: the peaks of 1F1B's program (found by review: W's hold was counted)
    compiled = [st.memory_peak for st in auto.memory_plan(plan, a[0], S, recompute="none", offload="none", budget=None,
                                                          param_sizes=sizes, compiled=True).stages]
    one_f_one_b = [st.memory_peak for st in auto.memory_plan(
        partition.Plan.from_dict({**plan.to_dict(), "schedule": "1f1b"}), a[0], S, recompute="none", offload="none",
        budget=None, param_sizes=sizes).stages]
    assert compiled == one_f_one_b and compiled[-1] < plain[-1], (compiled, one_f_one_b, plain)
