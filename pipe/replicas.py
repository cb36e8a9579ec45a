"""Data-parallel replicas of a pipeline: the mesh's groups, and grads averaged over "dp" in buckets.

Legend: s stage, dp the number of replicas. Each replica runs the same program, so the buckets
(a stage's grads, in the order its backward finishes them, cut at `bucket_bytes`) and the order
they are launched in are the same on every replica, as collectives need. A bucket is one flat
tensor and the parameters' grads are views into it (DDP's gradient_as_bucket_view), made before
the stage's first backward of the step: its all-reduce needs no copy. The program's REDUCE_GRAD
(pipe.lower.with_grad_reduction) arms a stage before its final backward; while that runs, each
bucket is launched (async) as soon as its grads are final, in bucket order, so the collectives
overlap the rest of the backward; `finish` waits for them and divides by dp.
"""
from __future__ import annotations

import warnings
import weakref
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from partition.errors import FxpipeError
from pipe import launch
from pipe.lower import Item, final_backward
from pipe.scale import bucket_cap
from pipe.schedules import Action
from pipe.timing import Clock, HostClock

__all__ = ["DataParallelError", "GradReducer", "ShardedStages", "pipeline_groups", "group_of", "DP_SHARD",
           "share_buffers", "written_buffers"]

DP_SHARD = ("none", "optimizer", "full")


class DataParallelError(FxpipeError, ValueError):
    """A data-parallel layout the pipeline cannot run; the message names the values and the fix."""


_MADE: dict[Any, tuple[Any, Any]] = {}  # key -> (the default group it was made under, the group or mesh)


def _once(key: Any, make: Any) -> Any:
    """make(), once per process and default group: every rank calls it alike, in one order (each new
    gloo group keeps a context, its connections and three threads for the life of the process)."""
    default = dist.distributed_c10d._get_default_group()
    made = _MADE.get(key)
    if made is None or made[0] is not default:
        made = _MADE[key] = (default, make())
    return made[1]


def group_of(ranks: Sequence[int], world_size: int) -> Any:
    """A process group of these global ranks, for every Pipeline of the process. Every rank calls it for
    every group, in one order, as dist.new_group asks, so every rank decides alike whether to make one.
    The whole world's is the default group."""
    if world_size == 1:
        return None
    if sorted(ranks) == list(range(world_size)):
        return dist.group.WORLD
    return _once(("group", tuple(ranks)), lambda: dist.new_group(list(ranks)))


def _mesh(device: str, pp: int, dp: int) -> Any:
    """The ("pp", "dp") mesh every Pipeline with data_parallel= of the process uses."""
    from torch.distributed.device_mesh import init_device_mesh
    return _once(("mesh", device, pp, dp), lambda: init_device_mesh(device, (pp, dp), mesh_dim_names=("pp", "dp")))


