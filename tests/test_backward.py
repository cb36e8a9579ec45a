"""pipe.backward without processes: the zero-bubble B and W passes give the full backward's grads."""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn

import partition
from partition.split import stage_io
from pipe import backward as pb
from pipe.backward import Saved, backward_input, backward_weight, with_param_outputs

SMALL = {"n_layer": 2, "d_model": 32, "n_head": 2, "seq_len": 16, "vocab": 64}


def _grads(stage: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in stage.named_parameters() if p.grad is not None}
    stage.zero_grad(set_to_none=True)
    return out


def _split(zb: torch.nn.Module, extra: Any, in_b: Any, xs: list[torch.Tensor], direct: bool,
           loss: Any = lambda out: out[0].float().pow(2).mean()) -> list[Saved]:
    """B then W over the microbatches `xs` (the second accumulates); the Saved of each after B."""
    after_b = []
    for x in xs:
        outs, param_outs, *ins = zb(x)
        assert bool(ins) == direct
        saved = Saved(roots=[loss(outs)], leaves=[], param_outs=list(param_outs), param_ins=list(ins[0]) if ins else [],
                      param_versions=list(ins[1]) if ins else [])
        backward_input(saved, [None], in_b, extra)
        after_b.append(Saved(roots=list(saved.roots), leaves=[], param_outs=list(saved.param_outs),
                             param_grads=list(saved.param_grads)))
        backward_weight(saved, extra)
    return after_b


def test_b_then_w_equals_the_full_backward() -> None:
    """B then W, with W differentiating every parameter node (by calling each one's autograd node, or
    an autograd call where that node does not read the parameters) or (direct) the nn.Linear nodes
    alone, by matrix products from the inputs the forward kept, both equal one full backward over two
    microbatches (the second accumulates); direct B computes every other parameter's grads and frees
    the graph; a linear whose weight is frozen is no W node and keeps no input."""
    w = partition.load("gpt", **SMALL)
    plan = partition.plan(w.model, w.example_args, 1, cost="flops")
    stage = partition.split(w.model, plan)[0]
    io = stage_io(stage)
    xs = [w.batch(w.microbatch_size, k)[0][0] for k in range(2)]
    for x in xs:
        stage(x)[0].float().pow(2).mean().backward()  # a stage returns a tuple of its outputs
    want = _grads(stage)
    for direct in (False, True):
        zb, extra, in_b = with_param_outputs(stage, io.param_nodes, direct=direct)
        names = [n for n, _ in extra]
        linear = [n for n in names if "attn" in n or "mlp" in n]
        assert len(linear) == 4 * SMALL["n_layer"], names  # qkv, proj, fc, proj (the head is tied: B's)
        if direct:  # W: the linear nodes alone; B: the norms' and the embeddings' grads, and the tied weight's
            assert names == linear
            assert {id(p) for p in in_b} == {id(p) for n, p in stage.named_parameters()
                                             if "attn" not in n and "mlp" not in n}
        else:
            assert set(linear) < set(names) and any("ln" in n for n in names)
        calls = []
        real = torch.autograd.grad

        def counted(*a: Any, **k: Any) -> Any:
            calls.append(a)
            return real(*a, **k)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch.autograd, "grad", counted)
            after_b = _split(zb, extra, in_b, xs, direct)
        # one autograd call per B; W's: none when direct, else one per linear node (whose autograd node
        # reads its weight through a transpose), the norms' and embeddings' calling their own nodes
        assert len(calls) == len(xs) * (1 if direct else 1 + len(linear)), (direct, len(calls))
        for saved in after_b:
            kept = [t for got in saved.param_grads for t, _ in got]
            assert all(t is None for t in kept) if direct else all(t is not None for t in kept)
            assert (saved.roots == []) == direct  # direct: B freed the graph (the outputs dropped)
        assert not any(p.grad.requires_grad for p in stage.parameters() if p.grad is not None)
        got = _grads(stage)
        assert set(got) == set(want)
        for n in want:
            torch.testing.assert_close(got[n], want[n], msg=f"direct={direct} {n}")
    stage.get_submodule("blocks.0.attn.qkv").weight.requires_grad_(False)
    zb, extra, in_b = with_param_outputs(stage, io.param_nodes, direct=True)
    assert [n for n, _ in extra if n.startswith("blocks_0_attn_")] == ["blocks_0_attn_proj"]
    assert len(zb(xs[0])[2]) == len(extra)  # an input per W node
    assert id(stage.get_submodule("blocks.0.attn.qkv").bias) in {id(p) for p in in_b}  # its bias trains, in B


