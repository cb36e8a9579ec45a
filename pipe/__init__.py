"""pipe: schedules as data, a simulator, and the pipeline runtime over torch.distributed."""
from pipe.comm import Context, init
from pipe.runtime import Pipeline, PipelineError
from pipe.schedules import Action, ScheduleError, build
from pipe.simulate import Timeline, simulate

__all__ = ["Action", "Context", "Pipeline", "PipelineError", "ScheduleError", "Timeline", "build", "init",
           "simulate"]
