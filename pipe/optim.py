"""The optimizer of a pipeline's parameters (pp.build_optimizer), and the memory plan told of the one
the loop uses (pp.attach_optimizer)."""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable

import torch

import memory
from pipe.errors import PipelineError

if TYPE_CHECKING:
    from pipe.runtime import Pipeline

__all__ = ["attach", "build"]


def build(pp: Pipeline, factory: Callable[..., torch.optim.Optimizer] | None,
          kwargs: dict[str, Any]) -> torch.optim.Optimizer:
    """pp.build_optimizer: `factory(params, **kwargs)`, ZeroRedundancyOptimizer's under dp_shard="optimizer"."""
    factory = factory or pp._optimizer or torch.optim.AdamW
    params = list(pp.parameters())
    if not params:
        raise PipelineError(f"rank {pp.ctx.rank} holds no parameter (its stages {pp.local} have none), so "
                            "it has nothing to optimize; re-plan so every stage holds a parameter, or skip "
                            "the optimizer on this rank")
    if pp.dp_shard == "optimizer":
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
                                                             process_group=pp.dp_group, **kw)
    else:
        opt = factory(params, **kwargs)
    pp.attach_optimizer(opt)
    return opt


def attach(pp: Pipeline, optimizer: torch.optim.Optimizer) -> None:
    """pp.attach_optimizer: the memory plan predicts with the state `optimizer` keeps."""
    if pp.dp_shard == "optimizer":  # split only by torch's ZeroRedundancyOptimizer
        pp._state_split = pp.dp if memory.local_optimizer(optimizer) is not None else 1
    tell = getattr(pp.memory, "attach_optimizer", None)
    if tell is not None:
        f = memory.optimizer_state_factor(optimizer)  # ZeRO: a dp-th of its local optimizer's
        if f is not None and pp.dp_shard == "full":  # FSDP: the state of the shards (their own counted apart)
            f /= pp.dp
        tell(optimizer, f)
        for s, c in getattr(pp.memory, "choices", {}).items():
            pp.plan.stages[s].memory_peak = c.predicted_peak
