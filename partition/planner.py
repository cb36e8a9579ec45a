"""partition.plan and partition.split: trace, cost, coarsen, solve, and cut a model into stages."""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import time
from typing import Any, Callable, Sequence

import torch
import torch.fx
import torch.utils._pytree as pytree

from partition.costs import NodeCost, node_costs, param_names, preserve_state, storage_owner
from partition.errors import first_line
from partition.graph import build_graph, coarsen
from partition.loss import attach_loss, has_loss, infer_target
from partition.measure import Share, measure_blocks
from partition.meta import on_meta, to_meta
from partition.rewrite import apply_rewrites, splittable_linear, vocab_parallel_why
from partition.plan import Plan, PlanError, StagePlan, Value, fingerprint, human_bytes, in_flight, parse_bytes
from partition.solve import Chain, CostModel, InfeasibleBudget, Solution, solve
from partition.split import example_from_plan, live_values, param_nodes_of, split_graph, w_nodes
from partition.trace import TraceError, flatten_inputs, graph_copy, trace

__all__ = ["plan", "split", "Analysis", "plan_from_bounds", "split_heavy_ops", "calibrate_plan"]


class Analysis:
    """A traced, costed and coarsened model: everything the solver and the baselines need. `traced`: the
    model's trace (partition.trace of it, the example and leaf_modules), copied instead of tracing again."""

    def __init__(self, model: torch.nn.Module, example_args: Sequence[Any],
                 example_kwargs: dict[str, Any] | None = None, *, cost: str = "measured",
                 leaf_modules: Sequence[type[torch.nn.Module]] = (), max_blocks: int = 2000,
                 repeats: int = 5, rewrites: Sequence[Sequence[Any]] = (),
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None = None, example_target: Any = None,
                 progress: Callable[[str], None] | None = None, device: torch.device | str | None = None,
                 share: Share | None = None, traced: torch.fx.GraphModule | None = None,
                 _traced: tuple[torch.fx.GraphModule, str] | None = None) -> None:
        say = progress or (lambda _: None)
        self.device, self.share = device, share
        self.progress = progress
        self.model = model
        self.args = tuple(example_args)
        self.kwargs = dict(example_kwargs or {})
        self.cost = cost
        self.leaf_modules, self.max_blocks, self.repeats = tuple(leaf_modules), max_blocks, repeats
        self.rewrites = [tuple(r) for r in rewrites]
        self.loss_fn, self.target = loss_fn, example_target
        self.meta = on_meta(model)  # shapes only: the analysis runs on meta copies of the inputs
        given = (self.args, self.kwargs, example_target)
        if self.meta:
            self.args, self.kwargs, example_target = to_meta(given)
        if _traced is None:
            start = time.perf_counter()
            if traced is not None:  # the caller's trace of this model and example (pipe.Pipeline traces once)
                gm = graph_copy(traced)
            else:
                say(f"tracing {type(model).__name__} ...")
                gm = trace(model, given[0], given[1], leaf_modules=leaf_modules)
            took = "traced once, for planning and splitting" if traced is not None else \
                f"{time.perf_counter() - start:.1f} s"
            say(f"traced by {gm.meta['fxpipe_tracer']}: {len(gm.graph.nodes)} nodes ({took})")
            # with the loss in the graph the last stage returns the loss and the head can be cut
            # without moving logits; loss_note says why the loss stays outside ("" when it is in)
            self.loss_note, inferred = loss_placement(gm, model, self.args, self.kwargs, loss_fn, example_target)
            if example_target is None and inferred is not None:  # the target loss_fn was found to take
                self.target = inferred
                given = (given[0], given[1], inferred)
                example_target = to_meta(inferred) if self.meta else inferred
        else:  # with_rewrites: this model's trace, the loss placed, before any rewrite (a copy of it)
            gm, self.loss_note = _traced
        self.notes: list[str] = []  # faster paths not taken, and why (shown in the plan table)
        self._pristine = graph_copy(gm) if self.rewrites else None  # what with_rewrites starts from
        self.gm = apply_rewrites(gm, self.rewrites)
        self.flat = flatten_inputs(self.gm, self.args, self.kwargs, example_target)
        self.names = param_names(model)
        start = time.perf_counter()
        # measured on the target device block by block when the model cannot run there whole: on the
        # meta device, or with its weights on another device (partition.measure)
        here = next((t.device for t in (*model.parameters(), *model.buffers())), torch.device("cpu"))
        target = torch.device(device) if device is not None else here
        blockwise = cost == "measured" and (self.meta or target != here)
        self.cost_device = str(target if cost in ("measured", "shaped") else "")
        self.cost_method = ("FLOP count" + (" (meta tensors)" if self.meta else "") if cost == "flops" else
                            "FLOP count, each matrix product priced by its shape's speed on " + str(target)
                            if cost == "shaped" else
                            "block by block, one block's weights at a time" if blockwise else "whole graph, op by op")
        say(f"costing {len(self.gm.graph.nodes)} nodes ({cost}{', timing each op' if cost == 'measured' else ''}"
            f"{' block by block on ' + str(target) if blockwise else ''}) ...")
        self.costs = node_costs(self.gm, self.flat, cost="flops" if blockwise else cost, names=self.names,
                                repeats=repeats, device=target)
        pbytes = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
        # block by block; partition.plan(calibrate=True) then times its stages whole (calibrate_plan)
        self.blockwise, self.target_device = blockwise, target
        self.example_flat = flatten_inputs(self.gm, *given)  # the example's own tensors, for measuring
        if blockwise:
            members = coarsen(build_graph(self.gm, self.costs), pbytes, max_blocks=max_blocks).members
            if self.share is not None and self.share.world > 1:
                self.cost_method += f", shared by {self.share.world} ranks"
            measure_blocks(self.gm, self.costs, members, self.example_flat, target, pbytes,
                           repeats=repeats, share=share)
        say(f"costed in {time.perf_counter() - start:.1f} s")
        self.recost()

    def recost(self) -> None:
        """The graph and blocks again from `costs` (after they changed: calibrate_plan)."""
        pbytes = {n: p.numel() * p.element_size() for n, p in self.model.named_parameters()}
        self.graph = build_graph(self.gm, self.costs)
        self.blocks = coarsen(self.graph, pbytes, max_blocks=self.max_blocks)

    @property
    def chain(self) -> Chain:
        return self.blocks.chain

    @property
    def loss(self) -> bool:
        """Whether the loss is part of the graph (partition.loss)."""
        return has_loss(self.gm)

    def with_rewrites(self, rewrites: Sequence[Sequence[Any]]) -> "Analysis":
        """The same model and example analysed again with `rewrites` applied: this analysis's trace
        (a copy of its graph, sharing the model's tensors; tracing is deterministic) costed again."""
        base = graph_copy(self._pristine if self._pristine is not None else self.gm)
        return Analysis(self.model, self.args, self.kwargs, cost=self.cost, leaf_modules=self.leaf_modules,
                        max_blocks=self.max_blocks, repeats=self.repeats, rewrites=rewrites,
                        loss_fn=self.loss_fn, example_target=self.target, progress=self.progress,
                        device=self.device, share=self.share, _traced=(base, self.loss_note))


