"""Training and evaluation mode: a trace fixes the mode the model had (a `self.training` read in forward
becomes a constant of the graph), so a pipeline evaluates in the other mode with stages split from a
trace made in that mode, its modules' own flags (dropout, batch norm) set to it while they run."""
from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterable, Iterator, Mapping, Sequence
from difflib import SequenceMatcher
from typing import Any, Callable

import torch
import torch.fx
import torch.utils._pytree

from partition.loss import attach_loss
from partition.meta import meta_copy, on_meta, retarget, to_meta
from partition.plan import Plan, PlanError
from partition.rewrite import apply_rewrites
from partition.split import live_values, subgraph
from partition.trace import flatten_outputs, trace

__all__ = ["in_mode", "matched", "renamed", "traceable", "traced_in_mode", "stages_in_mode"]

# what a mode may drop (a dropout and the output it picks), and what may stand for it in another (a copy)
_DROPOUT = {torch.ops.aten.native_dropout.default, torch.ops.aten.dropout.default, torch.nn.functional.dropout,
            operator.getitem}
_COPIES = {torch.ops.aten.clone.default, torch.ops.aten.alias.default}
# batch norm under torch.export: in training mode it normalizes by the batch's statistics and writes the running
# ones back (and counts the batches), in eval mode it reads them
_NORM_TRAINING = torch.ops.aten._native_batch_norm_legit_functional.default
_NORM_EVAL = torch.ops.aten._native_batch_norm_legit_no_training.default


def _norm_bookkeeping(n: torch.fx.Node) -> bool:
    """Whether `n` is what a batch norm does in training mode alone under torch.export: its count of batches (the
    buffer read, one added), a running statistic it returns, or the write of either back into its buffer."""
    def buffer(a: Any) -> bool:
        return isinstance(a, torch.fx.Node) and a.op == "get_attr"
    if n.op == "get_attr":
        return str(n.target).endswith("num_batches_tracked") and all(_norm_bookkeeping(u) for u in n.users)
    if n.target is torch.ops.aten.add.Tensor:
        return buffer(n.args[0]) and str(n.args[0].target).endswith("num_batches_tracked")  # type: ignore[union-attr]
    if n.target is torch.ops.aten.copy_.default:  # (only what batch norm writes back: another write of a buffer is
        return buffer(n.args[0]) and isinstance(n.args[1], torch.fx.Node) and _norm_bookkeeping(n.args[1])  # kept)
    return n.target is operator.getitem and isinstance(n.args[0], torch.fx.Node) and \
        n.args[0].target is _NORM_TRAINING and n.args[1] in (3, 4)


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


def traceable(model: torch.nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any]) -> torch.nn.Module:
    """`model` to trace on the example `args`, `kwargs`: itself where its parameters and buffers are all on
    the example's device (or all on meta), else a meta copy (partition.meta.meta_copy). A pipeline moves its stages'
    parameters, which are the model's own, to its device: on a GPU the model then holds this rank's
    stages there and the other ranks' where they were, and cannot run on the example."""
    leaves = torch.utils._pytree.tree_leaves((tuple(args), dict(kwargs)))
    example = {t.device for t in leaves if isinstance(t, torch.Tensor)} or {torch.device("cpu")}
    held = {t.device for t in (*model.parameters(), *model.buffers())}
    return model if held <= example or held == {torch.device("meta")} else meta_copy(model)


def traced_in_mode(model: torch.nn.Module, args: Sequence[Any], kwargs: dict[str, Any], training: bool, *,
                   leaf_modules: Any, loss_fn: Callable[..., Any] | None, loss: bool,
                   device: torch.device) -> torch.fx.GraphModule:
    """`model` traced in mode `training` (its flags as they were after), a model on the meta device (a copy:
    partition.meta.meta_copy) on meta copies of the example with its factory calls made for `device`, with
    the loss attached when the plan has it in its graph. ValueError when the loss cannot go into it."""
    meta = on_meta(model)
    with in_mode([model], training):
        gm = trace(model, to_meta(tuple(args)) if meta else tuple(args), to_meta(dict(kwargs)) if meta else
                   dict(kwargs), leaf_modules=leaf_modules)
    if meta:
        retarget(gm, device)
    why = attach_loss(gm, loss_fn) if loss and loss_fn is not None else None
    if why:
        raise ValueError(f"loss_fn cannot go into the graph traced in {'training' if training else 'eval'} mode: {why}")
    return gm


