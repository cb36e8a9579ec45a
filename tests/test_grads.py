"""pipe.grads and Pipeline.clip_grad_norm_: the whole model's grad norm across ranks and clipping by it,
against torch.nn.utils.clip_grad_norm_ over the unpartitioned model. Pure cases without processes; one
2-rank launch (tied weights, a head cut into vocabulary slices on both ranks, V placement, streamed
states, the norm orders, bad calls). The 4-rank data-parallel cases are in test_data_parallel."""
import math
from typing import Any

import pytest
import torch

from pipe import grads
from tests.mp import run_ranks

GPT = dict(n_layer=2, d_model=32, n_head=2, seq_len=16, vocab=64)
WIDE = dict(n_layer=2, d_model=32, n_head=2, seq_len=16, vocab=2000)
M = 4


def _grads(seed: int, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g) for s in shapes]


@pytest.mark.parametrize("p", [1.0, 2.0, 3.0, math.inf])
def test_parts_of_ranks_combine_into_the_norm_of_all_grads(p: float) -> None:
    every = _grads(0, [(3, 4), (5,), (2, 2, 2), (7, 1), (1,)])
    ranks = [every[:2], every[2:4], [], every[4:]]
    part = grads.combine([grads.local_part(gs, p) for gs in ranks], p)
    total = part if math.isinf(p) else part ** (1 / p)
    torch.testing.assert_close(torch.tensor(total, dtype=torch.float32), torch.nn.utils.get_total_norm(every, p))
    assert grads.local_part([], p) == 0.0
    ranks[3] = [torch.tensor([math.nan])]  # a NaN on a later rank: the norm is NaN, as torch's (max() kept 4.1)
    assert math.isnan(grads.combine([grads.local_part(gs, p) for gs in ranks], p))


def _params(seed: int, scale: float = 1.0) -> list[torch.nn.Parameter]:
    ps = [torch.nn.Parameter(torch.zeros(s)) for s in [(3, 4), (5,), (6,)]]
    for p, g in zip(ps, _grads(seed, [(3, 4), (5,), (6,)])):
        p.grad = g * scale
    return ps


@pytest.mark.parametrize("max_norm,p", [(1.0, 2.0), (0.5, 1.0), (0.1, math.inf), (100.0, 2.0), (math.inf, 2.0)])
def test_one_process_clips_as_torch_does(max_norm: float, p: float) -> None:
    ours, theirs = _params(1), _params(1)
    norm = grads.clip_grad_norm_(ours, ours, max_norm, p, reductions=[], rank=0, device=torch.device("cpu"))
    ref = torch.nn.utils.clip_grad_norm_(theirs, max_norm, p)
    torch.testing.assert_close(norm, ref)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad)
    clipped = max_norm < float(ref)
    assert clipped == (max_norm in (1.0, 0.5, 0.1)), (max_norm, float(ref))  # the cases do what they say
    if not clipped:  # left exactly as they were
        assert all(torch.equal(a.grad, b) for a, b in zip(ours, _grads(1, [(3, 4), (5,), (6,)])))


def test_only_counted_grads_add_up_and_every_grad_is_scaled() -> None:
    """A weight held by another rank too (counted there) is scaled here but not counted."""
    ps = _params(2)
    norm = grads.clip_grad_norm_(ps, ps[:2], 0.5, 2.0, reductions=[], rank=0, device=torch.device("cpu"))
    want = torch.nn.utils.get_total_norm([p.grad for p in _params(2)[:2]], 2.0)
    torch.testing.assert_close(norm, want)
    for p, g in zip(ps, _params(2)):
        torch.testing.assert_close(p.grad, g.grad * (0.5 / (float(want) + 1e-6)))


def test_bad_arguments_and_non_finite_grads() -> None:
    cpu = torch.device("cpu")
    for max_norm, p in [(-1.0, 2.0), (math.nan, 2.0), (1.0, 0.0), (1.0, -2.0)]:
        with pytest.raises(ValueError, match="max_norm >= 0 .* norm order > 0") as e:
            grads.clip_grad_norm_(_params(0), _params(0), max_norm, p, reductions=[], rank=0, device=cpu)
        assert f"max_norm={max_norm}, norm_type={p}" in str(e.value)
    ps = _params(3)
    ps[1].grad[2] = math.nan
    with pytest.raises(grads.NonFiniteGrads, match=r"is nan.*not finite on rank 0; on this rank \(rank 0\): b"):
        grads.clip_grad_norm_(ps, ps, 1.0, 2.0, reductions=[], rank=0, device=cpu, error_if_nonfinite=True,
                              names={id(p): n for p, n in zip(ps, "abc")})
    theirs = _params(3)
    theirs[1].grad[2] = math.nan
    norm = grads.clip_grad_norm_(ps, ps, 1.0, 2.0, reductions=[], rank=0, device=cpu)  # as torch: nan grads
    ref = torch.nn.utils.clip_grad_norm_(theirs, 1.0, 2.0)
    assert math.isnan(float(norm)) and math.isnan(float(ref))
    assert all(bool(p.grad.isnan().all()) == bool(q.grad.isnan().all()) for p, q in zip(ps, theirs))


