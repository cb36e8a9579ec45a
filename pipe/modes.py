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
from partition.plan import Plan, PlanError
from partition.rewrite import apply_rewrites
from partition.split import live_values, subgraph
from partition.trace import flatten_outputs, trace

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


def stages_in_mode(gm: torch.fx.GraphModule, trained: torch.fx.GraphModule, plan: Plan,
                   roots: Mapping[int, torch.nn.Module]) -> dict[int, tuple[torch.fx.GraphModule, list[int]]]:
    """The stages `roots` names (stage -> the module holding its parameters and submodules under the
    model's names), cut from `gm` by `plan`, each called as the training stage is (received values, then
    the model inputs at the returned positions). `trained`: the graph the plan cut. `gm` may lack some of
    its operations (torch.export drops a dropout in eval mode: the identity), and a value that crossed a
    cut from one of them crosses from its input then; PlanError when `gm` has an operation `trained` has
    not, or another, or its cuts would send other values than the plan's."""
    present = {n.name for n in gm.graph.nodes}
    todo = [r for r in plan.rewrites if str(r[0]) in present]
    if todo:
        apply_rewrites(gm, todo)
    names = {n.name: n for n in gm.graph.nodes}
    known = {n.name: n for n in trained.graph.nodes}
    other = [n for n, node in names.items()
             if n not in known or (node.op, node.target) != (known[n].op, known[n].target)]
    if other:
        raise PlanError(f"its graph has operations the plan's graph has not ({', '.join(other[:5])})")
    dropped = set(known) - set(names)

    def passed_on(name: str) -> str:
        """The value a dropped operation passed on: its first input's, through dropped ones."""
        while name in dropped and known[name].all_input_nodes:
            name = known[name].all_input_nodes[0].name
        return name

    S = plan.n_stages
    stage_of = {n: st.index for st in plan.stages for n in st.nodes if n in names}
    recv = live_values(gm, stage_of, S)
    for s in range(1, S):
        want = [passed_on(v.name) for v in plan.stages[s].recv]
        if want != recv[s]:
            raise PlanError(f"stage {s} would receive {', '.join(recv[s][:4])}, where the plan sends it "
                            f"{', '.join(v.name for v in plan.stages[s].recv[:4])}")
    leaves, _ = flatten_outputs(gm)
    out = {}
    for s, root in roots.items():
        sends = leaves if s == S - 1 else [names[r] for r in recv[s + 1]]
        cut, inputs, _ = subgraph(gm, {n for n in plan.stages[s].nodes if n in names}, stage_of, recv[s], sends,
                                  f"Stage{s}InMode")
        out[s] = (torch.fx.GraphModule(root, cut.graph, f"Stage{s}InMode"), inputs)
    return out
