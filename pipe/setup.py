"""A Pipeline's set-up (its plan: pipe.planning): the stages materialized or moved and filled with the
model's values, the memory manager, FSDP sharding, the grad reducer and the tied weights' groups; each a
function of the pipeline being built (pipe.runtime.Pipeline.__init__ calls them in order)."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.fx

from partition.errors import first_line
from partition.plan import human_bytes, parse_bytes
from partition.split import param_nodes_of
from partition.trace import flatten_inputs
import memory
from memory import MemoryManager
from pipe.errors import PipelineError, agree_everywhere
from pipe.options import COMPILED_MOST
from pipe.planning import gather, state_factor
from pipe.lower import fuse_backward, with_grad_reduction
from pipe.replicas import GradReducer, ShardedStages, group_of
from pipe.auto import w_part_managed
from pipe.backward import callable_nodes, with_param_outputs
from pipe.weights import Init, allocate, default_init, empty_like, init_stages, unset
from partition.meta import retarget, to_meta

if TYPE_CHECKING:
    from pipe.runtime import Pipeline

__all__ = ["build_memory", "check_weights", "compile_note", "compiled", "fill", "make_reducer", "make_tied_groups",
           "materialize", "memory_costs", "note_param_placement", "shard", "tied_holders"]


def check_weights(pp: Pipeline, model: torch.nn.Module, weights: Any) -> Any:
    """weights= as pipe.weights takes it (an Init, a source of a state dict, or None), refused
    alike on every rank before anything runs."""
    name = type(model).__name__
    if isinstance(weights, (str, Path, dict)) or weights is None:
        if weights is None and pp.meta:
            fn = default_init(model)
            if fn is None:
                raise PipelineError(
                    f"{name} is on the meta device, so its weights have no values, and neither weights= nor an "
                    "init is there to give them: no module has reset_parameters() and the model has no "
                    "_init_weights; pass weights= a state dict of the model (a .safetensors, .pt, a folder of "
                    "Hugging Face shards, a checkpoint or a dict) or an init function fn(module)")
            return Init(fn)
        if weights is not None and not isinstance(weights, dict) and not Path(weights).exists():
            raise PipelineError(f"weights={str(weights)!r} does not exist; give a .safetensors, .pt or .bin file, "
                                "a folder of Hugging Face shards, an fxpipe or torch.distributed.checkpoint folder")
        return weights
    if isinstance(weights, Init) or callable(weights):
        if not pp.meta:
            raise PipelineError(f"weights= is an init function but {name} is not on the meta device: its weights "
                                "have values already; build the model under `with torch.device('meta'):` to have "
                                "each rank initialise only its stages, or leave weights= out")
        init = weights if isinstance(weights, Init) else Init(weights)
        return init if init.fn is not None else Init(default_init(model), init.seed)
    raise PipelineError(f"weights= takes a state dict (a dict, or the path of a .safetensors, .pt, a folder of "
                        f"Hugging Face shards or a checkpoint) or an init function fn(module), got "
                        f"{type(weights).__name__}")


def materialize(pp: Pipeline, model: torch.nn.Module, stages: list[torch.fx.GraphModule]
                ) -> dict[int, torch.fx.GraphModule]:
    """This rank's stages of a meta model as new modules with storage on this rank's device (one
    tensor per tied weight on the rank); rank 0 also holds the buffers and parameters no stage reads."""
    device = pp.ctx.device
    error: str | None = None
    copies: list[Any] = []
    made: dict[int, torch.Tensor] = {}
    try:
        copies, made = allocate([stages[s] for s in pp.local], device)
    except ValueError as e:
        error = f"{type(e).__name__}: {e}"
    agree_everywhere(error)
    if pp.rank == 0:
        for k, t in (*model.named_buffers(), *model.named_parameters()):
            if id(t) not in pp._placed:
                pp._unplaced[k] = made.setdefault(id(t), empty_like(t, device) if t.is_meta else t.detach().to(device))
    pp._names = {id(made[i]): n for i, n in pp._names.items() if i in made}
    pp._made = made
    for s, c in zip(pp.local, copies):
        c.io = stages[s].io
        retarget(c, device)
    return dict(zip(pp.local, copies))


def note_param_placement(pp: Pipeline, model: torch.nn.Module) -> None:
    """A plan note: the parameter bytes each pipeline rank holds, where, and what the model built on
    each rank holds besides (the whole model, unless it was built on the meta device)."""
    per = [0] * pp.world
    for st in pp.plan.stages:
        per[pp.place[st.index]] += st.param_bytes
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    where = "the host" if pp.ctx.device.type == "cpu" else f"{pp.ctx.device.type} (each rank's own)"
    pp.plan.notes.append(
        f"parameters per rank, on {where}: " + ", ".join(f"rank {r} {human_bytes(b)}" for r, b in enumerate(per))
        + (f"; built on the meta device, no rank holds more (the model: {human_bytes(whole)})" if pp.meta else
           f"; every rank also built the whole model ({human_bytes(whole)}) on "
           f"{next((p.device for p in model.parameters()), 'the host')}: build it under "
           "`with torch.device('meta'):` and pass weights= to hold only the stages"))
    if pp.ctx.device.type == "cpu":
        pp.plan.notes.append(
            "CPU memory: glibc keeps what the process frees (pipe.init(keep_freed=True), the default), so "
            "activations are not page-faulted in afresh each microbatch" if pp.ctx.freed_kept else
            "CPU memory: the C library hands large freed blocks back to the kernel, and each microbatch's "
            "activations are page-faulted in afresh (pipe.init(keep_freed=True) or FXPIPE_KEEP_FREED=1 keeps them "
            "with glibc: steps of a model with 33 MB of logits per microbatch measured 0-20% faster)")


def _meta_non_persistent(model: torch.nn.Module) -> list[str]:
    """The model's non-persistent buffers on the meta device, by name (BERT's position ids, a causal mask)."""
    out = []
    for name, module in model.named_modules():
        for b in module._non_persistent_buffers_set:
            t = module._buffers.get(b)
            if t is not None and t.is_meta:
                out.append(f"{name}.{b}" if name else b)
    return out


def _non_persistent_by_init(pp: Pipeline, model: torch.nn.Module) -> list[str]:
    """A state dict holds no non-persistent buffer (rotary frequencies, position ids): this rank's are given
    by the model's own init (default_init), run for their modules alone (the modules' other tensors are
    scratch, so what the state dict gave stays), as from_pretrained initialises what its file lacks; the
    names of those it ran for, every rank failing alike if the init fails."""
    fn = default_init(model)
    names = set(_meta_non_persistent(model))
    local = {k: t for k, t in pp.local_buffers().items() if k in names and not t.is_meta and t.dtype != torch.bool}
    ids = {id(t) for t in local.values()}
    made = {mid: t for mid, t in pp._made.items() if id(t) in ids}
    error = None
    if fn is not None and made:
        try:
            init_stages(model, made, fn, 0)
        except Exception as e:  # the model's own init
            error = f"the model's own init failed on this rank's non-persistent buffers ({type(e).__name__}: " \
                    f"{first_line(e)}); give weights= an init function, or build those buffers off the meta device"
    agree_everywhere(error)
    mine = sorted(local) if fn is not None else []
    return sorted(set().union(*gather(mine))) if pp.ctx.world_size > 1 else mine  # the same note on every rank


def fill(pp: Pipeline, model: torch.nn.Module) -> None:
    """Give a meta model's local stages their values (weights=), or load a state dict into a real
    model's; every rank fails alike, naming the tensors no source gave a value."""
    w = pp._weights
    if w is None:
        return
    if not isinstance(w, Init):
        from pipe.ckpt_format import CheckpointError
        try:
            read_as = pp.load_model_state(w)
        except CheckpointError as e:  # raised alike on every rank
            raise PipelineError(f"weights= cannot give {type(model).__name__}'s stages their values: {e}") from None
        what = ("the state dict given" if isinstance(w, dict) else str(w)) + (f", {read_as}" if read_as else "")
        if pp.meta:
            by_init = _non_persistent_by_init(pp, model)
            if by_init:
                what += (f"; {len(by_init)} non-persistent buffer{'s' if len(by_init) > 1 else ''}, which a state "
                         f"dict does not hold ({', '.join(by_init[:3])}{', ...' if len(by_init) > 3 else ''}), from "
                         "the model's own init (reset_parameters, _init_weights), as from_pretrained gives them")
    else:
        assert w.fn is not None
        error = None
        try:
            init_stages(model, pp._made, w.fn, w.seed)
        except Exception as e:  # the user's init function
            error = f"the init function failed on this rank's stages ({type(e).__name__}: {first_line(e)})"
        agree_everywhere(error)
        what = "the init function"
    if not pp.meta:
        pp.plan.notes.append(f"the stages took their values from {what}")
        return
    named: dict[str, torch.Tensor] = dict(pp.named_parameters())
    named.update(pp.unread_parameters())
    named.update(pp.local_buffers())
    mine = unset(named)  # floating ones still NaN, integer ones still their least value (an init of parameters
    # alone writes no buffer; a state dict holds no non-persistent one, BERT's position ids); and, from a state
    # dict, the boolean non-persistent buffers on the meta device, which no value marks (a causal mask)
    if not isinstance(w, Init):
        mine += sorted(k for k in _meta_non_persistent(model) if k in named and named[k].dtype == torch.bool)
    missing = sorted(set().union(*gather(mine))) if pp.ctx.world_size > 1 else mine
    if missing:  # every rank's, named on every rank
        raise PipelineError(
            f"{', '.join(missing[:8])}{' and more' if len(missing) > 8 else ''} of {type(model).__name__} (on the "
            f"meta device) got no value from {what}: a state dict does not hold non-persistent buffers (the "
            "model's own init, reset_parameters or _init_weights, gives those it writes, but no value marks a "
            "boolean one as written), and an init must write every parameter and buffer; give an init function "
            "that writes them, or build these tensors outside `with torch.device('meta')`")
    pp.plan.notes.append(f"built on the meta device: each rank allocated only its stages, on {pp.ctx.device}, "
                         f"and took their values from {what}" + (
                             f" (seeded per module from seed {w.seed})" if isinstance(w, Init) else ""))


