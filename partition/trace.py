"""Trace a model into a torch.fx GraphModule: symbolic_trace first, torch.export as the fallback."""
from __future__ import annotations

import inspect
from typing import Any, Sequence

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.fx._pytree import tree_flatten_spec

__all__ = ["trace", "TraceError", "flatten_inputs", "flatten_outputs", "unflatten_outputs"]


class TraceError(TypeError):
    """Neither torch.fx.symbolic_trace nor torch.export could trace the model."""


class _Tracer(torch.fx.Tracer):
    def __init__(self, leaf_modules: tuple[type[torch.nn.Module], ...]) -> None:
        super().__init__()
        self._leaves = leaf_modules

    def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
        return isinstance(m, self._leaves) or super().is_leaf_module(m, qualname)


def _same(a: Any, b: Any) -> bool:
    la, sa = pytree.tree_flatten(a)
    lb, sb = pytree.tree_flatten(b)
    if len(la) != len(lb):
        return False
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor)
            if x.shape != y.shape or x.dtype != y.dtype or not torch.allclose(x, y, rtol=1e-4, atol=1e-5,
                                                                              equal_nan=True):
                return False
    return True


def _symbolic(model: torch.nn.Module, leaf_modules: tuple[type[torch.nn.Module], ...]) -> torch.fx.GraphModule:
    graph = _Tracer(leaf_modules).trace(model)
    return torch.fx.GraphModule(model, graph, model.__class__.__name__)


def _export(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.fx.GraphModule:
    ep = torch.export.export(model, args, kwargs, strict=False)
    gm = ep.module()
    assert isinstance(gm, torch.fx.GraphModule)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def trace(model: torch.nn.Module, example_args: Sequence[Any], example_kwargs: dict[str, Any] | None = None,
          leaf_modules: Sequence[type[torch.nn.Module]] = ()) -> torch.fx.GraphModule:
    """The model as a GraphModule whose parameters are the model's own, under their original names.

    `torch.fx.symbolic_trace` is tried first and its result is checked against the model on
    the example inputs (control flow on values can make a trace silently wrong); when it
    fails or disagrees, `torch.export.export(strict=False)` traces the model instead.
    """
    args = tuple(example_args)
    kwargs = dict(example_kwargs or {})
    leaves = tuple(leaf_modules)
    with torch.no_grad():
        expected = model(*args, **kwargs)
    reasons: list[str] = []
    for name, fn in (("torch.fx.symbolic_trace", lambda: _symbolic(model, leaves)),
                     ("torch.export.export", lambda: _export(model, args, kwargs))):
        try:
            gm = fn()
            with torch.no_grad():
                got = gm(*args, **kwargs)
        except Exception as e:  # both tracers raise many kinds of errors
            reasons.append(f"{name}: {type(e).__name__}: {str(e).strip().splitlines()[0][:300]}")
            continue
        if _same(got, expected):
            gm.meta["fxpipe_tracer"] = name
            return gm
        reasons.append(f"{name}: the traced graph's output differs from the model's on the example inputs")
    raise TraceError(
        f"cannot trace {type(model).__name__}: " + "; ".join(reasons) +
        ". Fix: make control flow independent of tensor values (or move it into a module passed in "
        "leaf_modules=...), turn off caches and dropout (e.g. config.use_cache=False), or pass the "
        "inputs the model really takes as example_args/example_kwargs.")


def flatten_inputs(gm: torch.fx.GraphModule, args: Sequence[Any], kwargs: dict[str, Any] | None = None
                   ) -> list[Any]:
    """The values of gm's placeholders, in order, for a call `model(*args, **kwargs)`."""
    kwargs = dict(kwargs or {})
    spec = getattr(gm, "_in_spec", None)
    if spec is not None:  # torch.export: placeholders are the flattened (args, kwargs)
        return list(tree_flatten_spec((tuple(args), kwargs), spec))
    names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    sig = inspect.signature(type(gm).forward)
    bound = sig.bind(None, *args, **kwargs)
    bound.apply_defaults()
    return [bound.arguments[str(n)] for n in names]


def flatten_outputs(gm: torch.fx.GraphModule) -> tuple[list[Any], pytree.TreeSpec]:
    """The output node's leaves (fx Nodes or constants) and the spec that rebuilds the model's output."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    leaves, spec = pytree.tree_flatten(out.args[0])
    export_spec = getattr(gm, "_out_spec", None)
    if export_spec is not None:
        return leaves, export_spec
    return leaves, spec


def unflatten_outputs(leaves: Sequence[Any], spec: pytree.TreeSpec) -> Any:
    return pytree.tree_unflatten(list(leaves), spec)