def pipeline_groups(ctx: launch.Context, mesh: Any, data_parallel: int) -> tuple[Any, Any, Any, list[list[int]]]:
    """(mesh, pp group, dp group, every pipeline's global ranks in pipeline order) for a Pipeline.

    No mesh and data_parallel=1: the pipeline is the whole job (groups None). data_parallel=N:
    a mesh (pipeline ranks, N) named ("pp", "dp"), the pipeline outermost as in torchtitan and
    Megatron (init_device_mesh). A mesh of the user's: its "pp" dimension is the pipeline, "dp"
    (if any) the replicas; other dimensions are left to the user."""
    if isinstance(data_parallel, bool) or not isinstance(data_parallel, int) or data_parallel < 1:
        raise DataParallelError(f"data_parallel must be a positive number of pipeline replicas, got "
                                f"{data_parallel!r}; pass e.g. data_parallel=2, or 1 for one pipeline over every rank")
    world = ctx.world_size
    if mesh is None and data_parallel == 1:
        return None, None, None, [list(range(world))]
    if mesh is None:
        if world % data_parallel:
            raise DataParallelError(f"the world size {world} is not divisible into data_parallel={data_parallel} "
                                    f"replicas; launch a multiple of {data_parallel} processes, or another "
                                    "data_parallel=")
        mesh = _mesh(ctx.device.type, world // data_parallel, data_parallel)
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if "pp" not in names:
        raise DataParallelError(f"the mesh has dimensions {names or '(unnamed)'} but no 'pp' for the pipeline; build "
                                "it with init_device_mesh(..., mesh_dim_names=('pp', 'dp')), or pass data_parallel= "
                                "instead")
    dp_size = mesh.size(names.index("dp")) if "dp" in names else 1
    if data_parallel not in (1, dp_size):
        raise DataParallelError(f"data_parallel={data_parallel} but the mesh's 'dp' dimension has {dp_size} "
                                "replicas; pass the mesh alone")
    ranks = mesh.mesh.movedim(names.index("pp"), -1)
    rows = ranks.reshape(-1, ranks.shape[-1]).tolist()
    return mesh, mesh.get_group("pp"), mesh.get_group("dp") if dp_size > 1 else None, rows


def written_buffers(stage: torch.nn.Module) -> list[torch.Tensor]:
    """The buffers a stage may write in a step: those its graph writes in place (through views too), and every
    buffer of a module it calls whole (batch norm kept as a module); all of them for a module that is no graph.
    Constant ones (rotary frequencies, causal masks, position ids) are the same on every replica."""
    if not isinstance(stage, torch.fx.GraphModule):
        return list(stage.buffers())
    from partition.split import written_in_place
    names = {n for n, _ in stage.named_buffers()}
    out: dict[int, torch.Tensor] = {}
    for node in stage.graph.nodes:
        if node.op == "get_attr" and str(node.target) in names and written_in_place(stage, node):
            b = stage.get_buffer(str(node.target))
            out[id(b)] = b
        elif node.op == "call_module":
            out.update((id(b), b) for b in stage.get_submodule(str(node.target)).buffers())
    return list(out.values())


def share_buffers(buffers: Sequence[torch.Tensor], group: Any) -> None:
    """Every replica takes the first replica's `buffers` (those the stages write: batch norm's running
    statistics), as DDP's broadcast_buffers does: replicas then evaluate and save alike. One broadcast per
    dtype over `group`."""
    held = list({id(b): b for b in buffers}.values())
    src = dist.get_process_group_ranks(group)[0]
    for dtype in sorted({b.dtype for b in held}, key=str):
        same = [b for b in held if b.dtype == dtype]
        flat = torch.cat([b.detach().reshape(-1) for b in same])
        dist.broadcast(flat, src=src, group=group)
        with torch.no_grad():
            for b, part in zip(same, flat.split([b.numel() for b in same])):
                b.copy_(part.view_as(b))


class _Bucket:
    """Grads of some parameters of one stage, one dtype: a flat tensor they are views into. Between
    steps the bucket keeps only weak references: the grads (while the user keeps them) keep it."""

    def __init__(self, stage: int, index: int, params: list[torch.nn.Parameter]) -> None:
        self.stage, self.index, self.params = stage, index, params
        self.numel = sum(p.numel() for p in params)
        self.flat: torch.Tensor | None = None  # during a step only
        self.views: list[weakref.ref[torch.Tensor]] = []
        self.work: Any = None
        self.done: Any = None  # the future of the all-reduce's completion callback
        self.ready: set[int] = set()
        self.marks: list[Any] = []  # [launch, end]: the step clock's marks

    def bind(self, device: torch.device) -> None:
        """Make every grad a view of the flat tensor (a new one unless they all are already),
        keeping what a grad held (accumulation across steps, or a stage's earlier backward)."""
        views = [r() for r in self.views]
        if views and all(v is not None and p.grad is v for p, v in zip(self.params, views)):
            base = views[0]._base  # type: ignore[union-attr]
            self.flat = base if base is not None else views[0]
            return
        flat = torch.zeros(self.numel, dtype=self.params[0].dtype, device=device)
        self.views, offset = [], 0
        for p in self.params:
            v = flat[offset:offset + p.numel()].view_as(p)
            if p.grad is not None:
                v.copy_(p.grad)
            p.grad = v
            self.views.append(weakref.ref(v))
            offset += p.numel()
        self.flat = flat


def _cut(params: list[torch.nn.Parameter], cap: int) -> list[list[torch.nn.Parameter]]:
    """Consecutive runs of one dtype, each at most `cap` bytes (or one parameter)."""
    out: list[list[torch.nn.Parameter]] = []
    size = 0
    for p in params:
        n = p.numel() * p.element_size()
        if not out or p.dtype != out[-1][0].dtype or size + n > cap:
            out.append([])
            size = 0
        out[-1].append(p)
        size += n
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class ShardedStages:
    """dp_shard="full": each local stage's module (the one the runtime calls) sharded over "dp" with
    torch's fully_shard (FSDP2), composed with the pipeline as torch.distributed.pipelining and
    torchtitan do: the parameters are gathered at the stage's first forward of a step and kept for
    its other microbatches (reshard_after_forward=False), grads accumulate unsharded, and after the
    stage's final backward (`reduce`) they are reduce-scattered, averaged over dp, into the sharded
    parameters' grads, and the gathered copy is freed."""

    def __init__(self, modules: Mapping[int, torch.nn.Module], mesh: Any) -> None:
        from torch.distributed.fsdp import fully_shard
        # a stage returns views (reshapes); FSDP warns that an in-place op on one would skip its
        # pre-backward hook. The runtime never changes a stage's outputs in place (it sends them and
        # differentiates them), so the warning says nothing here
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPStage\d+(ZB)?\) returned a view tensor")
        self.modules = modules
        for m in modules.values():
            fully_shard(m, mesh=mesh, reshard_after_forward=False)
        for s in modules:
            self._accumulate(s)

    def _accumulate(self, stage: int) -> None:
        m: Any = self.modules[stage]
        m.set_is_last_backward(False)
        m.set_requires_gradient_sync(False)
        m.set_reshard_after_backward(False)

    def held(self, stage: int) -> tuple[int, int]:
        """(parameter bytes, grad bytes) of the stage on this rank now: its shards, and the gathered
        parameters and their unsharded grads while a step has them."""
        from torch.distributed.fsdp import fully_shard
        params = grads = 0
        state = fully_shard.state(self.modules[stage])  # type: ignore[attr-defined]
        for st in state._state_ctx.all_states:
            for group in st._fsdp_param_groups:
                for fp in group.fsdp_params:
                    shard = fp.sharded_param
                    params += _nbytes(shard.to_local())
                    if shard.grad is not None:
                        grads += _nbytes(shard.grad.to_local())
                    whole = getattr(fp, "_unsharded_param", None)
                    if whole is not None and whole.untyped_storage().nbytes() > 0:
                        params += _nbytes(whole)
                        if whole.grad is not None:
                            grads += _nbytes(whole.grad)
        return params, grads

    def reshard(self) -> None:
        """Free the gathered parameters (after inference, which has no backward to do it)."""
        for m in self.modules.values():
            m.reshard()  # type: ignore[operator]

    def reduce(self, stage: int) -> None:
        """The stage's grads are final: reduce-scatter them and free the gathered parameters (what
        FSDP's post-backward does when a backward is the last; the pipeline's backward passes are
        several autograd calls per step, so it is called here)."""
        from torch.distributed.fsdp import fully_shard
        m: Any = self.modules[stage]
        m.set_is_last_backward(True)
        m.set_requires_gradient_sync(True)
        m.set_reshard_after_backward(True)
        state = fully_shard.state(m)  # type: ignore[attr-defined]
        for st in state._state_ctx.all_states:
            for group in st._fsdp_param_groups:
                group.post_backward()
        state._root_post_backward_final_callback()
        self._accumulate(stage)


