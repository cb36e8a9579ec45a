"""The pipeline's errors (pipe.runtime and pipe.step raise them; pipe exports them)."""
from __future__ import annotations

from partition.errors import FxpipeError

__all__ = ["ModeError", "NonFiniteLoss", "PipelineError"]


class PipelineError(FxpipeError, ValueError):
    """A request the pipeline cannot run; the message names the constraint, the values and the fix."""


class ModeError(PipelineError):
    """The model cannot run in the mode asked (pp.train / pp.eval) by the pipeline's plan: traced in it, its
    graph is not the one the plan cut."""


class NonFiniteLoss(FxpipeError, FloatingPointError):
    """The loss of a step was NaN or infinite."""
