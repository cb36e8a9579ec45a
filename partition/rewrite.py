"""Graph rewrites before cutting: a linear layer too slow for any one stage becomes row slices."""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx
import torch.nn.functional as F

__all__ = ["linear_rows", "splittable_linear", "split_linear", "apply_rewrites"]


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lo: int, hi: int) -> torch.Tensor:
    """Output features [lo, hi) of F.linear(x, weight, bias): the same numbers, a slice of the work."""
    return F.linear(x, weight[lo:hi], None if bias is None else bias[lo:hi])


torch.fx.wrap("linear_rows")

_LINEAR_FUNCTIONS = (F.linear, torch.ops.aten.linear.default)


def _attr(gm: torch.nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


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
        weight = _attr(gm, str(w.target))
        return x, w, b, int(weight.shape[0])
    return None


def split_linear(gm: torch.fx.GraphModule, name: str, parts: int) -> None:
    """Replace linear node `name` by `parts` row slices and a concatenation, in place.

    Each slice reads the whole weight (so a stage holding one slice holds the weight, and
    the grads of the stages sharing it are summed like a tied weight's); values are unchanged.
    """
    node = next((n for n in gm.graph.nodes if n.name == name), None)
    found = splittable_linear(gm, node) if node is not None else None
    if node is None or found is None:
        raise ValueError(f"cannot split node {name!r}: it is not a linear layer with its weight as an attribute")
    x, w, b, out = found
    parts = max(1, min(parts, out))
    bounds = [round(k * out / parts) for k in range(parts + 1)]
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
    gm.recompile()


def apply_rewrites(gm: torch.fx.GraphModule, rewrites: Sequence[Sequence[Any]]) -> torch.fx.GraphModule:
    """Apply a plan's rewrites ([node name, parts] pairs) to a fresh trace, in order."""
    for name, parts in rewrites:
        split_linear(gm, str(name), int(parts))
    return gm