def memory_costs(pp: Pipeline, args: tuple[Any, ...], kwargs: dict[str, Any], recompute: str, offload: str,
                 budget: float | str | None) -> dict[str, memory.NodeCost]:
    """Per-node costs for the memory plan (FLOP-based, so every rank computes the same), or none
    when no memory feature is asked for."""
    if recompute == "none" and offload == "none" and budget is None:
        return {}
    from partition.costs import node_costs
    flat = flatten_inputs(pp._gm, args, kwargs, pp._example_target)
    found = node_costs(pp._gm, to_meta(flat) if pp.meta else flat, cost="flops")
    return {n: memory.NodeCost(c.fwd_ms, c.out_bytes, c.saved_bytes, tuple(c.params), tuple(c.saved.items()),
                               c.storage)
            for n, c in found.items()}


def build_memory(pp: Pipeline, model: torch.nn.Module, costs: dict[str, memory.NodeCost], recompute: str,
                 offload: str, budget: float | str | None) -> MemoryManager:
    """The memory manager: every rank plans every stage alike, so a budget error is raised everywhere."""
    from dataclasses import asdict
    from partition.costs import FLOP_PER_MS
    speeds: list[Any] = [(FLOP_PER_MS, 5e6)]
    if costs:  # what recomputing and copying cost on this device; rank 0's, so every rank plans alike
        if pp.ctx.rank == 0:
            speeds[0] = memory.measure_speeds(pp.ctx.device)
        if pp.ctx.world_size > 1:
            dist.broadcast_object_list(speeds, src=0)
    mm: MemoryManager | None = None
    error = None
    programs, actions = pp.programs, [(a.stage, a.kind, a.mb) for a in pp.actions]
    if pp.has_w and not pp.split_w:  # compiled stages run each backward as one BW at its B (found by review: W's hold
        programs = fuse_backward(programs, range(pp.S))  # of the activations was counted, 36% over the measured)
        actions = [(s, "BW" if k == "B" else k, mb) for s, k, mb in actions if k != "W"]
    try:
        mm, choices = memory.build(
            recompute=recompute, offload=offload, budget=parse_bytes(budget),
            stages=[asdict(st) for st in pp.plan.stages], costs=costs, gm=pp._gm, modules=pp.stages,
            param_nodes={s: pp.io[s].param_nodes for s in pp.local},
            param_sizes={n: (p.numel(), p.element_size()) for n, p in model.named_parameters()},
            actions=actions, programs=programs, place=pp.place,
            microbatches=pp.M, device=pp.ctx.device,
            optim_factor=max(pp.plan.state_factor - 2.0, 0.0) if pp._optim_factor is None
            else state_factor(pp),
            time_scale=FLOP_PER_MS / speeds[0][0], copy_bytes_per_ms=speeds[0][1],
            output_bytes=pp.plan.output_bytes, most=COMPILED_MOST if pp._compile is not None else ("auto", "all"))
        # device ms -> plan's (notional ms when counted)
        to_plan = FLOP_PER_MS / speeds[0][0] if pp.plan.cost in ("flops", "shaped") else 1.0
        for c in choices:
            pp.plan.stages[c.stage].memory = c.label()
            pp.plan.stages[c.stage].memory_peak = c.predicted_peak
            pp.plan.stages[c.stage].memory_ms = c.cost_ms / to_plan
            pp.plan.stages[c.stage].memory_nodes = c.recomputed_nodes(len(pp.plan.stages[c.stage].nodes))
            if pp.split_w and not c.plain:
                st = pp.plan.stages[c.stage]
                st.w_ms, st.w_nodes = w_part_managed(st, c, param_nodes_of(pp._gm, st.nodes))
    except ValueError as e:
        error = f"{type(e).__name__}: {e}"
    agree_everywhere(error)
    assert mm is not None
    return mm