def loss_placement(gm: torch.fx.GraphModule, model: torch.nn.Module, args: tuple[Any, ...],
                   kwargs: dict[str, Any], loss_fn: Callable[[Any, Any], torch.Tensor] | None,
                   target: Any) -> tuple[str, torch.Tensor | None]:
    """Attach `loss_fn` to `gm` when it can go into the graph faithfully. Returns a note ("" when
    attached with the given target; else why it is outside, or how its target was inferred) and
    the target inferred when none was given (partition.loss.infer_target), else None.

    The loss is first run eagerly on the model's output for the example: a loss that fails
    there, or is not a scalar, is the user's error (PlanError), named as such.
    """
    if loss_fn is None:
        return "no loss_fn given", None
    with torch.no_grad(), preserve_state(model):
        torch.manual_seed(0)  # the seed trace checks its graph with: dropout draws the same masks
        if on_meta(model):  # the traced graph, whose output trace checked: an eager call may need values
            output = pytree.tree_unflatten(pytree.tree_leaves(gm(*args, **kwargs)), gm.meta["fxpipe_out_spec"])
        else:
            output = model(*args, **kwargs)
        if target is None:
            target, how = infer_target(loss_fn, output)
            if target is None:
                return how, None
            why = attach_loss(gm, loss_fn, example=(output, target.to(_device_of(output)),
                                                    loss_fn(output, target.to(_device_of(output)))))
            return (why or how), (None if why else target)
        try:
            expected = loss_fn(output, target)
        except Exception as e:  # whatever the user's loss raises
            raise PlanError(f"loss_fn(model(*example_args, **example_kwargs), example_target) fails on the example "
                            f"({type(e).__name__}: {first_line(e)}); the model "
                            f"returns {_kind(output)} and example_target is {_kind(target)}: fix loss_fn, or pass "
                            "the target of the one microbatch in example_args (e.g. make_batch(microbatch_size, "
                            "0)'s)") from e
    check_scalar_loss(expected, "on the example")
    if not isinstance(target, torch.Tensor):
        return f"the target is {_kind(target)}, not one tensor", None
    return attach_loss(gm, loss_fn, example=(output, target, expected)) or "", None


