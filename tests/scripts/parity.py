"""Launched by tests under torchrun or mpiexec: a pipelined gpt in parity with the plain model."""
import torch
import torch.distributed as dist

import pipe
from tests.parity import parity_body

torch.set_num_threads(1)
ctx = pipe.init()
losses = parity_body(ctx.rank, ctx.world_size, spec="gpt",
                     model_args={"n_layer": 2, "d_model": 64, "n_head": 4, "seq_len": 32, "vocab": 256},
                     schedules=[("1f1b", 1), ("zb-h1", 1)], M=4)
print(f"rank {ctx.rank} launcher={ctx.launcher} parity ok {losses}", flush=True)
dist.barrier()
dist.destroy_process_group()
