"""Pipeline: partition a model, keep this rank's stages, and run any schedule with one interpreter."""
from __future__ import annotations

import contextlib
import functools
import math
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.fx
from torch.distributed.tensor import DTensor

from partition.errors import first_line
from partition.plan import Plan
from partition.split import StageIO
from partition.split import split_graph
from partition.loss import attach_loss
from partition.trace import flatten_inputs, trace
import memory
from memory import MemoryManager
from pipe import calls, comm, inference, launch, planning, setup
from pipe.calls import split_microbatches
from pipe.errors import ModeError, NonFiniteLoss, PipelineError, agree_everywhere
from pipe.exchange import Exchange
from pipe.lower import forward_only, fuse_backward, lower, validate, with_reloads
from pipe.replicas import DP_SHARD, DataParallelError, ShardedStages, pipeline_groups
from pipe.backward import with_param_outputs
from pipe.schedules import Action, ScheduleError, build, default_stages_per_rank, placement
from pipe.simulate import Event, Timeline
from pipe.step import StepState
from partition.meta import meta_copy, on_meta
from partition.measure import release_memory

__all__ = ["ModeError", "NonFiniteLoss", "Pipeline", "PipelineError", "split_microbatches"]


def _compile_options(compile: Any, recompute: str, dynamic: bool) -> dict[str, Any] | None:
    """torch.compile's keyword arguments for `compile=` (True: its defaults), None for False."""
    if compile is False:
        return None
    if compile is not True and not isinstance(compile, dict):
        raise PipelineError(f"compile must be True, False or a dict of torch.compile arguments, got {compile!r}; "
                            "pass e.g. compile=True or compile={'backend': 'inductor', 'mode': 'max-autotune'}")
    if recompute != "none":
        raise PipelineError(f"compile= runs with recompute='none' (got recompute={recompute!r}): fxpipe recomputes "
                            "through checkpoints and saved-tensor hooks inside the stage, which torch.compile would "
                            "trace into its graph; use recompute='none', or compile=False")
    options = {} if compile is True else dict(compile)
    if dynamic:
        options.setdefault("dynamic", True)
    return options


def _calibration(given: Any, plan: Any, cost: str) -> Any:
    """calibration= as Pipeline takes it: None, a pipe.calibration.Calibration, or the path of one's JSON;
    refused for plans costed otherwise than its own (`cost`, or a given plan's)."""
    from pipe.calibration import Calibration
    if given is None:
        return None
    if not isinstance(given, (str, Path, Calibration)):
        raise PipelineError(f"calibration= takes a pipe.calibration.Calibration or the path of its JSON file, got "
                            f"{type(given).__name__}; make one with python -m bench calibrate --out FILE")
    try:
        cal = given if isinstance(given, Calibration) else Calibration.load(given)
        cal.check_cost(plan.cost if isinstance(plan, Plan) else cost)
    except (OSError, ValueError) as e:
        raise PipelineError(str(e)) from None
    return cal


