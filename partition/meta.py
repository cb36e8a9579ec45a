"""Models on the meta device: planned from shapes alone, nothing the size of the model allocated.

A model built under `with torch.device("meta"):` has parameters and buffers with shapes and
dtypes but no storage. Tracing, the FLOP costs and the memory model run it on meta tensors (the
example inputs are moved to the meta device for that); pipe materializes only each rank's stages
(pipe.weights), and measured costs time the graph block by block on the target device
(partition.measure).
"""
from __future__ import annotations

import copy
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

__all__ = ["on_meta", "to_meta", "meta_copy", "retarget"]


def on_meta(model: torch.nn.Module) -> bool:
    """Whether any of the model's parameters or buffers is on the meta device."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def to_meta(tree: Any) -> Any:
    """`tree` with every tensor replaced by a meta tensor of its shape, stride and dtype."""
    def move(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or x.is_meta:
            return x
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta").requires_grad_(x.requires_grad)
    return pytree.tree_map(move, tree)


def meta_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` with every parameter and buffer on the meta device, tied tensors still tied
    (`model.to("meta")` would replace each module's tensors apart, untying them)."""
    from torch.distributed.tensor import DTensor
    memo: dict[int, Any] = {}
    for t in (*model.parameters(), *model.buffers()):
        if id(t) not in memo:  # a sharded (FSDP) tensor as the whole one
            m = torch.empty(t.shape, dtype=t.dtype, device="meta") if isinstance(t, DTensor) else \
                torch.empty_like(t, device="meta")
            memo[id(t)] = torch.nn.Parameter(m, t.requires_grad) if isinstance(t, torch.nn.Parameter) else m
    return copy.deepcopy(model, memo)


def retarget(gm: torch.fx.GraphModule, device: torch.device) -> None:
    """Make `gm` (a graph traced on the meta device) create its tensors on `device`: torch.export
    writes the device it traced on into factory calls (`arange(16, device=meta)`), which on a real
    device would make meta tensors. In place, recompiled when anything changed."""
    meta = torch.device("meta")
    changed = False
    for node in gm.graph.nodes:
        if node.kwargs.get("device") == meta:
            node.kwargs = {**node.kwargs, "device": device}
            changed = True
        if any(a == meta for a in node.args if isinstance(a, torch.device)):
            node.args = tuple(device if isinstance(a, torch.device) and a == meta else a for a in node.args)
            changed = True
    if changed:
        gm.recompile()
