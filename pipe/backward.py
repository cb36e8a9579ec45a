"""Backward passes for one stage and microbatch: full, or split into input grads (B) and weight grads (W)."""
from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

from partition.split import linear_input, w_nodes

__all__ = ["with_param_outputs", "callable_nodes", "Saved", "backward_full", "backward_input", "backward_weight"]


def with_param_outputs(stage: torch.fx.GraphModule, param_nodes: dict[str, list[str]], direct: bool = False
                       ) -> tuple[torch.fx.GraphModule, list[tuple[str, list[torch.nn.Parameter]]],
                                  list[torch.nn.Parameter]]:
    """A copy of `stage` that also returns the output of every node whose weight grads W computes.

    Returns (the module, [(node, its parameters)] for the extra outputs in order, and the parameters
    whose grads B computes whole: those read by several nodes of the stage (splitting them would count
    paths twice), and under `direct` those of every node but the nn.Linear ones).
    `direct`: W computes only the nn.Linear nodes' weight grads, each as two matrix products of the
    node's input and output grad, and the module returns a third and a fourth tuple, aligned with the
    extra outputs: the input of each (`backward_weight`), and the version counters of its output and
    input right after the node (`backward_input` takes the autograd call for a node whose output or
    input a later op wrote in place). Otherwise W differentiates every node that reads parameters of
    its own.
    """
    uses: dict[int, int] = {}
    resolved: dict[str, list[torch.nn.Parameter]] = {}
    for node, names in param_nodes.items():
        ps = list({id(p): p for p in (stage.get_parameter(n) for n in names)}.values())
        resolved[node] = ps
        for p in ps:
            uses[id(p)] = uses.get(id(p), 0) + 1
    nodes = {n.name: n for n in stage.graph.nodes}
    apart = set(w_nodes(stage, param_nodes)) if direct else None
    extra = [(node, ps) for node, ps in resolved.items()
             if node in nodes and all(uses[id(p)] == 1 for p in ps) and (apart is None or node in apart)]
    ins = {n: linear_input(stage, nodes[n]) for n, _ in extra} if direct else {}
    g = torch.fx.Graph()
    env: dict[str, torch.fx.Node] = {}
    versions: dict[str, torch.fx.Node] = {}
    out_node = None
    for node in stage.graph.nodes:
        if node.op == "output":
            out_node = node
            continue
        env[node.name] = g.node_copy(node, lambda n: env[n.name])
        x = ins.get(node.name)
        if x is not None:  # the versions of its output and input as the node made them (written in place later:
            versions[node.name] = g.call_function(_versions, (env[node.name], env[x.name]))  # backward_input)
    assert out_node is not None
    in_w = {id(p) for _, ps in extra for p in ps}
    in_b = list({id(p): p for ps in resolved.values() for p in ps if id(p) not in in_w}.values())
    outs = torch.fx.node.map_arg(out_node.args[0], lambda n: env[n.name])
    result: tuple[Any, ...] = (outs, tuple(env[n] for n, _ in extra))
    if direct:
        assert all(x is not None for x in ins.values()), ins  # w_nodes: linear nodes alone
        result += (tuple(env[x.name] for x in ins.values() if x is not None),
                   tuple(versions[n] for n, _ in extra))
    g.output(result)
    gm = torch.fx.GraphModule(stage, g, type(stage).__name__ + "ZB")
    return gm, extra, in_b


def callable_nodes(stage: torch.fx.GraphModule, names: Collection[str]) -> frozenset[str]:
    """The nodes of `names` whose output's autograd node W may call for their weight grads (`_node_grads`):
    torch's own (a torch.nn module, a torch function or an aten op), which read each of their parameters in
    that last op alone if at all. A module of the user's kept whole (leaf_modules) may read a parameter again
    below its last op, whose grads the call would miss."""
    nodes = {n.name: n for n in stage.graph.nodes}
    return frozenset(n for n in names if _one_op(stage, nodes[n]))