def _device_of(output: Any) -> torch.device:
    """Where the model's output tensors are (a meta model's: meta)."""
    return next((x.device for x in pytree.tree_leaves(output) if isinstance(x, torch.Tensor)), torch.device("cpu"))


def qualnames(types: Sequence[type]) -> list[str]:
    """'package.module.Class' of each type, as a plan records its leaf modules."""
    return [f"{t.__module__}.{t.__qualname__}" for t in types]


def check_scalar_loss(loss: Any, where: str, error: type[Exception] = PlanError) -> None:
    """loss_fn must return one number (a tensor of one element) to be differentiated."""
    if loss is None:
        raise error(f"loss_fn must return a scalar tensor (one element), but {where} it returned None (a Hugging "
                    "Face model's out.loss is None unless the call passes labels=: pass them among the inputs, or "
                    "compute the loss from the output and the target, e.g. F.cross_entropy on out.logits)")
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise error(f"loss_fn must return a scalar tensor (one element), but {where} it returned "
                    f"{_kind(loss)}; reduce it, e.g. loss.mean() or F.cross_entropy(..., reduction='mean')")


def _kind(x: Any) -> str:
    """A short description of a value for error messages: 'a tensor of shape [2, 3] (float32)'."""
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {list(x.shape)} ({str(x.dtype).removeprefix('torch.')})"
    if x is None:
        return "None"
    return f"a {type(x).__name__}"


def _value(x: Any) -> Value | None:
    if not isinstance(x, torch.Tensor):
        return None
    return Value(name="", shape=list(x.shape), dtype=str(x.dtype).removeprefix("torch."))


def _json_exact(x: Any) -> bool:
    return not (isinstance(x, float) and not math.isfinite(x)) and json.loads(json.dumps(x)) == x


def _constants(leaves: list[Any]) -> dict[str, Any]:
    """The example's non-tensor leaves that JSON keeps exactly (flags such as use_cache=False)."""
    return {str(i): x for i, x in enumerate(leaves)
            if x is None or isinstance(x, (bool, int, float, str)) and _json_exact(x)}


def memory_check(cm: CostModel, recompute: str, offload: str) -> CostModel:
    """The cost model a split's memory is checked with: less than memory/ reaches with these options
    (a split is refused only when no policy it may use fits): with recompute or activation offload
    no saved activations, with state offload no resident model state."""
    return dataclasses.replace(cm, activation_floor=recompute != "none" or offload in ("activations", "all"),
                               state_factor=0.0 if offload in ("states", "all") else cm.state_factor)



def _output_bytes(gm: torch.fx.GraphModule, costs: dict[str, NodeCost]) -> int:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return sum(costs[x.name].out_bytes for x in pytree.tree_leaves(out.args[0])
               if isinstance(x, torch.fx.Node) and x.name in costs)


def _saved_on_stage(costs: dict[str, NodeCost], nodes: Sequence[str], stage_of: dict[str, int]) -> int:
    """Bytes a stage's nodes save for backward per microbatch, every storage once. Left out: a storage
    made on another stage (it arrives as a received input, a message buffer the stage holds anyway:
    memory.buffers counts it until the backward that frees the microbatch), and a model input's (the
    runtime holds the step's batch whatever the stage saves)."""
    mine = set(nodes)
    saved: dict[str, int] = {}
    for u in nodes:
        for sid, nb in costs[u].saved.items() if u in costs else ():
            owner = storage_owner(sid)
            if owner not in costs or (owner in stage_of and owner not in mine):
                continue
            saved[sid] = nb
    return sum(saved.values())


