"""The loss as part of the traced graph: the last stage returns it, so the partitioner sees it.

With the loss in the graph a rewrite can spread a wide LM head and its cross entropy over
several stages (partition.rewrite.vocab_parallel) without any stage ever holding the whole
logits. The target becomes the graph's last input, fed to whichever stages read it.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx

__all__ = ["TARGET", "attach_loss", "has_loss"]

TARGET = "fxpipe_target"  # the placeholder attach_loss adds
_SUBMODULE = "fxpipe_loss"  # where a loss that is an nn.Module (or holds one) lives in the graph module


class _Loss(torch.nn.Module):
    def __init__(self, fn: Callable[[Any, Any], torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, output: Any, target: Any) -> torch.Tensor:
        return self.fn(output, target)


def has_loss(gm: torch.fx.GraphModule) -> bool:
    """Whether attach_loss has put a loss into `gm`."""
    return bool(gm.meta.get("fxpipe_loss", False))


def attach_loss(gm: torch.fx.GraphModule, loss_fn: Callable[[Any, Any], torch.Tensor]) -> str | None:
    """Append `loss_fn(output, target)` to gm's graph, in place; None on success, else why not.

    The graph gains a last placeholder `fxpipe_target` and returns the loss instead of the
    model's output. Only a model whose output is one tensor qualifies, and `loss_fn` must be
    traceable by torch.fx (no control flow on tensor values) and hold no parameters; when it
    does not qualify, gm is left as it was and the reason is returned.
    """
    if has_loss(gm):
        return None
    out = next(n for n in gm.graph.nodes if n.op == "output")
    value = out.args[0]
    if isinstance(value, (tuple, list)) and len(value) == 1:
        value = value[0]
    if not isinstance(value, torch.fx.Node):
        return "the model's output is not one tensor"
    wrapper = _Loss(loss_fn)
    if any(True for _ in wrapper.parameters()):
        return "the loss function holds parameters"
    try:
        loss_graph = torch.fx.symbolic_trace(wrapper).graph
    except Exception as e:  # fx raises many kinds of errors on untraceable code
        return f"torch.fx cannot trace the loss function ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
    g = gm.graph
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    with g.inserting_after(placeholders[-1]) if placeholders else g.inserting_before(next(iter(g.nodes))):
        target = g.placeholder(TARGET)
    ins = [n for n in loss_graph.nodes if n.op == "placeholder"]
    uses_module = False
    for n in loss_graph.nodes:
        if n.op in ("call_module", "get_attr"):
            n.target = f"{_SUBMODULE}.{n.target}"
            uses_module = True
    if type(g._codegen) is not torch.fx.graph.CodeGen:  # torch.export's: flat placeholders from here on,
        g.set_codegen(torch.fx.graph.CodeGen())          # and no hook checking the (args, kwargs) structure
        gm._forward_pre_hooks.clear()
        gm._forward_pre_hooks_with_kwargs.clear()
    g.erase_node(out)
    loss = g.graph_copy(loss_graph, {ins[0]: value, ins[1]: target})
    g.output(loss)
    if uses_module:
        gm.add_submodule(_SUBMODULE, wrapper)
    if hasattr(gm, "_out_spec"):  # torch.export's output structure: now one tensor
        import torch.utils._pytree as pytree
        gm._out_spec = pytree.tree_flatten(torch.zeros(()))[1]
    gm.meta["fxpipe_loss"] = True
    g.lint()
    gm.recompile()
    return None
