"""Backward passes for one stage and microbatch: full, or split into input grads (B) and weight grads (W)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

__all__ = ["with_param_outputs", "Saved", "backward_full", "backward_input", "backward_weight"]


def _linear_input(stage: torch.fx.GraphModule, node: torch.fx.Node) -> torch.fx.Node | None:
    """The input of `node` when it calls an nn.Linear (exactly that class) on one tensor and trains its
    weight (autograd then keeps that input for the weight's grad anyway), else None."""
    if node.op != "call_module" or node.kwargs or len(node.args) != 1 or not isinstance(node.args[0], torch.fx.Node):
        return None
    mod = stage.get_submodule(str(node.target))
    return node.args[0] if type(mod) is torch.nn.Linear and mod.weight.requires_grad else None


def with_param_outputs(stage: torch.fx.GraphModule, param_nodes: dict[str, list[str]], direct: bool = False
                       ) -> tuple[torch.fx.GraphModule, list[tuple[str, list[torch.nn.Parameter]]],
                                  list[torch.nn.Parameter]]:
    """A copy of `stage` that also returns the output of every node reading a parameter once.

    Returns (the module, [(node, its parameters)] for the extra outputs in order, and the
    parameters read by several nodes of the stage, whose grads the B pass computes whole).
    `direct`: the module returns a third tuple, aligned with the extra outputs: the input of each
    nn.Linear node (None for other nodes), from which W computes that node's weight grads as two
    matrix products instead of an autograd call (`backward_weight`).
    """
    uses: dict[int, int] = {}
    resolved: dict[str, list[torch.nn.Parameter]] = {}
    for node, names in param_nodes.items():
        ps = list({id(p): p for p in (stage.get_parameter(n) for n in names)}.values())
        resolved[node] = ps
        for p in ps:
            uses[id(p)] = uses.get(id(p), 0) + 1
    g = torch.fx.Graph()
    env: dict[str, torch.fx.Node] = {}
    extra: list[tuple[str, list[torch.nn.Parameter]]] = []
    out_node = None
    for node in stage.graph.nodes:
        if node.op == "output":
            out_node = node
            continue
        env[node.name] = g.node_copy(node, lambda n: env[n.name])
    assert out_node is not None
    for node, ps in resolved.items():
        if all(uses[id(p)] == 1 for p in ps) and node in env:
            extra.append((node, ps))
    multi = list({id(p): p for ps in resolved.values() for p in ps if uses[id(p)] > 1}.values())
    outs = torch.fx.node.map_arg(out_node.args[0], lambda n: env[n.name])
    nodes = {n.name: n for n in stage.graph.nodes}
    result: tuple[Any, ...] = (outs, tuple(env[n] for n, _ in extra))
    if direct:
        ins = [_linear_input(stage, nodes[n]) for n, _ in extra]
        result += (tuple(None if x is None else env[x.name] for x in ins),)
    g.output(result)
    gm = torch.fx.GraphModule(stage, g, type(stage).__name__ + "ZB")
    return gm, extra, multi


@dataclass
class Saved:
    """What one microbatch's forward left for its backward on one stage."""
    roots: list[torch.Tensor]                 # outputs sent on (or the scaled loss on the last stage)
    leaves: list[torch.Tensor | None]         # received inputs (None: not differentiable)
    param_outs: list[Any] = field(default_factory=list)   # zero-bubble extra outputs, one per node
    param_grads: list[list[tuple[torch.Tensor, torch.Tensor | None]]] = field(default_factory=list)  # by B
    param_ins: list[torch.Tensor | None] = field(default_factory=list)  # direct W: each linear node's input


def _accumulate(p: torch.Tensor, g: torch.Tensor | None) -> None:
    if g is None:
        return
    if p.grad is None:
        p.grad = g.detach().clone()
    else:
        p.grad.add_(g)


def _roots(saved: Saved, grads: list[torch.Tensor | None]) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    pairs = [(r, g) for r, g in zip(saved.roots, grads) if r.requires_grad]
    return [r for r, _ in pairs], [g for _, g in pairs]


def _leaf_grads(saved: Saved, got: dict[int, torch.Tensor | None]) -> list[torch.Tensor | None]:
    out: list[torch.Tensor | None] = []
    for leaf in saved.leaves:
        if leaf is None:
            out.append(None)
        else:
            g = got.get(id(leaf))
            out.append(torch.zeros_like(leaf) if g is None else g)
    return out


def backward_full(saved: Saved, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Weight and input grads in one pass; returns the grads of the received inputs."""
    roots, gs = _roots(saved, grads)
    leaves = [x for x in saved.leaves if x is not None and x.requires_grad]
    if roots:
        torch.autograd.backward(roots, gs, inputs=None)
    return _leaf_grads(saved, {id(x): x.grad for x in leaves})


def _tensors(out: object) -> list[torch.Tensor]:
    """The tensors of a parameter-reading node's output that need grads (a module such as
    nn.MultiheadAttention returns a tuple)."""
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]


def backward_input(saved: Saved, grads: list[torch.Tensor | None], multi: list[torch.nn.Parameter]
                   ) -> list[torch.Tensor | None]:
    """B of zero-bubble: grads of the received inputs, and of each parameter-reading node's output.

    The weight grads themselves wait for `backward_weight`; parameters read by several nodes
    get their whole grad here (splitting them would count paths twice).
    """
    roots, gs = _roots(saved, grads)
    leaves = [x for x in saved.leaves if x is not None and x.requires_grad]
    outs = [_tensors(o) for o in saved.param_outs]
    targets: list[torch.Tensor] = leaves + list(multi) + [t for ts in outs for t in ts]
    got: dict[int, torch.Tensor | None] = {}
    if roots and targets:
        res = torch.autograd.grad(roots, targets, gs, retain_graph=True, allow_unused=True)
        got = {id(t): g for t, g in zip(targets, res)}
    for p in multi:
        _accumulate(p, got.get(id(p)))
    saved.param_grads = [[(t, got.get(id(t))) for t in ts] for ts in outs]
    return _leaf_grads(saved, got)


def _linear_grads(params: list[torch.nn.Parameter], x: torch.Tensor, g: torch.Tensor) -> bool:
    """A linear layer's weight (and bias) grads from its input `x` and output grad `g`: g^T x and the sum
    of g over the rows, accumulated; False (nothing done) unless the shapes and dtypes are a plain
    linear's (no autocast)."""
    w = [p for p in params if p.dim() == 2]
    b = [p for p in params if p.dim() == 1]
    if len(w) != 1 or len(b) > 1 or len(params) != len(w) + len(b) or not x.dim() or not g.dim():
        return False
    weight = w[0]
    out_f, in_f = weight.shape
    if (g.shape[-1], x.shape[-1]) != (out_f, in_f) or not (x.dtype == g.dtype == weight.dtype) or (
            b and b[0].shape != (out_f,)):
        return False
    with torch.no_grad():  # x is an activation that requires grad: no graph for the products
        g2 = g.reshape(-1, out_f)
        if weight.requires_grad:
            _accumulate(weight, g2.t().mm(x.reshape(-1, in_f)))
        if b and b[0].requires_grad:
            _accumulate(b[0], g2.sum(0))
    return True


def backward_weight(saved: Saved, extra: list[tuple[str, list[torch.nn.Parameter]]],
                    ready: Callable[[list[torch.nn.Parameter]], None] | None = None) -> None:
    """W of zero-bubble: each parameter-reading node's weight grads from its stored output grads;
    `ready(params)` after each node's (data parallel: their grads may be final).

    A linear node whose input the forward kept (`Saved.param_ins`) takes two matrix products; other
    nodes take an autograd call each, which walks the retained graph below the node (the longer the
    deeper the node sits)."""
    ins = saved.param_ins or [None] * len(extra)
    for (_, params), got, x in zip(extra, saved.param_grads, ins):
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = [(t, g) for t, g in got if g is not None]
        if not pairs:
            continue
        if not (x is not None and len(pairs) == 1 and _linear_grads(params, x, pairs[0][1])):
            res = torch.autograd.grad([t for t, _ in pairs], params, [g for _, g in pairs], retain_graph=True,
                                      allow_unused=True)
            for p, gp in zip(params, res):
                _accumulate(p, gp)
        if ready is not None:
            ready(params)
    saved.roots.clear()
    saved.param_outs.clear()
    saved.param_grads.clear()
    saved.param_ins.clear()