def _w_part(a: Analysis, nodes: Sequence[str]) -> tuple[float, int]:
    """(ms, nodes) of a stage's W under zero bubble: the nn.Linear nodes' weight grads W computes alone
    (partition.split.w_nodes), half of their backward (a matrix product each, as for the input grad).
    A stage whose memory plan recomputes or offloads runs BW instead, W nothing (pipe.auto.memory_plan
    and the pipeline set its W part to 0 once memory/ has chosen)."""
    w = w_nodes(a.gm, param_nodes_of(a.gm, nodes))
    return sum(a.costs[n].bwd_ms for n in w) / 2, len(w)


def plan_from_bounds(a: Analysis, bounds: Sequence[int], cost_model: CostModel, *, schedule: str,
                     microbatches: int, stages_per_rank: int, memory_budget: float | None) -> Plan:
    """The Plan for given block bounds (the solver's, or a baseline's), with predicted figures."""
    from partition.solve import evaluate
    sol: Solution = evaluate(a.chain, tuple(bounds), cost_model)
    S = len(bounds) - 1
    ch = a.chain
    members = a.blocks.members
    stage_of = {n: s for s in range(S) for b in range(bounds[s], bounds[s + 1]) for n in members[b]}
    recv = live_values(a.gm, stage_of, S)
    nodes_of = [[n for b in range(bounds[s], bounds[s + 1]) for n in members[b]] for s in range(S)]
    params_of = [sorted({a.blocks.param_names[p] for b in range(bounds[s], bounds[s + 1])
                         for p in ch.params[b]}) for s in range(S)]
    holders: dict[str, int] = {}
    for ps in params_of:
        for p in ps:
            holders[p] = holders.get(p, 0) + 1
    pbytes = {n: p.numel() * p.element_size() for n, p in a.model.named_parameters()}
    flights = cost_model.in_flight or tuple([1] * S)
    stages = []
    for s in range(S):
        lo, hi = bounds[s], bounds[s + 1]
        values = []
        for r in recv[s]:
            c = a.costs[r]
            values.append(Value(name=r, shape=list(c.shape), dtype=c.dtype, stride=list(c.stride)))
        stages.append(StagePlan(
            index=s, nodes=nodes_of[s], params=params_of[s],
            fwd_ms=float(ch.fwd_ms[lo:hi].sum()), bwd_ms=float(ch.bwd_ms[lo:hi].sum()),
            param_bytes=sum(pbytes[p] for p in params_of[s]),
            activation_bytes=_saved_on_stage(a.costs, nodes_of[s], stage_of), in_flight=int(flights[s]),
            peak_bytes=float(sol.stage_bytes[s]), send_bytes=int(ch.cut_bytes[hi]),
            recv_bytes=int(ch.cut_bytes[lo]), recv=values,
            shared=[p for p in params_of[s] if holders[p] > 1]))
        stages[-1].w_ms, stages[-1].w_nodes = _w_part(a, nodes_of[s])
    times = list(sol.stage_ms)
    notes = list(a.notes) + [f"stage {s} holds no parameters (the model has too few blocks with parameters, or "
                             "the budget allows no other split): build no optimizer on its rank, as torch's "
                             "refuse an empty parameter list" for s in range(S) if not params_of[s]]
    flat_leaves, spec = pytree.tree_flatten((a.args, a.kwargs))
    inputs = [_value(x) for x in flat_leaves] + ([_value(a.target)] if a.loss else [])
    return Plan(stages=stages, schedule=schedule, microbatches=microbatches, stages_per_rank=stages_per_rank,
                cost=a.cost, memory_budget=memory_budget, bottleneck_ms=float(sol.bottleneck_ms),
                imbalance=float(max(times) / (sum(times) / len(times))) if sum(times) > 0 else 1.0,
                model=type(a.model).__name__, fingerprint=fingerprint(a.gm), rewrites=[list(r) for r in a.rewrites],
                tracer=str(a.gm.meta.get("fxpipe_tracer", "")), inputs=inputs, loss=a.loss,
                loss_note=a.loss_note, output_bytes=_output_bytes(a.gm, a.costs), notes=notes,
                leaf_modules=qualnames(a.leaf_modules),
                input_spec=pytree.treespec_dumps(spec), input_constants=_constants(flat_leaves),
                state_factor=cost_model.state_factor, cost_device=a.cost_device, cost_method=a.cost_method,
                bytes_per_ms=cost_model.bytes_per_ms, latency_ms=cost_model.latency_ms)


