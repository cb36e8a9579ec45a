"""Every rank of a pipeline makes the same calls: each pipeline built alike, each call's batch agreed on
before any message.

`pipe.Pipeline(...)` first compares its arguments, the example's shapes and the model's parameters and
buffers (sampled) across the ranks (`build_of`): ranks given another schedule, microbatch count or
budget would deadlock in the first collective that follows, and a model loaded with pretrained weights
on rank 0 alone (as DDP users do, whose wrapper broadcasts rank 0's) would train the other stages from
their random init.

Each rank reads what its own stages need from the batch it was given: the first stage the inputs,
the last the target, a stage reading an input directly (a mask used by every layer) that input. Ranks
given different batches would train on a mixture of them with no error at all: the usual cause is a
data loader sharded over the world's ranks (DistributedSampler) where the pipeline wants one batch per
replica. And a rank that refuses its call (a shape the plan was not made for) while the others go on
would leave them waiting on it until the timeout. So before a step (or an inference call) sends
anything, the ranks of the pipeline compare a digest of their calls in one all-gather of two
integers each; only when they differ, or a rank refused, do they gather the calls' descriptions, and every
rank raises an error that names the ranks and what differs.

The digest covers every input's path, kind, shape and dtype, constants by value, and the bytes of up to
`SAMPLE` of each tensor's elements, evenly spaced: two different batches differ there with near
certainty, and reading at most that many elements costs microseconds whatever the batch's size.
"""
from __future__ import annotations

import hashlib
import inspect
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from partition.signature import check_call, describe, input_paths
from pipe import comm, launch
from pipe.errors import PipelineError
from pipe.exchange import Exchange

if TYPE_CHECKING:
    from pipe.runtime import Pipeline

__all__ = ["SAMPLE", "BATCHES", "BUILDS", "Call", "call_of", "build_of", "agree", "agree_on_build", "agreed_call",
           "agree_on_call", "agree_on_kind", "check_pipeline_call", "split_microbatches", "target_bound"]

SAMPLE = 1024  # elements of each tensor whose bytes enter the digest, evenly spaced
_PLAIN = (bool, int, float, str, bytes, type(None))  # constants compared by value (others by type)


class Call:
    """One rank's call as the ranks compare it: `digest` (62 bits) and `parts`, the description of
    each input ("args[0]: a tensor [16, 64] int64, sampled bytes 3fa1c2d09e4b"), for messages."""

    def __init__(self, digest: int, parts: list[str]) -> None:
        self.digest, self.parts = digest, parts