def matched(fresh: torch.fx.GraphModule, gm: torch.fx.GraphModule
            ) -> tuple[dict[str, str], set[str], list[torch.fx.Node]]:
    """`gm`'s nodes -> the names of the nodes of `fresh` (the model traced in the plan's mode, before any
    rewrite) they stand for, the nodes of `fresh` that `gm` has none for, and the copies of `gm` that stand for
    nothing of `fresh`. The graphs are aligned in program order by operation; where they differ only a dropout or a
    copy may give way, to a copy (torch.export in eval mode) or to nothing, a copy of `gm` may stand for nothing (a
    `.contiguous()` that copies on the meta device, where `gm` was traced, and not where `fresh` was), and
    torch.export's batch norm of training mode stands for its eval mode's, its running statistics' updates giving
    way. PlanError otherwise."""
    a, b = list(fresh.graph.nodes), list(gm.graph.nodes)
    to: dict[str, str] = {}
    extra: list[torch.fx.Node] = []
    gone = {n.name for n in a if _norm_bookkeeping(n)}  # (batch norm's running statistics, in training mode alone)
    a = [n for n in a if n.name not in gone]

    def op(n: torch.fx.Node) -> tuple[str, str]:  # (a .contiguous()'s copy is not a .clone()'s)
        return n.op, "batch norm" if n.target in (_NORM_TRAINING, _NORM_EVAL) else \
            f"{n.target} {n.kwargs.get('memory_format')}" if n.target in _COPIES else str(n.target)
    ops = SequenceMatcher(a=[op(n) for n in a], b=[op(n) for n in b], autojunk=False)
    for tag, i1, i2, j1, j2 in ops.get_opcodes():
        was, now = a[i1:i2], b[j1:j2]
        if tag == "equal":
            to.update((y.name, x.name) for x, y in zip(was, now))
            continue
        if not was and all(n.target in _COPIES for n in now):
            extra += now
            continue
        values = [n for n in was if not all(u in was for u in n.users)]  # what the block passes on
        if not (all(n.target in _DROPOUT | _COPIES for n in was)
                and all(n.target in _COPIES for n in now) and len(now) in (0, len(values))):
            raise PlanError(f"its graph has {', '.join(n.name for n in now[:4]) or 'nothing'} where the plan's graph "
                            f"has {', '.join(n.name for n in was[:4]) or 'nothing'}")
        to.update((y.name, x.name) for x, y in zip(values, now))
        gone |= {n.name for n in was} - {to[y.name] for y in now}
    _same_inputs(fresh, gm, to, gone, extra)
    return to, gone, extra


def _same_inputs(fresh: torch.fx.GraphModule, gm: torch.fx.GraphModule, to: Mapping[str, str], gone: set[str],
                 extra: list[torch.fx.Node]) -> None:
    """PlanError unless each node of `gm` reads what the node of `fresh` it stands for reads (`matched`'s
    alignment, by op alone, could pair a copy with another; found by review: a meta copy's `.contiguous()` paired with
    a user's `.clone()` of a buffer written after it, which then read the buffer after the write); a node that gave
    way (gone, extra) passes its first input on. The graphs' outputs may differ (a ratio's numerator returned)."""
    extras, theirs = {n.name for n in extra}, {n.name: n for n in fresh.graph.nodes}

    def ours(n: torch.fx.Node) -> str | None:
        while n.name in extras:
            n = n.all_input_nodes[0]
        return to.get(n.name)

    def passed(n: torch.fx.Node) -> str:
        while n.name in gone and n.all_input_nodes:
            n = n.all_input_nodes[0]
        return n.name
    for y in gm.graph.nodes:
        if y.name in extras or y.op == "output":
            continue
        x = theirs[to[y.name]]
        got, want = [ours(i) for i in y.all_input_nodes], [passed(i) for i in x.all_input_nodes]
        if got != want:
            raise PlanError(f"its node {y.name} reads {', '.join(map(str, got)) or 'nothing'} where the plan's "
                            f"{x.name} reads {', '.join(want) or 'nothing'}")