def plan(model: torch.nn.Module, example_args: Sequence[Any], n_stages: int, *,
         example_kwargs: dict[str, Any] | None = None, cost: str = "measured", schedule: str = "1f1b",
         microbatches: int | None = None, memory_budget: float | int | str | None = None,
         stages_per_rank: int = 1, in_flight_counts: Sequence[int] | None = None,
         speeds: Sequence[float] | None = None, leaf_modules: Sequence[type[torch.nn.Module]] = (),
         bytes_per_ms: float = 1e6, latency_ms: float = 0.05, state_factor: float = 4.0,
         max_blocks: int = 2000, analysis: Analysis | None = None, recompute: str = "none",
         offload: str = "none", loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
         example_target: Any = None, progress: Callable[[str], None] | None = None,
         stable_within: float = 0.1, device: torch.device | str | None = None, share: Share | None = None,
         stage_share: Share | None = None, calibrate: bool = False,
         analysis_out: list[Analysis] | None = None, traced: torch.fx.GraphModule | None = None) -> Plan:
    """Balanced stages for `model`, found by the exact solver under a per-stage memory budget.

    `example_args`/`example_kwargs` are one microbatch. Memory per stage counts parameters
    times `state_factor` (weight, grad, Adam's two moments), plus the activations of the
    microbatches the schedule keeps in flight there (1F1B: min(M, S - s); pass
    `in_flight_counts` for other schedules), each with its received inputs and sent outputs.
    The memory check counts less than memory/ can reach, so that no split it can fit is refused:
    with any `recompute` but 'none', or `offload` of activations, per microbatch in flight only
    the received inputs and sent outputs (memory/ may recompute or offload any saved tensor, in
    regions finer than a block); with `offload` 'states' or 'all' no model state (its chunks
    stream through the device). memory/ then plans the policy and refuses a budget below what it
    reaches, naming that figure.
    With `loss_fn` and a tensor `example_target` (one microbatch's) the loss is traced into
    the graph (partition.loss) when fx can trace it: the last stage returns the loss, and a
    linear layer too slow for one stage that feeds a cross entropy is spread over stages
    by vocabulary slices (partition.rewrite.vocab_parallel). `progress` receives a line at
    each phase (tracing, costing, solving), for a command line to show.
    With measured costs, which differ between launches by noise, splits whose slowest stage is
    within `stable_within` (10%) of the fastest measured split's count as equal, and the most
    even among them by FLOP count is taken: a fresh launch gets the same cuts unless its
    measurements move a stage by more than that (the plan's notes say when this choice is not
    the fastest measured split, and by how much).
    A model on the meta device (built under `with torch.device("meta"):`) is planned from shapes: its
    trace, FLOP costs and memory figures come from meta tensors; cost="measured" then times each
    block on `device` (default: where the model's weights are; pipe passes its own device), one
    block's weights at a time (partition.measure), and so does a model whose weights are on another
    device than `device`; `share` splits that work between ranks. With `calibrate`, the plan's stages are
    then timed whole and the costs scaled to them (calibrate_plan), each rank timing its share of the
    stages by `stage_share` (default `share`): closer stage times, but planning then peaks at a stage's
    weights plus one microbatch's activations of it (about 2-3x the stage's weights on the 16-layer
    GPT of bench memory-scale; on a GPU the activations of the calls timed back to back, at most a quarter
    of the free device memory) instead of one unit's. The plan records how and where.
    `analysis_out`, a list, receives the analysis the plan was cut from (rewrites applied): planning
    other schedules over the same stage count with `analysis=` it reuses the trace and the costs.
    `traced`: partition.trace of this model, example and leaf_modules, planned from (a copy; it is left as
    it is) instead of tracing again, as pipe.Pipeline does with the trace its stages are split from.
    """
    if isinstance(n_stages, bool) or not isinstance(n_stages, int) or n_stages < 1:
        raise PlanError(f"n_stages must be a positive integer (one per pipeline stage), got {n_stages!r}; "
                        "pass e.g. n_stages=2, usually the number of ranks times stages_per_rank")
    M = microbatches if microbatches is not None else n_stages
    if isinstance(M, bool) or not isinstance(M, int) or M < 1:
        raise PlanError(f"microbatches must be a positive integer, got {M!r}; pass e.g. microbatches="
                        f"{2 * n_stages} (at least n_stages={n_stages} keeps every stage busy)")
    budget = parse_bytes(memory_budget)
    a = analysis or Analysis(model, example_args, example_kwargs, cost=cost, leaf_modules=leaf_modules,
                             max_blocks=max_blocks, loss_fn=loss_fn, example_target=example_target,
                             progress=progress, device=device, share=share, traced=traced)
    n = len(a.blocks.members)
    if n_stages > n:
        raise PlanError(f"cannot cut {type(model).__name__} into {n_stages} stages: its traced graph has "
                        f"only {n} blocks between which a stage boundary can go (n_stages <= {n}); use at "
                        f"most {n} stages, or a larger model per stage")
    flights = list(in_flight_counts) if in_flight_counts is not None else in_flight(schedule, n_stages, M)
    if len(flights) != n_stages:
        raise PlanError(f"in_flight_counts has {len(flights)} entries for {n_stages} stages")
    # every stage holds a parameter when the model has enough blocks with them: each rank then
    # has something to optimise (torch's optimizers refuse an empty parameter list)
    with_params = sum(1 for ps in a.chain.params if ps)
    cm = CostModel(bytes_per_ms=bytes_per_ms, latency_ms=latency_ms, state_factor=state_factor,
                   in_flight=tuple(flights), speeds=tuple(speeds) if speeds is not None else None,
                   memory_budget=budget, params_every_stage=with_params >= n_stages,
                   tolerance=stable_within if a.cost == "measured" else 0.0)
    kept = memory_check(cm, recompute, offload)
    floor = kept.activation_floor
    if progress is not None:
        progress(f"solving {n_stages} stages over {n} blocks ...")
    try:
        try:
            sol = solve(a.chain, n_stages, kept)
        except InfeasibleBudget:
            if not kept.params_every_stage:
                raise
            kept = dataclasses.replace(kept, params_every_stage=False)  # a stage without parameters, said below
            sol = solve(a.chain, n_stages, kept)
    except InfeasibleBudget as e:
        need = e.needed_bytes
        raise InfeasibleBudget(
            f"{type(model).__name__} does not fit {n_stages} stages with memory_budget={human_bytes(budget or 0)} "
            f"({budget:.0f} bytes) per stage under schedule {schedule!r} with {M} microbatches: the "
            f"least budget any split fits is {human_bytes(need)} ({need:.0f} bytes; "
            + (f"parameters x {state_factor:g} for weights, grads and optimizer state" if kept.state_factor
               else f"no model state (offload={offload!r})")
            + (", plus per microbatch in flight its received inputs and sent outputs; activations, which "
               "recompute/offload plan, are not counted here" if floor else ", plus in-flight activations") + "). "
            + (f"Fix: give memory_budget >= {need:.0f} plus what the activations need (this is a lower bound: the "
               "memory plan then names the least for the stages it cuts), use more stages, or fewer microbatches in "
               "flight"
               if floor else f"Fix: give memory_budget >= {need:.0f}, use more stages, fewer microbatches in flight, "
               "or recompute/offload activations"), need) from None
    if analysis is None:
        a, sol = split_heavy_ops(a, sol, n_stages, kept)
        if a.blockwise and calibrate:
            a, sol = calibrate_plan(a, sol, n_stages, kept, progress, share=stage_share)
        elif calibrate:
            a.notes.append(f"calibrate=True not applied: it corrects costs measured block by block, and these "
                           f"were {a.cost_method!r} (a real model on its own device is timed as a whole graph)")
    if analysis_out is not None:  # as it stands now: the notes below are this plan's
        out = copy.copy(a)
        out.notes = list(a.notes)
        analysis_out.append(out)
    if kept.tolerance > 0:
        fastest = solve(a.chain, n_stages, dataclasses.replace(kept, tolerance=0.0))
        if fastest.bounds != sol.bounds:
            a.notes.append(f"measured costs: these cuts are the most even by FLOPs among the splits within "
                           f"{kept.tolerance:.0%} of the fastest measured one (stable across launches); the "
                           f"fastest measured split predicts {fastest.bottleneck_ms:.2f} ms for the slowest "
                           f"stage, this one {sol.bottleneck_ms:.2f} ms (pass stable_within=0 for it)")
    return plan_from_bounds(a, sol.bounds, cm, schedule=schedule, microbatches=M,
                            stages_per_rank=stages_per_rank, memory_budget=budget)