def _sampled(x: torch.Tensor) -> bytes:
    """The bytes of up to SAMPLE of `x`'s elements, evenly spaced ("" for a tensor without plain
    strided storage or values: a sparse, nested or meta one, whose shape and dtype alone enter the digest)."""
    try:
        x, n = x.detach(), x.numel()
        every = -(-n // SAMPLE) if n else 1
        if x.is_contiguous():
            part = x.view(-1)[::every]
        else:  # the elements a contiguous copy would give, without making one
            part = x[torch.unravel_index(torch.arange(0, n, every, device=x.device), x.shape)]
        part = part.contiguous().cpu()
        return part.view(torch.uint8).numpy().tobytes() if part.numel() else b""
    except (RuntimeError, TypeError, NotImplementedError):  # NotImplementedError: a meta tensor's
        return b""


def call_of(args: Sequence[Any], kwargs: dict[str, Any], target: Any = None) -> Call:
    """The digest and description of the call `step(*args, target=target, **kwargs)` (the whole batch)."""
    h = hashlib.blake2b(digest_size=8)
    parts = []
    aimed = [("target" + pytree.keystr(k), x) for k, x in pytree.tree_flatten_with_path(target)[0]]
    for path, x in input_paths(args, kwargs) + aimed:
        if isinstance(x, torch.Tensor):
            part = f"{path}: {describe(x)}, sampled bytes {hashlib.blake2b(_sampled(x), digest_size=6).hexdigest()}"
        elif isinstance(x, _PLAIN):
            part = f"{path}: {describe(x)}"
        else:  # an object's repr may hold its address, which differs from process to process
            part = f"{path}: a {type(x).__module__}.{type(x).__qualname__}"
        h.update(part.encode())  # a tensor's sampled bytes by their own digest, in its description
        parts.append(part)
    return Call(int.from_bytes(h.digest(), "big") >> 2, parts)


BATCHES = ("were given different batches", "each rank reads what its own stages need from its own batch (the first "
           "stage the inputs, the last the target), so they would train on a mixture of them. Give every rank of a "
           "pipeline the same batch: a data loader sharded over the world's ranks (DistributedSampler's default) "
           "gives each its own; shard over the data-parallel replicas instead (DistributedSampler(..., "
           "num_replicas=pp.dp, rank=pp.dp_rank)), or not at all without data_parallel=")
BUILDS = ("were built differently", "every rank builds the same pipeline: the same model with the same values "
          "(seed torch alike before building it, and load pretrained weights on every rank or pass weights= a file "
          "every rank reads) and the same arguments")
CALLS = ("made different calls", "step(), evaluate(), forward(), clip_grad_norm_(), save() and load() each run every "
         "rank of the pipeline together (its stages send to each other, the norm sums theirs, a checkpoint holds each "
         "rank's part), so make the same call on every rank: evaluate, clip or save on every rank, not on one alone")
_SHOWN = 4  # differing parts a message lists per rank


def agree(call: Call, refused: Exception | None, *, group: Any, ranks: Sequence[int], device: torch.device,
          what: str, error: type[Exception], differ: tuple[str, str] = BATCHES, extra: int = 0) -> int:
    """Compare this rank's call with the other ranks' of `group` (global ranks `ranks`, in the group's
    order); `refused`: this rank's own error about its call (re-raised here). Raises on every rank when
    a rank refused its call (that rank's error, the others an `error` naming it) or the calls differ
    (an `error` naming the ranks and what differs, `differ`: how the ranks differ and the fix);
    returns when they agree, with the sum of the ranks' `extra` (a number each rank adds that need not agree).
    One all-gather of three integers a rank; the descriptions are gathered only when something is wrong."""
    mine_t = torch.tensor([int(refused is not None), call.digest, extra], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine_t) for _ in ranks]
    with comm.guarded(f"the check that every rank makes the same {what} call",
                      every=len(ranks) == dist.get_world_size()):  # (a lost rank named by a roll call)
        dist.all_gather(every, mine_t, group=group)  # on gloo 2-3x faster than an all_reduce of as much
    flags = torch.stack(every).tolist()
    if not any(f for f, _, _ in flags) and len({d for _, d, _ in flags}) == 1:
        return sum(x for _, _, x in flags)
    got: list[Any] = [None] * len(ranks)
    mine = (None if refused is None else f"{type(refused).__name__}: {refused}", call.parts)
    with comm.guarded(f"gathering the ranks' {what} calls"):
        dist.all_gather_object(got, mine, group=group)
    if refused is not None:
        raise refused
    why = [(r, msg) for r, (msg, _) in zip(ranks, got) if msg is not None]
    if why:
        r, msg = why[0]
        others = "" if len(why) == 1 else \
            f" (and rank{'s' if len(why) > 2 else ''} {', '.join(str(x) for x, _ in why[1:])})"
        raise error(f"rank {r}{others} refused this {what} call, which every rank of the pipeline makes "
                    f"alike, so this rank stops too; rank {r}'s error: {msg}")
    seen: dict[int, list[str]] = {r: parts for r, (_, parts) in zip(ranks, got)}
    common = set.intersection(*[set(parts) for parts in seen.values()])
    # what differs between the ranks (everything in the unlikely case that only the digests do)
    differs = {p for parts in seen.values() for p in parts} - common or {p for parts in seen.values() for p in parts}
    lines = []
    for r, parts in seen.items():
        mine_differ = [p for p in parts if p in differs]
        more = f" and {len(mine_differ) - _SHOWN} more" if len(mine_differ) > _SHOWN else ""
        lines.append(f"rank {r}: " + ", ".join(mine_differ[:_SHOWN]) + more)
    if len({p for p in differs if p.startswith("call: ")}) > 1:  # different calls, whatever their batches
        differ = CALLS
    elif differ is BATCHES and all(p.startswith(("mode: ", "autocast: ")) for p in differs):  # the same batches
        differ = ("made the same call in different states", "make it in the same state on every rank: "
                  "pp.train() or pp.eval() on every rank alike, and the same torch.autocast (or none) around it")
    raise error(f"the ranks of this pipeline {differ[0]} for this {what} call ({'; '.join(lines)}); {differ[1]}")


