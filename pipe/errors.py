"""The pipeline's errors (pipe.runtime and pipe.step raise them; pipe exports them)."""
from __future__ import annotations

from typing import Any

import torch.distributed as dist

from partition.errors import FxpipeError

__all__ = ["ModeError", "NonFiniteLoss", "PipelineError", "agree_everywhere"]


class PipelineError(FxpipeError, ValueError):
    """A request the pipeline cannot run; the message names the constraint, the values and the fix."""


class ModeError(PipelineError):
    """The model cannot run in the mode asked (pp.train / pp.eval) by the pipeline's plan: traced in it, its
    graph is not the one the plan cut."""


class NonFiniteLoss(FxpipeError, FloatingPointError):
    """The loss of a step was NaN or infinite."""


def agree_everywhere(error: str | None, cls: type[PipelineError] | None = None, group: Any = None,
                     when: str = "setting up the pipeline") -> None:
    """Raise `cls` (PipelineError) on every rank of the job (of `group`: one pipeline's, whose replicas need not
    take part) when any rank failed, naming the first failing (global) rank and what it failed `when` doing."""
    world = dist.get_world_size(group)
    errors: list[Any] = [None] * world
    if world > 1:
        dist.all_gather_object(errors, error, group=group)
    else:
        errors = [error]
    ranks = list(range(world)) if group is None else dist.get_process_group_ranks(group)
    for r, e in zip(ranks, errors):
        if e is not None:
            raise (cls or PipelineError)(f"rank {r} failed while {when}: {e}")