def zero_bubble(pp: Pipeline) -> dict[int, tuple[torch.fx.GraphModule, list[tuple[str, list[torch.nn.Parameter]]],
                                                   list[torch.nn.Parameter]]]:
    """Under a zero-bubble schedule whose B and W run apart (split_w): each local stage's module that
    also returns its parameter nodes' inputs (pipe.backward.with_param_outputs), with (nodes and their
    parameters, parameters read by several nodes), the memory manager told W's order; the plan's notes
    say how each stage computes W. Empty otherwise."""
    zb: dict[int, Any] = {}
    pp._zb_callable = {}  # the nodes whose autograd node W may call (pipe.backward.callable_nodes)
    pp._zb_kept = set()  # the stages whose B kept the graph for W though planned not to
    if not pp.split_w:
        return zb
    # W from the linear layers' inputs, kept from the forward, where neither recompute nor offload manage
    # what it keeps; a recomputing stage runs BW (memory.fused_backward); an offloading one's W
    # differentiates every parameter node over the graph B keeps
    fused = [s for s in pp.local if pp.memory.fused_backward(s)]
    graph = [s for s in pp.local if not pp.memory.plain(s) and s not in fused]
    pp.plan.notes.append(
        "zero bubble: W computes the nn.Linear layers' weight grads, each as matrix products of the input its "
        "forward kept and the output grad; B computes every other parameter's grads with the input grads "
        "and frees the graph"
        + (f"; stages {fused} recompute: their B computes the weight grads too (BW) and W does nothing"
           if fused else "")
        + (f"; stages {graph} offload: their W computes every parameter node's weight grads by calling its "
           "autograd node, or an autograd call where that node does not read the parameters itself (the "
           "linear layers' inputs are not kept for it)" if graph else ""))
    for s in pp.local:
        zb[s] = with_param_outputs(pp.stages[s], pp.io[s].param_nodes, direct=pp.memory.plain(s))
        pp._zb_callable[s] = callable_nodes(pp.stages[s], [n for n, _ in zb[s][1]])
        pp.memory.set_weight_order(s, [n for n, _ in zb[s][1]], zb[s][2])
    return zb