def _setting(v: Any) -> str:
    """A constructor argument as the ranks compare it: plain values (and lists, tuples, dicts of them)
    by repr, a file by its path, a class or function by its qualified name, a plan by its stages, schedule
    and graph (not its cost figures, which ranks measuring on their own may see differ), anything else by
    its type."""
    from pathlib import PurePath
    from partition.plan import Plan
    if isinstance(v, _PLAIN):
        return repr(v)
    if isinstance(v, PurePath):
        return f"path {str(v)!r}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_setting(x) for x in v) + "]"
    if isinstance(v, dict) and all(isinstance(k, str) for k in v) and len(v) <= 64:
        return "{" + ", ".join(f"{k!r}: {_setting(x)}" for k, x in sorted(v.items())) + "}"
    if isinstance(v, Plan):  # what the stages are built from; its cost figures may differ by rank harmlessly
        import json
        shape = [[st.nodes for st in v.stages], v.schedule, v.microbatches, v.stages_per_rank, v.fingerprint,
                 v.rewrites, v.loss, v.leaf_modules]
        return "a plan " + hashlib.blake2b(json.dumps(shape, sort_keys=True, default=str).encode(),
                                           digest_size=6).hexdigest()
    if isinstance(v, torch.Tensor):
        return describe(v)
    if isinstance(v, type) or callable(v) and hasattr(v, "__qualname__"):
        return f"{getattr(v, '__module__', '?')}.{v.__qualname__}"
    return f"a {type(v).__module__}.{type(v).__qualname__}"


def _state_dict(sd: dict[Any, Any]) -> str:
    """A state dict given as weights=, by one digest of its names, shapes, dtypes and sampled values."""
    h = hashlib.blake2b(digest_size=6)
    for k in sorted(sd, key=str):
        v = sd[k]
        h.update(f"{k}: {describe(v) if isinstance(v, torch.Tensor) else _setting(v)}".encode())
        if isinstance(v, torch.Tensor):
            h.update(_sampled(v))
    return f"a state dict of {len(sd)} entries, digest {h.hexdigest()}"


def build_of(model: torch.nn.Module, example_args: Sequence[Any], example_kwargs: dict[str, Any],
             example_target: Any, settings: dict[str, Any]) -> Call:
    """The digest and description of a `pipe.Pipeline(model, example_args, ...)` call on one rank: its
    arguments (`settings`, by name; a state dict given as weights= by its values sampled), the example's
    inputs and target by shape and dtype (their values only shape the trace), the model's class, and
    every parameter and buffer by name, shape, dtype and, unless weights= gives the values, up to SAMPLE
    of its values (a model on the meta device: none)."""
    h = hashlib.blake2b(digest_size=8)
    weights = settings.get("weights")
    parts = [f"{k}={_setting(v) if not (k == 'weights' and isinstance(v, dict)) else _state_dict(v)}"
             for k, v in settings.items()]
    aimed = [("example_target" + pytree.keystr(k), x) for k, x in pytree.tree_flatten_with_path(example_target)[0]]
    for path, x in [(f"example {p}", x) for p, x in input_paths(example_args, example_kwargs)] + aimed:
        parts.append(f"{path}: {describe(x) if isinstance(x, (torch.Tensor, *_PLAIN)) else _setting(x)}")
    parts.append(f"model {type(model).__module__}.{type(model).__qualname__}")
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in named:  # with weights=, the values come from there: the model's own are not compared
            parts.append(f"{kind} {name}: {describe(t)}" + ("" if weights is not None else ", sampled bytes "
                         f"{hashlib.blake2b(_sampled(t), digest_size=6).hexdigest()}"))
    for part in parts:
        h.update(part.encode())
    return Call(int.from_bytes(h.digest(), "big") >> 2, parts)


