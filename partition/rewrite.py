"""Graph rewrites before cutting: a linear layer too slow for any one stage becomes slices.

Two forms. `split_linear` cuts a linear layer into row slices joined by a concatenation,
the same numbers in pieces. `vocab_parallel` applies when the layer's output goes only into
a cross entropy (an LM head with the loss in the graph, see partition.loss): slice k folds
its logits into running per-row statistics (log-sum-exp so far, the target's logit if seen),
so between slices only the hidden states and two floats per row travel, never the logits.
"""
from __future__ import annotations

import operator
from typing import Any, Mapping, Sequence

import torch
import torch.fx
import torch.nn.functional as F

from partition.costs import attr_of

__all__ = ["linear_rows", "logit_size", "loss_args", "splittable_linear", "split_linear", "vocab_slice", "vocab_loss",
           "vocab_parallel_loss", "vocab_parallel_why", "vocab_parallel", "apply_rewrites"]


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lo: int, hi: int) -> torch.Tensor:
    """Output features [lo, hi) of F.linear(x, weight, bias): the same numbers, a slice of the work."""
    return F.linear(x, weight[lo:hi], None if bias is None else bias[lo:hi])


class _LseAndPicked(torch.autograd.Function):
    """(logsumexp of each row of z, z[row, idx[row]] where `inside` else 0), with the gradient of z in
    one buffer: the softmax scaled by the first's grad, plus the second's grad at each row's index.
    Autograd's own (logsumexp's, then gather's) zero-fills a second buffer of z's size and adds it."""

    @staticmethod
    def forward(ctx: Any, z: torch.Tensor, idx: torch.Tensor, inside: torch.Tensor) -> tuple[torch.Tensor, ...]:
        zf = z.to(torch.promote_types(z.dtype, torch.float32))  # at least float32 (bfloat16 logits under
        # autocast), as cross entropy works
        lse = torch.logsumexp(zf, dim=1)
        picked = zf.gather(1, idx.unsqueeze(1)).squeeze(1).masked_fill(~inside, 0.0)
        ctx.save_for_backward(z, idx, inside)
        return lse, picked

    @staticmethod
    def backward(ctx: Any, g_lse: torch.Tensor | None, g_picked: torch.Tensor | None) -> tuple[Any, ...]:
        z, idx, inside = ctx.saved_tensors
        # the softmax of each row, exp(z - logsumexp): torch's softmax kernel forms it in 0.58x the time of
        # a subtraction and an exp (3.5 against 6.0 ms for 512 x 8000 on one CPU thread)
        zf = z.to(torch.promote_types(z.dtype, torch.float32))
        dz = torch.softmax(zf, 1).mul_(g_lse.unsqueeze(1)) if g_lse is not None else torch.zeros_like(zf)
        if g_picked is not None:
            dz.scatter_add_(1, idx.unsqueeze(1), g_picked.masked_fill(~inside, 0.0).unsqueeze(1).to(dz.dtype))
        return dz.to(z.dtype), None, None


def vocab_slice(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
                lo: int, hi: int, stats: torch.Tensor | None) -> torch.Tensor:
    """Logits [lo, hi) of F.linear(h, weight, bias), one row per target, folded into `stats`.

    Row i of the result holds (log-sum-exp of row i's logits in [0, hi), the logit of row i's
    target if it lies in [0, hi), else 0); `stats` holds the same for [0, lo), or is None when
    lo is 0. h is (..., d) with its leading dims flattened to the target's rows.
    """
    z = F.linear(h.reshape(-1, h.shape[-1]), weight[lo:hi], None if bias is None else bias[lo:hi])  # (N, hi-lo)
    t = target.reshape(-1).long()  # (N,)
    inside = (t >= lo) & (t < hi)
    lse, picked = _LseAndPicked.apply(z, (t - lo).clamp(0, hi - lo - 1), inside)
    if stats is None:
        return torch.stack((lse, picked), 1)  # (N, 2)
    return torch.stack((torch.logaddexp(stats[:, 0], lse), stats[:, 1] + picked), 1)