def compiled(pp: Pipeline, module: torch.nn.Module) -> torch.nn.Module:
    """The stage module torch.compile makes (forward, and backward through AOTAutograd) under
    compile=, or the module itself."""
    if pp._compile is None:
        return module
    return torch.compile(module, **pp._compile)  # type: ignore[return-value]


def compile_note(pp: Pipeline) -> str:
    backend = pp._compile.get("backend", "inductor") if pp._compile is not None else ""
    note = f"compile: each stage's forward and backward compiled by torch.compile (backend {backend})"
    if pp.has_w:
        note += (f"; under {pp.schedule_name} each B computes its weight grads too (BW) and W does nothing: "
                 "a compiled stage's backward is one function (AOTAutograd), which cannot be split into input "
                 "and weight grads (torch.distributed.pipelining refuses compiled stages there)")
    return note


def shard(pp: Pipeline, offload: str) -> ShardedStages:
    """dp_shard="full": shard each local stage's called module with fully_shard over "dp"; the
    original names and zero-bubble's parameter lists follow the sharded modules by name."""
    if offload in ("states", "all"):
        raise PipelineError(f"dp_shard='full' shards the stages' parameters over the replicas, which offload="
                            f"{offload!r} would stream in chunks too; use offload='none' or 'activations', or "
                            "dp_shard='optimizer'")
    scalars = sorted(n for n, p in pp._gm.named_parameters() if p.dim() == 0)  # (the whole model's: every rank's)
    if scalars:  # (found by review: fully_shard refused them on the ranks holding them alone; the others went on)
        raise PipelineError(f"dp_shard='full' shards every parameter along dim 0 with torch's fully_shard, which "
                            f"takes no 0-dim parameter, and {', '.join(scalars[:4])}"
                            f"{f' and {len(scalars) - 4} more' if len(scalars) > 4 else ''} "
                            f"{'is one' if len(scalars) == 1 else 'are'}; use dp_shard='optimizer' (or 'none'), or "
                            "make each a tensor of shape [1]")
    holder: dict[tuple[str, int], int] = {}  # (parameter, rank) -> stage; from the plan, alike everywhere
    for st in pp.plan.stages:
        for n in st.params:
            r = pp.place[st.index]
            if holder.setdefault((n, r), st.index) != st.index:
                raise PipelineError(f"dp_shard='full' shards each stage's parameters on their own, but {n} is held "
                                    f"by stages {holder[(n, r)]} and {st.index}, both on pipeline rank {r}; use a "
                                    "schedule that places them on different ranks (not zbv), or "
                                    "dp_shard='optimizer'")
    local = {s: {id(p): n for n, p in pp._trained[s].named_parameters()} for s in pp.local}
    before = {s: {n: pp._names.get(id(p), n) for n, p in pp._trained[s].named_parameters()}
              for s in pp.local}
    if pp.split_w:  # W resolves its parameters by name at each call: FSDP swaps in gathered ones
        pp._zb_names = {s: ([(node, [local[s][id(p)] for p in ps]) for node, ps in pp._zb[s][1]],
                            [local[s][id(p)] for p in pp._zb[s][2]]) for s in pp.local}
    sharded = ShardedStages(pp._trained, pp.mesh["dp"])
    pp.memory.count_state_with(sharded.held, {s: list(pp._trained[s].named_parameters()) for s in pp.local},
                               1.0 / pp.dp)
    for s in pp.local:
        for n, p in pp._trained[s].named_parameters():
            pp._names[id(p)] = before[s][n]
    return sharded


