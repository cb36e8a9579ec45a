"""memory/regions.py and the fx-level recompute in one process: where regions are cut, the rewritten
graph against plain autograd, what the ledger counts, and the planner's bounds."""
from __future__ import annotations

import pytest
import torch
import torch.fx

from memory.budget import NodeInfo, Region, StageChoice, StageInfo, choose
from memory.manager import PlannedMemory
from memory.recompute import remat_candidates, savers
from memory.regions import cut_regions
from tests.test_memory import _run_step


def test_regions_are_cut_where_the_fewest_bytes_cross() -> None:
    # a -> b -> c -> d -> e, with a skip a -> c: crossing before b is a (4), before c is a + b (4 + 8),
    # before d is c (2), before e is d (8); the least (2) is before d: two regions
    order = ["a", "b", "c", "d", "e"]
    users = {"a": ["b", "c"], "b": ["c"], "c": ["d"], "d": ["e"], "e": ["output"]}
    reads = {"b": ["a"], "c": ["a", "b"], "d": ["c"], "e": ["d"]}
    out = {"a": 4, "b": 8, "c": 2, "d": 8, "e": 1}
    ms = dict.fromkeys(order, 1.0)
    assert cut_regions(order, users, reads, out, ms) == [Region(("a", "b", "c"), 3.0, 0),
                                                         Region(("d", "e"), 2.0, 2, ("c",))]
    # a run under the minimum share of the stage's time joins its neighbour
    assert cut_regions(order, users, reads, out, dict(ms, d=0.0625, e=0.0625)) == [Region(tuple(order), 3.125, 0)]
    # e writes c in place (c.mul_): a region starting at d would recompute from the written c and write it again
    # (the cheapest cut allowed then falls before b)
    assert cut_regions(order, users, reads, out, ms, writes={"e": ["c"]}) == [
        Region(("a",), 1.0, 0), Region(("b", "c", "d", "e"), 4.0, 4, ("a",))]


def test_a_recomputation_leaves_batch_norms_statistics_as_one_forward_left_them() -> None:
    """A checkpoint (whole stage or region) runs the forward again in the backward: batch norm would update its
    running statistics twice. They are put back after the recomputation (found by their versions)."""
    from memory.recompute import Recomputed
    from memory.regions import Checkpointed
    torch.manual_seed(0)
    for wrap in (lambda m: Recomputed(m), lambda m: Checkpointed(m, entering=lambda a: None, again=lambda: None,
                                                                   recomputed=lambda t: None)):
        net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh())
        ref = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh())
        ref.load_state_dict(net.state_dict())
        wrapped = wrap(net)
        for x in (torch.randn(5, 4), torch.randn(5, 4)):
            wrapped(x).pow(2).sum().backward()
            ref(x).pow(2).sum().backward()
        for (n, b), r in zip(net.named_buffers(), ref.buffers()):
            torch.testing.assert_close(b, r, rtol=0, atol=0, msg=n)
        for (n, q), r in zip(net.named_parameters(), ref.parameters()):
            torch.testing.assert_close(q.grad, r.grad, msg=n)


def test_random_nodes_include_torchs_builtins_aten_ops_and_modules_holding_dropout() -> None:
    """'selective' never recomputes what draws random numbers: a new draw in the backward would not match the
    forward's. torch.dropout (the builtin attention code calls), aten ops torch tags nondeterministic_seeded
    (torch.export's graphs) and a module kept whole that holds a dropout were missed."""
    from memory.recompute import is_random_node

    class Kept(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x)

    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.kept = Kept()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.dropout(torch.softmax(x, -1), 0.1, True)
            return self.kept(h) * torch.tanh(h)

    class Tracer(torch.fx.Tracer):
        def is_leaf_module(self, m: torch.nn.Module, name: str) -> bool:
            return isinstance(m, Kept) or super().is_leaf_module(m, name)
    gm = torch.fx.GraphModule(M(), Tracer().trace(M()))
    got = {n.name: is_random_node(gm, n) for n in gm.graph.nodes if n.op.startswith("call")}
    assert got == {"softmax": False, "dropout": True, "kept": True, "tanh": False, "mul": False}, got
    g = torch.fx.Graph()
    x = g.placeholder("x")
    noise = g.call_function(torch.ops.aten.randn_like.default, (x,))
    same = g.call_function(torch.ops.aten.tanh.default, (x,))
    g.output((noise, same))
    aten = torch.fx.GraphModule(torch.nn.Module(), g)
    assert is_random_node(aten, noise) and not is_random_node(aten, same)


