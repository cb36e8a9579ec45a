"""Cut a traced model into one fx GraphModule per stage, keeping the original parameter names."""
from __future__ import annotations

import inspect
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

from partition.costs import attr_of
from partition.plan import Plan, PlanError, fingerprint
from partition.loss import has_loss, model_outputs
from partition.rewrite import _op_name, apply_rewrites, linear_rows, vocab_slice
from partition.trace import flatten_outputs

__all__ = ["StageIO", "stage_io", "split_graph", "inference_stage", "assemble_outputs", "live_values",
           "example_from_plan", "linear_input", "w_nodes", "param_nodes_of"]


@dataclass
class StageIO:
    """How to call a stage: `stage(*[value of r for r in recv], *[model input i for i in inputs])`.

    It returns the values named in `send` (the next stage's `recv`), or on the last stage
    the model's flat outputs, which `out_spec` rebuilds into the model's output structure.
    """
    index: int
    recv: list[str]
    inputs: list[int]                     # positions in the flat model inputs
    send: list[str]
    last: bool
    out_spec: Any = None
    param_nodes: dict[str, list[str]] = field(default_factory=dict)  # node -> params it reads


def stage_io(stage: torch.nn.Module) -> StageIO:
    """The StageIO that split_graph attached to a stage module."""
    io = getattr(stage, "io", None)
    if not isinstance(io, StageIO):
        raise TypeError(f"{type(stage).__name__} is not a stage made by partition.split (it has no StageIO .io)")
    return io


def live_values(gm: torch.fx.GraphModule, stage_of: dict[str, int], n_stages: int) -> list[list[str]]:
    """recv[s]: values computed on an earlier stage and read on stage s or later (or output).

    A value crosses every boundary between its producer and its last reader, in program order.
    """
    out = next(n for n in gm.graph.nodes if n.op == "output")
    recv: list[list[str]] = [[] for _ in range(n_stages)]
    for node in gm.graph.nodes:
        if node.name not in stage_of:
            continue
        last = max([n_stages - 1 if u is out else stage_of.get(u.name, -1) for u in node.users] + [-1])
        for s in range(stage_of[node.name] + 1, last + 1):
            recv[s].append(node.name)
    return recv


def _needed(gm: torch.fx.GraphModule, own: set[str], stage_of: dict[str, int], roots: list[torch.fx.Node]
            ) -> set[str]:
    """Own nodes plus everything not placed on a stage (replicated ops, attributes, inputs) they read."""
    need: set[str] = set()
    todo = [n for n in gm.graph.nodes if n.name in own] + roots
    writers: dict[str, list[torch.fx.Node]] = {}  # a value -> the unplaced nodes writing it in place
    nodes = {n.name: n for n in gm.graph.nodes}
    for w, written in writes_in_place(gm).items():
        if w not in stage_of:
            for x in written:
                writers.setdefault(x, []).append(nodes[w])
    while todo:
        node = todo.pop()
        if node.name in need:
            continue
        need.add(node.name)
        for a in node.all_input_nodes:
            if a.name not in stage_of:
                todo.append(a)
        if node.name not in stage_of:  # a replicated value comes with its writes, even those whose result is unused
            todo += writers.get(node.name, [])
    return need


def linear_input(gm: torch.nn.Module, node: torch.fx.Node) -> torch.fx.Node | None:
    """The input of `node` when it calls an nn.Linear (exactly that class, without hooks: a forward pre-hook
    changes its input, a forward or backward hook its output or grads) on one tensor and trains its weight
    (autograd then keeps that input for the weight's grad anyway), else None."""
    if node.op != "call_module" or node.kwargs or len(node.args) != 1 or not isinstance(node.args[0], torch.fx.Node):
        return None
    mod = gm.get_submodule(str(node.target))
    from torch.nn.modules import module as hooks
    hooked = any((mod._forward_hooks, mod._forward_pre_hooks, mod._backward_hooks, mod._backward_pre_hooks,
                  hooks._global_forward_hooks, hooks._global_forward_pre_hooks, hooks._global_backward_hooks,
                  hooks._global_backward_pre_hooks))
    return node.args[0] if type(mod) is torch.nn.Linear and mod.weight.requires_grad and not hooked else None


