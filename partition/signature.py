"""The call a plan was made for (inputs by path, their kinds and dtypes), checked at every call."""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.utils._pytree as pytree

from partition.plan import Plan, PlanError, Value

__all__ = ["input_paths", "check_call", "describe"]


def _path(keys: Sequence[Any]) -> str:
    """'args[0]', "kwargs['attention_mask']", ... for a key path into (args, kwargs)."""
    if not keys:
        return "inputs"
    head = "args" if getattr(keys[0], "idx", None) == 0 else "kwargs"
    return head + pytree.keystr(tuple(keys[1:]))


def input_paths(args: Sequence[Any], kwargs: dict[str, Any]) -> list[tuple[str, Any]]:
    """(path, leaf) for every leaf of the call `model(*args, **kwargs)`, in pytree order."""
    return [(_path(k), x) for k, x in pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))[0]]


def describe(x: Any) -> str:
    """A leaf as the messages name it: 'a tensor [2, 16] int64', or the constant's repr."""
    if isinstance(x, torch.Tensor):
        return f"a tensor {list(x.shape)} {str(x.dtype).removeprefix('torch.')}"
    if isinstance(x, Value):
        return f"a tensor {x.shape} {x.dtype}"
    return f"{type(x).__name__} {x!r:.60}"


def _planned(plan: Plan) -> list[tuple[str, Any]]:
    """(path, Value or constant) of the inputs the plan was made for (its target left out)."""
    model_inputs = plan.inputs[:-1] if plan.loss else plan.inputs
    leaves: list[Any] = [v if v is not None else plan.input_constants.get(str(i), _Unknown())
                         for i, v in enumerate(model_inputs)]
    spec = pytree.treespec_loads(plan.input_spec)
    args, kwargs = pytree.tree_unflatten(leaves, spec)
    return input_paths(args, kwargs)


class _Unknown:
    """A non-tensor example input that JSON could not keep: its value is not checked."""

    def __repr__(self) -> str:
        return "(a value not recorded)"


def _same_constant(x: Any, v: Any) -> bool:
    """x is the constant v: of its type and equal (NaN to NaN); a comparison that gives no plain bool is not."""
    if type(x) is not type(v):
        return False
    if isinstance(x, float) and math.isnan(x) and math.isnan(v):
        return True
    try:
        same = x == v
        return not isinstance(same, torch.Tensor) and bool(same)  # (numpy scalars give numpy's bool)
    except Exception:  # an object whose == raises, or gives an array
        return False


