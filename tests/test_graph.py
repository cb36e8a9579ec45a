"""Tests for partition/graph.py: the networkx graph, blocks that may be cut between, boundary bytes."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import partition
from bench import models
from partition.costs import node_costs
from partition.graph import build_graph, coarsen

B, C = 2, 8


class Skip(torch.nn.Module):
    """a = l1(x); b = l2(a); c = l3(b); out = c + a: the skip `a` crosses two boundaries."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = (torch.nn.Linear(C, C) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C)
        a = self.l1(x)
        return self.l3(self.l2(a)) + a


class Chunky(torch.nn.Module):
    """chunk returns a tuple: no cut may separate it from its getitems."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(C, 2 * C)
        self.out = torch.nn.Linear(C, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C)
        h = self.inp(x)  # (B, 2C)
        a, b = h.chunk(2, dim=-1)  # (B, C) each
        return self.out(a * b.sigmoid())


def _graph(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.fx.GraphModule, object]:
    gm = partition.trace(model, (x,))
    costs = node_costs(gm, [x], cost="flops")
    return gm, build_graph(gm, costs)


def _param_bytes(model: torch.nn.Module) -> dict[str, int]:
    return {n: p.numel() * p.element_size() for n, p in model.named_parameters()}


def test_graph_nodes_edges_and_bytes() -> None:
    model = Skip()
    gm, g = _graph(model, torch.randn(B, C))
    assert list(g.nodes) == [n.name for n in gm.graph.nodes]
    assert g.has_edge("l1", "l2") and g.has_edge("l1", "add")
    assert g.edges["l1", "add"]["bytes"] == B * C * 4
    assert g.nodes["l1"]["cost"].params == ("l1.bias", "l1.weight")
    assert g.graph["output"] == "output"


def test_a_skip_is_counted_at_every_boundary_it_crosses() -> None:
    model = Skip()
    _, g = _graph(model, torch.randn(B, C))
    blocks = coarsen(g, _param_bytes(model))
    assert blocks.members == [["l1"], ["l2"], ["l3"], ["add"]]
    v = B * C * 4
    np.testing.assert_array_equal(blocks.chain.cut_bytes, [0, v, 2 * v, 2 * v, 0])
    assert [blocks.param_names[i] for ps in blocks.chain.params for i in ps] == [
        "l1.bias", "l1.weight", "l2.bias", "l2.weight", "l3.bias", "l3.weight"]


def test_tuples_stay_with_their_getitems() -> None:
    model = Chunky()
    _, g = _graph(model, torch.randn(B, C))
    blocks = coarsen(g, _param_bytes(model))
    block_of = {u: i for i, block in enumerate(blocks.members) for u in block}
    chunk = next(u for u in g.nodes if u.startswith("chunk"))
    getitems = [u for u in g.successors(chunk)]
    assert len(getitems) == 2
    assert {block_of[u] for u in getitems} == {block_of[chunk]}


def test_nodes_of_inputs_alone_are_replicated_not_placed() -> None:
    w = models.gpt(n_layer=2, d_model=32, n_head=2, seq_len=16, vocab=64)
    a = partition.Analysis(w.model, w.example_args, cost="flops")
    rep = a.blocks.replicated
    assert any(u.startswith("arange") for u in rep)  # positions from the input's length
    placed = {u for block in a.blocks.members for u in block}
    assert not rep & placed
    plan = partition.plan(w.model, w.example_args, 2, analysis=a)
    arange = next(u for u in rep if u.startswith("arange"))
    assert all(arange not in sp.nodes for sp in plan.stages)
    assert all(arange not in [v.name for v in sp.recv] for sp in plan.stages)


class _Noised(torch.nn.Module):
    """A diffusion-style step: noise drawn from the input alone, the prediction and the noise both returned."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        noise = torch.randn_like(x)
        scaled = x.mul(2).add_(1)  # an in-place write on a value of the input alone: replicated with it
        return self.net(x + noise + scaled), noise


def test_random_ops_of_inputs_alone_are_placed_once() -> None:
    """Replicated on every stage that reads it, a draw would be drawn again there (the prediction made from
    other noise than the one returned): it is placed on one stage."""
    a = partition.Analysis(_Noised(), (torch.randn(2, 8),), cost="flops")
    rep = a.blocks.replicated
    placed = {u for block in a.blocks.members for u in block}
    assert "randn_like" in placed and "randn_like" not in rep, (rep, placed)
    assert {"mul", "add_"} <= rep  # a write to a value of the inputs alone goes with it


class _Masked(torch.nn.Module):
    """A causal mask built in place from the input's length, and a bias written in place, its result unused."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.full((x.shape[1], x.shape[1]), float("-inf")).triu_(1)
        bias = torch.zeros_like(x)
        bias.add_(1.0)
        return self.net(x + bias) + mask.sum() * 0 + bias


def test_writes_to_values_of_inputs_alone_are_replicated_with_them() -> None:
    """The mask's triu_ is replicated with the mask (it crossed stages, its grad sent back, when every in-place
    write was placed once); a replicated bias's unused write goes with it to every stage that reads the bias
    (a later stage read it unwritten)."""
    from partition.split import subgraph
    w_model = _Masked()
    x = torch.randn(2, 8)
    a = partition.Analysis(w_model, (x,), cost="flops")
    assert {"full", "triu_", "zeros_like", "add_"} <= a.blocks.replicated, a.blocks.replicated
    plan = partition.plan(w_model, (x,), 2, analysis=a)
    assert not any(v.name in ("triu_", "full") for st in plan.stages for v in st.recv)
    gm = partition.trace(w_model, (x,))
    stage_of = {n: st.index for st in plan.stages for n in st.nodes}
    last = plan.stages[-1]
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    stage, _, _ = subgraph(gm, set(last.nodes), stage_of, [v.name for v in last.recv], [out], "Last")
    assert "add_" in {n.name for n in stage.graph.nodes}  # the bias this stage reads, written


def test_max_blocks_merges_neighbours_and_keeps_totals() -> None:
    w = models.mlp(depth=6, width=32)
    a = partition.Analysis(w.model, w.example_args, cost="flops")
    fine = a.blocks
    coarse = coarsen(a.graph, _param_bytes(w.model), max_blocks=4)
    assert len(coarse.members) == 4 < len(fine.members)
    assert sum(coarse.members, []) == sum(fine.members, [])
    assert coarse.chain.fwd_ms.sum() == pytest.approx(fine.chain.fwd_ms.sum())
    assert coarse.chain.act_bytes.sum() == fine.chain.act_bytes.sum()


def test_a_model_that_computes_nothing_is_refused() -> None:
    class Identity(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    with pytest.raises(ValueError, match="no operations"):
        partition.plan(Identity(), (torch.randn(2, 2),), 1, cost="flops")
