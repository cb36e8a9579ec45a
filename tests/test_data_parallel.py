"""Pipeline x data parallel on a DeviceMesh: (pp=2, dp=2) on 4 ranks gives the unpartitioned model's
loss and grads over the concatenation of the replicas' batches, and its parameters after AdamW
steps; a user's mesh with a dimension the pipeline ignores; bad layouts refused on every rank; a
checkpoint saved by two replicas resumed by one. One 4-rank launch and one 2-rank launch."""
from pathlib import Path
from typing import Any

import torch

from tests.mp import run_ranks

GPT = dict(n_layer=2, d_model=32, n_head=2, seq_len=16, vocab=64)
UNET = dict(depth=2, channels=4)
M, STEPS = 4, 3


def _batch(w: Any, step: int, replica: int) -> tuple[tuple[Any, ...], Any]:
    args, _, target = w.batch(w.microbatch_size * M, 10 * step + replica)
    return args, target


def _named(name: str) -> Any:
    return lambda m: f"{name}: {m}"


def _case(name: str, kw: dict[str, Any], **pipe_kw: Any) -> dict[str, Any]:
    """Train STEPS steps on every replica; compare with one process over the replicas' batches."""
    import partition
    import pipe
    w = partition.load(name, **kw)
    ref = partition.load(name, **kw)
    pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=M, cost="flops", **pipe_kw)
    # eps 1e-4: the U-Net's conv biases feed GroupNorm, so their grads are zero up to rounding, which
    # Adam's default eps (1e-8) would blow up to full-size steps of either sign
    opt = torch.optim.AdamW(list(pp.parameters()), lr=1e-2, eps=1e-4)
    ref_opt = torch.optim.AdamW(ref.model.parameters(), lr=1e-2, eps=1e-4)
    ref_params = dict(ref.model.named_parameters())
    out: dict[str, Any] = {"losses": [], "ref": [], "dp": pp.dp, "world": pp.world}
    for step in range(STEPS):
        args, target = _batch(w, step, pp.dp_rank)
        out["losses"].append(pp.step(*args, target=target))
        parts = [_batch(ref, step, j) for j in range(pp.dp)]
        cat_args = tuple(torch.cat([p[0][i] for p in parts]) for i in range(len(args)))
        loss = ref.loss_fn(ref.model(*cat_args), torch.cat([p[1] for p in parts]))
        loss.backward()
        out["ref"].append(float(loss.detach()))
        if step == 0:  # every grad, by name
            for n, p in pp.named_parameters():
                torch.testing.assert_close(p.grad, ref_params[n].grad, rtol=1e-4, atol=1e-5, msg=_named(n))
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    for n, p in pp.named_parameters():
        torch.testing.assert_close(p.detach(), ref_params[n].detach(), rtol=1e-4, atol=1e-5, msg=_named(n))
    out["pp"], out["opt"] = pp, opt
    return out


def four_body(rank: int, world: int, *, root: str) -> dict[str, Any]:
    import pipe
    from torch.distributed.device_mesh import init_device_mesh
    pipe.init()
    res: dict[str, Any] = {}
    user_mesh = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("pp", "dp", "tp"))  # "tp": left to the user
    for case, name, kw, pipe_kw in [
            ("gpt 1f1b", "gpt", GPT, dict(data_parallel=2)),
            ("gpt interleaved", "gpt", GPT, dict(data_parallel=2, schedule="interleaved-1f1b", stages_per_rank=2)),
            ("gpt zb-h1", "gpt", GPT, dict(data_parallel=2, schedule="zb-h1")),
            ("unet 1f1b", "unet", UNET, dict(data_parallel=2)),
            ("user mesh", "gpt", GPT, dict(mesh=user_mesh))]:
        got = _case(name, kw, **pipe_kw)
        pp, opt = got.pop("pp"), got.pop("opt")
        if case == "gpt 1f1b":  # saved by two replicas, to be resumed by one
            gpt_w = _gpt()
            pp.save(f"{root}/ckpt", optimizer=opt)
            got["after"] = []
            for step in range(STEPS, STEPS + 2):
                args, target = _batch(gpt_w, step, pp.dp_rank)
                got["after"].append(pp.step(*args, target=target))
                opt.step()
                opt.zero_grad(set_to_none=True)
        res[case] = got
    errors = {}
    for case, kw in [("data_parallel=0", dict(data_parallel=0)), ("not divisible", dict(data_parallel=3)),
                     ("no pp dimension", dict(mesh=init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))))]:
        import partition
        w = partition.load("gpt", **GPT)
        try:
            pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=M, cost="flops", **kw)
            errors[case] = "no error"
        except pipe.PipelineError as e:
            errors[case] = str(e)
    res["errors"] = errors
    return res


def test_pipeline_times_data_parallel_on_4_ranks(tmp_path: Path) -> None:
    res = run_ranks("tests.test_data_parallel:four_body", 4, timeout=240, root=str(tmp_path))
    resumed = run_ranks("tests.test_data_parallel:one_replica_body", 2, timeout=120, root=str(tmp_path))
    torch.testing.assert_close(torch.tensor(resumed[0]), torch.tensor(res[0]["gpt 1f1b"]["after"]),
                               rtol=1e-5, atol=1e-5)
    for case in ("gpt 1f1b", "gpt interleaved", "gpt zb-h1", "unet 1f1b", "user mesh"):
        for r in res:
            got = r[case]
            assert got["dp"] == 2 and got["world"] == 2, case
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(got["ref"]), rtol=1e-5, atol=1e-5)
    words = {"data_parallel=0": ["data_parallel must be a positive", "got 0"],
             "not divisible": ["world size 4 is not divisible", "data_parallel=3"],
             "no pp dimension": ["no 'pp'", "mesh_dim_names=('pp', 'dp')"]}
    for case, ws in words.items():
        assert len({r["errors"][case] for r in res}) == 1, case  # the same on every rank
        for word in ws:
            assert word in res[0]["errors"][case], (case, res[0]["errors"][case])



def _gpt() -> Any:
    import partition
    return partition.load("gpt", **GPT)


def one_replica_body(rank: int, world: int, *, root: str) -> list[float]:
    """dp=1 on 2 ranks resumes what dp=2 saved; each step's batch is both replicas' batches, in
    twice the microbatches."""
    import pipe
    pipe.init()
    w = _gpt()
    pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=2 * M, cost="flops")
    opt = torch.optim.AdamW(list(pp.parameters()), lr=1e-2, eps=1e-4)
    assert pp.load(f"{root}/ckpt", optimizer=opt) == STEPS
    losses = []
    for step in range(STEPS, STEPS + 2):
        parts = [_batch(w, step, j) for j in range(2)]
        losses.append(pp.step(torch.cat([p[0][0] for p in parts]), target=torch.cat([p[1] for p in parts])))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses
