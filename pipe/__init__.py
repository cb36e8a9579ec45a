"""pipe: schedules as data, a simulator, and the pipeline runtime over torch.distributed."""
from partition.errors import FxpipeError
from pipe.comm import PeerLost, RemoteError
from pipe.grads import NonFiniteGrads
from pipe.launch import Context, init
from pipe.runtime import Pipeline, PipelineError
from pipe.schedules import Action, ScheduleError, build
from pipe.simulate import Timeline, simulate

__all__ = ["Action", "Context", "FxpipeError", "NonFiniteGrads", "PeerLost", "Pipeline", "PipelineError",
           "RemoteError", "ScheduleError", "Timeline", "build", "init", "simulate"]