def vocab_loss(stats: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str,
               vocab: int = 0) -> torch.Tensor:
    """F.cross_entropy's result from the statistics of every slice (rows whose target is
    `ignore_index` count as 0 and are left out of the mean, as there), in float32; a target outside
    [0, vocab) other than ignore_index is an error, as there."""
    t = target.reshape(-1)
    valid = t != ignore_index
    if vocab:
        torch._assert_async(torch.logical_not((valid & ((t < 0) | (t >= vocab))).any()),
                            "a target of the cross entropy lies outside [0, vocabulary size) and is not its "
                            "ignore_index (fxpipe's vocabulary-parallel loss)")
    per = (stats[:, 0] - stats[:, 1]).masked_fill(~valid, 0.0)  # -log softmax(z)[target]
    if reduction == "none":
        return per
    if reduction == "sum":
        return per.sum()
    return per.sum() / valid.sum()


torch.fx.wrap("linear_rows")
torch.fx.wrap("vocab_slice")
torch.fx.wrap("vocab_loss")
torch.fx.wrap("logit_size")

_LINEAR_FUNCTIONS = (F.linear, torch.ops.aten.linear.default)



def splittable_linear(gm: torch.fx.GraphModule, node: torch.fx.Node) -> tuple[Any, Any, Any, int] | None:
    """(input, weight, bias, out_features) when `node` is a linear layer whose weight is an attribute."""
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        if type(mod) is not torch.nn.Linear or len(node.args) != 1 or node.kwargs:
            return None
        return node.args[0], f"{node.target}.weight", None if mod.bias is None else f"{node.target}.bias", \
            mod.out_features
    if node.op == "call_function" and node.target in _LINEAR_FUNCTIONS:
        args = list(node.args) + [node.kwargs.get("bias")] * (3 - len(node.args))
        x, w, b = args[:3]
        if not (isinstance(w, torch.fx.Node) and w.op == "get_attr"):
            return None
        if b is not None and not (isinstance(b, torch.fx.Node) and b.op == "get_attr"):
            return None
        weight = attr_of(gm, str(w.target))
        return x, w, b, int(weight.shape[0])
    return None


def split_linear(gm: torch.fx.GraphModule, name: str, parts: int | Sequence[int], recompile: bool = True) -> None:
    """Replace linear node `name` by `parts` row slices and a concatenation, in place (`recompile`: gm's code
    too; apply_rewrites does that once, after them all).

    Each slice reads the whole weight (so a stage holding one slice holds the weight, and
    the grads of the stages sharing it are summed like a tied weight's); values are unchanged.
    """
    node = next((n for n in gm.graph.nodes if n.name == name), None)
    found = splittable_linear(gm, node) if node is not None else None
    if node is None or found is None:
        raise ValueError(f"cannot split node {name!r}: it is not a linear layer with its weight as an attribute")
    x, w, b, out = found
    bounds = _bounds(parts, out)
    g = gm.graph
    with g.inserting_before(node):
        if isinstance(w, str):
            w = g.get_attr(w)
            b = g.get_attr(b) if isinstance(b, str) else None
        # the slices live inside linear_rows, so no view of the weight can cross a cut
        pieces = [g.create_node("call_function", linear_rows, (x, w, b, lo, hi), {}, name=f"{name}_rows{i}")
                  for i, (lo, hi) in enumerate(zip(bounds, bounds[1:]))]
        cat = g.create_node("call_function", torch.cat, (pieces, -1), {}, name=f"{name}_cat")
    node.replace_all_uses_with(cat)
    g.erase_node(node)
    g.lint()
    if recompile:
        gm.recompile()


_CE_SIGNATURE = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction",
                 "label_smoothing")
_REDUCTIONS = ("none", "mean", "sum")
_MERGING = {"reshape", "view", "flatten", "contiguous", torch.reshape, torch.flatten,
            torch.ops.aten.reshape.default, torch.ops.aten.view.default, torch.ops.aten.flatten.using_ints,
            torch.ops.aten._unsafe_view.default, torch.ops.aten.clone.default}


