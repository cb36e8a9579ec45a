"""Pipeline: partition a model, keep this rank's stages, and run any schedule with one interpreter."""
from __future__ import annotations

import functools
import math
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.fx
from torch.distributed.tensor import DTensor
# imported with pipe, before a process group is up: its __init__'s default process_group (dist.group.WORLD,
# evaluated at import) would otherwise hold the job's group, and its gloo threads, past destroy_process_group,
# which then abort the process at exit (make_grad_scaler names the default group at each call instead)
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from partition.plan import Plan, per_stage_note
from partition.split import StageIO
from partition.split import split_graph
from partition.loss import TARGET, attach_loss
from partition.reduction import Weighting, batch_statistics, keep_numerator, loss_weighting, pairing_read, weigh_terms
from partition.trace import flatten_inputs, graph_copy, trace
from memory import MemoryManager
from pipe import calls, comm, grads, inference, launch, optim, options, planning, setup, state_dicts, timing
from pipe.inference import literals_at_twice, output_shapes
from pipe.calls import split_microbatches
from pipe.errors import ModeError, NonFiniteLoss, PipelineError, agree_everywhere
from pipe.lower import forward_only, fuse_backward, lower, validate, with_reloads
from pipe.replicas import DataParallelError, ShardedStages, pipeline_groups, share_buffers, written_buffers
from pipe.schedules import Action, ScheduleError, build, placement
from pipe.simulate import Event, Timeline
from pipe.step import StepState, drop_grads, failures, grads_not_finite, non_finite, sum_tied_grads, tied_trained
from partition.meta import meta_copy, on_meta
from partition.measure import release_memory

__all__ = ["ModeError", "NonFiniteLoss", "Pipeline", "PipelineError", "split_microbatches"]