# ----- 2 ranks -----

CASES = {  # name: (workload, its arguments, Pipeline's, the loss in the graph)
    "tied 1f1b": ("gpt", GPT, {}, False),
    "tied zbv": ("gpt", GPT, dict(schedule="zbv"), False),           # the tied weight twice on rank 0
    "tied interleaved": ("gpt", GPT, dict(schedule="interleaved-1f1b", stages_per_rank=2), False),
    "streamed states": ("gpt", GPT, dict(offload="states"), False),   # grads are host views between steps
    "vocabulary slices": ("gpt_wide_vocab", WIDE, {}, True),          # the head's weight on both ranks
}
ORDERS = [(0.05, 2.0), (0.02, 1.0), (0.001, math.inf), (math.inf, 2.0)]  # (max_norm, p): all but the last clip


def _case(spec: str, model_args: dict[str, Any], pipe_kw: dict[str, Any], fused: bool) -> dict[str, Any]:
    """Two steps per norm order: the norm and the clipped grads against the plain model's, then SGD."""
    import partition
    import pipe
    w, ref = partition.load(spec, **model_args), partition.load(spec, **model_args)
    pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=M, cost="flops",
                       example_target=w.example_target if fused else None, **pipe_kw)
    opt = torch.optim.SGD(list(pp.parameters()), lr=0.1)
    ref_opt = torch.optim.SGD(ref.model.parameters(), lr=0.1)
    refs = dict(ref.model.named_parameters())
    out: dict[str, Any] = {"norms": [], "rewrites": [list(r) for r in pp.plan.rewrites],
                           "holders": sorted({pp.place[s.index] for s in pp.plan.stages for n in s.params
                                              if n in ("head.weight", "tok_emb.weight")})}
    for step, (max_norm, p) in enumerate(ORDERS):
        args, kwargs, target = w.batch(w.microbatch_size * M, step)
        pp.step(*args, target=target, **kwargs)
        ref.loss_fn(ref.model(*args, **kwargs), target).backward()
        norm = pp.clip_grad_norm_(max_norm, p)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.model.parameters(), max_norm, p)
        out["norms"].append((float(norm), float(ref_norm), max_norm))
        for n, q in pp.named_parameters():
            torch.testing.assert_close(q.grad, refs[n].grad, rtol=1e-4, atol=1e-7, msg=lambda m: f"{n} {p}: {m}")
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    for n, q in pp.named_parameters():
        torch.testing.assert_close(q.detach(), refs[n].detach(), rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")
    return out


def _refusals(rank: int) -> dict[str, str]:
    """Different max_norm on the two ranks, and a non-finite grad on rank 1: refused on both ranks."""
    import partition
    import pipe
    w = partition.load("gpt", **GPT)
    pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=M, cost="flops")
    args, kwargs, target = w.batch(w.microbatch_size * M, 0)
    out = {}
    pp.step(*args, target=target, **kwargs)
    try:
        pp.clip_grad_norm_(1.0 if rank == 0 else 2.0)
        out["different"] = "no error"
    except pipe.PipelineError as e:
        out["different"] = str(e)
    if rank == 1:
        next(iter(pp.parameters())).grad[0] = math.inf
    try:
        pp.clip_grad_norm_(1.0, error_if_nonfinite=True)
        out["non-finite"] = "no error"
    except grads.NonFiniteGrads as e:
        out["non-finite"] = str(e)
    return out


def two_body(rank: int, world: int) -> dict[str, Any]:
    import pipe
    pipe.init()
    res: dict[str, Any] = {name: _case(*case) for name, case in CASES.items()}
    res["refused"] = _refusals(rank)
    return res


def test_clip_grad_norm_on_2_ranks_is_the_whole_models() -> None:
    res = run_ranks("tests.test_grads:two_body", 2, timeout=240)
    for name in CASES:
        norms = [r[name]["norms"] for r in res]
        assert norms[0] == norms[1], (name, norms)  # the same total on every rank
        for ours, ref, max_norm in norms[0]:
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=0, msg=lambda m: f"{name}: {m}")
            assert (ref > max_norm) == math.isfinite(max_norm), (name, ref, max_norm)  # clipped, but for inf
    assert res[0]["tied 1f1b"]["holders"] == [0, 1]  # the tied embedding/head on both ranks: counted once
    assert any(r[-1:] == ["vocab"] for r in res[0]["vocabulary slices"]["rewrites"]), res[0]["vocabulary slices"]
    assert res[0]["vocabulary slices"]["holders"] == [0, 1]
    for r in res:
        assert "different arguments" in r["refused"]["different"], r["refused"]
        for said in ("max_norm=1.0, norm_type=2.0 on rank 0", "max_norm=2.0, norm_type=2.0 on rank 1"):
            assert said in r["refused"]["different"], r["refused"]
        assert "is inf" in r["refused"]["non-finite"] and "not finite on rank 1" in r["refused"]["non-finite"], r
    assert "on this rank (rank 1): " in res[1]["refused"]["non-finite"]