def calibrate_plan(a: Analysis, sol: Solution, n_stages: int, cm: CostModel,
                   progress: Callable[[str], None] | None = None, rounds: int = 2, gain: float = 0.1,
                   share: Share | None = None) -> tuple[Analysis, Solution]:
    """Costs measured block by block (partition.measure), corrected by the stages they lead to: each stage
    of the solution is timed whole on the target device (one stage's weights at a time) and its nodes'
    times are scaled to that (partition.measure.calibrate); the model is then solved again, and other
    cuts are taken (and timed in turn) only where they are predicted at least `gain` faster than the
    timed ones (the scaling is per stage, so nodes that change stages carry their old stage's factor:
    a small predicted gain is as likely that as a real one), at most `rounds` times. Returns the
    analysis (another one only where rank 0 chose other rewrites, below) and the solution; the
    cost_method says how it ended.

    `share` (default the analysis's) splits the stages between ranks, each timing the stages it will
    run; then rank 0's cuts, rewrites and decisions hold on every rank (its plan is the one used), so
    that every rank times a stage of the same plan and makes the same collective calls."""
    from partition.measure import calibrate
    from partition.solve import evaluate
    share = share if share is not None else a.share
    gather = share.gather if share is not None else None

    def agree(x: Any) -> Any:
        return gather(x)[0] if gather is not None else x
    rewrites = agree([list(r) for r in a.rewrites])
    if rewrites != [list(r) for r in a.rewrites]:  # rank 0 sliced other layers (noise near split_heavy_ops' bar)
        a = a.with_rewrites(rewrites)
    bounds = tuple(sol.bounds)
    for r in range(1, rounds + 1):
        if progress is not None:
            progress(f"timing the {n_stages} stages whole on {a.target_device} (round {r}) ...")
        bounds = agree(bounds)
        calibrate(a.gm, a.costs, a.blocks.members, bounds, a.example_flat, a.target_device, share=share)
        a.recost()
        timed = evaluate(a.chain, bounds, cm)
        again = solve(a.chain, n_stages, cm)
        move, bounds_next = agree((again.bounds != timed.bounds and
                                   again.bottleneck_ms <= (1 - gain) * timed.bottleneck_ms, tuple(again.bounds)))
        if not move:
            a.cost_method += f"; the plan's stages then timed whole and their nodes scaled to that ({r} " \
                             f"round{'s' if r > 1 else ''})"
            return a, timed
        bounds = bounds_next
    a.cost_method += f"; the stages of {rounds} plans timed whole, each next one predicted faster by " \
                     f"{gain:.0%} or more (this plan's stages predicted from nodes scaled to the last ones)"
    return a, evaluate(a.chain, bounds, cm)