# ----- a Pipeline's calls -----
def agree_on_build(model: torch.nn.Module, example_args: Sequence[Any], example_kwargs: dict[str, Any] | None,
                   example_target: Any, settings: dict[str, Any]) -> None:
    """Compare this rank's `pipe.Pipeline(...)` call with every other rank's (build_of: the arguments, the
    example's shapes, the model's parameters and buffers sampled); different ones raise on every rank,
    naming what differs."""
    device = launch.context().device  # starts torch.distributed from the launcher's environment if not yet
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    refused, call = None, None
    try:
        call = build_of(model, tuple(example_args), dict(example_kwargs or {}), example_target, settings)
    except Exception as e:  # noqa: BLE001 - one rank's failure must reach the others, never leave them waiting
        refused = PipelineError(f"describing this rank's pipeline failed: {type(e).__name__}: {e}")
    agree(call or Call(0, []), refused, group=None, ranks=list(range(dist.get_world_size())),
          device=device, what="Pipeline(...)", error=PipelineError, differ=BUILDS)


def split_microbatches(tree: Any, n: int, what: str = "batch") -> list[Any]:
    """Split every tensor of `tree` along dim 0 into `n` equal microbatches; other leaves repeat."""
    leaves, spec = pytree.tree_flatten(tree)
    sizes = {x.shape[0] for x in leaves if isinstance(x, torch.Tensor) and x.dim() > 0}
    if len(sizes) > 1:
        paths = [(pytree.keystr(k), x) for k, x in pytree.tree_flatten_with_path(tree)[0]]
        each = ", ".join(f"{p} {x.shape[0]}" for p, x in paths if isinstance(x, torch.Tensor) and x.dim() > 0)
        raise PipelineError(f"the {what}'s tensors disagree on the batch size (dim 0): {each}; every input tensor "
                            "carries the batch along dim 0, split into the microbatches: expand a tensor every sample "
                            "shares to the batch (x.expand(batch, ...)), or pass it as one every microbatch takes "
                            "whole (a 0-dim tensor, a number)")
    size = sizes.pop() if sizes else n
    if size % n:
        raise PipelineError(f"a {what} of {size} samples is not divisible into {n} microbatches; use a "
                            f"batch size that is a multiple of {n}, or another microbatches=")
    parts = [x.chunk(n) if isinstance(x, torch.Tensor) and x.dim() > 0 else [x] * n for x in leaves]
    return [pytree.tree_unflatten([p[i] for p in parts], spec) for i in range(n)]


def _same_samples(batch: Any, target: Any) -> None:
    """Refuse a target whose dim 0 is not the batch's samples or a multiple of them (its tokens, flattened) (found
    by review: a target of 8 for a batch of 16 failed inside the step, in the loss, ending the job; split along
    dim 0 as the inputs are, one of another size would pair each microbatch with another's targets)."""
    def samples(tree: Any) -> int | None:
        return next((x.shape[0] for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor) and x.dim()), None)
    ours, theirs = samples(batch), samples(target)
    if ours and theirs is not None and theirs % ours:
        raise PipelineError(f"the target's dim 0 is {theirs} but the batch has {ours} samples (its inputs' dim 0): "
                            "fxpipe splits the target into the microbatches along dim 0 as it splits the inputs; "
                            "pass the batch's target, its samples (or their tokens, flattened) along dim 0")


_FORWARDS: dict[Any, Any] = {}  # a model class -> its forward's parameters, or None (looked up once, not per call)


def _forward_parameters(cls: Any) -> Any:
    """The parameters of `cls.forward`, or None."""
    if cls not in _FORWARDS:
        try:
            _FORWARDS[cls] = inspect.signature(cls.forward).parameters
        except (TypeError, ValueError):
            _FORWARDS[cls] = None
    return _FORWARDS[cls]