class Pipeline:
    """A model trained as a pipeline over the ranks of the current process group.

    Every rank builds the same model (same seed) and makes the same calls. Rank 0 plans the
    stages (or `plan=` gives them) and shares the plan; each rank keeps the stages the
    schedule's placement gives it (pipe.schedules.placement: stage s on rank s % world, or the
    V of zbv); `step` runs one schedule and returns the mean loss on every rank. `optimizer`: the
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
        if recompute is None:  # schedule='auto' within a budget weighs recompute for every candidate
            recompute = "auto" if schedule == "auto" and memory_budget is not None and not compile else "none"
        self.recompute = recompute  # the policy asked for (memory/ chooses each stage's: plan table, "memory")
        if loss_fn is None or not callable(loss_fn):
            raise PipelineError(f"loss_fn must be a callable (output, target) -> scalar loss, got {loss_fn!r}; "
                                "pass e.g. loss_fn=lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten())")
        try:
            memory.check_options(recompute, offload)
            # optimizer state per parameter byte the plans count: the optimizer's to come, else Adam's two copies
            self._optim_factor = None if optimizer is None else memory.factory_state_factor(optimizer)
            self._optimizer = optimizer
        except ValueError as e:
            raise PipelineError(str(e)) from None
        self._compile = _compile_options(compile, recompute, dynamic_shapes)
        self.calibration = _calibration(calibration, plan, cost)
        self.trace_loss = bool(trace_loss)
        self.meta = on_meta(model)
        self._weights = setup.check_weights(self, model, weights)
        auto = schedule == "auto"
        if auto and plan is not None:
            raise PipelineError("schedule='auto' chooses the schedule and plans for it, but plan= gives a plan made "
                                "for one schedule; pass schedule=plan.schedule with the plan, or leave plan= out")
        if not auto and batch_size is not None:
            raise PipelineError(f"batch_size={batch_size!r} is for schedule='auto' (it chooses the microbatch count "
                                f"among the batch's divisors), but schedule={schedule!r}; pass microbatches= instead")
        if not auto and auto_schedules is not None:
            raise PipelineError(f"auto_schedules= lists the schedules schedule='auto' weighs, but schedule="
                                f"{schedule!r}; pass schedule='auto', or leave auto_schedules out")
        if auto and stages_per_rank is not None:
            raise PipelineError(f"schedule='auto' chooses the stages per rank with the schedule, but stages_per_rank="
                                f"{stages_per_rank!r} fixes it; leave stages_per_rank out, or name a schedule")
        interleaved = schedule.startswith("interleaved")
        if auto:
            stages_per_rank = 1  # until chosen
        elif stages_per_rank is None:
            try:
                stages_per_rank = default_stages_per_rank(schedule)
            except ScheduleError as e:
                raise PipelineError(str(e)) from None
        if interleaved and stages_per_rank < 2:
            raise PipelineError(f"schedule {schedule!r} interleaves several stages per rank, but stages_per_rank="
                                f"{stages_per_rank}; pass stages_per_rank=2 (or more), or schedule='1f1b'")
        self.ctx = launch.context()
        # the pipeline is one dimension of a mesh ("pp"), replicated over "dp": rank and world are the
        # pipeline's; _global maps its ranks to global ones; _rows: every pipeline's global ranks
        if dp_shard not in DP_SHARD:
            raise PipelineError(f"dp_shard must be one of {', '.join(DP_SHARD)}, got {dp_shard!r}")
        if dp_bucket_mb is not None and (isinstance(dp_bucket_mb, bool) or not isinstance(dp_bucket_mb, (int, float))
                                         or not 0 < dp_bucket_mb < 1e6):
            raise PipelineError(f"dp_bucket_mb must be a number of MiB per gradient bucket in (0, 1e6), got "
                                f"{dp_bucket_mb!r}; pass e.g. 25, or None for an eighth of a stage's grads in [1, 25] "
                                "MiB")
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
        self.steps_done = 0
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
        if self.meta:
            release_memory()  # what planning held (fx graphs in reference cycles, the heap it grew)
        if progress is not None:
            progress(f"building this rank's stages{' (materialized from the meta device)' if self.meta else ''} ...")
        try:
            gm = traced if traced is not None else trace(model, args, kwargs, leaf_modules=self.leaf_modules)
            why = attach_loss(gm, loss_fn) if self.plan.loss else None
            if why:
                raise ValueError(f"the plan puts the loss in the last stage, but loss_fn cannot go into the graph: "
                                 f"{why}; re-plan without example_target")
            stages = split_graph(gm, self.plan)
            error = None
        except (ValueError, TypeError) as e:
            error = f"{type(e).__name__}: {e}"
        agree_everywhere(error)
        self._gm = gm
        # forward() on a plan with the loss in the graph: each stage without it (built at the first call)
        self._inference: dict[int, tuple[torch.fx.GraphModule, list[int], list[Any]]] = {}
        # the mode the stages were traced in, the mode evaluate() and forward() run in (pp.train / pp.eval), and
        # the stages of the other mode, split from a trace made in it (built at the first call in it)
        self._traced_mode = self.training = model.training
        self._example = (args, kwargs)
        self._other_mode: dict[str, Any] = {}
        self.local = [s for s in range(self.S) if self.place[s] == self.rank]
        if self.plan.loss and not isinstance(example_target, torch.Tensor):  # the shape the plan recorded
            v = self.plan.inputs[-1]
            assert v is not None
            example_target = torch.zeros(v.shape, dtype=getattr(torch, v.dtype))
        self._example_target = example_target
        self._wants_target = example_target is not None
        self._target_fixed = calls.target_bound(self)
        costs = setup.memory_costs(self, args, kwargs, recompute, offload, memory_budget)
        # buffers by original name, read before the move: moving a module to a device replaces its
        # buffers with new tensors (parameters keep their identity)
        orig = {id(b): k for k, b in model.named_buffers()}
        self._buffer_names = {s: {n: orig[id(b)] for n, b in stages[s].named_buffers() if id(b) in orig}
                              for s in self.local}
        self._placed = {id(b) for st in stages for b in st.buffers()}
        self._names = {id(p): n for n, p in model.named_parameters()}
        self._model = model
        self.sharded: ShardedStages | None = None
        self._unplaced: dict[str, torch.Tensor] = {}  # a meta model's buffers no stage reads (rank 0's)
        if self.meta:
            self.stages = setup.materialize(self, model, stages)
        else:
            self.stages = {s: stages[s].to(self.ctx.device) for s in self.local}
        self.io: dict[int, StageIO] = {s: stages[s].io for s in self.local}  # type: ignore[misc]
        setup.fill(self, model)
        if self.meta:
            release_memory()  # the reads of the weights
        self.memory: MemoryManager = setup.build_memory(self, model, costs, recompute, offload, memory_budget)
        self._zb: dict[int, tuple[torch.fx.GraphModule, list[tuple[str, list[torch.nn.Parameter]]],
                                  list[torch.nn.Parameter]]] = {}
        if self.split_w:
            # W from the linear layers' inputs, kept from the forward, where neither recompute nor offload manage
            # what it keeps; a recomputing stage runs BW (memory.fused_backward); an offloading one's W
            # differentiates every parameter node over the graph B keeps
            fused = [s for s in self.local if self.memory.fused_backward(s)]
            graph = [s for s in self.local if not self.memory.plain(s) and s not in fused]
            self._zb_kept: set[int] = set()  # the stages whose B kept the graph for W though planned not to
            self.plan.notes.append(
                "zero bubble: W computes the nn.Linear layers' weight grads, each as matrix products of the input its "
                "forward kept and the output grad; B computes every other parameter's grads with the input grads "
                "and frees the graph"
                + (f"; stages {fused} recompute: their B computes the weight grads too (BW) and W does nothing"
                   if fused else "")
                + (f"; stages {graph} offload: their W computes every parameter node's weight grads by calling its "
                   "autograd node, or an autograd call where that node does not read the parameters itself (the "
                   "linear layers' inputs are not kept for it)" if graph else ""))
            for s in self.local:
                self._zb[s] = with_param_outputs(self.stages[s], self.io[s].param_nodes, direct=self.memory.plain(s))
                self.memory.set_weight_order(s, [n for n, _ in self._zb[s][1]], self._zb[s][2])
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
        self.memory.set_program(self.program)
        setup.note_param_placement(self, model)
        self._tied_groups = setup.make_tied_groups(self)
        self.transport: comm.Transport = transport or comm.TorchTransport(
            None if self.pp_group is None else self._global)
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
        from pipe import grads
        owner: dict[str, int] = {}
        for st in self.plan.stages:
            for name in st.params:
                owner[name] = min(owner.get(name, self.world), self.place[st.index])
        named = list(self.named_parameters())
        reductions = [grads.Reduction(self.pp_group, self._global, adds=True)] if self.world > 1 else []
        if self.dp_group is not None:
            reductions.append(grads.Reduction(self.dp_group, dist.get_process_group_ranks(self.dp_group),
                                              adds=self.dp_shard == "full"))
        counted = [p for n, p in named if owner.get(n, self.rank) == self.rank]  # held elsewhere too: once
        return grads.clip_grad_norm_([p for _, p in named], counted, max_norm, norm_type, reductions=reductions,
                                     rank=self.ctx.rank, device=self.ctx.device, error=PipelineError,
                                     error_if_nonfinite=error_if_nonfinite, foreach=foreach,
                                     names={id(p): n for n, p in named})

    def build_optimizer(self, factory: Callable[..., torch.optim.Optimizer] | None = None,
                        **kwargs: Any) -> torch.optim.Optimizer:
        """The optimizer of this rank's parameters, `factory(params, **kwargs)` (default: the
        pipeline's optimizer=, else torch.optim.AdamW), attached for the memory plan. With
        dp_shard="optimizer" it is torch's ZeroRedundancyOptimizer over the "dp" group (ZeRO-1: each
        replica keeps and updates a dp-th of the state, then the updated parameters are broadcast)."""
        factory = factory or self._optimizer or torch.optim.AdamW
        params = list(self.parameters())
        if not params:
            raise PipelineError(f"rank {self.ctx.rank} holds no parameter (its stages {self.local} have none), so "
                                "it has nothing to optimize; re-plan so every stage holds a parameter, or skip "
                                "the optimizer on this rank")
        if self.dp_shard == "optimizer":
            from torch.distributed.optim import ZeroRedundancyOptimizer
            cls, kw = factory, kwargs
            if isinstance(factory, functools.partial) and not factory.args:  # partial(SGD, lr=0.1)
                cls, kw = factory.func, {**factory.keywords, **kwargs}
            if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
                raise PipelineError(f"dp_shard='optimizer' builds torch's ZeroRedundancyOptimizer, which needs a "
                                    f"torch.optim class (or functools.partial of one with keywords), got "
                                    f"{getattr(factory, '__qualname__', type(factory).__name__)}; pass e.g. "
                                    "pp.build_optimizer(torch.optim.AdamW, lr=3e-4)")
            opt: torch.optim.Optimizer = ZeroRedundancyOptimizer(params, optimizer_class=cls,
                                                                 process_group=self.dp_group, **kw)
        else:
            opt = factory(params, **kwargs)
        self.attach_optimizer(opt)
        return opt

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Predict memory with the state this optimizer keeps (its kind; measured after its first step,
        which happens anyway when it is not attached) rather than the planned Adam's; BudgetError (on
        every rank, as each computes it alike) when the budget is then not met."""
        if self.dp_shard == "optimizer":  # split only by torch's ZeroRedundancyOptimizer
            self._state_split = self.dp if memory.local_optimizer(optimizer) is not None else 1
        attach = getattr(self.memory, "attach_optimizer", None)
        if attach is not None:
            f = memory.optimizer_state_factor(optimizer)  # ZeRO: a dp-th of its local optimizer's
            if f is not None and self.dp_shard == "full":  # FSDP: the state of the shards (their own counted apart)
                f /= self.dp
            attach(optimizer, f)
            for s, c in getattr(self.memory, "choices", {}).items():
                self.plan.stages[s].memory_peak = c.predicted_peak

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
        point at the first name)."""
        first: dict[int, str] = {}
        out = {}
        for k, v in self._model.state_dict(keep_vars=True).items():
            out[k] = first.setdefault(id(v), k)
        return out

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
                if id(b) not in self._placed:
                    out.setdefault(k, self._unplaced.get(k, b))
        return out

    def save(self, path: str | Path, optimizer: torch.optim.Optimizer | None = None,
             extra: dict[str, Any] | None = None, keep: int = 1) -> str:
        """Checkpoint every rank's stages, the optimizer and the loop's `extra` state (collective);
        returns the version folder written. See pipe.checkpoint.save."""
        from pipe import checkpoint
        return str(checkpoint.save(self, path, optimizer, extra=extra, keep=keep))

    def load(self, path: str | Path, optimizer: torch.optim.Optimizer | None = None) -> int:
        """Resume from a checkpoint any plan of this model saved (collective); returns the number of
        steps done. `self.loaded` then holds the extra state saved with it (pipe.checkpoint.Loaded)."""
        from pipe import checkpoint
        self.loaded = checkpoint.load(self, path, optimizer)
        return self.loaded.step

    def load_model_state(self, path: str | Path) -> None:
        """Load a state dict of the unpartitioned model (.pt, .safetensors, a folder of Hugging Face
        shards, or a checkpoint), each rank reading only its tensors (collective)."""
        from pipe import checkpoint
        checkpoint.load_model_state(self, path)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """On rank 0: a state dict that loads into the unpartitioned model; None on other ranks."""
        held = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu()
                for n, p in self.named_parameters()}
        held.update({k: b.detach().cpu() for k, b in self.local_buffers().items()})
        mine = {k: held[first] for k, first in self.state_key_names().items() if first in held}
        parts: list[Any] = [None] * self.world
        if self.world > 1:
            dist.all_gather_object(parts, mine, group=self.pp_group)
        else:
            parts = [mine]
        if self.rank != 0:
            return None
        full = {k: v.detach().cpu().clone() for k, v in self._model.state_dict().items() if not v.is_meta}
        for part in parts:
            full.update(part)
        return full

    # ----- one step -----
    def _flats(self, mbs: list[tuple[Any, dict[str, Any]]], targets: list[Any]) -> list[list[Any]]:
        """Each microbatch's values for the graph's placeholders, on this rank's device."""
        dev = self.ctx.device
        return [[x.to(dev) if isinstance(x, torch.Tensor) else x for x in flatten_inputs(self._gm, a, k, t)]
                for (a, k), t in zip(mbs, targets)]

    def step(self, *batch_args: Any, target: Any = None, **batch_kwargs: Any) -> float:
        """One training step over M microbatches; same call on every rank; returns the mean loss.

        Gradients accumulate into this rank's parameters (scaled by 1/M); tied parameters'
        gradients are summed over the ranks that hold them. A call whose inputs the plan was not
        made for is refused on every rank before anything runs, as are ranks given different batches
        (pipe.calls: the pipeline's ranks compare a digest of their calls). An error raised while the step
        runs (in the model, the loss, a stage) is re-raised on its rank as itself, with the rank,
        stage and microbatch noted, and every other rank raises RemoteError naming it; a rank
        that dies or stops answering ends the others with PeerLost.
        """
        mbs, targets = calls.agreed_call(self, (batch_args, batch_kwargs), target, "step")
        flats = self._flats(mbs, targets)
        dev = self.ctx.device
        exchange = Exchange(self.transport, self.plan, self.place, self.rank, dev, self.dynamic)
        run = StepState(self, flats, targets, exchange)
        with self._failures(run, f"step {self.steps_done}"):
            over = getattr(self.memory, "over_budget", None)
            if over is not None:  # the optimizer's first step measured more state than the budget allows
                raise over
            # what tied grads held before the step (accumulated over steps): only this step's part is summed;
            # read before the memory manager's step begins (streamed grads are host views between steps)
            held = {id(p): p.grad.detach().clone() for _, ps in self._tied_groups for p in ps if p.grad is not None}
            self.memory.step_begin()
            if self.reducer is not None:
                self.reducer.step_begin(run.clock)
            run.execute(self.program)
            self.memory.step_end()
            if self.reducer is not None:  # before the tied sums: they add into the averaged grads
                with comm.guarded("the data-parallel all-reduce of grads"):
                    self.reducer.finish()
            with comm.guarded("the all-reduce of tied parameters' grads"):
                for group, params in self._tied_groups:
                    for p in params:
                        if p.grad is None:
                            p.grad = torch.zeros_like(p)
                        g = p.grad  # dp_shard="full": every holder keeps the same shard of it
                        if id(p) in held:
                            g.sub_(held[id(p)])
                        dist.all_reduce(g.to_local() if isinstance(g, DTensor) else g, group=group)
                        if id(p) in held:
                            g.add_(held[id(p)])
            loss = self._mean_loss(run)
        self.timeline, self.collectives, self.posts = run.events()
        self.steps_done += 1
        value = float(loss.item())
        if not math.isfinite(value):
            self._non_finite(value, run)
        return value

    @contextlib.contextmanager
    def _failures(self, run: "StepState", when: str) -> Iterator[None]:
        """Classify what fails inside: this rank's own error is re-raised as itself (noted with the
        rank, stage and microbatch) after telling every rank; failed communication is RemoteError
        when another rank failed first, else PeerLost."""
        try:
            yield
        except comm.PeerLost as e:
            if self.reducer is not None:  # no hook of the step left on the parameters
                self.reducer.fail()
            waited = e.peer if e.peer is not None else (
                None if run.ex.peer is None else self._global[run.ex.peer])  # global ranks
            me = self.ctx.rank
            if waited is not None:
                comm.report_lost(waited)  # first, so the ranks waiting on this one follow the chain
            first = comm.first_failure()
            if first is not None:
                raise comm.RemoteError(f"rank {me} stopped in {when} because {first}") from None
            if waited is None:
                raise comm.PeerLost(f"rank {me} lost another rank during {when} ({first_line(e)}); that "
                                    "process died or stopped answering within the timeout; see its output") from e
            lost, chain = comm.follow_lost(waited, e.early, me)
            via = "" if lost == waited else (f", which rank {me} waited on through " +
                                             " -> ".join(f"rank {r}" for r in chain[:-1]))
            raise comm.PeerLost(f"rank {me} lost rank {lost} during {when}{via} ({first_line(e)}); that "
                                "process died or stopped answering within the timeout; see its output",
                                lost) from e
        except Exception as e:  # this rank's own error: the model's, the loss's, or a stage's
            if self.reducer is not None:
                self.reducer.fail()
            a = run.current
            where = f"rank {self.ctx.rank}" + (f", stage {a.stage}, microbatch {a.mb} ({a.kind})" if a else "")
            e.add_note(f"fxpipe: raised on {where} of {when}")
            comm.fail_everywhere(f"{where} failed in {when} with {type(e).__name__}: {first_line(e, 300)}")
            raise

    def _non_finite(self, value: float, run: "StepState") -> None:
        """Name the first stage whose outputs were not finite; stop, or skip the step if asked."""
        mine = min([s for s, ok in run.finite if not bool(ok)] + [self.S - 1])
        firsts: list[Any] = [None] * self.world
        if self.world > 1:
            dist.all_gather_object(firsts, mine, group=self.pp_group)
        else:
            firsts = [mine]
        stage = min(firsts)
        if self.skip_nonfinite:
            for p in self.parameters():
                p.grad = None
            return
        raise NonFiniteLoss(f"the loss is {value} at step {self.steps_done - 1}; it first appeared on stage {stage} "
                            f"(rank {self._global[self.place[stage]]}); lower the learning rate, check the data, or "
                            "pass skip_nonfinite=True to drop such steps (their grads are cleared)")

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
        forward order; tensor outputs are concatenated along dim 0, 0-dim ones (a loss) averaged.
        """
        return inference.forward(self, batch_args, batch_kwargs)

    def gather_timeline(self) -> Timeline | None:
        """The last step's measured timeline of every rank, on rank 0 (a collective call)."""
        parts: list[Any] = [None] * self.world
        if self.world > 1:
            dist.all_gather_object(parts, (self.timeline, self.collectives, self.posts), group=self.pp_group)
        else:
            parts = [(self.timeline, self.collectives, self.posts)]
        if self.rank != 0:
            return None
        events, collectives, posts = ([e for p in parts for e in p[i]] for i in range(3))
        t0 = min((e.start for e in events + collectives), default=0.0)

        def shifted(group: list[Event]) -> list[Event]:
            return [Event(e.rank, e.action, e.start - t0, e.end - t0) for e in group]
        return Timeline(shifted(events), self.world, shifted(collectives), shifted(posts))