def w_nodes(gm: torch.fx.GraphModule, param_nodes: dict[str, list[str]]) -> list[str]:
    """The nodes of a stage whose weight grads a zero-bubble W computes apart from the rest of the backward,
    as matrix products (pipe.backward, where neither recompute nor offload manage what the forward keeps):
    its nn.Linear calls (`linear_input`) whose parameters no other node of the stage reads.
    `param_nodes`: the stage's nodes (names in `gm`) -> the parameters each reads."""
    nodes = {n.name: n for n in gm.graph.nodes}
    reads = {n: {id(gm.get_parameter(p)): None for p in names} for n, names in param_nodes.items()}
    uses: dict[int, int] = {}
    for ids in reads.values():
        for i in ids:
            uses[i] = uses.get(i, 0) + 1
    return [n for n, ids in reads.items() if n in nodes and linear_input(gm, nodes[n]) is not None
            and all(uses[i] == 1 for i in ids)]


def param_nodes_of(gm: torch.fx.GraphModule, names: Iterable[str]) -> dict[str, list[str]]:
    """The nodes `names` of gm that read parameters -> the parameters each reads (as a stage's
    StageIO.param_nodes)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    return {n: ps for n in names if n in nodes and (ps := _param_names(gm, nodes[n]))}


def _param_names(gm: torch.fx.GraphModule, node: torch.fx.Node) -> list[str]:
    if node.op == "call_module":
        return [f"{node.target}.{n}" for n, _ in gm.get_submodule(str(node.target)).named_parameters()]
    return [str(a.target) for a in node.all_input_nodes
            if a.op == "get_attr" and isinstance(attr_of(gm, str(a.target)), torch.nn.Parameter)]



def subgraph(gm: torch.fx.GraphModule, own: set[str], stage_of: dict[str, int], recv: list[str],
             outputs: list[Any], name: str) -> tuple[torch.fx.GraphModule, list[int], dict[str, list[str]]]:
    """The nodes `own` of `gm` as a GraphModule of their own, called with the values `recv` (made
    elsewhere; each placeholder is named after the node that makes it) and then the model inputs
    it reads, and returning `outputs` (nodes, or constants) as a tuple. Nodes on no stage (inputs,
    attributes, ops replicated from the inputs) are copied in where needed. Also returned: the
    positions of the model inputs it reads, and the parameters each own node reads.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    roots = [x for x in outputs if isinstance(x, torch.fx.Node) and x.name not in stage_of]
    need = _needed(gm, own, stage_of, roots)
    g = torch.fx.Graph()
    env: dict[str, torch.fx.Node] = {}
    for r in recv:
        env[r] = g.placeholder(r)
    inputs = []
    for i, p in enumerate(placeholders):
        if p.name in need:
            env[p.name] = g.placeholder(p.name)
            inputs.append(i)
    param_nodes: dict[str, list[str]] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output") or node.name not in need:
            continue
        env[node.name] = g.node_copy(node, lambda n: env[n.name])
        if node.name in own:
            pn = _param_names(gm, node)
            if pn:
                param_nodes[node.name] = pn
    g.output(tuple(env[x.name] if isinstance(x, torch.fx.Node) else x for x in outputs))
    first = next(n for n in g.nodes if n.op != "placeholder")
    for r in recv:  # a received value is a leaf that requires grad, which autograd lets no op write in place:
        ph = env[r]  # the stage writes a copy of it (as the model wrote the value itself)
        if written_in_place(gm, ph):
            with g.inserting_before(first):
                copy = g.call_method("clone", (ph,))
            copy.meta["fxpipe_copy"] = True  # (a checkpoint region writing it recomputes it: memory.regions)
            ph.replace_all_uses_with(copy, delete_user_cb=lambda u: u is not copy)
    return torch.fx.GraphModule(gm, g, name), inputs, param_nodes


# ops that return a view of their first argument: a write to the view writes the argument
_VIEWS = {"view", "view_as", "reshape", "reshape_as", "transpose", "permute", "flatten", "unflatten", "unsqueeze",
          "squeeze", "expand", "expand_as", "narrow", "select", "t", "chunk", "split", "unbind", "getitem",
          "__getitem__", "as_strided", "movedim", "swapaxes", "diagonal", "unfold", "real", "imag", "detach",
          "split_with_sizes", "slice", "alias"}


def _name(target: Any) -> str:
    """An fx target's bare name: a method's, a function's or an aten overload's ('relu_' for aten.relu_.default)."""
    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1]
    return getattr(target, "__name__", "")