class GradReducer:
    """Average this rank's grads over the data-parallel group, bucket by bucket, as they become final.

    `stages[s]`: the parameters of local stage s in the order its backward finishes their grads
    (the reverse of the forward's); a parameter two local stages share is reduced with the one
    whose final backward comes last in `program`; those that do not require grad are left out (the
    buckets are made again at a step that finds another set, alike on every replica). A parameter the
    backward gives no grad on any replica (read only through .detach()) keeps none, as on the model (a
    zero grad would have the optimizer step it: weight decay, momentum): the first step of a layout
    learns which (its grads are reduced from copies, after the step, with one all-reduce of which
    parameters have one), and the buckets leave them out from then on (a traced graph gives the same
    parameters grads at every step). `late[s]`:
    the parameters whose grads the final backward of s writes (None: all); the others are final
    when it is armed (zero-bubble: B wrote them, W writes the rest). `overlap=False` (grads are not
    the stages' own tensors, e.g. streamed in chunks): the buckets are reduced from copies in
    `finish`, one at a time. Collectives are timed with the step's clock (pipe.timing): device
    time on CUDA (an event recorded where the collective's completion is waited for).
    """

    def __init__(self, *, group: Any, size: int, device: torch.device, program: Sequence[Item],
                 stages: dict[int, list[torch.nn.Parameter]], late: dict[int, set[int] | None],
                 bucket_bytes: int | None = None, overlap: bool = True,
                 sharded: ShardedStages | None = None) -> None:
        self.group, self.size, self.device, self.overlap = group, size, device, overlap
        self.sharded = sharded  # dp_shard="full": FSDP reduces each stage after its final backward
        finals = {s: final_backward(program, s) for s in stages}
        self.order = sorted((s for s in stages if finals[s] is not None), key=lambda s: program.index(finals[s]))
        owner: dict[int, int] = {}
        for s in self.order:  # the later final backward wins
            for p in stages[s]:
                owner[id(p)] = s
        self.mine = {s: [p for p in stages[s] if owner[id(p)] == s] for s in self.order}
        self.final = {s: finals[s] for s in self.order}
        self.late, self.bucket_bytes = late, bucket_bytes
        self.buckets: list[_Bucket] = []
        self.of_stage: dict[int, list[_Bucket]] = {}
        self._trainable: tuple[bool, ...] = ()
        self._untouched: set[int] = set()  # the parameters no replica's backward gives a grad
        self._learning = False  # this step learns them (the first of a layout)
        self._build()
        self._started: set[int] = set()  # stages whose grads were bound this step
        self._armed: int | None = None
        self._hooks: list[Any] = []
        self._next = 0  # buckets launch in list order, the same on every replica
        self._clock: Clock = HostClock()
        self._spans: list[tuple[Action, Any, Any]] = []  # dp_shard="full": each stage's reduce-scatter

    def _build(self, learn: bool = True) -> None:
        """The buckets of the parameters that require grad now (`learn`: all of them, for a step that
        learns which get one; else those that do)."""
        self._trainable = tuple(p.requires_grad for s in self.order for p in self.mine[s])
        self._learning = learn and self.sharded is None
        if learn:
            self._untouched = set()
        self.buckets, self.of_stage = [], {}
        for s in self.order if self.sharded is None else []:
            params = [p for p in self.mine[s] if p.requires_grad and id(p) not in self._untouched]
            cap = bucket_cap(sum(p.numel() * p.element_size() for p in params), self.bucket_bytes)
            self.of_stage[s] = [_Bucket(s, i, part) for i, part in enumerate(_cut(params, cap))]
            self.buckets += self.of_stage[s]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}

    # ----- the step -----
    def step_begin(self, clock: Clock) -> None:
        """A new step, timed by `clock`; a parameter frozen or unfrozen since the last makes the
        buckets again."""
        self.fail()
        if tuple(p.requires_grad for s in self.order for p in self.mine[s]) != self._trainable:
            self._build()
        self._clock = clock
        self._spans = []
        self._started.clear()
        self._next = 0
        for b in self.buckets:
            b.work = b.done = b.flat = None
            b.marks = []
            b.ready.clear()

    def before(self, a: Action) -> None:
        """Before a compute action: the first backward of a stage this step binds its grads."""
        if self.overlap and not self._learning and a.kind in ("B", "W", "BW") and a.stage in self.of_stage and \
                a.stage not in self._started:
            self._started.add(a.stage)
            for b in self.of_stage[a.stage]:
                b.bind(self.device)

    def arm(self, stage: int, mb: int) -> None:
        """The program's REDUCE_GRAD: the next backward of `stage` finishes its grads; launch each
        bucket as they are."""
        if self.sharded is not None:
            self._armed = stage
            return
        if stage not in self.of_stage or self._learning:  # (learning: reduced after the step)
            return
        if stage not in self._started:  # a stage whose only backward is this one
            self._started.add(stage)
            for b in self.of_stage[stage]:
                b.bind(self.device)
        self._armed = stage
        late = self.late.get(stage)
        for b in self.of_stage[stage]:
            for p in b.params:
                if late is not None and id(p) not in late:
                    b.ready.add(id(p))
                else:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._accumulated))
        self._launch_ready()

    def _accumulated(self, p: torch.Tensor) -> None:
        self.ready([p])

    def ready(self, params: Sequence[torch.Tensor]) -> None:
        """These parameters' grads are final (a hook, or zero-bubble's W after a node)."""
        if self._armed is None:
            return
        for p in params:
            b = self._bucket_of.get(id(p))
            if b is not None and b.stage == self._armed:
                b.ready.add(id(p))
        self._launch_ready()

    def after(self, a: Action) -> None:
        """After a compute action: the armed stage's final backward leaves every grad of it final."""
        if self._armed is None or a != self.final[self._armed]:
            return
        if self.sharded is not None:
            start = self._clock.mark()
            self.sharded.reduce(self._armed)
            self._spans.append((Action(self._armed, "REDUCE_GRAD", 0), start, self._clock.mark()))
            self._armed = None
            return
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for b in self.of_stage[self._armed]:
            b.ready.update(id(p) for p in b.params)
        self._launch_ready()
        self._armed = None

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets):
            b = self.buckets[self._next]
            if len(b.ready) < len(b.params):
                return
            assert b.flat is not None
            self._launch(b, b.flat)
            self._next += 1

    def _launch(self, b: _Bucket, flat: torch.Tensor) -> None:
        b.marks = [self._clock.mark()]
        b.work = dist.all_reduce(flat, group=self.group, async_op=True)
        clock = self._clock

        def done(fut: Any, marks: list[Any] = b.marks) -> None:
            # where the completion is waited for: on CUDA this callback's stream follows the collective
            marks.append(clock.mark())
        b.done = b.work.get_future().then(done)

    def finish(self) -> None:
        """Wait for every bucket (reduce them now, one at a time, without overlap) and divide by
        dp; the collectives' spans go to the step's clock (REDUCE_GRAD, mb = the bucket's index in
        its stage)."""
        copied = not self.overlap or self._learning  # grads may be host views between steps (streamed states)
        if self._learning:  # which parameters have a grad on some replica: the buckets are made of those
            params = [p for b in self.buckets for p in b.params]
            has = torch.tensor([int(p.grad is not None) for p in params], dtype=torch.int32, device=self.device)
            dist.all_reduce(has, op=dist.ReduceOp.MAX, group=self.group)
            self._untouched = {id(p) for p, h in zip(params, has.tolist()) if not h}
            self._build(learn=False)
        for b in self.buckets:
            if copied:  # from a copy on the device
                b.flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                                    for p in b.params]).to(self.device)
                self._launch(b, b.flat)
            assert b.work is not None and b.flat is not None, f"bucket {b.index} of stage {b.stage} was never launched"
            b.work.wait()
            b.done.wait()
            b.flat.div_(self.size)
            if copied:
                offset = 0
                for p in b.params:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    p.grad.copy_(b.flat[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()
            self._clock.span(Action(b.stage, "REDUCE_GRAD", b.index), b.marks[0], b.marks[-1])
            b.flat = None  # the grads hold it from now on
        for a, start, end in self._spans:
            self._clock.span(a, start, end)

    def fail(self) -> None:
        """A step that failed half-way: drop the hooks (the works end with the group)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._armed = None