def make_reducer(pp: Pipeline, bucket_mb: float | None) -> GradReducer | None:
    """The data-parallel grad reduction: the pass that arms each stage before its final backward
    (overlapped), unless grads stream in chunks (then after the step, and the plan says so)."""
    if pp.dp_group is None:
        return None
    pp.plan.notes.append({
        "none": f"data parallel: {pp.dp} replicas, each rank holds its stages' parameters and optimizer state",
        "optimizer": f"data parallel: {pp.dp} replicas share each stage's optimizer state (ZeRO-1: a "
                     f"{pp.dp}-th per rank, counted in the peaks)",
        "full": f"data parallel: {pp.dp} replicas shard each stage's parameters and optimizer state (FSDP: a "
                f"{pp.dp}-th per rank, plus the gathered parameters and their grads during a step, counted "
                "in the peaks)"}[pp.dp_shard])
    overlap = getattr(pp.memory, "store", None) is None
    if overlap:
        pp.program = with_grad_reduction({pp.rank: pp.program}, pp.local)[pp.rank]
    else:
        pp.plan.notes.append("data parallel: grads are averaged after the step, not overlapped with the "
                             "backward, on ranks whose states stream in chunks (offload of states)")
    params: dict[int, list[torch.nn.Parameter]] = {}
    late: dict[int, set[int] | None] = {}
    for s in pp.local:
        st = pp.stages[s]
        if pp.split_w and not pp.memory.fused_backward(s):  # W finishes its nodes' grads in forward
            w_params = [p for _, ps in pp._zb[s][1] for p in ps]  # order, after what B finished
            written = {id(p) for p in w_params}
            order = [p for p in st.parameters() if id(p) not in written] + w_params
            late[s] = written
        else:  # a backward finishes the last node's grads first
            used = [st.get_parameter(n) for names in pp.io[s].param_nodes.values() for n in names]
            order = list({id(p): p for p in reversed(used)}.values())
            seen = {id(p) for p in order}
            order += [p for p in st.parameters() if id(p) not in seen]
            late[s] = None
        params[s] = order
    return GradReducer(group=pp.dp_group, size=pp.dp, device=pp.ctx.device, program=pp.program,
                       stages=params, late=late, overlap=overlap, sharded=pp.sharded,
                       bucket_bytes=None if bucket_mb is None else max(1, int(bucket_mb * (1 << 20))))