def check_call(plan: Plan, args: Sequence[Any], kwargs: dict[str, Any], *, dynamic: bool = False,
               microbatches: int = 1, error: type[Exception] = PlanError,
               example: tuple[Sequence[Any], dict[str, Any]] | None = None) -> None:
    """Refuse a call whose inputs are not those the plan was made for: a missing or extra input,
    a tensor where the plan has a constant (or the reverse), another dtype, another constant,
    or (unless `dynamic`) another shape than `microbatches` microbatches of the planned ones. A constant
    the plan could not record (inf, an Enum, a dtype) is compared with `example`'s (the call traced),
    when given: the graph is specialised on it as on any other."""
    if not plan.input_spec:
        return
    want = _planned(plan)
    if example is not None:
        seen = dict(input_paths(*example))
        want = [(p, seen[p] if isinstance(v, _Unknown) and p in seen else v) for p, v in want]
    got = input_paths(args, kwargs)
    fix = ("re-plan with an example that has exactly these inputs (example_args=, example_kwargs= of one "
           "microbatch), or call with the inputs of the example")
    planned = ", ".join(f"{p} ({describe(v)})" for p, v in want) or "none"
    w, g = dict(want), dict(got)
    missing = [p for p in w if p not in g]
    extra = [p for p in g if p not in w]
    if missing or extra:  # (keywords in another order are the same call: the graph's inputs are bound by name)
        parts = ([f"missing {', '.join(missing)}"] if missing else []) + \
                ([f"not planned for: {', '.join(f'{p} ({describe(g[p])})' for p in extra)}"] if extra else [])
        differ = "; ".join(parts)
        raise error(f"the inputs of this call are not those the plan was made for ({differ}); the plan's inputs "
                    f"are {planned}; an input the plan does not know would be dropped silently, so {fix}")
    batched = {p: v.shape[0] for p, v in want if isinstance(v, Value) and v.shape}
    if dynamic and len(set(batched.values())) > 1:  # a shared tensor (a [T, T] mask) would be split when T = batch
        raise error(f"with dynamic_shapes=True every input tensor carries the batch along dim 0, but the plan's "
                    f"example had {', '.join(f'{p} {n}' for p, n in batched.items())} there; pass a shared tensor "
                    f"(a mask of the sequence) with a batch dim, expanded to the batch, or {fix}")
    for path, x in got:
        v = w[path]
        if isinstance(v, Value) != isinstance(x, torch.Tensor):
            raise error(f"input {path} is {describe(x)} but the plan was made with {describe(v)} there; {fix}")
        if isinstance(v, Value):
            assert isinstance(x, torch.Tensor)
            if str(x.dtype).removeprefix("torch.") != v.dtype:
                raise error(f"input {path} has dtype {str(x.dtype).removeprefix('torch.')} but the plan was made "
                            f"for {v.dtype}; convert it (e.g. x.to(torch.{v.dtype})) or {fix}")
            shape = [v.shape[0] * microbatches, *v.shape[1:]] if v.shape else v.shape
            if not dynamic and list(x.shape) != shape:
                later = [d for d in range(1, min(x.dim(), len(v.shape))) if microbatches > 1 and x.shape[0] ==
                         v.shape[0] and x.shape[d] == v.shape[d] * microbatches and list(x.shape[1:d]) ==
                         v.shape[1:d] and list(x.shape[d + 1:]) == v.shape[d + 1:]]
                if later:  # the batch along another dim: dynamic shapes would split the wrong one
                    raise error(f"input {path} has shape {list(x.shape)} but the plan was made for {v.shape} per "
                                f"microbatch, so {shape} for {microbatches} microbatches; its dim {later[0]} holds "
                                f"{microbatches} microbatches' worth, as if the batch were along dim {later[0]} "
                                f"(sequence-first), but microbatches are split along dim 0 of every input (with "
                                f"dynamic_shapes=True too); put the batch first (x.transpose(0, {later[0]}), and "
                                f"the example's likewise)")
                if microbatches > 1 and list(x.shape) == v.shape and any(
                        p != path and n * microbatches == g[p].shape[0] for p, n in batched.items()
                        if isinstance(g[p], torch.Tensor) and g[p].dim()):  # (the others' batch is theirs x M)
                    raise error(f"input {path} has shape {list(x.shape)}, as in the example, but every input tensor "
                                f"is split into the microbatches along dim 0, so its dim 0 must be the batch "
                                f"({shape} for {microbatches} microbatches): a tensor every sample shares "
                                f"(position_ids of shape [1, T], cache_position of shape [T]) cannot be split; "
                                f"expand it to the batch (x.expand(batch, ...)) in the calls and the example alike, "
                                f"or leave it out where the model makes it itself")
                export = plan.tracer == "torch.export.export"
                raise error(f"input {path} has shape {list(x.shape)} but the plan was made for {v.shape} per "
                            f"microbatch, so {shape} for {microbatches} microbatches; use batches of the planned "
                            f"shape (batch size = {v.shape[0] if v.shape else '?'} x microbatches)" + (
                                ", padded to its sizes (torch.export's graph of this model is fixed to the sizes it "
                                "was traced with), or build a pipeline for each shape" if export else
                                ", pass dynamic_shapes=True, or re-plan with an example of this shape"))
        elif not isinstance(v, _Unknown) and not _same_constant(x, v):
            varies = (" If it changes from batch to batch (a count such as num_items_in_batch), make it a 0-dim "
                      "tensor in the example and the calls (torch.tensor(n)): every microbatch takes it whole, a "
                      "value of the graph." if isinstance(x, (int, float)) and not isinstance(x, bool) else "")
            raise error(f"input {path} is {x!r} but the plan was made with {v!r} there (the graph is specialised "
                        f"on it); pass {v!r}, or {fix}.{varies}")
