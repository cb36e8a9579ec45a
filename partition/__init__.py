"""partition: trace a model, cost it and cut it into balanced pipeline stages."""
from partition.errors import FxpipeError
from partition.plan import Plan, PlanError, StagePlan, Value, parse_bytes
from partition.planner import Analysis, plan, split
from partition.solve import InfeasibleBudget, PartitionError
from partition.split import StageIO
from partition.trace import TraceError, trace
from partition.workload import Workload, WorkloadError, load

__all__ = ["Analysis", "FxpipeError", "InfeasibleBudget", "PartitionError", "Plan", "PlanError", "StageIO", "StagePlan",
           "TraceError", "Value", "Workload", "WorkloadError", "load", "parse_bytes", "plan", "split",
           "trace"]
