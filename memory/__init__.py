"""memory: per-stage memory budgets met by recomputation and chunked CPU offload."""
from memory.base import MemoryManager

__all__ = ["MemoryManager"]