def _writes(root: torch.nn.Module, user: torch.fx.Node, value: torch.fx.Node) -> bool:
    """Whether `user` writes `value` in place: an inplace module (nn.ReLU(inplace=True)), an inplace=True
    argument, a method or function named with a trailing underscore (x.add_, torch.relu_) or an aten op
    whose schema writes that argument, each on `value` as the argument written."""
    first = user.args[0] if user.args else None
    if user.op == "call_module":
        return first is value and getattr(root.get_submodule(str(user.target)), "inplace", False) is True
    if user.op not in ("call_method", "call_function"):
        return False
    if isinstance(user.target, torch._ops.OpOverload):
        schema = user.target._schema
        return any(a.alias_info is not None and a.alias_info.is_write and x is value
                   for a, x in zip(schema.arguments, user.args))
    name = _name(user.target)
    if first is not value:
        return False
    if name.endswith("_") and not name.startswith("_") or name in ("setitem", "__setitem__"):
        return True
    if user.kwargs.get("inplace") is True:
        return True
    if user.op == "call_function" and callable(user.target):  # F.relu(x, True): inplace given by position
        try:
            bound = inspect.signature(user.target).bind(*user.args, **user.kwargs)
        except (TypeError, ValueError):
            return False
        return bound.arguments.get("inplace") is True
    return False


def _returns_written(root: torch.nn.Module, node: torch.fx.Node) -> bool:
    """Whether `node`'s value is the tensor it writes in place, its first argument (x.mul_(2), torch.relu_(x),
    F.relu(x, inplace=True), nn.ReLU(inplace=True), an aten op returning its written self): not a setitem."""
    first = node.args[0] if node.args else None
    if not isinstance(first, torch.fx.Node) or not _writes(root, node, first):
        return False
    if isinstance(node.target, torch._ops.OpOverload):
        returns, arguments = node.target._schema.returns, node.target._schema.arguments
        return len(returns) == 1 and returns[0].alias_info is not None and arguments[0].alias_info is not None \
            and returns[0].alias_info.before_set == arguments[0].alias_info.before_set
    return _name(node.target) not in ("setitem", "__setitem__")