class _Shared(nn.Module):
    """Two linear layers sharing one weight, the second with a bias of its own; a norm between."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6, bias=False)
        self.b = nn.Linear(6, 6)
        self.b.weight = self.a.weight
        self.norm = nn.LayerNorm(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.norm(self.a(x)))


@pytest.mark.parametrize("direct", [False, True])
def test_a_node_reading_a_shared_and_an_own_parameter(direct: bool) -> None:
    """A node that reads a parameter other nodes read too (the tied weight) and one of its own (b's
    bias): B computes both whole, none is lost."""
    torch.manual_seed(0)
    gm = torch.fx.symbolic_trace(_Shared())
    param_nodes = {n.name: [str(n.target) + ".weight"] + ([str(n.target) + ".bias"] if n.target != "a" else [])
                   for n in gm.graph.nodes if n.op == "call_module"}
    x = torch.randn(5, 6)
    gm(x).pow(2).sum().backward()
    want = _grads(gm)
    zb, extra, in_b = with_param_outputs(gm, param_nodes, direct=direct)
    assert [n for n, _ in extra] == ["norm"] * (not direct)  # a and b share their weight; the norm is no linear
    assert {id(p) for p in in_b} == {id(gm.a.weight), id(gm.b.bias)} | (
        {id(gm.norm.weight), id(gm.norm.bias)} if direct else set())
    _split(zb, extra, in_b, [x], direct, loss=lambda out: out.pow(2).sum())
    got = _grads(gm)
    assert set(got) == set(want) == {"a.weight", "b.bias", "norm.weight", "norm.bias"}
    for n in want:
        torch.testing.assert_close(got[n], want[n], msg=n)


def test_under_autocast_b_keeps_the_graph_for_w() -> None:
    """Under autocast a linear's output is bfloat16 while its input and weight are float32: W cannot
    take the matrix products, so B keeps the graph and W takes an autograd call; the grads match one
    full backward under the same autocast."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    gm = torch.fx.symbolic_trace(model)
    param_nodes = {n.name: [f"{n.target}.weight", f"{n.target}.bias"] for n in gm.graph.nodes
                   if n.op == "call_module" and n.target != "1"}
    x = torch.randn(3, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        gm(x).float().pow(2).sum().backward()
    want = _grads(gm)
    zb, extra, in_b = with_param_outputs(gm, param_nodes, direct=True)
    assert len(extra) == 2 and in_b == []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs, param_outs, ins, versions = zb(x)
    saved = Saved(roots=[outs.float().pow(2).sum()], leaves=[], param_outs=list(param_outs), param_ins=list(ins),
                  param_versions=list(versions))
    backward_input(saved, [None], in_b, extra)
    assert saved.roots and all(t is not None for got in saved.param_grads for t, _ in got)  # the graph kept
    backward_weight(saved, extra)
    got = _grads(gm)
    assert set(got) == set(want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], msg=n)


@pytest.mark.parametrize("make", [
    lambda: (nn.LayerNorm(8), torch.randn(3, 8)),
    lambda: (nn.RMSNorm(8), torch.randn(3, 8)),  # its scale's node is a broadcasting multiply
    lambda: (nn.Embedding(10, 8), torch.tensor([1, 2, 2])),
    lambda: (nn.Conv2d(2, 3, 3), torch.randn(1, 2, 5, 5)),
    lambda: (nn.BatchNorm1d(8), torch.randn(4, 8)),
    lambda: (nn.GroupNorm(2, 4), torch.randn(2, 4, 3)),  # its node makes three outputs
], ids=["layernorm", "rmsnorm", "embedding", "conv", "batchnorm", "groupnorm"])
def test_a_nodes_own_backward_gives_its_weight_grads(make: Any) -> None:
    """W calls the autograd node that made a module's output: the weight grads equal autograd's, the
    node's input grad is dropped, a grad already held is added to."""
    torch.manual_seed(0)
    m, x = make()
    if x.is_floating_point():
        x.requires_grad_(True)
    y = m(x)
    g = torch.randn_like(y)
    params = list(m.parameters())
    want = torch.autograd.grad(y, params, g, retain_graph=True)
    with torch.no_grad():
        assert pb._node_grads(params, y, g)
        assert pb._node_grads(params, y, g)  # accumulates
    for p, w in zip(params, want):
        torch.testing.assert_close(p.grad, 2 * w)
    if x.is_floating_point():
        assert x.grad is None


