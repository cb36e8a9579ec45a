"""Launched by tests: python tests/scripts/allreduce.py under torchrun or mpiexec; prints the all-reduced sum.
With --exit-process, every rank then leaves through pipe.launch.exit_process, the last one a second
after the others (it also says when it is about to)."""
import sys
import time

import torch
import torch.distributed as dist

import pipe.launch as launch

ctx = launch.init()
assert launch.init() is ctx  # idempotent
t = torch.tensor([float(ctx.rank + 1)])
dist.all_reduce(t)
print(f"rank {ctx.rank}/{ctx.world_size} launcher={ctx.launcher} backend={ctx.backend} sum={t.item():g}",
      flush=True)
if "--exit-process" in sys.argv:
    if ctx.rank == ctx.world_size - 1:
        launch.finish()
        time.sleep(1.0)  # the others have left by now
        print(f"rank {ctx.rank} leaves last", flush=True)
    launch.exit_process(0)
dist.destroy_process_group()
