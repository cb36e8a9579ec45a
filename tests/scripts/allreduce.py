"""Launched by tests: python tests/scripts/allreduce.py under torchrun or mpiexec; prints the all-reduced sum."""
import torch
import torch.distributed as dist

import pipe.launch as launch

ctx = launch.init()
assert launch.init() is ctx  # idempotent
t = torch.tensor([float(ctx.rank + 1)])
dist.all_reduce(t)
print(f"rank {ctx.rank}/{ctx.world_size} launcher={ctx.launcher} backend={ctx.backend} sum={t.item():g}",
      flush=True)
dist.destroy_process_group()
