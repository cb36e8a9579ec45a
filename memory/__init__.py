"""memory: per-stage memory budgets met by recomputation and chunked CPU offload."""
from memory.base import MemoryManager
from memory.budget import OFFLOAD, RECOMPUTE, BudgetError, StageChoice, check_options
from memory.build import NodeCost, build, plan_choices
from memory.manager import PlannedMemory, factory_state_factor, local_optimizer, optimizer_state_factor
from memory.streams import measure_speeds

__all__ = ["MemoryManager", "PlannedMemory", "BudgetError", "StageChoice", "NodeCost", "build", "plan_choices",
           "check_options", "measure_speeds", "factory_state_factor", "local_optimizer",
           "optimizer_state_factor", "RECOMPUTE", "OFFLOAD"]