def _defaults_as_planned(pp: Pipeline, kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` with a keyword set to its default in the model's forward (a plain constant: `mask=None`) as the
    example set it: given explicitly where the example left it out, or left out where the example gave it; the
    model's call is the same."""
    params = _forward_parameters(type(pp._model))
    if params is None:
        return kwargs
    planned = pp._example[1]

    def default(k: str, v: Any) -> bool:
        d = params[k].default if k in params else inspect.Parameter.empty
        return v is d or type(v) is type(d) and isinstance(v, _PLAIN) and v == d
    out = {k: v for k, v in kwargs.items() if k in planned or not default(k, v)}
    out.update({k: v for k, v in planned.items() if k not in out and default(k, v)})
    return out


def still_running(what: str, pp: Pipeline | None = None) -> None:
    """PipelineError, naming the failure, for a call of pipeline `pp` made after a failure inside a step tore its
    process group down, or (pp None: a new pipeline, pipe.init()) one made while no group has been started since
    (found by review: torch's "Default process group has not been initialized", for every call after). A pipeline
    built on a group the user started again runs."""
    why = comm.stopped()
    lost = comm.stops() > pp._stops if pp is not None else why is not None and not dist.is_initialized()
    if lost:
        raise PipelineError(f"{what}: this job's process group was torn down after a failure ({why}): a failure "
                            "inside a step or pass leaves messages between the ranks unmatched, so fxpipe stops the "
                            "group rather than let a later call receive them; restart the job (torchrun or mpirun) "
                            "and resume from the last checkpoint (pp.load)")


def agreed_call(pp: Pipeline, batch: tuple[tuple[Any, ...], dict[str, Any]], target: Any, what: str,
                training: bool = True) -> tuple[list[Any], list[Any]]:
    """The call's microbatches and targets, once every rank of the pipeline has agreed on it: a call the
    plan was not made for is refused, and ranks given different batches stop, on every rank before any
    message."""
    still_running(f"pp.{what}()", pp)
    refused: Exception | None = None
    mbs: list[Any] = []
    targets: list[Any] = [None] * pp.M
    batch = (batch[0], _defaults_as_planned(pp, batch[1]))
    over = getattr(pp.memory, "over_budget", None) if what == "step" else None
    if over is not None:  # the optimizer's first step measured more state than the budget allows: refused on every
        refused = over  # rank before anything runs (found by review: raised inside the step on that rank alone, the
        # others waiting on it, then the process group torn down)
    try:  # (with fixed shapes, the plan's first: they say which one batch size it takes)
        lost, cast = pp._autocast_lost, autocast_key(pp.ctx.device)
        if lost and cast:
            raise PipelineError(f"this {what} call runs under an autocast ({cast}), but {lost}: the pipeline would "
                                "run that region at the autocast's precision where the model does not; make the "
                                "call without autocast, or move the region into a submodule (fxpipe keeps a "
                                "submodule that switches autocast whole, where torch.fx traces the model)")
        if not pp.dynamic:
            check_pipeline_call(pp, batch, target, training, step=what == "step")
        mbs = split_microbatches(batch, pp.M)
        if pp.dynamic:
            check_pipeline_call(pp, batch, target, training, step=what == "step")
        if target is not None:
            targets = split_microbatches(target, pp.M, "target")
            _same_samples(batch, target)
    except PipelineError as e:
        refused = refused or e
    agree_on_call(pp, batch, target, what, refused)  # (raises on every rank when a rank refused)
    return mbs, targets


def agree_on_call(pp: Pipeline, batch: tuple[tuple[Any, ...], dict[str, Any]], target: Any, what: str,
                  refused: Exception | None = None) -> None:
    """Compare this rank's call with the pipeline's other ranks' (agree); `refused`: this rank's own error
    about it. What each step adds to agree (bench schedules times it)."""
    # what this rank freezes, summed over the pipeline's ranks, so that every replica's rank compares the whole
    # pipeline's (found by review: a replica freezing otherwise on one rank was refused on some ranks only)
    trains = _frozen_digest(pp, what) if pp.dp > 1 else 0
    if pp.world > 1:
        call = call_of(batch[0], batch[1], target)  # and the pipeline's mode (pp.train / pp.eval), and the
        mode = "train" if pp.training else "eval"  # autocast its ranks run under (the values' dtypes follow it)
        key = autocast_key(pp.ctx.device)
        cast = f"autocast: {key or 'off'}" + ("" if key == pp._build_autocast else ", dtypes known"
                                                if key in pp._cut_dtypes else ", dtypes to learn")
        kind = f"call: pp.{what}()"  # step, evaluate or forward: ranks making different ones wait on each other
        salt = int.from_bytes(hashlib.blake2b(f"{cast}; {kind}".encode(), digest_size=7).digest(), "little")
        call = Call(call.digest ^ int(not pp.training) ^ (salt << 1), call.parts + [f"mode: {mode}", cast, kind])
        try:
            trains = agree(call, refused, group=pp.pp_group, ranks=pp._global, device=pp.ctx.device, what=what,
                           error=PipelineError, extra=trains)
        except PipelineError as e:
            refused = e
        else:
            refused = None
    if pp.dp > 1 and (what != "forward" or pp.sharded is not None):  # (a replica's forward() is its own, unless
        _replicas_agree(pp, refused, what, trains)  # its parameters are sharded over the replicas: gathered from them)
    elif refused is not None:
        raise refused


def _kind_digest(what: str) -> int:
    """The digest of a call's kind (pp.step(), pp.clip_grad_norm_(), ...), as the ranks compare it."""
    return int.from_bytes(hashlib.blake2b(f"call: pp.{what}()".encode(), digest_size=7).digest(), "little")


def agree_on_kind(pp: Pipeline, what: str, replicas: bool = True) -> None:
    """Compare which call this is with the pipeline's other ranks' (a call without a batch: clip_grad_norm_), in
    the all-gather step() makes to agree on its call, and then (`replicas`: a call the replicas make together)
    with the other replicas', in the all-gather each call begins the replicas' collectives with, so that ranks
    making different calls stop at once."""
    still_running(f"pp.{what}()", pp)
    refused: PipelineError | None = None
    if pp.world > 1:
        try:
            agree(Call(_kind_digest(what), [f"call: pp.{what}()"]), None, group=pp.pp_group, ranks=pp._global,
                  device=pp.ctx.device, what=what, error=PipelineError)
        except PipelineError as e:  # the replicas are told too, in their check
            refused = e
    if pp.dp > 1 and replicas:
        _replicas_agree(pp, refused, what)
    elif refused is not None:
        raise refused


def _frozen_digest(pp: Pipeline, what: str) -> int:
    """A digest of the parameters this rank freezes (requires_grad=False), for a step: 7 bytes, so that the sum
    over a pipeline's ranks fits an int64."""
    if what != "step":
        return 0
    frozen = [n for n, p in pp.named_parameters() if not p.requires_grad]
    return int.from_bytes(hashlib.blake2b("\n".join(frozen).encode(), digest_size=7).digest(), "little")


def _replicas_agree(pp: Pipeline, stopped: Exception | None, what: str, trains: int | None = None) -> None:
    """Raise on every replica when one replica's pipeline stopped its call (`stopped`: this rank's error, the
    same kind on every rank of its pipeline) or made another call (step() on one, clip_grad_norm_() on another):
    the replicas' grads are averaged together, so the others would pair this step's collectives with the stopped
    replica's next step, averaging grads of two batches, or another call's, then wait for it until the timeout.
    One all-gather of a flag and the call's kind over the replicas; the errors are gathered only when they
    differ."""
    frozen = [n for n, p in pp.named_parameters() if not p.requires_grad] if what == "step" else []
    if trains is None:  # (`trains`: the pipeline's ranks' digests summed, the same on every rank of a pipeline)
        trains = _frozen_digest(pp, what)
    mine = torch.tensor([int(stopped is not None), _kind_digest(what), trains], dtype=torch.int64,
                        device=pp.ctx.device)
    every = [torch.empty_like(mine) for _ in range(pp.dp)]
    with comm.guarded(f"the check that every replica makes its {what} call"):
        dist.all_gather(every, mine, group=pp.dp_group)
    rows = torch.stack(every).tolist()
    if not any(f for f, _, _ in rows) and len({(k, t) for _, k, t in rows}) == 1:
        return
    got: list[Any] = [None] * pp.dp
    with comm.guarded(f"gathering the replicas' {what} errors"):
        dist.all_gather_object(got, (None if stopped is None else str(stopped), what, pp._global, frozen),
                               group=pp.dp_group)
    if stopped is not None:
        raise stopped
    stop = next(((i, g) for i, g in enumerate(got) if g[0] is not None), None)
    if stop is not None:
        i, (msg, _, ranks, _) = stop
        raise PipelineError(f"replica {i} (global ranks {ranks}) stopped this {what} call, so this replica stops "
                            f"too (the replicas' grads are averaged together, and every replica must make the "
                            f"same calls); its error: {msg}")
    if len({kind for _, kind, _, _ in got}) > 1:
        calls = "; ".join(f"replica {i} (global ranks {ranks}): pp.{kind}()"
                          for i, (_, kind, ranks, _) in enumerate(got))
        raise PipelineError(f"the data-parallel replicas made different calls ({calls}): their grads are averaged "
                            "together, a norm is summed over them and a checkpoint holds each replica's part, so make "
                            "the same calls in the same order on every replica: step, evaluate, clip or save on every "
                            "replica, not on one alone")
    common = set.intersection(*[set(f) for _, _, _, f in got])
    differ = "; ".join(f"replica {i} (global ranks {ranks}) freezes {', '.join(sorted(set(f) - common)[:4]) or 'none'}"
                       f"{' ...' if len(set(f) - common) > 4 else ''}" for i, (_, _, ranks, f) in enumerate(got))
    if all(set(f) == common for _, _, _, f in got):  # alike on this rank's stages: on another rank of the pipelines
        differ = "alike on this rank's stages; the replicas' pipelines differ on another of their ranks, whose error "\
                 "names the parameters"
    raise PipelineError(f"the data-parallel replicas train different parameters (beyond those every replica "
                        f"freezes: {differ}): their grads are averaged together, bucket by bucket, so freeze and "
                        "unfreeze (requires_grad) the same parameters on every replica")


def check_pipeline_call(pp: Pipeline, batch: tuple[tuple[Any, ...], dict[str, Any]], target: Any,
                        training: bool = True, step: bool = False) -> None:
    """Refuse a call the plan was not made for (`batch`: the whole batch, split in pp.M)."""
    check_call(pp.plan, batch[0], batch[1], microbatches=pp.M, dynamic=pp.dynamic, error=PipelineError,
               example=pp._example)
    user = getattr(pp._model, "training", pp._traced_mode)
    if user != pp._traced_mode and pp.training != user:  # the model switched, the pipeline not: found by review
        now, was = ("training", "eval") if user else ("eval", "training")
        raise PipelineError(f"the model was put in {now} mode after this pipeline was built from it in {was} mode, "
                            f"but the pipeline's mode is its own: its stages were traced in {was} mode (a model "
                            "from_pretrained comes in eval mode), and step() trains them so; build the Pipeline "
                            f"after model.{'train' if user else 'eval'}(), or switch the pipeline's mode for "
                            f"evaluate() and forward() with pp.{'train' if user else 'eval'}()")
    if not training:
        return
    if step and not torch.is_grad_enabled():
        within = "torch.inference_mode()" if torch.is_inference_mode_enabled() else "torch.no_grad()"
        raise PipelineError(f"step() under {within}: no grads can be computed (the model itself raises 'element 0 of "
                            "tensors does not require grad'); call step() with grad enabled, and evaluate() or "
                            "forward() for inference")
    grads = [path for path, x in input_paths(batch[0], batch[1]) if isinstance(x, torch.Tensor) and x.requires_grad]
    if grads:
        raise PipelineError(f"the input{'s' if len(grads) > 1 else ''} {', '.join(grads)} require"
                            f"{'' if len(grads) > 1 else 's'} grad, but a step computes the grads of the model's "
                            "parameters only: each rank would keep the part of an input's grad its own stages give, "
                            "or none under zero bubble; pass it detached (x.detach()), or make the module that "
                            "computes it part of the model")
    if step and pp.training != pp._traced_mode:
        mode, traced = ("training", "eval") if pp.training else ("eval", "training")
        raise PipelineError(f"step() in {mode} mode, but this pipeline's stages were traced in {traced} mode (the "
                            f"model's mode when it was built), and step() trains the stages as traced; call "
                            f"pp.{'eval' if pp.training else 'train'}() before step(), or build the Pipeline "
                            f"from the model in {mode} mode")
    call = "step" if step else "evaluate"
    if target is None and pp._wants_target:
        raise PipelineError(f"{call}() got no target, but this pipeline's loss reads one (loss_fn(output, target) "
                            f"{'is planned into its last stage' if pp.plan.loss else 'was given example_target='}); "
                            f"call pp.{call}(*inputs, target=y) with the batch's target")
    if pp.plan.loss and target is not None:
        v = pp.plan.inputs[-1]
        assert v is not None
        if not isinstance(target, torch.Tensor):
            raise PipelineError(f"this pipeline computes the loss inside its last stage and needs the target "
                                f"as a tensor, got {type(target).__name__}; call step(*inputs, target=tensor)")
        got = f"{str(target.dtype).removeprefix('torch.')}[*{''.join(f', {d}' for d in target.shape[1:])}]"
        want = f"{v.dtype}[*{''.join(f', {d}' for d in v.shape[1:])}]"
        if got != want and pp._target_fixed:  # else the loss's graph takes any target, as loss_fn does
            raise PipelineError(
                f"the target is {got} (* the batch) but the plan was made for {want}, and {pp._target_fixed}; "
                f"pass example_target= with one microbatch's target to plan for it, or convert the target")


def target_bound(pp: Pipeline) -> str:
    """Why the target must have the planned dtype and shape (beyond the batch), or "" when the loss's graph
    takes any target, as loss_fn would: values computed from it cross stages, or a rewrite's cross entropy
    reads class indices of that shape."""
    from partition.loss import TARGET
    from partition.split import live_values
    if not pp.plan.loss:
        return ""
    vocab = [str(r[0]) for r in pp.plan.rewrites if list(r[2:]) == ["vocab"]]
    if vocab:
        return f"the cross entropy of {', '.join(vocab)} is cut into vocabulary slices that read class indices"
    stage_of = {n: st.index for st in pp.plan.stages for n in st.nodes}
    crossing = {x for r in live_values(pp._gm, stage_of, pp.S) for x in r}
    todo = [n for n in pp._gm.graph.nodes if n.op == "placeholder" and n.name == TARGET]
    seen: set[str] = set()
    while todo:
        n = todo.pop()
        if n.name not in seen:
            seen.add(n.name)
            todo += list(n.users)
    sent = sorted(seen & crossing)
    return f"values computed from it are sent between stages ({', '.join(sent)})" if sent else ""


def autocast_key(device: torch.device) -> str:
    """The autocast the ranks' ops run under ("" when off), which the dtypes of the values crossing stages
    follow: "cuda bfloat16", say."""
    return ", ".join(f"{t} {str(torch.get_autocast_dtype(t)).removeprefix('torch.')}"
                     for t in sorted({device.type, "cpu"}) if torch.is_autocast_enabled(t))


def exchange(pp: Pipeline) -> Exchange:
    """The messages of one step or pass: received into buffers of the plan's dtypes, or of those learned
    under the autocast the call runs in (the first step under one learns them: each value's shape and
    dtype travel ahead of it, pipe.exchange)."""
    key = autocast_key(pp.ctx.device)
    known = {} if key == pp._build_autocast else pp._cut_dtypes.get(key)  # the plan's under the build's autocast
    return Exchange(pp.transport, pp.plan, pp.place, pp.rank, pp.ctx.device, pp.dynamic, dtypes=known,
                    learn=known is None)


def learned(pp: Pipeline, ex: Exchange) -> None:
    """After a step or pass every rank completed (its last collective done): keep what it learned of the dtypes."""
    key = autocast_key(pp.ctx.device)
    if key != pp._build_autocast and key not in pp._cut_dtypes and ex.headers:
        pp._cut_dtypes[key] = dict(ex.learned)
