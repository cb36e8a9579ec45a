"""The Pipeline's arguments checked and made concrete on each rank, before it talks to another: each
refusal names the argument, the value and the fix."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import memory
from partition.plan import Plan
from pipe.errors import PipelineError
from pipe.replicas import DP_SHARD
from pipe.schedules import ScheduleError, default_stages_per_rank

__all__ = ["COMPILED_MOST", "Options", "check", "compile_options", "calibration_of"]


@dataclass(frozen=True)
class Options:
    recompute: str                  # the policy asked for ("auto" within a budget under schedule="auto")
    stages_per_rank: int            # 1 under schedule="auto" until it chooses
    compile: dict[str, Any] | None  # torch.compile's arguments, None for compile=False
    calibration: Any                # a pipe.calibration.Calibration, or None
    optim_factor: float | None      # optimizer state per parameter byte of optimizer=, None for Adam's planned two


def check(*, loss_fn: Any, schedule: str, plan: Any, stages_per_rank: int | None, cost: str,
          memory_budget: Any, recompute: str | None, offload: str, optimizer: Callable[..., Any] | None,
          compile: Any, dynamic_shapes: bool, calibration: Any, batch_size: int | None,
          auto_schedules: Any, dp_shard: str, dp_bucket_mb: Any, microbatches: Any = 1) -> Options:
    """pipe.Pipeline's arguments that need no other rank and no model: checked, defaults filled in."""
    auto = schedule == "auto"
    chosen = auto and batch_size is not None  # schedule='auto' chooses the count among the batch's divisors
    if not (chosen and microbatches == "auto") and (isinstance(microbatches, bool) or not isinstance(
            microbatches, int) or microbatches < 1):  # (found by review: a TypeError from the schedule's check)
        raise PipelineError(f"microbatches= must be a whole number >= 1, got {microbatches!r}; to have it chosen, "
                            "pass schedule='auto' with batch_size= (it weighs the divisors of the batch), "
                            "and microbatches= is then left out or 'auto'")
    if recompute is None:  # schedule='auto' within a budget weighs recompute for every candidate
        recompute = "auto" if auto and memory_budget is not None and not compile else "none"
    if loss_fn is None or not callable(loss_fn):
        raise PipelineError(f"loss_fn must be a callable (output, target) -> scalar loss, got {loss_fn!r}; "
                            "pass e.g. loss_fn=lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten())")
    try:
        memory.check_options(recompute, offload)
        # optimizer state per parameter byte the plans count: the optimizer's to come, else Adam's two copies
        optim_factor = None if optimizer is None else memory.factory_state_factor(optimizer)
    except ValueError as e:
        raise PipelineError(str(e)) from None
    compiled = compile_options(compile, recompute, dynamic_shapes, offload)
    cal = calibration_of(calibration, plan, cost)
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
    if auto:
        stages_per_rank = 1  # until chosen
    elif stages_per_rank is None:
        try:
            stages_per_rank = default_stages_per_rank(schedule)
        except ScheduleError as e:
            raise PipelineError(str(e)) from None
    if schedule.startswith("interleaved") and stages_per_rank < 2:
        raise PipelineError(f"schedule {schedule!r} interleaves several stages per rank, but stages_per_rank="
                            f"{stages_per_rank}; pass stages_per_rank=2 (or more), or schedule='1f1b'")
    if dp_shard not in DP_SHARD:
        raise PipelineError(f"dp_shard must be one of {', '.join(DP_SHARD)}, got {dp_shard!r}")
    if dp_bucket_mb is not None and (isinstance(dp_bucket_mb, bool) or not isinstance(dp_bucket_mb, (int, float))
                                     or not 0 < dp_bucket_mb < 1e6):
        raise PipelineError(f"dp_bucket_mb must be a number of MiB per gradient bucket in (0, 1e6), got "
                            f"{dp_bucket_mb!r}; pass e.g. 25, or None for an eighth of a stage's grads in [1, 25] "
                            "MiB")
    return Options(recompute, stages_per_rank, compiled, cal, optim_factor)


COMPILED_MOST = ("none", "activations")  # the most recompute and offload compiled stages run with


def compile_options(compile: Any, recompute: str, dynamic: bool, offload: str = "none") -> dict[str, Any] | None:
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
    if offload in ("states", "all"):  # (found by review: rank 1 died of a segfault in its first backward)
        raise PipelineError(f"compile= runs with offload='none' or 'activations' (got offload={offload!r}): streamed "
                            "model state fetches each parameter chunk from hooks on the stage's modules as they "
                            "run, which torch.compile breaks its graph on; use offload='activations', or "
                            "compile=False")
    options = {} if compile is True else dict(compile)
    if dynamic:
        options.setdefault("dynamic", True)
    return options


def calibration_of(given: Any, plan: Any, cost: str) -> Any:
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