def split_heavy_ops(a: Analysis, sol: Solution, n_stages: int, cm: CostModel) -> tuple[Analysis, Solution]:
    """When the solution's slowest stage is well above a perfectly balanced one (total / S)
    and holds a linear layer that takes a quarter of a balanced stage or more, cut that layer
    into slices (partition.rewrite) and solve again; keep the result only if its bottleneck
    is lower. Example: a wide-vocabulary LM head.

    A layer feeding a cross entropy in the graph becomes vocabulary-parallel (only hidden
    states and two floats per row cross a cut); others become row slices joined by a
    concatenation. Slices are first fine (about a quarter of a fair stage each, so the
    solver can place cuts finely); the slices that land on one stage are then merged into
    one (fewer, larger kernels and one weight gradient per stage) and the model solved again.
    """
    ch = a.chain
    work = ch.fwd_ms + ch.bwd_ms
    fair = float(work.sum()) / n_stages
    if n_stages < 2 or sol.bottleneck_ms <= 1.05 * fair:
        return a, sol
    nodes = {n.name: n for n in a.gm.graph.nodes}
    shapes = {name: list(c.shape) for name, c in a.costs.items()}
    dtypes = {name: c.dtype for name, c in a.costs.items()}
    added: list[tuple[Any, ...]] = []
    notes: list[str] = []
    for s in range(n_stages):  # the stages slower than fair: their big linear layers
        if sol.stage_ms[s] <= 1.05 * fair:
            continue
        for b in range(sol.bounds[s], sol.bounds[s + 1]):
            for name in a.blocks.members[b]:
                c = a.costs[name]
                t = c.fwd_ms + c.bwd_ms
                linear = splittable_linear(a.gm, nodes[name])
                if linear is None or linear[3] < 2:
                    continue
                ce, why = vocab_parallel_why(a.gm, nodes[name], shapes, dtypes)
                if ce is not None:  # its cross entropy is sliced with it
                    t += a.costs[ce.name].fwd_ms + a.costs[ce.name].bwd_ms
                if t >= 0.25 * fair:
                    parts = min(32, math.ceil(4 * t / fair), linear[3])  # about a quarter stage, a row at least
                    added.append((name, parts, "vocab") if ce is not None else (name, parts))
                    if ce is None:
                        why = why if a.loss else f"the loss is outside the graph ({a.loss_note})"
                        notes.append(f"{name} may be cut into row slices, whose outputs ({human_bytes(c.out_bytes)} "
                                     f"per microbatch) cross stages, not into vocabulary slices with its loss: {why}")
    if not added:
        return a, sol
    a.notes += notes
    best = (a, sol)
    fine = a.with_rewrites(list(a.rewrites) + added)
    try:
        sol2 = solve(fine.chain, n_stages, cm)
    except InfeasibleBudget:
        return best
    if sol2.bottleneck_ms < best[1].bottleneck_ms * 0.98:
        best = (fine, sol2)
    merged = [_merge_slices(fine, sol2.bounds, r) for r in added]
    if merged != added:
        coarse = a.with_rewrites(list(a.rewrites) + merged)
        try:
            sol3 = solve(coarse.chain, n_stages, cm)
        except InfeasibleBudget:
            return best
        if best[0] is fine:  # the same cuts stay possible with fewer kernels: keep it (its costs are
            best = (coarse, sol3)  # measured afresh, so comparing the two bottlenecks would compare noise)
    best[0].notes = a.notes
    return best


