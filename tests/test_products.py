"""Tests for partition/products.py and cost="shaped": products priced by their measured shapes, the rest counted."""
from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import partition
import partition.costs as costs
import partition.products as products
from partition.costs import BYTES_PER_MS, FLOP_PER_MS, node_costs
from partition.products import PRODUCTS, product_flops, product_ratio, ratios_measured
from partition.trace import flatten_inputs, trace

aten = torch.ops.aten


@pytest.mark.parametrize("op,args", [
    (aten.mm.default, (torch.randn(5, 7), torch.randn(7, 3))),
    (aten.addmm.default, (torch.randn(3), torch.randn(5, 7), torch.randn(7, 3))),
    (aten.bmm.default, (torch.randn(2, 5, 7), torch.randn(2, 7, 3))),
    (aten.baddbmm.default, (torch.randn(2, 5, 3), torch.randn(2, 5, 7), torch.randn(2, 7, 3))),
], ids=["mm", "addmm", "bmm", "baddbmm"])
def test_a_product_s_flops_are_what_torch_s_counter_counts(op: Any, args: tuple[Any, ...]) -> None:
    assert op._schema.name in PRODUCTS
    with FlopCounterMode(display=False) as counter:
        op(*args)
    assert product_flops(op._schema.name, args) == counter.get_total_flops() == 2 * 5 * 7 * 3 * (
        2 if args[-1].dim() == 3 else 1)


def test_a_shape_is_timed_once_and_a_layout_is_a_shape_of_its_own() -> None:
    a, b = torch.randn(64, 32), torch.randn(32, 48)
    before = ratios_measured()
    torch.manual_seed(3)
    expected = torch.rand(2)
    torch.manual_seed(3)
    r = product_ratio(aten.mm.default, (a, b), {})
    assert torch.equal(torch.rand(2), expected)  # its random factors come from a generator of its own
    assert ratios_measured() == before + 1
    assert product_ratio(aten.mm.default, (torch.randn(64, 32), torch.randn(32, 48)), {}) == r  # remembered
    assert ratios_measured() == before + 1
    product_ratio(aten.mm.default, (a, torch.randn(48, 32).t()), {})  # the same shape, transposed strides
    assert ratios_measured() == before + 2
    assert 0 < r < float("inf")


def test_eight_times_the_reference_s_work_measures_more_than_twice_its_time() -> None:
    """A timing: the best of three measurements (each the median of 21 alternations), as a loaded machine gave
    1.18 once (scripts/test's other worker running a launch); a product timed as the reference, or the reference
    as the product, measures about 1 every time."""
    m, k, n = products.REFERENCE
    ratios = []
    for _ in range(3):
        products._RATIOS.clear()  # (measured again, not remembered)
        ratios.append(product_ratio(aten.mm.default, (torch.randn(2 * m, 2 * k), torch.randn(2 * k, 2 * n)), {}))
        if ratios[-1] > 2.0:
            break
    assert max(ratios) > 2.0, ratios


def test_on_the_meta_device_a_shape_cannot_be_timed_and_the_error_says_what_to_do() -> None:
    a, b = torch.empty(4, 4, device="meta"), torch.empty(4, 4, device="meta")
    with pytest.raises(ValueError, match="meta device; name the target device.*cost='flops'"):
        product_ratio(aten.mm.default, (a, b), {})
    assert product_ratio(aten.mm.default, (a, b), {}, device=torch.device("cpu")) > 0  # timed where it will run


def test_shaped_costs_price_each_product_by_its_ratio_and_count_everything_else(monkeypatch: Any) -> None:
    """With every ratio fixed at 3, a Linear's cost is the FLOP model's less its product's FLOPs and traffic
    plus 3 reference prices; the ReLU between the two Linears is the FLOP model's, unchanged."""
    torch.manual_seed(0)
    B, i, h, o = 8, 16, 32, 4
    model = torch.nn.Sequential(torch.nn.Linear(i, h), torch.nn.ReLU(), torch.nn.Linear(h, o))
    x = torch.randn(B, i)
    gm = trace(model, (x,))
    flat = flatten_inputs(gm, (x,))
    monkeypatch.setattr(costs, "product_ratio", lambda *a, **k: 3.0)
    flops, shaped = node_costs(gm, flat, cost="flops"), node_costs(gm, flat, cost="shaped")
    first, relu = [n.name for n in gm.graph.nodes if n.op == "call_module"][:2]
    assert shaped[relu].fwd_ms == flops[relu].fwd_ms and shaped[relu].bwd_ms == flops[relu].bwd_ms
    # forward: addmm(bias (h), x (B, i), W^T (i, h)); its traffic reads the three and writes (B, h)
    product_ms = 2 * B * i * h / FLOP_PER_MS + 4 * (h + B * i + i * h + B * h) / BYTES_PER_MS
    torch.testing.assert_close(shaped[first].fwd_ms, flops[first].fwd_ms - product_ms + 3 * costs._REFERENCE_MS)
    assert shaped[first].bwd_ms != flops[first].bwd_ms  # its weight's grad is a product too
    assert all(c.ref_ms == c.fwd_ms + c.bwd_ms for c in shaped.values())


def test_a_plan_costed_by_shape_says_so_and_a_meta_model_needs_a_device() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])
    x = torch.randn(8, 32)
    plan = partition.plan(model, (x,), 2, cost="shaped")
    assert plan.cost == "shaped" and plan.cost_device == "cpu"
    assert "each matrix product priced by its shape's speed on cpu" in plan.cost_method
    assert "cost shaped" in plan.table()
    with torch.device("meta"):
        big = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])
    meta_x = torch.empty(8, 32, device="meta")
    with pytest.raises(ValueError, match="meta device; name the target device"):
        partition.plan(big, (meta_x,), 2, cost="shaped")
    on_cpu = partition.plan(big, (meta_x,), 2, cost="shaped", device="cpu")
    assert on_cpu.cost_device == "cpu" and [len(s.nodes) for s in on_cpu.stages] == [len(s.nodes) for s in plan.stages]
