"""Training and evaluation mode: a trace fixes the mode the model had (a `self.training` read in forward
becomes a constant of the graph), so a pipeline evaluates in the other mode with stages split from a
trace made in that mode, its modules' own flags (dropout, batch norm) set to it while they run."""
from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Callable

import torch
import torch.fx

from partition.loss import attach_loss
from partition.meta import retarget, to_meta
from partition.plan import Plan
from partition.split import split_graph, stage_io
from partition.trace import trace

__all__ = ["in_mode", "traced_in_mode", "stages_in_mode"]


@contextlib.contextmanager
def in_mode(modules: Iterable[torch.nn.Module], training: bool) -> Iterator[None]:
    """Every module of `modules` (and their submodules) in mode `training` inside; each module's own
    flag as it was after."""
    flags = {m: m.training for root in modules for m in root.modules()}
    try:
        for m in flags:
            m.training = training
        yield
    finally:
        for m, flag in flags.items():
            m.training = flag


def traced_in_mode(model: torch.nn.Module, args: Sequence[Any], kwargs: dict[str, Any], training: bool, *,
                   leaf_modules: Any, loss_fn: Callable[..., Any] | None, loss: bool,
                   device: torch.device) -> torch.fx.GraphModule:
    """`model` (a meta copy: partition.meta.meta_copy) traced in mode `training` on meta copies of the
    example, its factory calls made for `device`, with the loss attached when the plan has it in its
    graph. ValueError when the loss cannot go into it."""
    with in_mode([model], training):
        gm = trace(model, to_meta(tuple(args)), to_meta(dict(kwargs)), leaf_modules=leaf_modules)
    retarget(gm, device)
    why = attach_loss(gm, loss_fn) if loss and loss_fn is not None else None
    if why:
        raise ValueError(f"loss_fn cannot go into the graph traced in {'training' if training else 'eval'} mode: {why}")
    return gm


def stages_in_mode(gm: torch.fx.GraphModule, plan: Plan, roots: Mapping[int, torch.nn.Module]
                   ) -> dict[int, tuple[torch.fx.GraphModule, list[int]]]:
    """The stages `roots` names (stage -> the module holding its parameters and submodules under the
    model's names) cut from `gm` by `plan`: each called as the training stage is (received values, then
    the model inputs at the returned positions). PlanError when `gm`'s operations differ from the plan's
    graph (the mode changed the model's control flow)."""
    cut = split_graph(gm, plan)
    return {s: (torch.fx.GraphModule(root, cut[s].graph, f"Stage{s}InMode"), list(stage_io(cut[s]).inputs))
            for s, root in roots.items()}