def stages_in_mode(gm: torch.fx.GraphModule, fresh: torch.fx.GraphModule, trained: torch.fx.GraphModule,
                   plan: Plan, roots: Mapping[int, torch.nn.Module], names: dict[str, str] | None = None
                   ) -> dict[int, tuple[torch.fx.GraphModule, list[int]]]:
    """The stages `roots` names (stage -> the module holding its parameters and submodules under the
    model's names), cut from `gm` by `plan`, each called as the training stage is (received values, then
    the model inputs at the returned positions). `fresh`: the model traced in the plan's mode; `trained`:
    the graph the plan cut (rewritten). Nodes are matched as `matched` does; a value that crossed a cut
    from a node `gm` lacks crosses from that node's input. PlanError where the cuts would send other
    values than the plan's, or a rewritten node is named otherwise. `names`, when given, receives each node of
    gm (rewritten) -> the name of the plan's node it stands for."""
    to, gone, extra = matched(fresh, gm)
    for n in extra:  # (a copy's value is its input's: what reads it reads that)
        n.replace_all_uses_with(n.all_input_nodes[0])
        gm.graph.erase_node(n)
    if extra:
        gm.recompile()
    back = {v: k for k, v in to.items()}
    todo = [r for r in plan.rewrites if str(r[0]) in back]
    renamed = [str(r[0]) for r in todo if back[str(r[0])] != str(r[0])]
    if renamed:
        raise PlanError(f"the plan rewrites {', '.join(renamed)}, which its graph names otherwise")
    if todo:
        apply_rewrites(gm, todo)
    known = {n.name: n for n in trained.graph.nodes}
    for n in gm.graph.nodes:  # the rewrites' own nodes are named alike in both
        to.setdefault(n.name, n.name)
    if names is not None:
        names.update(to)
    strange = [n.name for n in gm.graph.nodes if to[n.name] not in known]
    if strange:
        raise PlanError(f"its nodes {', '.join(strange[:4])} are not in the plan's graph")

    def passed_on(name: str) -> str:
        """The value a node `gm` lacks passed on: its first input's, through such nodes."""
        while name in gone and known[name].all_input_nodes:
            name = known[name].all_input_nodes[0].name
        return name

    S = plan.n_stages
    planned = {n: st.index for st in plan.stages for n in st.nodes}
    stage_of = {n.name: planned[to[n.name]] for n in gm.graph.nodes if to[n.name] in planned}
    recv = live_values(gm, stage_of, S)
    for s in range(1, S):
        want = [passed_on(v.name) for v in plan.stages[s].recv]
        if want != [to[r] for r in recv[s]]:
            raise PlanError(f"stage {s} would receive {', '.join(recv[s][:4])}, where the plan sends it "
                            f"{', '.join(v.name for v in plan.stages[s].recv[:4])}")
    names = {n.name: n for n in gm.graph.nodes}
    leaves, _ = flatten_outputs(gm)
    out = {}
    for s, root in roots.items():
        sends = leaves if s == S - 1 else [names[r] for r in recv[s + 1]]
        cut, inputs, _ = subgraph(gm, {n for n, t in stage_of.items() if t == s}, stage_of, recv[s], sends,
                                  f"Stage{s}InMode")
        out[s] = (torch.fx.GraphModule(root, cut.graph, f"Stage{s}InMode"), inputs)
    return out


def renamed(gm: torch.fx.GraphModule, names: Mapping[str, str]) -> torch.fx.GraphModule:
    """A copy of gm whose nodes bear the names `names` gives them (the plan's nodes they stand for: stages_in_mode),
    so that what cuts by the plan's names (partition.split.inference_stage) cuts it; gm's own parameters."""
    import copy
    g = copy.deepcopy(gm.graph)
    nodes = list(g.nodes)
    for i, n in enumerate(nodes):  # (through names of their own: no two nodes named alike at any point)
        n.name = f"_fxpipe_renaming_{i}"
    for n, was in zip(nodes, gm.graph.nodes):
        n.name = names.get(was.name, was.name)
    out = torch.fx.GraphModule(gm, g, type(gm).__name__)
    out.meta.update(gm.meta)
    if "fxpipe_model_out" in gm.meta:  # (partition.loss.model_outputs: the model's outputs by node name)
        leaves, spec = gm.meta["fxpipe_model_out"]
        out.meta["fxpipe_model_out"] = ([(is_node, names.get(x, x) if is_node else x) for is_node, x in leaves], spec)
    for attr in ("_in_spec", "_out_spec"):
        if hasattr(gm, attr):
            setattr(out, attr, getattr(gm, attr))
    return out