def read_written_inputs(gm: torch.fx.GraphModule) -> int:
    """Make the readers of a model input, after an op that writes it in place and returns it (x.mul_(2)), read
    that op's value: on one process the same tensor, but a value the partitioner sees and sends on, where a later
    stage would read its own copy of the input, unwritten. In place on gm; returns the uses moved. An input
    written otherwise (through a view, by a setitem) and read after the write is refused (ValueError)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    by_name = {n.name: n for n in gm.graph.nodes}
    base: dict[torch.fx.Node, torch.fx.Node] = {}  # an op writing an input (or its last such op) and returning it
    for n in gm.graph.nodes:
        first = n.args[0] if n.args else None
        if isinstance(first, torch.fx.Node) and _returns_written(gm, n):
            p = base.get(first, first)
            if p.op == "placeholder":
                base[n] = p
    for name, bases in writes_in_place(gm).items():  # a write the readers cannot follow: refused
        u = by_name[name]
        for p in (by_name[b] for b in bases):
            later = [r.name for r in p.users if order[r] > order[u]] if p.op == "placeholder" and u not in base else []
            if later:
                raise ValueError(
                    f"the model writes its input {p.name} in place through a view or an op that does not return "
                    f"it ({u.name}: {_op_name(u)}) and reads it after that ({', '.join(later[:3])}); stages send "
                    f"values, not writes, so a later stage would read its own copy unwritten: write into a copy "
                    f"({p.name} = {p.name}.clone() first), or write the whole tensor with an op that returns it "
                    f"({p.name}.mul_(...), {p.name}.masked_fill_(...))")
    latest: dict[torch.fx.Node, torch.fx.Node] = {}  # an input -> the op that last wrote it so far
    moved = 0
    for node in list(gm.graph.nodes):
        for p, w in latest.items():  # (the output too: an input returned is its written value)
            if p in node.all_input_nodes:
                node.replace_input_with(p, w)
                moved += 1
        if node in base:
            latest[base[node]] = node
    if moved:
        gm.recompile()
    return moved


def is_in_place(root: torch.nn.Module, node: torch.fx.Node) -> bool:
    """Whether `node` writes one of its inputs in place (`_writes`)."""
    return any(_writes(root, node, a) for a in node.all_input_nodes)


def writes_in_place(gm: torch.fx.GraphModule) -> dict[str, list[str]]:
    """Each node that writes values in place -> the nodes making them (through views: the viewed value's)."""
    out: dict[str, list[str]] = {}
    for u in gm.graph.nodes:
        for a in u.all_input_nodes:
            if _writes(gm, u, a):
                base = a
                while base.op != "placeholder" and base.args and isinstance(base.args[0], torch.fx.Node) \
                        and _name(base.target) in _VIEWS:
                    base = base.args[0]
                out.setdefault(u.name, []).append(base.name)
    return out


def trained_parameters_written(gm: torch.fx.GraphModule) -> list[str]:
    """The parameters requiring grad that the graph writes in place, directly or through a view (not through
    .data or a detach): the model's write ran under torch.no_grad(), which the graph does not keep, so under
    autograd it fails ("a leaf Variable that requires grad is being used in an in-place operation")."""
    trained = {n for n, p in gm.named_parameters() if p.requires_grad}
    out: list[str] = []
    for u in gm.graph.nodes:
        for a in u.all_input_nodes:
            if not _writes(gm, u, a):
                continue
            while a.op != "get_attr" and a.args and isinstance(a.args[0], torch.fx.Node) \
                    and _name(a.target) in _VIEWS - {"detach"}:
                a = a.args[0]
            if a.op == "get_attr" and str(a.target) in trained and str(a.target) not in out:
                out.append(str(a.target))
    return out


def written_in_place(root: torch.nn.Module, node: torch.fx.Node) -> bool:
    """Whether an op of `node`'s graph writes its value in place, directly or through a view of it."""
    todo, seen = [node], {node}
    while todo:
        n = todo.pop()
        for u in n.users:
            if _writes(root, u, n):
                return True
            if u not in seen and u.args and u.args[0] is n and _name(u.target) in _VIEWS:
                seen.add(u)
                todo.append(u)
    return False


def split_graph(gm: torch.fx.GraphModule, plan: Plan) -> list[torch.fx.GraphModule]:
    """One GraphModule per stage of `plan`; each has `.io` (a StageIO).

    Submodules and attributes keep their qualified names, so `named_parameters()` of a
    stage gives the model's own names; a tied weight appears on every stage that reads it.
    The plan's rewrites (partition.rewrite) are applied to `gm` first, in place, if not yet.
    """
    if plan.loss != has_loss(gm):
        raise PlanError("the plan has the loss traced into its last stage but this graph has none: attach it "
                        "first (partition.split(model, plan, loss_fn=...), or partition.loss.attach_loss)"
                        if plan.loss else "this graph has a loss attached but the plan was made without one; "
                        "re-create the plan with loss_fn= and example_target=, or trace without the loss")
    present = {n.name for n in gm.graph.nodes}
    todo = [r for r in plan.rewrites if str(r[0]) in present]
    if todo:
        apply_rewrites(gm, todo)
    fp = fingerprint(gm)
    if fp != plan.fingerprint:
        raise PlanError(f"the plan was made for another model ({plan.model}, fingerprint {plan.fingerprint}) "
                        f"than this one ({type(gm).__name__}, fingerprint {fp}); re-create it for this "
                        "model with partition.plan(...) or python -m partition")
    S = plan.n_stages
    stage_of = {n: s.index for s in plan.stages for n in s.nodes}
    names = {n.name: n for n in gm.graph.nodes}
    missing = [n for n in stage_of if n not in names]
    if missing:
        raise PlanError(f"plan nodes {missing[:5]} are not in the traced graph; re-create the plan")
    check_state_writes(gm, stage_of)
    recv = live_values(gm, stage_of, S)
    leaves, out_spec = flatten_outputs(gm)
    stages = []
    for s in range(S):
        last = s == S - 1
        send = [x.name if isinstance(x, torch.fx.Node) else "" for x in leaves] if last else list(recv[s + 1])
        stage, inputs, param_nodes = subgraph(gm, set(plan.stages[s].nodes), stage_of, recv[s],
                                              leaves if last else [names[r] for r in send], f"Stage{s}")
        stage.io = StageIO(index=s, recv=list(recv[s]), inputs=inputs, send=send, last=last,  # type: ignore[assignment]
                           out_spec=out_spec if last else None, param_nodes=param_nodes)
        stages.append(stage)
    return stages


def check_state_writes(gm: torch.fx.GraphModule, stage_of: dict[str, int]) -> None:
    """PlanError when the graph writes a buffer or parameter in place (an EMA of activations, a weight clamped
    through .data) on one stage and reads it on another: each stage holds its own copy of it (on another rank),
    and under a schedule another microbatch's turn comes between, so the read would not see the write as the
    model's does. A module written and read inside one call (batch norm's statistics) is one node: no cut."""
    attrs = {n.name: str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    names = {n.name: n for n in gm.graph.nodes}
    written: dict[str, set[int]] = {}
    for u, bases in writes_in_place(gm).items():
        for b in bases:
            n = names[b]
            while n.op != "get_attr" and n.args and isinstance(n.args[0], torch.fx.Node) and _view_or_data(n):
                n = n.args[0]  # w.data, a view of it
            b = n.name
            if b in attrs and u in stage_of:
                written.setdefault(attrs[b], set()).add(stage_of[u])
    for target, writers in written.items():
        readers = {stage_of[u.name] for n in gm.graph.nodes if n.op == "get_attr" and str(n.target) == target
                   for u in _viewers(n) if u.name in stage_of}
        readers |= {stage_of[n.name] for n in gm.graph.nodes if n.op == "call_module" and n.name in stage_of
                    and target.startswith(f"{n.target}.")}  # a module reading its own
        if len(readers | writers) > 1:
            raise PlanError(f"the model writes {target} in place on stage {min(writers)} and reads it on stage "
                            f"{max((readers | writers) - {min(writers)})}: each stage holds its own copy, and "
                            "another microbatch's turn comes between, so the read would not see the write as the "
                            "model's does; keep the modules that write and read it in one stage (leaf_modules=), or "
                            "compute the value in the forward instead of keeping it in the module")
    # a module called whole on several stages (one batch norm applied at several depths, as ALBERT shares its
    # layers) that writes its buffers: each stage would update its own copy, and the model's statistics would be
    # one stage's (found by review: num_batches_tracked 8 where the model counts 24, silently)
    called: dict[str, set[int]] = {}
    for n in gm.graph.nodes:
        if n.op == "call_module" and n.name in stage_of:
            called.setdefault(str(n.target), set()).add(stage_of[n.name])
    recorded = gm.meta.get("fxpipe_buffers_written")
    for target, stages in called.items():
        if len(stages) < 2:
            continue
        module = gm.get_submodule(target)
        buffers = [f"{target}.{b}" for b, _ in module.named_buffers()]
        written_here = [b for b in buffers if b in recorded] if recorded is not None else buffers if isinstance(
            module, torch.nn.modules.batchnorm._NormBase) and module.track_running_stats and module.training else []
        if written_here:
            on = ", ".join(map(str, sorted(stages)))
            raise PlanError(f"{target} ({type(module).__name__}) is called on stages {on} and writes its buffers "
                            f"{', '.join(written_here[:3])} in a step: each stage would update its own copy, and the "
                            "model's would be one stage's; cut the model so that its calls fall in one stage (fewer "
                            "stages), or use a module per call (or one that keeps no running statistics)")


def _view_or_data(n: torch.fx.Node) -> bool:
    """Whether `n` is a view of its first argument or its .data (the same storage)."""
    return _name(n.target) in _VIEWS or n.target is getattr and n.args[1:] == ("data",)


def _viewers(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes reading `node`, directly or through views of it (a .data, a slice)."""
    out, todo, seen = [], [node], {node}
    while todo:
        n = todo.pop()
        for u in n.users:
            out.append(u)
            if u not in seen and u.args and u.args[0] is n and _view_or_data(u):
                seen.add(u)
                todo.append(u)
    return out


def inference_stage(gm: torch.fx.GraphModule, plan: Plan, s: int, root: torch.nn.Module
                    ) -> tuple[torch.fx.GraphModule, list[int], list[Any]]:
    """Stage s of a plan with the loss in its graph (`gm`, split by split_graph), for inference:
    called as the training stage is (its received values, then the model inputs at the returned
    positions; the target may be None), it returns what it sends on (nothing on the last stage)
    and then the model's outputs it computes, without the loss, which needs a target. Also
    returned: which of the model's flat outputs those are (assemble_outputs puts them together):
    leaf i, or (i, lo) for the logits [lo, hi) of a head cut into vocabulary slices
    (partition.rewrite.vocab_parallel), whose running statistics, which need the target, are sent
    on as zeros. `root` is the training stage, whose modules and parameters it uses. A model
    output no stage forms is refused with PlanError."""
    leaves, _ = model_outputs(gm)
    names = {n.name: n for n in gm.graph.nodes}
    sliced = {str(r[0]): i for r in plan.rewrites if list(r[2:]) == ["vocab"]
              for i, (is_node, name) in enumerate(leaves) if is_node and name == r[0]}
    gone = [name for is_node, name in leaves if is_node and name not in names and name not in sliced]
    if gone:
        raise PlanError(f"the model's outputs {gone} are never formed in this plan's graph (its rewrites: "
                        f"{', '.join(str(r[0]) for r in plan.rewrites) or 'none'}), so they cannot be returned; for "
                        "inference build a Pipeline with trace_loss=False (the loss outside the graph)")
    S = plan.n_stages
    stage_of = {n: st.index for st in plan.stages for n in st.nodes}
    recv = live_values(gm, stage_of, S)
    extras: list[Any] = [i for i, (is_node, name) in enumerate(leaves)
                         if is_node and name not in sliced and stage_of.get(name, S - 1) == s]
    outputs = ([] if s == S - 1 else [names[r] for r in recv[s + 1]]) + [names[leaves[i][1]] for i in extras]
    sub, inputs, _ = subgraph(gm, set(plan.stages[s].nodes), stage_of, recv[s], outputs, f"Stage{s}Inference")
    g = sub.graph
    logits = []
    for node in list(g.nodes):  # a vocabulary slice: its logits, and zeros for the statistics it passes on
        head = node.name.rsplit("_vocab", 1)[0]
        if node.op == "call_function" and node.target is vocab_slice and head in sliced:
            x, w, b, _, lo, hi, _ = node.args
            with g.inserting_after(node):
                blank = g.call_function(_no_statistics, (x,))
            with g.inserting_after(node):
                logits.append(g.call_function(linear_rows, (x, w, b, lo, hi)))
            node.replace_all_uses_with(blank)
            g.erase_node(node)
            extras.append((sliced[head], lo))
    out = next(n for n in g.nodes if n.op == "output")
    out.args = (tuple(out.args[0]) + tuple(logits),)
    # the loss and what only it reads; not an in-place write whose result is unused (fx counts it pure)
    g.eliminate_dead_code(is_impure_node=lambda n: n.is_impure() or any(_writes(root, n, a)
                                                                        for a in n.all_input_nodes))
    return torch.fx.GraphModule(root, g, f"Stage{s}Inference"), inputs, extras


def _no_statistics(x: torch.Tensor) -> torch.Tensor:
    """What a vocabulary slice passes on in inference, where no loss is computed: zeros of the
    statistics' shape (one row of two per token)."""
    return x.new_zeros(x.numel() // x.shape[-1], 2)


def assemble_outputs(gm: torch.fx.GraphModule, found: dict[Any, Any]) -> Any:
    """The model's output, in its own structure, from what inference_stage's stages returned
    (`found`: by key, from every stage); vocabulary slices of logits concatenated in order."""
    leaves, spec = model_outputs(gm)
    flat = []
    for i, (is_node, x) in enumerate(leaves):
        if not is_node:
            flat.append(x)
        elif i in found:
            flat.append(found[i])
        else:
            parts = sorted((k[1], v) for k, v in found.items() if isinstance(k, tuple) and k[0] == i)
            flat.append(torch.cat([v for _, v in parts], -1))
    return pytree.tree_unflatten(flat, spec)


def example_from_plan(plan: Plan) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Example (args, kwargs) for re-tracing: zeros of the recorded shapes and the recorded flags."""
    import torch.utils._pytree as pytree
    if not plan.input_spec:
        raise PlanError("the plan records no input structure; pass example_args to split()")
    model_inputs = plan.inputs[:-1] if plan.loss else plan.inputs  # the loss's target comes last
    flat = [torch.zeros(v.shape, dtype=getattr(torch, v.dtype)) if v is not None
            else plan.input_constants.get(str(i)) for i, v in enumerate(model_inputs)]
    args, kwargs = pytree.tree_unflatten(flat, pytree.treespec_loads(plan.input_spec))
    return tuple(args), dict(kwargs)