# per loss: its function, its ATen ops, their signatures, its module and the module's fields it takes
_LOSS_FORMS: dict[str, tuple[Any, tuple[Any, ...], tuple[str, ...], tuple[str, ...], type, tuple[str, ...]]] = {
    "cross_entropy": (F.cross_entropy, (torch.ops.aten.cross_entropy_loss.default,), _CE_SIGNATURE,
                      ("input", "target", "weight", "reduction", "ignore_index", "label_smoothing"),
                      torch.nn.CrossEntropyLoss, ("weight", "ignore_index", "reduction", "label_smoothing")),
    "nll_loss": (F.nll_loss, (torch.ops.aten.nll_loss.default, torch.ops.aten.nll_loss_nd.default),
                 ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction"),
                 ("input", "target", "weight", "reduction", "ignore_index"), torch.nn.NLLLoss,
                 ("weight", "ignore_index", "reduction")),
}


def loss_args(gm: torch.fx.GraphModule, node: torch.fx.Node, kind: str) -> dict[str, Any] | None:
    """The arguments by name of `node` when it is the loss `kind` ("cross_entropy", "nll_loss") as a function,
    an ATen op or a module; else None."""
    fn, aten, names, aten_names, module, fields = _LOSS_FORMS[kind]
    if node.op == "call_function" and (node.target is fn or node.target in aten):
        got: dict[str, Any] = dict(zip(names if node.target is fn else aten_names, node.args))
        got.update(node.kwargs)
        if node.target is not fn and "reduction" in got:  # ATen: 0 none, 1 mean, 2 sum
            got["reduction"] = _REDUCTIONS[int(got["reduction"])]
        return got
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        if type(mod) is module and len(node.args) + len(node.kwargs) == 2:
            got = dict(zip(("input", "target"), node.args))
            got.update(node.kwargs)
            got.update({f: getattr(mod, f) for f in fields})
            return got
    return None


def _ce_args(gm: torch.fx.GraphModule, node: torch.fx.Node) -> dict[str, Any] | None:
    """The arguments of a cross-entropy node by name, or None if `node` is not one."""
    return loss_args(gm, node, "cross_entropy")


def vocab_parallel_loss(gm: torch.fx.GraphModule, node: torch.fx.Node,
                        shapes: Mapping[str, Sequence[int]] | None = None,
                        dtypes: Mapping[str, str] | None = None) -> torch.fx.Node | None:
    """The cross-entropy node that linear `node` alone feeds, through reshapes that merge its
    leading dims (and casts to the dtype it already has), when vocab_parallel can replace the
    pair. `shapes` (output shapes by node name) check that the reshapes keep one row per
    token, `dtypes` that casts change nothing; without them (re-applying a plan made on a
    costed graph) only the structure is checked. See vocab_parallel_why for the reason of a None."""
    return vocab_parallel_why(gm, node, shapes, dtypes)[0]


