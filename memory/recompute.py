"""Recomputation of a stage's forward in its backward: full, selective (matmuls kept) or a kept-node set.

Every policy is torch's non-reentrant `torch.utils.checkpoint.checkpoint` around the whole
stage, once per microbatch; `selective` and `auto` add torch's selective checkpoint contexts
(`create_selective_checkpoint_contexts`): `selective` keeps the outputs of matmul,
convolution and attention ops, `auto` keeps the outputs of the fx nodes the knapsack chose
(`memory.budget`), known from a marker the stage graph calls before each node.
"""
from __future__ import annotations

import functools
import operator
from typing import Any, Callable

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

__all__ = ["MATMUL_OPS", "Markers", "instrument", "is_matmul_node", "Recomputed", "ChainedHooks"]

_aten = torch.ops.aten
MATMUL_OPS = {
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
    _aten.convolution.default, _aten._convolution.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
}
_MATMUL_MODULES = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d,
                   torch.nn.ConvTranspose1d, torch.nn.ConvTranspose2d, torch.nn.ConvTranspose3d,
                   torch.nn.MultiheadAttention, torch.nn.Bilinear)
_MATMUL_FUNCTIONS: set[Any] = {
    torch.matmul, torch.mm, torch.bmm, torch.baddbmm, torch.addmm, torch.einsum, operator.matmul,
    torch.nn.functional.linear, torch.nn.functional.conv1d, torch.nn.functional.conv2d,
    torch.nn.functional.conv3d, torch.nn.functional.scaled_dot_product_attention,
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.convolution.default,
    _aten.linear.default, _aten.matmul.default, _aten.scaled_dot_product_attention.default}


def is_matmul_node(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """A node the 'selective' policy keeps: a matmul, convolution or attention."""
    if node.op == "call_module":
        return isinstance(gm.get_submodule(str(node.target)), _MATMUL_MODULES)
    if node.op == "call_method":
        return node.target in ("matmul", "mm", "bmm", "__matmul__")
    return node.op == "call_function" and node.target in _MATMUL_FUNCTIONS


class Markers(torch.nn.Module):
    """What an instrumented stage graph calls: `(i,)` before node i runs, `(i, value)` after it."""

    def __init__(self, before: Callable[[int], None], after: Callable[[int, Any], None]) -> None:
        super().__init__()
        self.before, self.after = before, after

    def forward(self, i: int, *value: Any) -> None:
        if value:
            self.after(i, value[0])
        else:
            self.before(i)


def instrument(gm: torch.fx.GraphModule, markers: Markers, before: dict[str, int], after: dict[str, int]) -> None:
    """Insert calls to `markers` before the nodes in `before` and after those in `after` (in place)."""
    gm.add_submodule("_fxpipe_memory", markers)
    for node in list(gm.graph.nodes):
        if node.name in before:
            with gm.graph.inserting_before(node):
                gm.graph.call_module("_fxpipe_memory", (before[node.name],))
        if node.name in after:
            with gm.graph.inserting_after(node):
                gm.graph.call_module("_fxpipe_memory", (after[node.name], node))
    gm.recompile()


class ChainedHooks(torch.autograd.graph.saved_tensors_hooks):
    """Observe every tensor saved while active, then hand it to the hooks already in force
    (checkpoint's recomputation hooks), which keep deciding what is stored."""

    def __init__(self, observe: Callable[[torch.Tensor], None]) -> None:
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        outer_pack, outer_unpack = top if top is not None else (lambda t: t, lambda t: t)

        def pack(t: torch.Tensor) -> Any:
            observe(t)
            return outer_pack(t)

        super().__init__(pack, outer_unpack)


class Recomputed(torch.nn.Module):
    """Runs `inner` under non-reentrant checkpoint; a policy decides which op outputs are kept.

    `policy` is "full", "selective" or "keep" (keep the nodes whose marker index is in
    `keep`; `cursor()` gives the node running now). `kept(t)` is told of every tensor the
    selective contexts cache; `recomputed(t)` of every tensor the recomputation saves.
    """

    def __init__(self, inner: torch.nn.Module, policy: str, *, keep: frozenset[int] = frozenset(),
                 cursor: Callable[[], int] = lambda: -1, kept: Callable[[Any], None] = lambda t: None,
                 recomputed: Callable[[torch.Tensor], None] = lambda t: None) -> None:
        super().__init__()
        assert policy in ("full", "selective", "keep"), policy
        self.inner, self.policy, self.keep = inner, policy, keep
        self.cursor, self.kept, self.recomputed = cursor, kept, recomputed

    def _decide(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if self.policy == "selective":
            if op not in MATMUL_OPS:
                return CheckpointPolicy.PREFER_RECOMPUTE
        elif self.cursor() not in self.keep or getattr(op, "is_view", False):
            return CheckpointPolicy.PREFER_RECOMPUTE  # views are free to redo, and caching one pins its base
        out = ctx.op_output
        outs = [out] if isinstance(out, torch.Tensor) else [t for t in pytree.tree_leaves(out)
                                                             if isinstance(t, torch.Tensor)]
        if self.policy == "keep":  # an output aliasing an input would pin that input's storage too
            bases = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs))
                     if isinstance(t, torch.Tensor)}
            if any(t.untyped_storage().data_ptr() in bases for t in outs):
                return CheckpointPolicy.PREFER_RECOMPUTE
        for t in outs:
            self.kept(t)
        return CheckpointPolicy.MUST_SAVE

    def _contexts(self) -> tuple[Any, Any]:
        return create_selective_checkpoint_contexts(self._decide)

    def _run(self, calls: list[int], *args: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            return self.inner(*args)
        with ChainedHooks(self.recomputed):
            return self.inner(*args)

    def forward(self, *args: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.inner(*args)
        run = functools.partial(self._run, [0])
        if self.policy == "full":
            return checkpoint(run, *args, use_reentrant=False)
        return checkpoint(run, *args, use_reentrant=False, context_fn=self._contexts)