def _lost_named(what: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """A method whose communication is collectives over every rank (the build): a rank lost in one is named
    on every survivor (pipe.comm.collectives' roll call), where gloo says "Connection closed by peer" or times
    out, naming no rank."""
    def wrap(fn: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(fn)
        def run(self: Any, *args: Any, **kwargs: Any) -> None:
            with comm.collectives(what):
                fn(self, *args, **kwargs)
        return run
    return wrap


def _once(fn: Callable[[], Any]) -> Callable[[], Any]:
    """fn, called once at most: its result kept."""
    kept: list[Any] = []

    def call() -> Any:
        if not kept:
            kept.append(fn())
        return kept[0]
    return call


def weigh_on(last: set[str], w: Weighting) -> Weighting:
    """`w`, whose terms the last stage (`last`: the plan's nodes on it) will weigh where it adds them
    (partition.reduction.weigh_terms); where another stage adds them, the mean of the microbatches' losses, said not
    to be the batch's."""
    needed = [name for name, _, _ in w.at] + [n for p in w.parts if p.kind == "ratio"  # (a ratio term's division
                                               for n in (p.ratio, p.numerator, p.reader) if n]  # is read there too)
    if not w.parts or all(name in last for name in needed):
        return w
    return Weighting("mean", f"the loss adds terms the batch forms each its own way ({w.loss}), which fxpipe weighs "
                             "apart where the last stage adds them, and this plan adds them on an earlier stage: the "
                             "mean of the microbatches' losses, the batch's only where every microbatch counts as "
                             "many targets and shares one divisor", inexact=True, chain=w.chain)


class Pipeline:
    """A model trained as a pipeline over the ranks of the current process group.

    Every rank builds the same model (same seed) and makes the same calls. Rank 0 plans the
    stages (or `plan=` gives them) and shares the plan; each rank keeps the stages the
    schedule's placement gives it (pipe.schedules.placement: stage s on rank s % world, or the
    V of zbv); `step` runs one schedule and returns the batch's loss on every rank. `optimizer`: the
    torch.optim class or factory (called with the parameters) the training loop will step them with,
    so memory is planned for the state it keeps (by default Adam's two copies of the parameters).
    `data_parallel=N` or `mesh=` (a DeviceMesh with "pp" and optionally "dp"): N replicas of the
    pipeline whose grads are averaged in buckets of `dp_bucket_mb` as the backward finishes them
    (pipe.replicas); `dp_shard`: "optimizer" (ZeRO-1) or "full" (FSDP) shards the state over them,
    and `build_optimizer` makes the optimizer that goes with it. `compile=True` (or a dict of
    torch.compile's arguments) compiles each stage's forward, and its backward through AOTAutograd;
    under a zero-bubble schedule each backward then computes the weight grads too (BW: a compiled
    backward is one function), and the plan's notes say so. `schedule="auto"` (pipe.auto) plans every
    schedule at its stages per rank for every microbatch count (with `batch_size`, the divisors of the
    batch; `example_args` are resized to each microbatch; without, `microbatches`), within
    `memory_budget`, simulates each (`calibration=`: a pipe.calibration file or object, used for every
    prediction) and keeps the fastest predicted; `pp.candidates` ranks them, the plan's notes say which.
    With recompute or offload (under auto with a `memory_budget`, `recompute` defaults to "auto"), each
    candidate's stages get the memory plan memory/ would give them, its cost in the prediction.
    `loss_fn` is traced into the last stage whenever it can be (partition.loss), so the solver cuts and
    balances the loss with the model: with `example_target` (one microbatch's), or else a target it is
    found to take (partition.loss.infer_target; any target then works unless values computed from it
    cross stages); the plan table says which, or why the loss stays outside. `trace_loss=False` keeps it
    outside. `forward()` returns the model's output either way.
    """
    # set by pipe.setup while it builds the pipeline: each meta stage's tensors as allocated, and under dp_shard=
    # "full" each stage's zero-bubble parameter lists by name
    _made: dict[int, Any]
    _zb_names: dict[int, tuple[list[tuple[str, list[str]]], list[str]]]
    _zb_callable: dict[int, frozenset[str]]
    _zb_kept: set[int]  # the stages whose B kept the graph for W though planned not to (pipe.setup.zero_bubble)

    @_lost_named("setting up the pipeline")
    def __init__(self, model: torch.nn.Module, example_args: Sequence[Any], *,
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None, microbatches: int = 8,
                 schedule: str = "1f1b", plan: Plan | str | Path | None = None,
                 stages_per_rank: int | None = None,
                 example_kwargs: dict[str, Any] | None = None, cost: str = "measured",
                 memory_budget: float | str | None = None, dynamic_shapes: bool = False,
                 recompute: str | None = None, offload: str = "none", skip_nonfinite: bool = False,
                 example_target: Any = None, leaf_modules: Sequence[type[torch.nn.Module]] = (),
                 progress: Callable[[str], None] | None = None, transport: comm.Transport | None = None,
                 optimizer: Callable[..., torch.optim.Optimizer] | None = None, mesh: Any = None,
                 data_parallel: int = 1, dp_shard: str = "none", dp_bucket_mb: float | None = None,
                 weights: Any = None, compile: bool | dict[str, Any] = False, batch_size: int | None = None,
                 calibration: Any = None, auto_schedules: Sequence[str] | None = None,
                 trace_loss: bool = True) -> None:
        calls.still_running("pipe.Pipeline()")
        self._stops = comm.stops()  # (a failure tearing the group down after this: every call names it)
        # every rank builds the same pipeline: compared first, before anything that talks to the other ranks
        # (ranks given other arguments would otherwise deadlock in it, or train something else)
        calls.agree_on_build(model, example_args, example_kwargs, example_target, {
            "loss_fn": loss_fn, "microbatches": microbatches, "schedule": schedule, "plan": plan,
            "stages_per_rank": stages_per_rank, "cost": cost, "memory_budget": memory_budget,
            "dynamic_shapes": dynamic_shapes, "recompute": recompute, "offload": offload,
            "skip_nonfinite": skip_nonfinite, "leaf_modules": tuple(leaf_modules), "optimizer": optimizer,
            "data_parallel": data_parallel, "dp_shard": dp_shard, "dp_bucket_mb": dp_bucket_mb, "weights": weights,
            "compile": compile, "batch_size": batch_size, "calibration": calibration,
            "auto_schedules": auto_schedules, "trace_loss": trace_loss})
        o = options.check(loss_fn=loss_fn, schedule=schedule, plan=plan, stages_per_rank=stages_per_rank, cost=cost,
                          memory_budget=memory_budget, recompute=recompute, offload=offload, optimizer=optimizer,
                          compile=compile, dynamic_shapes=dynamic_shapes, calibration=calibration,
                          batch_size=batch_size, auto_schedules=auto_schedules, dp_shard=dp_shard,
                          dp_bucket_mb=dp_bucket_mb, microbatches=microbatches)
        assert loss_fn is not None  # (refused above otherwise)
        recompute = self.recompute = o.recompute  # the policy asked for (memory/ chooses each stage's: plan table)
        stages_per_rank = o.stages_per_rank
        self._optim_factor, self._optimizer = o.optim_factor, optimizer
        self._compile, self.calibration = o.compile, o.calibration
        self.trace_loss = bool(trace_loss)
        self.meta = on_meta(model)
        self._weights = setup.check_weights(self, model, weights)
        auto = schedule == "auto"
        self.ctx = launch.context()
        # the pipeline is one dimension of a mesh ("pp"), replicated over "dp": rank and world are the
        # pipeline's; _global maps its ranks to global ones; _rows: every pipeline's global ranks
        try:
            self.mesh, self.pp_group, self.dp_group, self._rows = pipeline_groups(self.ctx, mesh, data_parallel)
        except DataParallelError as e:
            raise PipelineError(str(e)) from None
        self._global = self._rows[0] if self.pp_group is None else dist.get_process_group_ranks(self.pp_group)
        self.rank, self.world = self._global.index(self.ctx.rank), len(self._global)
        self.dp = 1 if self.dp_group is None else dist.get_world_size(self.dp_group)
        self.dp_rank = 0 if self.dp_group is None else dist.get_rank(self.dp_group)  # this rank's replica
        self.dp_shard = dp_shard if self.dp > 1 else "none"
        self._state_split = 1 if self.dp_shard == "none" else self.dp  # ways the optimizer state is split
        self.leaf_modules = tuple(leaf_modules)
        self.progress = progress
        self.M, self.v = microbatches, stages_per_rank
        self.S = self.world * stages_per_rank
        self.loss_fn = loss_fn
        self.dynamic = dynamic_shapes
        self.skip_nonfinite = skip_nonfinite
        self.skipped = False  # skip_nonfinite dropped the last step: its loss, or a grad, was not finite
        self.steps_done = 0
        self._cut_dtypes: dict[str, dict[tuple[int, int], torch.dtype]] = {}  # autocast -> what a step learned
        self._build_autocast = calls.autocast_key(self.ctx.device)  # the plan's dtypes are this one's
        self.loaded: Any = None  # what the last load restored (pipe.checkpoint.Loaded)
        self.schedule_name = schedule
        args, kwargs = tuple(example_args), dict(example_kwargs or {})
        self.candidates: list[Any] = []  # schedule="auto": the ranked candidates (pipe.auto.Candidate)
        self.candidate_plans: dict[str, Plan] = {}  # and their plans, by label
        if auto:
            plan, (args, kwargs, example_target) = planning.choose(self, model, args, kwargs, cost, memory_budget,
                                                                (recompute, offload), example_target, batch_size,
                                                                microbatches, auto_schedules)
            schedule, microbatches, stages_per_rank = plan.schedule, plan.microbatches, plan.stages_per_rank
            recompute = self.recompute = self.candidates[0].recompute or recompute  # the one it chose
            self.schedule_name, self.M, self.v = schedule, microbatches, stages_per_rank
            self.S = self.world * stages_per_rank
        try:
            full = build(schedule, self.world, microbatches, stages_per_rank)
            self.place = placement(schedule, self.S, self.world)
            programs = lower(full, self.S, microbatches, self.place)
            validate(programs, self.S, self.place)  # messages matched in order on every pair, no deadlock
            inference = forward_only(programs)
            validate(inference, self.S, self.place)
        except ScheduleError as e:
            raise PipelineError(str(e)) from e
        self.actions: list[Action] = full[self.rank]
        self.program, self.inference_program = programs[self.rank], inference[self.rank]
        self.programs = programs  # every rank's, as lowered (self.program: this rank's, with its passes)
        self.has_w = any(a.kind == "W" for a in self.actions)
        self.split_w = self.has_w and self._compile is None  # B and W run apart (compiled stages run BW)
        traced = None  # every rank traces the model at once, and rank 0 plans from its trace (no second one)
        if not auto:  # (auto's candidates trace examples resized to their microbatches)
            error = None
            if progress is not None:
                progress(f"tracing {type(model).__name__} ...")
            try:
                traced = trace(model, args, kwargs, leaf_modules=self.leaf_modules)
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
            agree_everywhere(error)
        self.plan = planning.agree_on_plan(self, model, args, kwargs, plan, cost, memory_budget, (recompute, offload),
                                        example_target, traced)
        if self.plan.loss and not isinstance(example_target, torch.Tensor):  # the shape the plan recorded
            example_target = self.plan.example_target()
        if self.meta:
            release_memory()  # what planning held (fx graphs in reference cycles, the heap it grew)
        if progress is not None:
            progress(f"building this rank's stages{' (materialized from the meta device)' if self.meta else ''} ...")
        try:
            gm = traced if traced is not None else trace(model, args, kwargs, leaf_modules=self.leaf_modules)
            if self.dynamic and gm.meta.get("fxpipe_tracer") == "torch.export.export":
                raise ValueError(f"dynamic_shapes=True needs a graph that reads its sizes from its inputs, but "
                                 f"torch.fx could not trace {type(model).__name__} and torch.export fixed the "
                                 "example's sizes in its graph (a mean written as sum / x.shape[1] would keep the "
                                 "example's length); use batches of the example's shape (one microbatch each) "
                                 "without dynamic_shapes, or make the model traceable by torch.fx")
            why = attach_loss(gm, loss_fn) if self.plan.loss else None
            if why:
                raise ValueError(f"the plan puts the loss in the last stage, but loss_fn cannot go into the graph: "
                                 f"{why}; re-plan without example_target")
            # how the batch's loss is formed from the microbatches' (before rewrites change the loss); a ratio's
            # numerator returned in its place
            shapes = _once(lambda: output_shapes(model, args, kwargs, gm))
            self._twice = lambda: {name: two for name, (_, two) in shapes().items()}
            self._literals = _once(lambda: literals_at_twice(model, args, kwargs, gm))  # (torch.export's sizes)
            self.weighting = loss_weighting(gm, loss_fn, self.plan.loss,
                                            flatten_inputs(gm, args, kwargs, example_target), example_target,
                                            self._twice, self._literals)
            if self.plan.loss:  # a loss computed from outputs pairing the samples: said (the model's own, CLIP's)
                self.weighting = pairing_read(gm, self.weighting, shapes())
            # terms weighed on the last stage, decided before the graph returns a ratio's numerator (found by
            # review: a fallback to the mean then averaged the numerators)
            self.weighting = weigh_on(set(self.plan.stages[-1].nodes), self.weighting)
            keep_numerator(gm, self.weighting)
            # as traced (a ratio's numerator returned), before rewrites: what another mode's trace is matched to
            self._plan_graph = graph_copy(gm)
            stages = split_graph(gm, self.plan)
            if self.weighting.parts and not weigh_terms(stages[-1], self.weighting):
                raise ValueError(f"the last stage does not add the loss's terms {self.weighting.loss}, which the plan "
                                 "puts on it")
            error = None
        except (ValueError, TypeError) as e:
            error = f"{type(e).__name__}: {e}"
        agree_everywhere(error)
        self._gm = gm
        self.plan.notes.append(self.weighting.describe(self.dp, dynamic=self.dynamic))
        # the loss outside the graph without an example target: how it forms the batch's is found again at the
        # first call with a target (its kind may need the target's shape: a .sum() over the samples)
        self._weigh_at_target = not self.plan.loss and example_target is None and loss_fn is not None
        norms = batch_statistics(gm) if self.M > 1 else []
        if norms:
            self.plan.notes.append(
                f"batch norm ({', '.join(norms[:3])}{' ...' if len(norms) > 3 else ''}) normalizes each microbatch by "
                "its own samples' statistics, where the model over the whole batch uses the batch's (as under "
                "gradient accumulation; SyncBatchNorm spans replicas, not microbatches): the microbatches' losses add "
                "up as above, but each is computed with its own microbatch's statistics, so the loss and grads are "
                "not one process's over the batch")
        kept = gm.meta.get("fxpipe_autocast_kept")
        if kept:
            self.plan.notes.append(f"kept whole: {', '.join(kept)}, whose forward switches torch.autocast or asks "
                                   "whether one is in force (a region at another precision, or one entered only "
                                   "under an autocast), which a traced graph does not keep; whole, it runs as "
                                   "written under the autocast around each call")
        self._autocast_lost: str | None = gm.meta.get("fxpipe_autocast_lost")
        if self._autocast_lost:
            self.plan.notes.append(f"{self._autocast_lost}: a call under an autocast is refused")
        # forward() on a plan with the loss in the graph: each stage without it (built at the first call)
        self._inference: dict[int, tuple[torch.fx.GraphModule, list[int], list[Any]]] = {}
        # the mode the stages were traced in, the mode evaluate() and forward() run in (pp.train / pp.eval), and
        # the stages of the other mode, split from a trace made in it (built at the first call in it)
        self._traced_mode = self.training = model.training
        self._example = (args, kwargs)
        self._other_mode: dict[str, Any] = {}
        self._layouts: dict[bool, Any] = {}  # forward()'s output layout by mode (pipe.inference.output_layout)
        self._forms: Any = None  # how forward() forms each output leaf of one number (pipe.inference.forms)
        self.local = [s for s in range(self.S) if self.place[s] == self.rank]
        self._example_target = example_target
        # a step needs a target: the loss's graph reads it, or loss_fn outside the graph was given an example one
        self._wants_target = any(n.op == "placeholder" and n.name == TARGET and n.users for n in gm.graph.nodes) \
            if self.plan.loss else example_target is not None
        self._target_fixed = calls.target_bound(self)
        costs = setup.memory_costs(self, args, kwargs, recompute, offload, memory_budget)
        # buffers by original name, read before the move: moving a module to a device replaces its
        # buffers with new tensors (parameters keep their identity)
        orig = {id(b): k for k, b in model.named_buffers()}
        self._buffer_names = {s: {n: orig[id(b)] for n, b in stages[s].named_buffers() if id(b) in orig}
                              for s in self.local}
        self._placed = {id(t) for st in stages for t in (*st.buffers(), *st.parameters())}
        # by name, as the model has them now: sharding (dp_shard="full") replaces the stages' parameters, which
        # are the model's, with new tensors, so that ids would no longer find them nor their tied aliases
        self._placed_names = {k for k, t in model.state_dict(keep_vars=True).items() if id(t) in self._placed}
        first: dict[int, str] = {}
        self._key_names = {k: first.setdefault(id(t), k) for k, t in model.state_dict(keep_vars=True).items()}
        self._names = {id(p): n for n, p in model.named_parameters()}
        self._model = model
        self._loss_reads_checked = False  # loss_fn reads grads only through the model's output (pipe.step)
        self.sharded: ShardedStages | None = None
        self._unplaced: dict[str, torch.Tensor] = {}  # a meta model's tensors no stage reads (rank 0's)
        if self.meta:
            self.stages = setup.materialize(self, model, stages)
        else:
            self.stages = {s: stages[s].to(self.ctx.device) for s in self.local}
        self.io: dict[int, StageIO] = {s: stages[s].io for s in self.local}  # type: ignore[misc]
        if self.S - 1 in self.local:  # the loss's tensors (class weights), as loaded into the stage computing it
            for w in (self.weighting, *self.weighting.parts):  # (a loss of terms: each term's)
                w.holder = self.stages[self.S - 1]
        setup.fill(self, model)
        if self.meta:
            release_memory()  # the reads of the weights
        self.memory: MemoryManager = setup.build_memory(self, model, costs, recompute, offload, memory_budget)
        if memory_budget is not None and self.v > 1:
            self.plan.notes.append(per_stage_note(self.v))
        if dp_shard != "none" and self.dp == 1:
            self.plan.notes.append(f"dp_shard={dp_shard!r} shards over data-parallel replicas, and there is one: "
                                   "nothing is sharded")
        self._zb = setup.zero_bubble(self)  # split_w: each stage's W, from the parameter nodes
        # the module each stage calls; dp_shard="full" shards it (FSDP) and trains its parameters
        self._trained = {s: self._zb[s][0] if self.split_w else self.stages[s] for s in self.local}
        if self.dp_shard == "full" and not self.meta:  # what another mode's trace copies, taken before sharding
            self._other_mode["model"] = meta_copy(model)
        self.sharded = setup.shard(self, offload) if self.dp_shard == "full" else None
        self._call = {s: self.memory.wrap_stage(s, setup.compiled(self, self._trained[s])) for s in self.local}
        if self._compile is not None:
            self.plan.notes.append(setup.compile_note(self))
        # the memory passes: fused backward for stages that recompute under zero-bubble, then reloads
        fused = [s for s in self.local if self.memory.fused_backward(s) or self.has_w and not self.split_w]
        mine = fuse_backward({self.rank: self.program}, fused)
        self.program = with_reloads(mine, self.memory.reload_stages())[self.rank]
        self.reducer = setup.make_reducer(self, dp_bucket_mb)
        self._written_buffers = [b for s in self.local for b in written_buffers(self._trained[s])]
        self.memory.set_program(self.program)
        setup.note_param_placement(self, model)
        self._tied_groups = setup.make_tied_groups(self)
        self._tied_names = list(setup.tied_holders(self))  # (every rank knows them all)
        self.transport: comm.Transport = transport or comm.TorchTransport(
            None if self.pp_group is None else self._global)
        self.grad_scaler: Any = None  # make_grad_scaler's: scales each microbatch's loss before its backward
        self._loaded_scaler: dict[str, Any] | None = None  # the grad scaler's state the last pp.load read
        self.timeline: list[Event] = []
        self.collectives: list[Event] = []  # the last step's grad all-reduces (REDUCE_GRAD, mb = bucket)
        self.posts: list[Event] = []  # the last step's batches of messages, the host posting each (POST)

    # ----- set-up: pipe.setup -----
    def _zb_params(self, s: int) -> tuple[list[tuple[str, list[torch.nn.Parameter]]], list[torch.nn.Parameter]]:
        """Zero-bubble's (nodes with their parameters, parameters read by several nodes) of stage s;
        under dp_shard="full" the gathered parameters FSDP put in place."""
        if self.sharded is None:
            return self._zb[s][1], self._zb[s][2]
        m = self._trained[s]
        nodes, multi = self._zb_names[s]
        return [(node, [m.get_parameter(n) for n in ns]) for node, ns in nodes], [m.get_parameter(n) for n in multi]

    # ----- parameters -----
    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """This rank's parameters under their original (first) names, each once."""
        seen: set[int] = set()
        for s in self.local:
            for p in (self.stages if self.sharded is None else self._trained)[s].parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield self._names.get(id(p), f"stage{s}.unnamed{len(seen)}"), p

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        """Clip the grads of the whole model, as torch.nn.utils.clip_grad_norm_ over the unpartitioned
        model's parameters would: their total norm over every stage (and every replica's shard with
        dp_shard="full") is computed across ranks, and every rank scales its grads by the same factor.
        Returns that total norm before clipping, the same on every rank (max_norm=inf: only the norm).

        Collective: every rank of the job calls it, after step() and before the optimizer's step. A weight
        held on several ranks (tied, or a layer cut into slices) counts once. torch.nn.utils.clip_grad_norm_
        over pp.parameters() would clip each rank by its own stages' norm instead."""
        return grads.clip_pipeline(self, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite, foreach=foreach)

    def build_optimizer(self, factory: Callable[..., torch.optim.Optimizer] | None = None,
                        **kwargs: Any) -> torch.optim.Optimizer:
        """The optimizer of this rank's parameters, `factory(params, **kwargs)` (default: the
        pipeline's optimizer=, else torch.optim.AdamW), attached for the memory plan. With
        dp_shard="optimizer" it is torch's ZeroRedundancyOptimizer over the "dp" group (ZeRO-1: each
        replica keeps and updates a dp-th of the state, then the updated parameters are broadcast)."""
        return optim.build(self, factory, kwargs)

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Predict memory with the state this optimizer keeps (its kind; measured after its first step,
        which happens anyway when it is not attached) rather than the planned Adam's; BudgetError (on
        every rank, as each computes it alike) when the budget is then not met."""
        optim.attach(self, optimizer)

    def memory_report(self) -> dict[int, dict[str, int]]:
        """Per local stage: bytes held by kind, current and peak ('peak' in the key names); with data
        parallel replicas, how many ways its parameters (dp_shard_params) and its optimizer state
        (dp_shard_optimizer) are split among them (the bytes are this rank's)."""
        report = self.memory.report()
        for s, row in report.items():
            row["params_host"], row["params_device"] = self._param_bytes(s)
            row["dp_replicas"] = self.dp
            row["dp_shard_params"] = self.dp if self.dp_shard == "full" else 1
            row["dp_shard_optimizer"] = self._state_split
        return report

    def _param_bytes(self, s: int) -> tuple[int, int]:
        """Bytes of stage s's parameters (this rank's share of them) in host memory and on the device:
        the tensors the stage holds, by where they are, and the chunks streamed state keeps on the host."""
        host = device = 0
        seen: set[int] = set()
        for p in (self.stages if self.sharded is None else self._trained)[s].parameters():
            t = p.to_local() if isinstance(p, DTensor) else p
            if id(t) in seen or t.untyped_storage().nbytes() == 0:  # streamed out: counted by its chunk
                continue
            seen.add(id(t))
            if t.device.type == "cpu":
                host += t.numel() * t.element_size()
            else:
                device += t.numel() * t.element_size()
        store = getattr(self.memory, "store", None)
        if store is not None:
            host += sum(ch.nbytes for ch in store.chunks if ch.owner == s)
        return host, device

    def state_key_names(self) -> dict[str, str]:
        """Every key of the model's state dict -> the name its tensor is saved under (tied aliases
        point at the first name), as the model had them when the pipeline was built."""
        return dict(self._key_names)

    def make_grad_scaler(self, **kwargs: Any) -> Any:
        """Dynamic loss scaling for float16 training: torch.amp.GradScaler's, as torch's ShardedGradScaler
        over every rank of the job, so that a step whose grads hold an inf or NaN on any rank (a stage's,
        a replica's) is skipped on every rank, and every rank's scale moves alike. Each later step
        multiplies its microbatches' losses by the scale before their backward (the loss it returns is
        not scaled); the loop then calls, as with torch.amp, scaler.unscale_(opt) (before
        clip_grad_norm_), scaler.step(opt) and scaler.update(). kwargs: GradScaler's (init_scale,
        growth_factor, backoff_factor, growth_interval, enabled). A collective call's companion: every
        rank makes it. Checkpoints save its state (scale, growth tracker); a scaler made after pp.load takes
        the loaded one's."""
        self.grad_scaler = ShardedGradScaler(device=self.ctx.device.type, process_group=None, **kwargs)
        self.grad_scaler.scale(torch.zeros((), device=self.ctx.device))  # its scale set up on every rank, not
        if self._loaded_scaler:                                          # only where a loss is scaled
            self.grad_scaler.load_state_dict(self._loaded_scaler)
        return self.grad_scaler

    def unread_parameters(self) -> dict[str, torch.Tensor]:
        """The model's parameters no stage reads (a head the forward does not call), by original name: rank 0
        keeps them (untrained: they get no grad, as in the model) so that checkpoints, full_state_dict and
        weights= hold every key of the model; {} on other ranks."""
        if self.rank != 0:
            return {}
        return {k: self._unplaced.get(k, p) for k, p in self._model.named_parameters() if k not in self._placed_names}

    def local_buffers(self) -> dict[str, torch.Tensor]:
        """Buffers of this rank's stages by original name (the stages' own tensors, on its device);
        rank 0 also keeps those no stage reads."""
        out: dict[str, torch.Tensor] = {}
        for s in self.local:
            for n, b in self.stages[s].named_buffers():
                if n in self._buffer_names[s]:
                    out[self._buffer_names[s][n]] = b
        if self.rank == 0:
            for k, b in self._model.named_buffers():
                if k not in self._placed_names:
                    out.setdefault(k, self._unplaced.get(k, b))
        return out

    def save(self, path: str | Path, optimizer: torch.optim.Optimizer | None = None,
             extra: dict[str, Any] | None = None, keep: int = 1) -> str:
        """Checkpoint every rank's stages, the optimizer and the loop's `extra` state (collective);
        returns the version folder written. See pipe.checkpoint.save."""
        from pipe import checkpoint
        calls.agree_on_kind(self, "save")  # every rank saves (its own part), as every rank steps
        return str(checkpoint.save(self, path, optimizer, extra=extra, keep=keep))

    def load(self, path: str | Path, optimizer: torch.optim.Optimizer | None = None) -> int:
        """Resume from a checkpoint any plan of this model saved (collective); returns the number of
        steps done. `self.loaded` then holds the extra state saved with it (pipe.checkpoint.Loaded)."""
        from pipe import checkpoint
        calls.agree_on_kind(self, "load")
        self.loaded = checkpoint.load(self, path, optimizer)
        return self.loaded.step

    def load_model_state(self, path: str | Path) -> str | None:
        """Load a state dict of the unpartitioned model (.pt, .safetensors, a folder of Hugging Face
        shards, or a checkpoint), each rank reading only its tensors (collective). A Hugging Face
        checkpoint in an older layout than the model's (transformers' conversion mapping) is read as
        from_pretrained reads it; returns how, or None."""
        from pipe import checkpoint
        calls.agree_on_kind(self, "load_model_state")
        return checkpoint.load_model_state(self, path)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """On rank 0: a state dict that loads into the unpartitioned model; None on other ranks. Collective:
        every rank calls it (each sends its stages' tensors)."""
        calls.agree_on_kind(self, "full_state_dict", replicas=self.dp_shard == "full")  # (one replica's own, unless
        # its parameters are sharded over the replicas: a replica alone may export, as each holds them all)
        return state_dicts.full_state_dict(self)

    # ----- one step -----
    def _flats(self, mbs: list[tuple[Any, dict[str, Any]]], targets: list[Any]) -> list[list[Any]]:
        """Each microbatch's values for the graph's placeholders, on this rank's device."""
        dev = self.ctx.device
        return [[x.to(dev) if isinstance(x, torch.Tensor) else x for x in flatten_inputs(self._gm, a, k, t)]
                for (a, k), t in zip(mbs, targets)]

    def step(self, *batch_args: Any, target: Any = None, **batch_kwargs: Any) -> float:
        """One training step over M microbatches; same call on every rank; returns the batch's loss.

        Gradients accumulate into this rank's parameters, each microbatch's weighed as its loss is in the
        batch's (pipe.step.StepState._scales: 1/M, or by counted targets); tied parameters'
        gradients are summed over the ranks that hold them. A call whose inputs the plan was not
        made for is refused on every rank before anything runs, as are ranks given different batches
        (pipe.calls: the pipeline's ranks compare a digest of their calls). An error raised while the step
        runs (in the model, the loss, a stage) is re-raised on its rank as itself, with the rank,
        stage and microbatch noted, and every other rank raises RemoteError naming it; a rank
        that dies or stops answering ends the others with PeerLost.
        """
        mbs, targets = calls.agreed_call(self, (batch_args, batch_kwargs), target, "step")
        trained = tied_trained(self)  # (refused on every rank before anything runs: one frozen on some holders)
        flats = self._flats(mbs, targets)
        self._weigh_by_target(flats[0], targets[0])
        exchange = calls.exchange(self)
        run = StepState(self, flats, targets, exchange)
        with failures(self, run, f"step {self.steps_done + 1}"):  # (counted from 1, as pipe.run prints them)
            # what tied grads held before the step (accumulated over steps): only this step's part is summed;
            # read before the memory manager's step begins (streamed grads are host views between steps)
            held = {id(p): p.grad.detach().clone() for _, ps in self._tied_groups for p in ps if p.grad is not None}
            accumulated = self.skip_nonfinite and any(p.grad is not None for p in self.parameters())
            self.memory.step_begin()
            if self.reducer is not None:
                self.reducer.step_begin(run.clock)
            run.execute(self.program)
            self.memory.step_end()
            if self.reducer is not None:  # before the tied sums: they add into the averaged grads
                with comm.guarded("the data-parallel all-reduce of grads"):
                    self.reducer.finish()
            if self.dp_group is not None and self._written_buffers:
                with comm.guarded("the data-parallel broadcast of buffers"):
                    share_buffers(self._written_buffers, self.dp_group)
            sum_tied_grads(self, held, trained)
            loss = self._mean_loss(run)
            # (a grad scaler, enabled, finds inf grads and skips for itself; the loss is every rank's alike)
            unscaled = self.grad_scaler is None or not self.grad_scaler.is_enabled()
            bad_grads = self.skip_nonfinite and unscaled and math.isfinite(float(loss.item())) \
                and grads_not_finite(self)
            calls.learned(self, exchange)  # (the last collective of every rank)
        self.timeline, self.collectives, self.posts = run.events()
        self.steps_done += 1
        for said in self.memory.over_measured():  # the budget the plan claims to meet, not met: said, once
            self.plan.notes.append(said)
            warnings.warn(said, RuntimeWarning, stacklevel=2)
        value = float(loss.item())
        self.skipped = False
        if not math.isfinite(value):
            non_finite(self, value, run, accumulated)  # (raises NonFiniteLoss without skip_nonfinite)
            self.skipped = True
        elif bad_grads:
            drop_grads(self, value, accumulated)
            self.skipped = True
        return value

    def _weigh_by_target(self, flat: list[Any], target: Any) -> None:
        """With the loss outside the graph and no example target, the first call with a target (the same on every
        rank of the pipeline: agreed) finds how the loss forms the batch's from the microbatches' on its first
        microbatch, where planning could not: a .sum() over the samples is known to be one only from the target's
        shape (found by review: averaged, 1/M of the batch's loss and grads). The plan's note follows."""
        if not self._weigh_at_target or target is None:
            return
        self._weigh_at_target = False
        if self.weighting.kind in ("ratio", "terms"):  # the model's own, found at planning: the stages return its
            return  # numerator, or weigh its terms
        try:
            found = loss_weighting(self._gm, self.loss_fn, False, flat, target, self._twice, self._literals)
        except Exception:  # noqa: BLE001 - as planned: the note says so
            return
        if found.kind in (self.weighting.kind, "ratio", "terms"):  # (a ratio or terms only where the stages return
            # its numerator or weigh them, as planned)
            return
        said = self.weighting.describe(self.dp, dynamic=self.dynamic)
        found.holder = self.weighting.holder
        self.weighting = found
        now = found.describe(self.dp, dynamic=self.dynamic) + " (found at the first call with a target)"
        self.plan.notes = [now if n == said else n for n in self.plan.notes]

    # ----- modes -----
    def train(self, mode: bool = True) -> "Pipeline":
        """The mode evaluate() and forward() run the model in, as nn.Module.train(mode) sets it; returns
        the pipeline. The stages were traced in the mode the model had when the pipeline was built (a
        `self.training` read in its forward is a constant of the graph): in the other mode they run as
        cut from a trace made in it (built at the first call in it, by the same plan), with their modules'
        own flags set to it while they run. step() trains in the mode of the trace only."""
        self.training = bool(mode)
        return self

    def eval(self) -> "Pipeline":
        """train(False): evaluate() and forward() in eval mode (dropout off, batch norm's running statistics)."""
        return self.train(False)

    def evaluate(self, *batch_args: Any, target: Any = None, **batch_kwargs: Any) -> float:
        """The batch's mean loss without grads (a validation step) in the pipeline's mode (pp.eval() for
        eval mode); same call on every rank, the same loss returned on every rank (with data parallel
        replicas, the mean over their batches).

        The training stages run their forwards in the schedule's forward order under no_grad, the loss
        computed where step() computes it; only the loss travels back (pp.forward would send the model's
        whole output to every rank). Grads, the optimizer and the step count are left as they are. Parameters
        streamed from the host (offload='states') are fetched chunk by chunk for the pass, as a step fetches
        them."""
        return inference.evaluate(self, batch_args, batch_kwargs, target)

    def _mean_loss(self, run: "StepState") -> torch.Tensor:
        """The step's mean loss, from the last stage's rank to every rank of the pipeline, then averaged over
        the replicas (float64, shape [1])."""
        loss = torch.as_tensor(run.loss_sum, dtype=torch.float64).reshape(1).to(self.ctx.device)
        last = self._global[self.place[self.S - 1]]
        if self.world > 1:
            with comm.guarded("the loss broadcast", last):
                dist.broadcast(loss, src=last, group=self.pp_group)
        if self.dp_group is not None:
            with comm.guarded("the data-parallel all-reduce of the loss"):
                dist.all_reduce(loss, group=self.dp_group)
                loss.div_(self.dp)
        return loss

    def forward(self, *batch_args: Any, **batch_kwargs: Any) -> Any:
        """Inference without grads: the model's output for the whole batch, on every rank (on its device).

        Every rank makes the same call. Microbatches run through the stages in the schedule's
        forward order; tensor outputs are concatenated along dim 0, 0-dim floating ones (a loss) averaged, other
        0-dim ones kept when every microbatch gave the same, refused otherwise (pipe.step.concat_outputs).
        """
        return inference.forward(self, batch_args, batch_kwargs)

    def gather_timeline(self) -> Timeline | None:
        """The last step's measured timeline of every rank, on rank 0 (a collective call)."""
        return timing.gather(self)