def vocab_parallel_why(gm: torch.fx.GraphModule, node: torch.fx.Node,
                       shapes: Mapping[str, Sequence[int]] | None = None,
                       dtypes: Mapping[str, str] | None = None) -> tuple[torch.fx.Node | None, str]:
    """(the cross-entropy node, "") as vocab_parallel_loss finds it, or (None, why not)."""
    if splittable_linear(gm, node) is None:
        return None, f"{node.name} is not a linear layer with its weight as an attribute"
    if _size_queries(node) is None:
        return None, f"{node.name}'s shape is used other than by .size(i) or .shape[i]"
    cur = node
    while len(_others(cur)) == 1:
        (user,) = _others(cur)
        ce = _ce_args(gm, user)
        if ce is not None:
            reduction = ce.get("reduction", "mean")
            ok = (ce.get("input") is cur and isinstance(ce.get("target"), torch.fx.Node)
                  and ce.get("weight") is None and ce.get("size_average") is None and ce.get("reduce") is None
                  and not ce.get("label_smoothing") and reduction in _REDUCTIONS
                  and isinstance(ce.get("ignore_index", -100), int))
            if not ok:
                return None, ("its cross entropy has class weights, label smoothing, a legacy reduction or an "
                              "ignore_index that is not a constant")
            kind = (dtypes or {}).get(ce["target"].name)
            if kind is not None and (getattr(torch, kind, None) is None or getattr(torch, kind).is_floating_point):
                return None, f"its cross entropy's target is {kind} (probabilities), not class indices"
            if shapes is not None:
                rows, logits = list(shapes.get(cur.name, ())), list(shapes.get(node.name, ()))
                if not (len(rows) == 2 and bool(logits) and rows[1] == logits[-1]):
                    return None, f"the cross entropy reads the logits as shape {rows}, not one row per token"
                # reduction 'none' gives one loss per flattened row: only the same when the logits are 2-D
                if reduction == "none" and len(logits) != 2:
                    return None, "reduction='none' over logits of more than two dims"
            return user, ""
        target = user.target if user.op in ("call_function", "call_method") else None
        if (target not in _MERGING and not _same_dtype_cast(user, node, dtypes)) or not user.args \
                or user.args[0] is not cur:
            return None, f"{node.name}'s output reaches the loss through {_op_name(user)}, which is not a reshape"
        if cur is not node and _others(cur) != list(cur.users):  # only the logits' own sizes are rewritten
            return None, f"the size of {cur.name} (not of the logits) is asked for"
        cur = user
    if len(_others(cur)) > 1:
        return None, f"{cur.name} is used {len(_others(cur))} times (only a single cross entropy may read the logits)"
    return None, f"{node.name}'s output does not reach a cross entropy in the graph"


def _same_dtype_cast(user: torch.fx.Node, logits: torch.fx.Node, dtypes: Mapping[str, str] | None) -> bool:
    """A cast of the logits to the dtype they already have (`.float()` on float32 logits): no op."""
    to: Any = None
    if user.op == "call_method" and user.target == "float" and len(user.args) == 1 and not user.kwargs:
        to = torch.float32
    elif user.op == "call_method" and user.target == "to" and len(user.args) == 2 and not user.kwargs:
        to = user.args[1]
    elif user.op == "call_method" and user.target == "to" and len(user.args) == 1 and set(user.kwargs) == {"dtype"}:
        to = user.kwargs["dtype"]
    if not isinstance(to, torch.dtype):
        return False
    have = (dtypes or {}).get(logits.name, "float32")  # re-applying a plan: checked when it was made
    return str(to).removeprefix("torch.") == have


def _op_name(node: torch.fx.Node) -> str:
    t = node.target
    return f"{node.op} {t if isinstance(t, str) else getattr(t, '__name__', t)}"


def logit_size(x: torch.Tensor, dim: int, out_features: int) -> int:
    """Size `dim` of F.linear(x, weight) without computing it: out_features for the last dim."""
    d = x.dim()
    return out_features if dim % d == d - 1 else x.size(dim)


def _size_queries(node: torch.fx.Node) -> list[tuple[torch.fx.Node, int]] | None:
    """The users of `node` that only ask one of its sizes (`t.size(i)`, `t.shape[i]`) and the dim
    each asks, or None if some use of its shape is of another kind (kept out of the rewrite)."""
    found = []
    for u in node.users:
        if u.op == "call_method" and u.target == "size":
            if len(u.args) != 2 or not isinstance(u.args[1], int) or u.kwargs:
                return None
            found.append((u, u.args[1]))
        elif u.op == "call_function" and u.target is getattr and u.args[1:] == ("shape",):
            for g in u.users:
                if not (g.op == "call_function" and g.target is operator.getitem and isinstance(g.args[1], int)):
                    return None
                found.append((g, int(g.args[1])))
    return found