def _one_op(stage: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    if node.op == "call_module":
        return type(stage.get_submodule(str(node.target))).__module__.startswith("torch.nn.")
    if node.op == "call_function":
        return isinstance(node.target, torch._ops.OpOverload) or str(
            getattr(node.target, "__module__", None) or "").startswith("torch")
    return node.op == "call_method"


def _versions(out: torch.Tensor, x: torch.Tensor) -> tuple[int, int]:
    """The version counters of a linear node's output and input (called in the graph right after the node);
    (0, 0) for inference tensors, which keep none (evaluate() under torch.inference_mode(): no W follows)."""
    if out.is_inference() or x.is_inference():
        return 0, 0
    return out._version, x._version


@dataclass
class Saved:
    """What one microbatch's forward left for its backward on one stage."""
    roots: list[torch.Tensor]                 # outputs sent on (or the scaled loss on the last stage)
    leaves: list[torch.Tensor | None]         # received inputs (None: not differentiable)
    param_outs: list[Any] = field(default_factory=list)   # zero-bubble: each W node's output
    # by B: each W node's (output tensor, its grad); the output None where W needs no graph (B freed it)
    param_grads: list[list[tuple[torch.Tensor | None, torch.Tensor | None]]] = field(default_factory=list)
    param_ins: list[torch.Tensor | None] = field(default_factory=list)  # direct W: each linear node's input
    param_versions: list[tuple[int, int]] = field(default_factory=list)  # and its output's and input's versions


def _accumulate(p: torch.Tensor, g: torch.Tensor | None, fresh: bool = False) -> None:
    """p.grad += g; `fresh`: g is a new tensor nothing else holds, which becomes p.grad as it is
    (as autograd's own accumulation steals it) instead of being copied."""
    if g is None:
        return
    if p.grad is None:
        p.grad = g.detach() if fresh and g.is_contiguous() else g.detach().clone()
    else:
        p.grad.add_(g)


def _alone(r: torch.Tensor, others: list[torch.Tensor | None]) -> bool:
    """Whether `r` (one of `others`) is a tensor of its own: no view, and no other tensor of `others`
    (the grads an autograd call gave and was given) shares its memory."""
    ptr = r.untyped_storage().data_ptr()
    return r._base is None and sum(o is not None and o.untyped_storage().data_ptr() == ptr for o in others) == 1


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


def _linear_ok(params: list[torch.nn.Parameter], x: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether W can compute a linear node's weight (and bias) grads as g^T x and g summed over the rows,
    from its input `x` and the grad of its output `out`: the shapes and dtypes of a plain linear's (no
    autocast)."""
    w = [p for p in params if p.dim() == 2]
    b = [p for p in params if p.dim() == 1]
    if len(w) != 1 or len(b) > 1 or len(params) != len(w) + len(b) or not x.dim() or not out.dim():
        return False
    out_f, in_f = w[0].shape
    return (out.shape[-1], x.shape[-1]) == (out_f, in_f) and x.dtype == out.dtype == w[0].dtype and (
        not b or b[0].shape == (out_f,))


def _direct(saved: Saved, extra: list[tuple[str, list[torch.nn.Parameter]]] | None,
            outs: list[list[torch.Tensor]]) -> bool:
    """Whether W will compute every node's weight grads as matrix products (needing no graph)."""
    ins = saved.param_ins
    return extra is not None and len(ins) == len(extra) == len(outs) and all(
        x is not None and len(ts) == 1 and _linear_ok(ps, x, ts[0]) for (_, ps), x, ts in zip(extra, ins, outs))


def backward_input(saved: Saved, grads: list[torch.Tensor | None], in_b: list[torch.nn.Parameter],
                   extra: list[tuple[str, list[torch.nn.Parameter]]] | None = None) -> list[torch.Tensor | None]:
    """B of zero-bubble: grads of the received inputs, of each W node's output, and whole grads of the
    parameters `in_b` (`with_param_outputs`); returns the received inputs' grads.

    When W computes every node of `extra` from the input the forward kept (`_direct`), B frees the
    graph as a full backward does, so that a microbatch waiting for its W holds only those inputs and
    output grads; otherwise the graph stays for W's autograd calls.
    """
    roots, gs = _roots(saved, grads)
    leaves = [x for x in saved.leaves if x is not None and x.requires_grad]
    for i, (v, y, x) in enumerate(zip(saved.param_versions, saved.param_outs, saved.param_ins)):
        if x is not None and (y._version, x._version) != v:
            # written in place after the node (an inplace ReLU on its output): the output's grad is the
            # written tensor's, and the input is not the one it read, so no matrix products: the autograd
            # call, through the op that wrote it (which raises, as torch does, when the input was written)
            saved.param_ins[i] = None
    outs = [_tensors(o) for o in saved.param_outs]
    whole = [p for p in in_b if p.requires_grad]
    targets: list[torch.Tensor] = leaves + whole + [t for ts in outs for t in ts]
    keep = not _direct(saved, extra, outs)
    got: dict[int, torch.Tensor | None] = {}
    if roots and targets:
        res = torch.autograd.grad(roots, targets, gs, retain_graph=keep, allow_unused=True)
        got = {id(t): g for t, g in zip(targets, res)}
        for p in whole:
            r = got.get(id(p))
            _accumulate(p, r, fresh=r is not None and _alone(r, [*res, *gs]))
    saved.param_grads = [[(t if keep else None, got.get(id(t))) for t in ts] for ts in outs]
    leaf_grads = _leaf_grads(saved, got)
    saved.leaves = []
    if not keep:
        saved.roots.clear()
        saved.param_outs.clear()
    return leaf_grads


def _linear_grads(params: list[torch.nn.Parameter], x: torch.Tensor, g: torch.Tensor) -> None:
    """A linear layer's weight (and bias) grads from its input `x` and output grad `g`, accumulated
    (`_linear_ok` holds; under no_grad: x is an activation that requires grad)."""
    weight = next(p for p in params if p.dim() == 2)
    b = [p for p in params if p.dim() == 1]
    out_f, in_f = weight.shape
    g2 = g.reshape(-1, out_f)
    if weight.requires_grad:
        x2 = x.reshape(-1, in_f)
        if weight.grad is None:
            weight.grad = g2.t().mm(x2)
        else:  # added inside the product: no pass of its own over the grad
            weight.grad.addmm_(g2.t(), x2)
    if b and b[0].requires_grad:
        _accumulate(b[0], g2.sum(0), fresh=True)


def _node_grads(params: list[torch.nn.Parameter], t: torch.Tensor, g: torch.Tensor) -> bool:
    """A node's weight grads by calling, once, the autograd node that made its output `t`, when that
    node reads each of the parameters itself (LayerNorm, RMSNorm's scale, an embedding, a convolution,
    a batch norm): its own backward function, without the engine, whose call first walks the whole
    retained graph below the node. The call also computes the grad of the node's input, which is
    dropped. False (nothing done) unless each parameter is exactly one of the node's inputs, the node is
    a built-in one (a Python autograd.Function's node is not callable) and `t` has no hooks (which only
    the engine runs: memory/'s, which bring streamed parameters back before the node)."""
    fn = t.grad_fn
    if fn is None or not callable(fn) or t._backward_hooks:
        return False
    want = {id(p) for p in params if p.requires_grad}
    at: dict[int, int] = {}
    for i, (nxt, _) in enumerate(fn.next_functions):
        v = getattr(nxt, "variable", None)  # an AccumulateGrad: a leaf's
        if v is not None and id(v) in want:
            if id(v) in at:
                return False  # the same parameter twice: its grads would need adding
            at[id(v)] = i
    if len(at) != len(want):
        return False
    grads: list[torch.Tensor | None] = [None] * len(fn._input_metadata)  # one per output of the op
    grads[t.output_nr] = g
    res = fn(*grads)  # under no_grad (`backward_weight`)
    res = res if isinstance(res, tuple) else (res,)
    for p in params:
        r0 = res[at[id(p)]] if p.requires_grad else None
        if r0 is None:
            continue  # an undefined grad: nothing reached the parameter
        # what the engine does with an input's grad: sum a broadcast away, cast to its dtype (new tensors)
        r = r0.sum_to_size(p.shape) if r0.shape != p.shape else r0
        r = r.to(p.dtype)
        _accumulate(p, r, fresh=r is not r0 or _alone(r0, [*res, g]))
    return True


def backward_weight(saved: Saved, extra: list[tuple[str, list[torch.nn.Parameter]]],
                    ready: Callable[[list[torch.nn.Parameter]], None] | None = None,
                    callable_nodes: Collection[str] | None = None) -> None:
    """W of zero-bubble: each parameter-reading node's weight grads from its stored output grads;
    `ready(params)` after each node's (data parallel: their grads may be final).

    A linear node whose input the forward kept (`Saved.param_ins`) takes two matrix products; a node
    of `callable_nodes` (the module's, `with_param_outputs`; None: every node) whose own autograd node
    reads its parameters, a call of that node (`_node_grads`); any other node an autograd call, which
    walks the retained graph below the node (the longer the deeper the node sits)."""
    ins = saved.param_ins or [None] * len(extra)
    with torch.no_grad():  # the products read activations that require grad: no graph for them
        for (node, params), got, x in zip(extra, saved.param_grads, ins):
            pairs = [(t, g) for t, g in got if g is not None]
            if not pairs:
                continue
            (t, g), one = pairs[0], len(pairs) == 1
            if one and x is not None and (t is None or _linear_ok(params, x, g)):  # t None: B checked it
                _linear_grads(params, x, g)
            elif not (one and t is not None and (callable_nodes is None or node in callable_nodes)
                      and _node_grads(params, t, g)):
                trained = [p for p in params if p.requires_grad]
                outs = [t for t, _ in pairs if t is not None]  # kept: B kept the graph for this W
                res = torch.autograd.grad(outs, trained, [g for _, g in pairs], retain_graph=True, allow_unused=True)
                for p, gp in zip(trained, res):
                    _accumulate(p, gp)
            if ready is not None:
                ready(params)
    saved.roots.clear()
    saved.param_outs.clear()
    saved.param_grads.clear()
    saved.param_ins.clear()
    saved.param_versions.clear()