def test_a_node_that_does_not_read_its_parameters_itself_is_left_to_autograd() -> None:
    """A linear's node reads its weight through a transpose, a Python autograd.Function's node cannot be
    called, an output with a hook needs the engine (memory/ brings streamed parameters back in one):
    _node_grads does nothing and says so."""
    lin = nn.Linear(4, 3)
    y = lin(torch.randn(2, 4, requires_grad=True))

    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(x, w)
            return x * w

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            x, w = ctx.saved_tensors
            return g * w, (g * x).sum(0)

    w = nn.Parameter(torch.randn(4))
    z = Scale.apply(torch.randn(3, 4, requires_grad=True), w)
    norm = nn.LayerNorm(4)
    h = norm(torch.randn(2, 4))
    h.register_hook(lambda g: None)
    with torch.no_grad():
        assert not pb._node_grads(list(lin.parameters()), y, torch.ones_like(y))
        assert not pb._node_grads([w], z, torch.ones_like(z))
        assert not pb._node_grads(list(norm.parameters()), h, torch.ones_like(h))
    assert lin.weight.grad is None and w.grad is None and norm.weight.grad is None


class _Inplace(nn.Module):
    """Linear layers whose outputs later ops write in place, as ReLU(inplace=True) and x.mul_ do."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.a(x))
        return self.c(self.b(h).mul_(0.5).relu_())


def test_w_of_a_linear_whose_output_is_written_in_place_is_the_full_backwards() -> None:
    """W's matrix products would take the grad of the written tensor (after the ReLU) for the linear's
    output's: the versions the graph records right after the node show the write, and that node's W takes
    the autograd call through the op that wrote it (B keeps the graph); the unwritten ones stay products."""
    torch.manual_seed(0)
    gm = torch.fx.symbolic_trace(_Inplace())
    param_nodes = {n.name: [f"{n.target}.weight", f"{n.target}.bias"] for n in gm.graph.nodes
                   if n.op == "call_module" and n.target in ("a", "b", "c")}
    xs = [torch.randn(3, 8) for _ in range(2)]
    for x in xs:
        gm(x).pow(2).sum().backward()
    want = _grads(gm)
    zb, extra, in_b = with_param_outputs(gm, param_nodes, direct=True)
    assert [n for n, _ in extra] == ["a", "b", "c"] and in_b == []
    for x in xs:
        outs, param_outs, ins, versions = zb(x)
        saved = Saved(roots=[outs.pow(2).sum()], leaves=[], param_outs=list(param_outs), param_ins=list(ins),
                      param_versions=list(versions))
        backward_input(saved, [None], in_b, extra)
        assert [x is None for x in saved.param_ins] == [True, True, False]  # a's and b's outputs were written
        assert saved.roots  # so the graph stays for their autograd calls
        backward_weight(saved, extra)
    got = _grads(gm)
    for n in want:
        torch.testing.assert_close(got[n], want[n], msg=n)


class _Twice(nn.Module):
    """A user's module, kept whole, that reads its parameter twice: (x * g) * g."""

    def __init__(self) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.rand(4) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.g) * self.g


def test_only_torchs_own_nodes_are_called_for_their_weight_grads() -> None:
    """A module of the user's kept whole may read a parameter below its last op too: calling that op's
    autograd node would miss those grads (half of them here), so W takes the autograd call for it."""
    class Tracer(torch.fx.Tracer):
        def is_leaf_module(self, m: nn.Module, name: str) -> bool:
            return isinstance(m, _Twice) or super().is_leaf_module(m, name)
    model = nn.Sequential(nn.LayerNorm(4), _Twice())
    gm = torch.fx.GraphModule(model, Tracer().trace(model))
    assert pb.callable_nodes(gm, ["_0", "_1"]) == frozenset({"_0"})
    x = torch.randn(3, 4)
    gm(x).pow(2).sum().backward()
    want = _grads(gm)
    zb, extra, in_b = with_param_outputs(gm, {"_0": ["0.weight", "0.bias"], "_1": ["1.g"]})
    outs, param_outs = zb(x)
    saved = Saved(roots=[outs.pow(2).sum()], leaves=[], param_outs=list(param_outs))
    backward_input(saved, [None], in_b, extra)
    backward_weight(saved, extra, callable_nodes=pb.callable_nodes(gm, [n for n, _ in extra]))
    got = _grads(gm)
    for n in want:
        torch.testing.assert_close(got[n], want[n], msg=n)