def _others(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The users of `node` other than size queries."""
    asks = {u for u in node.users if u.op == "call_method" and u.target == "size"
            or u.op == "call_function" and u.target is getattr and u.args[1:] == ("shape",)}
    return [u for u in node.users if u not in asks]


def vocab_parallel(gm: torch.fx.GraphModule, name: str, parts: int | Sequence[int],
                   shapes: Mapping[str, Sequence[int]] | None = None, recompile: bool = True) -> None:
    """Replace linear `name` and the cross entropy it feeds by vocabulary slices (in place; `recompile` as
    split_linear's).

    `parts` is a slice count or the slice bounds [0, b1, ..., out_features]. The loss value
    is unchanged up to rounding; each slice reads the whole weight, as in split_linear.
    """
    node = next((n for n in gm.graph.nodes if n.name == name), None)
    found = splittable_linear(gm, node) if node is not None else None
    ce = vocab_parallel_loss(gm, node, shapes) if node is not None and found is not None else None
    if node is None or found is None or ce is None:
        raise ValueError(f"cannot make node {name!r} vocabulary-parallel: it is not a linear layer whose output "
                         "goes only into a cross entropy with default weight and label smoothing")
    x, w, b, out = found
    bounds = _bounds(parts, out)
    args = _ce_args(gm, ce)
    assert args is not None
    g = gm.graph
    with g.inserting_before(ce):
        if isinstance(w, str):
            w = g.get_attr(w)
            b = g.get_attr(b) if isinstance(b, str) else None
        stats: torch.fx.Node | None = None
        for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            stats = g.create_node("call_function", vocab_slice, (x, w, b, args["target"], lo, hi, stats), {},
                                  name=f"{name}_vocab{i}")
        loss = g.create_node("call_function", vocab_loss,
                             (stats, args["target"], int(args.get("ignore_index", -100)),
                              str(args.get("reduction", "mean")), out), {}, name=f"{name}_loss")
    for q, dim in _size_queries(node) or []:  # e.g. logits.view(-1, logits.size(-1)): sizes without logits
        with g.inserting_before(q):
            q.replace_all_uses_with(g.create_node("call_function", logit_size, (x, dim, out), {}))
        g.erase_node(q)
    for u in [u for u in node.users if not u.users and u.op == "call_function" and u.target is getattr]:
        g.erase_node(u)  # a .shape whose items were all asked for above
    ce.replace_all_uses_with(loss)
    dead = [ce]
    while dead:
        n = dead.pop()
        inputs = [i for i in n.all_input_nodes if i.op != "placeholder"]
        g.erase_node(n)
        dead += [i for i in inputs if not i.users and i.op != "get_attr" and i not in dead]
    g.lint()
    if recompile:
        gm.recompile()


# Slice bounds fall on multiples of this where every slice keeps at least as many features: a product
# whose output width is not a multiple of 8 ran 1.3x longer per column on one CPU core (512 x 256 by
# 256 x 5333: 5.5 us per column, by 256 x 5336: 4.0; medians of 9 alternating)
_ALIGN = 8


def _bounds(parts: int | Sequence[int], out: int) -> list[int]:
    if isinstance(parts, int):
        k = max(1, min(parts, out))
        if out >= k * _ALIGN:
            return [_ALIGN * round(i * out / k / _ALIGN) for i in range(k)] + [out]
        return [round(i * out / k) for i in range(k + 1)]
    bounds = [int(b) for b in parts]
    if bounds[0] != 0 or bounds[-1] != out or any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"slice bounds {bounds} must rise strictly from 0 to the {out} output features")
    return bounds


def apply_rewrites(gm: torch.fx.GraphModule, rewrites: Sequence[Sequence[Any]]) -> torch.fx.GraphModule:
    """Apply a plan's rewrites to a fresh trace, in order: [node, parts] cuts a linear layer into
    row slices, [node, parts, "vocab"] makes it and its cross entropy vocabulary-parallel; parts
    is a count or a list of bounds."""
    for r in rewrites:
        name, parts = str(r[0]), r[1]
        parts = int(parts) if isinstance(parts, (int, float)) else [int(b) for b in parts]
        if len(r) > 2 and r[2] == "vocab":
            vocab_parallel(gm, name, parts, recompile=False)
        else:
            split_linear(gm, name, parts, recompile=False)
    if rewrites:
        gm.recompile()
    return gm