def _merge_slices(a: Analysis, bounds: Sequence[int], rewrite: tuple[Any, ...]) -> tuple[Any, ...]:
    """`rewrite` with the slices that `bounds` put on one stage merged: its parts as slice bounds."""
    name, parts = rewrite[0], int(rewrite[1])
    stage_of = {n: s for s in range(len(bounds) - 1) for b in range(bounds[s], bounds[s + 1])
                for n in a.blocks.members[b]}
    tag, at = ("_vocab", 4) if len(rewrite) > 2 else ("_rows", 3)  # where lo, hi sit in the slice's args
    by_name = {n.name: n for n in a.gm.graph.nodes}
    lo_hi = [(int(by_name[f"{name}{tag}{i}"].args[at]), int(by_name[f"{name}{tag}{i}"].args[at + 1]))
             for i in range(parts)]
    owners = [stage_of[f"{name}{tag}{i}"] for i in range(parts)]
    cuts = [0] + [lo_hi[i][0] for i in range(1, parts) if owners[i] != owners[i - 1]] + [lo_hi[-1][1]]
    return (name, cuts) + tuple(rewrite[2:])


def split(model: torch.nn.Module, plan: Plan, example_args: Sequence[Any] | None = None,
          example_kwargs: dict[str, Any] | None = None, *, gm: torch.fx.GraphModule | None = None,
          loss_fn: Callable[[Any, Any], torch.Tensor] | None = None) -> list[torch.fx.GraphModule]:
    """One module per stage of `plan` (see partition.split.StageIO for how to call them).

    The model is traced again (with the example inputs when given, else zeros of the
    shapes the plan recorded; `gm=` passes a trace already made) and must be the model the
    plan was made for. A plan with the loss in its last stage (plan.loss) needs `loss_fn`.
    """
    name = type(model).__name__
    if name != plan.model:
        raise PlanError(f"the plan was made for a {plan.model} (fingerprint {plan.fingerprint}), not for this "
                        f"{name}; re-create the plan for this model with partition.plan(...) or "
                        "python -m partition")
    if gm is None:
        if example_args is None:
            args, kwargs = example_from_plan(plan)
        else:
            args, kwargs = tuple(example_args), dict(example_kwargs or {})
        try:
            gm = trace(model, args, kwargs)
        except TraceError as e:
            if example_args is not None:
                raise
            raise PlanError(f"cannot re-trace {name} on inputs shaped as the plan records ({e}); the plan "
                            f"(fingerprint {plan.fingerprint}) may be for another model: pass "
                            "example_args=, or re-create the plan") from e
    if plan.loss and not has_loss(gm):
        if loss_fn is None:
            raise PlanError("this plan has the loss traced into its last stage; pass the loss function it was "
                            "made with: partition.split(model, plan, loss_fn=...)")
        why = attach_loss(gm, loss_fn)
        if why:
            raise PlanError(f"cannot put loss_fn into the graph as the plan requires: {why}")
    return split_graph(gm, plan)