def test_a_grad_aliasing_another_is_copied() -> None:
    """x + bias: the bias's grad from a node call is the output grad itself, which B may have passed on;
    it is copied into .grad, not taken."""
    bias = nn.Parameter(torch.zeros(4))
    y = torch.randn(2, 4, requires_grad=True) + bias[None].expand(1, 4).reshape(4)
    g = torch.randn(2, 4)
    with torch.no_grad():
        assert not pb._node_grads([bias], y, g)  # reached through a reshape and an expand: autograd's
    z = torch.randn(4, requires_grad=True) + bias
    g = torch.randn(4)
    with torch.no_grad():
        assert pb._node_grads([bias], z, g)
    assert bias.grad is not None and torch.equal(bias.grad, g)
    assert bias.grad.untyped_storage().data_ptr() != g.untyped_storage().data_ptr()


def test_the_plan_prices_the_w_the_runtime_runs() -> None:
    """The plan's W part of each stage (StagePlan.w_ms) is half the backward of exactly the nodes W
    differentiates at run time, the linear ones (with_param_outputs direct); a stage whose memory plan
    recomputes runs BW under zero bubble (memory.fused_backward), its W part 0 once memory/ has chosen
    (pipe.auto.memory_plan), and keeps it under a schedule without W; a stage of vocabulary slices
    alone has no W."""
    from pipe.auto import memory_plan
    w = partition.load("gpt", **SMALL)
    a = partition.Analysis(w.model, w.example_args, cost="flops")
    sizes = {n: (p.numel(), p.element_size()) for n, p in w.model.named_parameters()}
    for recompute in ("none", "full"):
        plan = partition.plan(w.model, w.example_args, 2, cost="flops", analysis=a, recompute=recompute,
                              schedule="zb-h1")
        for st, stage in zip(plan.stages, partition.split(w.model, plan)):
            io = stage_io(stage)
            extra = with_param_outputs(stage, io.param_nodes, direct=True)[1]
            assert st.w_nodes == len(extra)
            assert st.w_ms == pytest.approx(sum(a.costs[n].bwd_ms for n, _ in extra) / 2)
            assert 0 < st.w_ms < st.bwd_ms
        for schedule in ("zb-h1", "1f1b"):
            planned = memory_plan(partition.Plan.from_dict(plan.to_dict()) if schedule == "zb-h1" else
                                  partition.plan(w.model, w.example_args, 2, cost="flops", analysis=a,
                                                 recompute=recompute, schedule=schedule),
                                  a, 2, recompute=recompute, offload="none", budget=None, param_sizes=sizes)
            fused = recompute == "full" and schedule == "zb-h1"
            assert all((st.w_ms == 0.0 and st.w_nodes == 0) == fused for st in planned.stages), (recompute, schedule)
    wide = partition.load("gpt_wide_vocab", n_layer=2, d_model=32, n_head=2, seq_len=16, vocab=4096)
    plan = partition.plan(wide.model, wide.example_args, 2, cost="flops", loss_fn=wide.loss_fn,
                          example_target=wide.example_target)
    first, last = plan.stages
    assert last.nodes == ["lm_head_vocab1", "lm_head_loss"]  # the head's slices spread over both stages
    assert (last.w_ms, last.w_nodes) == (0.0, 0)
    assert first.w_nodes == 4 * 2 and "lm_head_vocab0" in first.nodes  # a slice is no W node


def autocast_body(rank: int, world: int) -> dict[str, list[str]]:
    import pipe
    from bench import models
    pipe.init()
    w = models.gpt(n_layer=2, d_model=32, n_head=2, seq_len=16, vocab=64)
    pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=2, schedule="zb-h1", cost="flops")
    args, target = w.make_batch(8, 0)
    said = lambda: [n for n in pp.plan.notes if "autograd call per node" in n]  # noqa: E731
    pp.step(*args, target=target)  # full precision: W's matrix products
    before = said()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pp.step(*args, target=target)
        pp.step(*args, target=target)
    return {"before": before, "after": said()}


def test_the_plan_says_when_w_falls_back_to_autograd_calls() -> None:
    """Planned as matrix products, W falls back to autograd calls under autocast (`test_under_autocast_
    b_keeps_the_graph_for_w`): the plan's notes say so once per stage, from the step it happened."""
    from tests.mp import run_ranks
    (res,) = run_ranks("tests.test_backward:autocast_body", 1, timeout=120)
    assert res["before"] == [] and len(res["after"]) == 1, res
    assert "stage 0's W" in res["after"][0] and "from step 2" in res["after"][0] and "autocast" in res["after"][0]