def tied_holders(pp: Pipeline) -> dict[str, tuple[int, ...]]:
    """The parameters held on several ranks (tied across stages), by name (sorted), with the ranks holding each:
    the same on every rank."""
    holders: dict[str, set[int]] = {}
    for st in pp.plan.stages:
        for p in st.params:
            holders.setdefault(p, set()).add(pp.place[st.index])
    return {p: tuple(sorted(holders[p])) for p in sorted(holders) if len(holders[p]) > 1}


def make_tied_groups(pp: Pipeline) -> list[tuple[Any, list[torch.nn.Parameter]]]:
    """Process groups for parameters held on several ranks; every rank creates them in one order."""
    groups: dict[tuple[int, ...], list[str]] = {}
    for p, ranks in tied_holders(pp).items():
        groups.setdefault(ranks, []).append(p)
    out = []
    mine = {n: p for n, p in pp.named_parameters()}
    for ranks, names in sorted(groups.items()):
        for row in pp._rows:  # each replica's pipeline: every rank creates every group, in one order
            glob = [row[r] for r in ranks]
            if pp.pp_group is not None and sorted(glob) == sorted(row):  # a whole pipeline: its own group
                g = pp.pp_group if pp.ctx.rank in glob else None
            else:
                g = group_of(glob, pp.ctx.world_size)
            if pp.ctx.rank in glob:
                out.append((g, [mine[n] for n in names]))
    return out