class _Blocks(torch.nn.Module):
    """Two pre-LN MLP blocks with residuals: x + proj(gelu(fc(ln(x))))."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.ln = torch.nn.ModuleList(torch.nn.LayerNorm(16) for _ in range(2))
        self.fc = torch.nn.ModuleList(torch.nn.Linear(16, 64) for _ in range(2))
        self.act = torch.nn.GELU()
        self.proj = torch.nn.ModuleList(torch.nn.Linear(64, 16) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(2):
            x = x + self.proj[i](self.act(self.fc[i](self.ln[i](x))))
        return x


def test_savers_follow_views_and_skip_ops_that_save_nothing() -> None:
    gm = torch.fx.symbolic_trace(_Blocks())
    got = savers(gm)
    assert got["ln_0"] == ("fc_0",) and got["fc_0"] == ("act",) and got["act"] == ("proj_0",)
    assert got["proj_0"] == () and got["add"] == ("ln_1",)       # an add saves nothing; LN saves its input
    assert set(remat_candidates(gm)) == {"ln_0", "act", "add", "ln_1", "act_1", "add_1"}


def _run(choice: StageChoice, xs: list[torch.Tensor]) -> tuple[list[torch.Tensor | None], dict[str, int], str]:
    gm = torch.fx.symbolic_trace(_Blocks())
    actions = [(0, "F", 0), (0, "F", 1), (0, "B", 0), (0, "B", 1)]
    mm = PlannedMemory(choices=[choice], modules={0: gm}, param_nodes={0: {}}, actions=actions, recv_bytes=[0],
                       send_bytes=[0], device=torch.device("cpu"))
    _run_step(mm, mm.wrap_stage(0, gm), actions, xs)
    return [p.grad for p in gm.parameters()] + [x.grad for x in xs], mm.report()[0], gm.code


def test_checkpointed_regions_match_plain_autograd_and_recompute_one_at_a_time() -> None:
    xs = [torch.randn(8, 16, requires_grad=True) for _ in range(2)]
    plain, r0, _ = _run(StageChoice(0, "none"), xs)
    for x in xs:
        x.grad = None
    regions = (("ln_0", "fc_0", "act", "proj_0", "add"), ("ln_1", "fc_1", "act_1", "proj_1", "add_1"))
    got, r1, code = _run(StageChoice(0, "auto", regions=regions, of_regions=2), xs)
    assert "_fxpipe_region0" in code and "_fxpipe_region1" in code
    for a, b in zip(plain, got):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    c, h, st = 8 * 16 * 4, 8 * 64 * 4, 2 * 8 * 4  # bytes of an (8, 16), an (8, 64) activation, LN's stats
    # plain, per microbatch: ln, fc, gelu, stats of both blocks, the first add (saved by ln_1) and the
    # last (by the loss's pow); the input x is a leaf the runtime holds. Regions keep what enters them
    # (x, the first add) and the last add
    assert r0["peak_activations"] == 2 * (2 * (c + 2 * h + st) + 2 * c)
    assert r1["peak_activations"] == 2 * (2 * c)
    assert r1["peak_recompute"] == c + 2 * h + st  # one region at a time: its ln, fc, gelu and stats
    assert r1["recompute"] == 0 and r1["activations"] == 0


def _info(regions: bool) -> StageInfo:
    # per block (fc and proj matmuls): ln 1 kB, 1 ms (recomputable, frees 1 kB), fc 4 kB, gelu 4 kB, 0.5 ms
    # (frees 4 kB); a region is one block; the second region's input is the first's proj output (1 kB)
    nodes: list[NodeInfo] = []
    regs = []
    for b in range(2):
        ln, fc, act, proj = (f"{k}{b}" for k in ("ln", "fc", "act", "proj"))
        nodes += [NodeInfo(ln, 1.0, 1000, remat_bytes=1000, remat=True, saved_by=(fc,)),
                  NodeInfo(fc, 4.0, 4000, saved_by=(act,)),
                  NodeInfo(act, 0.5, 4000, remat_bytes=4000, remat=True, saved_by=(proj,)),
                  NodeInfo(proj, 4.0, 1000, saved_by=(f"ln{b + 1}",) if b == 0 else ())]
        regs.append(Region((ln, fc, act, proj), 9.5, 1000 * b))
    return StageInfo(index=0, nodes=tuple(nodes), act_bytes=19_000, loss_bytes=0, in_flight=4, param_bytes=0,
                     comm_bytes=0, regions=tuple(regs) if regions else ())


def test_auto_prefers_recomputing_on_unpack_then_checkpoints_regions_within_bounds() -> None:
    st = _info(True)
    (c,) = choose([st], recompute="auto", offload="none", budget=4 * 19_000 - 4 * 5_000 + 8_000)
    assert c.label() == "remat 2" and c.remat == {"act0", "act1"}        # 4 kB per ms beats ln's 1 kB
    # recomputing all four on unpack: 4 x 9 kB + 8 kB (two recomputed at once) = 44 kB. Below that,
    # checkpoint block 0 (frees 9 kB for 9.5 ms) and recompute block 1's ln and gelu: 4 x 5 kB + 9 kB
    # (block 0 recomputed) + 5 kB = 34 kB (and A's 2% margin per microbatch), for 11 ms against 19 ms for
    # both blocks or the whole stage
    (c,) = choose([st], recompute="auto", offload="none", budget=40_000)
    assert (c.label(), c.recompute_ms) == ("ckpt 1/2+remat 2", 11.0)
    assert c.predicted_peak == pytest.approx(34_000 + 4 * 19_000 * 0.02 / 1.02)
    (c,) = choose([_info(False)], recompute="auto", offload="none", budget=40_000)
    assert c.label() == "full"                                            # no regions: the whole stage


def small_body(rank: int, world: int) -> dict[int, tuple[str, int, int]]:
    import partition
    import pipe
    pipe.init()
    w = partition.load("gpt")  # small activations: the bounds' margins matter
    pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=4, cost="flops", recompute="auto",
                       memory_budget="14MiB")
    opt = torch.optim.Adam(list(pp.parameters()), lr=1e-3)
    for step in range(2):
        args, _, target = w.batch(w.microbatch_size * 4, step)
        pp.step(*args, target=target)
        opt.step()
        opt.zero_grad(set_to_none=True)
    rep = pp.memory_report()
    return {s: (pp.memory.choices[s].label(), r["peak_total"], r["predicted_peak"])  # type: ignore[attr-defined]
            for s, r in rep.items()}


def test_predicted_peak_bounds_the_ledger_when_regions_keep_little() -> None:
    from tests.mp import run_ranks
    got = {s: v for r in run_ranks("tests.test_memory_regions:small_body", 2, timeout=120) for s, v in r.items()}
    assert got[0][0].startswith("ckpt"), got
    for s, (label, peak, predicted) in got.items():
        assert peak <= predicted <= 14 << 20, (s, label, peak, predicted)


class _Halves(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l0, self.l1 = torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l0(x)
        return self.l1(torch.tanh(h.mul_(0.5)))


def test_a_region_recomputes_the_stages_copy_of_a_received_value_it_writes() -> None:
    """Cut after l0, the second stage writes a copy of the value it receives (partition.split); a checkpoint
    region writing it takes that copy in, so its recomputation halves the received value once, not twice."""
    from memory.regions import Checkpointed, checkpoint_regions
    from partition.split import subgraph
    torch.manual_seed(0)
    model = _Halves()
    gm = torch.fx.symbolic_trace(model)
    stage_of = {n.name: (0 if n.name == "l0" else 1) for n in gm.graph.nodes if n.op.startswith("call")}
    own = {n for n, s in stage_of.items() if s == 1}
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    stage, _, _ = subgraph(gm, own, stage_of, ["l0"], [out], "Stage1")
    checkpoint_regions(stage, [[n.name for n in stage.graph.nodes if n.name in own]],
                       lambda k, sub: Checkpointed(sub, entering=lambda a: None, again=lambda: None,
                                                   recomputed=lambda t: None))
    region = next(m for m in stage.modules() if isinstance(m, Checkpointed))
    assert [n.target for n in region.inner.graph.nodes if n.op == "call_method"][0] == "clone"  # taken in
    x = torch.randn(3, 4)
    leaf = model.l0(x).detach().requires_grad_(True)
    stage(leaf)[0].pow(2).sum().backward()
    got = {n: p.grad.clone() for n, p in model.l1.named_parameters()}, leaf.grad.clone()
    model.zero_grad()
    h = model.l0(x).detach().requires_grad_(True)
    model.l1(torch.tanh(h * 0.5)).pow(2).sum().backward()
    for n, p in model.l1.named_parameters():
        torch.testing.assert_close(got[0][n], p.grad, msg=n)
    torch.testing.assert_close(got[1], h.grad)
