"""Pipeline x data parallel on a DeviceMesh: (pp=2, dp=2) on 4 ranks gives the unpartitioned model's
loss and grads over the concatenation of the replicas' batches, its grad norm (clip_grad_norm_), its
parameters after AdamW steps and its loss on held-out batches (evaluate), for 1f1b, interleaved-1f1b
and zb-h1 on the tied GPT and the U-Net, with unsharded, ZeRO-1 (dp_shard="optimizer") and FSDP
(dp_shard="full") state; a user's mesh with a dimension the pipeline ignores; bad layouts refused on
every rank; checkpoints saved by two replicas (each sharding) resumed by one. One 4-rank launch and
one 2-rank launch."""
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.mp import run_ranks

GPT = dict(n_layer=2, d_model=32, n_head=2, seq_len=16, vocab=64)
UNET = dict(depth=2, channels=4)
M, STEPS = 4, 3
CLIP = 0.3  # below every step's grad norm of both models: each step clips
SCHEDULES = {"1f1b": {}, "interleaved": dict(schedule="interleaved-1f1b", stages_per_rank=2),
             "zb-h1": dict(schedule="zb-h1")}
SHARDS = ("none", "optimizer", "full")
_UNET_PAIRS = dict(zip(SCHEDULES, SHARDS))  # the U-Net's cases: each schedule with one sharding, each sharding once
SAVED = ("none", "optimizer", "full")  # the gpt 1f1b case of each is checkpointed and resumed by one replica


def _batch(w: Any, step: int, replica: int) -> tuple[tuple[Any, ...], Any]:
    """A replica's batch. The GPT's tokens are ignored (-100) unevenly, a microbatch of replica 1 wholly:
    the batch's loss over both replicas weighs each microbatch by its counted targets."""
    args, _, target = w.batch(w.microbatch_size * M, 10 * step + replica)
    if not target.is_floating_point():
        target = target.clone()  # (a view of the tokens the inputs are)
        for i in range(target.shape[0]):
            target[i, :(3 * i + 5 * replica + step) % target.shape[1]] = -100
        if replica == 1:
            target[:w.microbatch_size] = -100
    return args, target


def _full(t: Any) -> torch.Tensor:
    """The whole tensor of a dp_shard='full' (DTensor) parameter or grad."""
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


def _named(name: str) -> Any:
    return lambda m: f"{name}: {m}"


def _sharding(pp: Any, opt: Any) -> dict[str, Any]:
    """What this rank keeps: its optimizer's kind, state elements, and its parameters' local elements."""
    from torch.distributed.tensor import DTensor
    def local(t: torch.Tensor) -> int:
        return (t.to_local() if isinstance(t, DTensor) else t).numel()
    inner = getattr(opt, "optim", opt)
    return {"optimizer": type(opt).__name__,
            "state": sum(local(v) for st in inner.state.values() for v in st.values()
                         if isinstance(v, torch.Tensor) and v.dim() > 0),
            "local": sum(local(p) for p in pp.parameters()),
            "whole": sum(p.numel() for p in pp.parameters())}


def _case(name: str, kw: dict[str, Any], **pipe_kw: Any) -> dict[str, Any]:
    """Train STEPS steps on every replica; compare with one process over the replicas' batches."""
    import partition
    import pipe
    w = partition.load(name, **kw)
    ref = partition.load(name, **kw)
    pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=M, cost="flops", **pipe_kw)
    # eps 1e-4: the U-Net's conv biases feed GroupNorm, so their grads are zero up to rounding, which
    # Adam's default eps (1e-8) would blow up to full-size steps of either sign
    opt = pp.build_optimizer(torch.optim.AdamW, lr=1e-2, eps=1e-4)
    ref_opt = torch.optim.AdamW(ref.model.parameters(), lr=1e-2, eps=1e-4)
    ref_params = dict(ref.model.named_parameters())
    out: dict[str, Any] = {"losses": [], "ref": [], "norms": [], "dp": pp.dp, "world": pp.world}
    with torch.inference_mode():  # a validation before training: under FSDP the first gather made inference
        pp.evaluate(*_batch(w, 98, pp.dp_rank)[0], target=_batch(w, 98, pp.dp_rank)[1])  # tensors no step could write
    for step in range(STEPS):
        args, target = _batch(w, step, pp.dp_rank)
        out["losses"].append(pp.step(*args, target=target))
        parts = [_batch(ref, step, j) for j in range(pp.dp)]
        cat_args = tuple(torch.cat([p[0][i] for p in parts]) for i in range(len(args)))
        loss = ref.loss_fn(ref.model(*cat_args), torch.cat([p[1] for p in parts]))
        loss.backward()
        out["ref"].append(float(loss.detach()))
        # the whole model's grad norm (FSDP: over the replicas' shards too), and the grads clipped by it
        out["norms"].append((float(pp.clip_grad_norm_(CLIP)),
                             float(torch.nn.utils.clip_grad_norm_(ref.model.parameters(), CLIP))))
        if step == 0:  # every grad, by name
            for n, p in pp.named_parameters():
                torch.testing.assert_close(_full(p.grad), ref_params[n].grad, rtol=1e-4, atol=1e-5, msg=_named(n))
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    for n, p in pp.named_parameters():
        torch.testing.assert_close(_full(p.detach()), ref_params[n].detach(), rtol=1e-4, atol=1e-5, msg=_named(n))
    whole = pp.full_state_dict()  # found by review: under dp_shard="full" rank 0 gave shards, and an untied head
    if whole is not None:         # untrained
        want = ref.model.state_dict()
        assert sorted(whole) == sorted(want), (sorted(set(whole) ^ set(want)))
        for k, v in want.items():
            torch.testing.assert_close(whole[k], v, rtol=1e-4, atol=1e-5, msg=_named(f"full_state_dict {k}"))
    args, target = _batch(w, 99, pp.dp_rank)  # a held-out batch per replica: the mean loss over both
    parts = [_batch(ref, 99, j) for j in range(pp.dp)]
    with torch.no_grad():
        held = ref.loss_fn(ref.model(*(torch.cat([p[0][i] for p in parts]) for i in range(len(args)))),
                           torch.cat([p[1] for p in parts]))
    out["evaluated"] = (pp.evaluate(*args, target=target), float(held))
    # in eval mode: stages cut from an eval-mode trace (no dropout here, so the same loss), run on every
    # sharding (FSDP: gathered for them, sharded again after) and with streamed states (fetched for the pass)
    out["evaluated in eval mode"] = (pp.eval().evaluate(*args, target=target), float(held))
    pp.train()
    if pp.dp_shard == "full":  # gathered for the forwards, sharded again after them
        assert all(isinstance(p, torch.distributed.tensor.DTensor) for p in pp.parameters())
    if pp.reducer is not None:  # grads set to None free the buckets: the reducer holds none between steps
        assert all(b.flat is None and all(r() is None for r in b.views) for b in pp.reducer.buckets)
    out["sharding"] = _sharding(pp, opt)
    last = max(e.end for e in pp.timeline)  # the last step's: when the buckets were launched, and how many
    out["launched"] = [(e.start < last, e.start <= e.end) for e in pp.collectives]
    out["memory"] = {s: {k: r[k] for k in ("peak_total", "predicted_peak", "dp_shard_params", "dp_shard_optimizer")}
                     for s, r in pp.memory_report().items()}
    out["pp"], out["opt"] = pp, opt
    return out


def _errors() -> dict[str, str]:
    """Bad layouts and options, each refused (the message kept, compared across ranks)."""
    import partition
    import pipe
    from torch.distributed.device_mesh import init_device_mesh
    errors = {}
    for case, kw in [("data_parallel=0", dict(data_parallel=0)), ("not divisible", dict(data_parallel=3)),
                     ("no pp dimension", dict(mesh=init_device_mesh("cpu", (4,), mesh_dim_names=("dp",)))),
                     ("dp_shard", dict(data_parallel=2, dp_shard="zero3")),
                     ("full with streamed states", dict(data_parallel=2, dp_shard="full", offload="states")),
                     ("full with a weight shared on a rank", dict(data_parallel=2, dp_shard="full", schedule="zbv")),
                     ("zero with a factory", dict(data_parallel=2, dp_shard="optimizer")),
                     ("bucket size", dict(data_parallel=2, dp_bucket_mb=True)),
                     ("full with a 0-dim parameter", dict(data_parallel=2, dp_shard="full"))]:
        w = partition.load("gpt", **GPT)
        if case == "full with a 0-dim parameter":  # (found by review: refused by fully_shard on the ranks holding
            w.model = _Tempered(w.model)          # it alone, the others going on into the step)
        try:
            pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=M, cost="flops", **kw)
            pp.build_optimizer(lambda params: torch.optim.SGD(params, lr=0.1))
            errors[case] = "no error"
        except pipe.PipelineError as e:
            errors[case] = str(e)
    return errors


class _Tempered(torch.nn.Module):
    """A model's logits over a learned temperature, a 0-dim parameter."""
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner, self.temperature = inner, torch.nn.Parameter(torch.tensor(1.0))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.inner(idx) / self.temperature


def _grads_after_two_steps(**pipe_kw: Any) -> dict[str, Any]:
    """Two steps without zero_grad (grads accumulate; the tied embedding's too) against one process
    over each step's replicas' batches; before them pos_emb, frozen when the pipeline was built, is
    unfrozen (the replicas must then average it too). Returns the largest difference per parameter."""
    import pipe
    w, ref = _gpt(), _gpt()
    w.model.pos_emb.weight.requires_grad_(False)
    pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=M, cost="flops", **pipe_kw)
    for _, p in pp.named_parameters():
        p.requires_grad_(True)
    for step in range(2):
        args, target = _batch(w, step, pp.dp_rank)
        pp.step(*args, target=target)
        parts = [_batch(ref, step, j) for j in range(pp.dp)]
        ref.loss_fn(ref.model(torch.cat([p[0][0] for p in parts])), torch.cat([p[1] for p in parts])).backward()
    if pp.dp_shard == "full":  # inference in between leaves the parameters sharded, as the optimizer holds them
        pp.forward(*_batch(w, 0, pp.dp_rank)[0])
        assert all(isinstance(p, torch.distributed.tensor.DTensor) for p in pp.parameters())
    refs = dict(ref.model.named_parameters())
    return {n: float((_full(p.grad) - refs[n].grad).abs().max()) for n, p in pp.named_parameters()}


class _Sized(torch.nn.Module):
    """Linear layers and a scale held by the model itself, with a branch on the batch's size, which torch.fx
    cannot trace and torch.export can: its graph reads the parameters as attributes (get_attr). Its attention's
    `.contiguous()` copies on the meta device and not on the CPU, as Hugging Face GPT-2's does."""
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))
        self.scale = torch.nn.Parameter(torch.rand(8) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.size(0) == 0:
            raise ValueError("no samples")
        for layer in self.layers:
            x = torch.tanh(layer(x))
        q = x.view(x.shape[0], 2, 2, 2).transpose(1, 2)  # (samples, 2 heads, 2 tokens, 2)
        x = F.scaled_dot_product_attention(q, q, q).transpose(1, 2).contiguous().view(x.shape[0], 8)
        return x * self.scale


def _exported_and_sharded() -> dict[str, Any]:
    """dp_shard="full" on a model torch.export traces: forward() and evaluate() in training and in eval mode (found
    by review: the stages cut for them read the parameters they were cut with, FSDP's shards, and raised "mixed
    torch.Tensor and DTensor"; found after: in eval mode the meta copy's trace had a copy the plan's graph lacks, a
    ModeError). Each against the unpartitioned model: (got, expected) pairs."""
    import pipe
    model, ref = _Sized(), _Sized()
    g = torch.Generator().manual_seed(5)
    x, t = torch.randn(16, 8, generator=g), torch.randint(0, 8, (16,), generator=g)
    pp = pipe.Pipeline(model, (x[:2],), loss_fn=F.cross_entropy, microbatches=M, cost="flops", data_parallel=2,
                       dp_shard="full")
    mine = slice(8 * pp.dp_rank, 8 * pp.dp_rank + 8)
    pp.step(x[mine], target=t[mine])  # (no optimizer step: the parameters stay the reference's)
    out: dict[str, Any] = {"tracer": pp.plan.table().split("traced by ")[-1].split()[0]}
    for mode in ("training", "eval"):
        getattr(pp, "train" if mode == "training" else "eval")()
        out[f"forward in {mode} mode"] = (pp.forward(x[mine]), ref(x[mine]).detach())
        out[f"evaluate in {mode} mode"] = (torch.tensor(pp.evaluate(x[mine], target=t[mine]), dtype=torch.float64),
                                           F.cross_entropy(ref(x), t).detach().double())
    return out


def _batch_norm_sharded() -> dict[str, Any]:
    """dp_shard="full" on a model with batch norm, the bundled ResNet: evaluate() in eval mode (found
    by review: the trace of the pipeline's meta copy in eval mode went to torch.export, as its check of the buffers
    it wrote raised on meta, and matched nothing of the plan's torch.fx graph: a ModeError). (got, expected)."""
    import pipe
    from partition.workload import load
    w, ref = (load("resnet", blocks=2, channels=8, image=8, microbatch_size=2) for _ in range(2))
    pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=M, cost="flops", data_parallel=2,
                       dp_shard="full")
    (x,), _, t = ref.batch(16, 0)
    mine = slice(8 * pp.dp_rank, 8 * pp.dp_rank + 8)
    with torch.no_grad():
        want = ref.loss_fn(ref.model.eval()(x), t).double()
    return {"evaluate in eval mode": (torch.tensor(pp.eval().evaluate(x[mine], target=t[mine]), dtype=torch.float64),
                                      want)}


def _masked_mean(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The GPT's cross entropy as a masked mean written by hand: its per-token loss times the mask, summed,
    over the mask's sum."""
    mask = (target >= 0).flatten()
    per = F.cross_entropy(logits.flatten(0, 1), target.clamp(min=0).flatten(), reduction="none")
    return (per * mask).sum() / mask.sum()


def _ratio_over_replicas() -> dict[str, float]:
    """Two steps of the masked mean on 2 replicas whose masks fall unevenly (a microbatch of replica 1 wholly
    masked): each microbatch's numerator over both replicas' divisor. The largest difference from one process
    over the replicas' batches, of the losses and of each parameter's grads."""
    import pipe
    w, ref = _gpt(), _gpt()
    pp = pipe.Pipeline(w.model, w.example_args, loss_fn=_masked_mean, microbatches=M, cost="flops", data_parallel=2,
                       example_target=w.example_target)
    assert pp.plan.loss and pp.weighting.kind == "ratio", pp.weighting
    out = {"loss": 0.0}
    for step in range(2):
        args, target = _batch(w, step, pp.dp_rank)
        loss = pp.step(*args, target=target)
        parts = [_batch(ref, step, j) for j in range(pp.dp)]
        want = _masked_mean(ref.model(torch.cat([p[0][0] for p in parts])), torch.cat([p[1] for p in parts]))
        want.backward()
        out["loss"] = max(out["loss"], abs(loss - float(want)))
    refs = dict(ref.model.named_parameters())
    return {**out, **{n: float((p.grad - refs[n].grad).abs().max()) for n, p in pp.named_parameters()}}


def _terms_over_replicas(how: str = "router") -> dict[str, float]:
    """A mixture of experts' loss (tests/test_natural_call.py's _OwnLoss("router"): a cross entropy plus a router's
    load-balancing term) on 2 replicas x 2 microbatches, replica 0's first microbatch counting no label, its
    parameters sharded over the replicas: the cross entropy weighed by both replicas' count of labels, the
    load-balancing term the mean of the 4 microbatches'. `ratio penalty`: a masked mean whose numerator adds a
    penalty of the weights, added once over both replicas. The largest difference from one process, of the loss
    and of each parameter's grads."""
    import pipe
    from tests.test_natural_call import _OwnLoss
    torch.manual_seed(0)
    x, labels = torch.randn(16, 8), torch.randint(0, 10, (16,))
    labels[:6] = -100
    torch.manual_seed(2)
    model, ref = _OwnLoss(how), _OwnLoss(how)
    ref.load_state_dict(model.state_dict())
    pp = pipe.Pipeline(model, (x[:4], labels[:4]), loss_fn=lambda out, _: out, microbatches=2, cost="flops",
                       data_parallel=2, dp_shard="full" if how == "router" else "none")
    assert pp.weighting.kind == ("terms" if how == "router" else "ratio") and pp.weighting.parts, pp.weighting
    mine = slice(8 * pp.dp_rank, 8 * pp.dp_rank + 8)
    loss = pp.step(x[mine], labels[mine])
    want = F.cross_entropy(ref.b(torch.relu(ref.a(x))), labels, weight=ref.classes) + \
        sum(ref.terms(xm, lm)[1] for xm, lm in zip(x.chunk(4), labels.chunk(4))) / 4 if how == "router" \
        else ref(x, labels)
    want.backward()
    refs = dict(ref.named_parameters())
    return {"loss": abs(loss - float(want)),
            **{n: float((_full(p.grad) - refs[n].grad).abs().max()) for n, p in pp.named_parameters()}}


def _frozen_on_one_rank() -> dict[str, Any]:
    """Found by review: a parameter frozen on global rank 0 alone (replica 0's first stage) was refused only by the
    ranks whose replica group saw the difference; the others went into the step and waited until the timeout (a
    retry hung the job). The pipeline's ranks sum their digests of what they freeze, so every rank is told; after
    unfreezing, the step runs."""
    import time

    import pipe
    w = _gpt()
    pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=M, cost="flops", data_parallel=2)
    name, param = next((n, p) for n, p in pp.named_parameters() if n not in pp._tied_names)
    if pp.ctx.rank == 0:
        param.requires_grad_(False)
    args, target = _batch(w, 0, pp.dp_rank)
    start = time.monotonic()
    out: dict[str, Any] = {}
    try:
        pp.step(*args, target=target)
        out["error"] = "no error"
    except pipe.PipelineError as e:
        out["error"] = str(e)
    out["s"] = time.monotonic() - start
    param.requires_grad_(True)
    # (refused before anything ran: no grads to clear)
    out["then"] = pp.step(*args, target=target)
    return out


def _one_replica_refuses() -> dict[str, Any]:
    """Found by review: replica 1 given a short last batch refused it while replica 0 ran its step, whose grads'
    all-reduce then paired with replica 1's next step (both losses the mean of two steps' batches, 4.167271 where
    4.171211), and replica 0 waited for replica 1 until the timeout. Every replica now stops the call; a loop that
    skips it goes on in step. Then forward() on replica 0 alone (it waited for replica 1's ranks in a check over
    the whole job). Returns each rank's error and the next step's loss against one process's."""
    import pipe
    w, ref = _gpt(), _gpt()
    pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=M, cost="flops", data_parallel=2)
    out: dict[str, Any] = {}
    args, target = _batch(w, 0, pp.dp_rank)
    if pp.dp_rank == 1:  # a last batch of half the size on this replica only
        args, target = tuple(a[: a.shape[0] // 2] for a in args), target[: target.shape[0] // 2]
    try:
        pp.step(*args, target=target)
        out["error"] = "no error"
    except pipe.PipelineError as e:
        out["error"] = str(e)
    args, target = _batch(w, 1, pp.dp_rank)
    if pp.dp_rank == 0:  # forward() on one replica alone: its own (it waited on the other replica's ranks)
        with torch.no_grad():
            out["forward"] = list(pp.forward(*args).shape)
    out["loss"] = pp.step(*args, target=target)
    parts = [_batch(ref, 1, j) for j in range(pp.dp)]
    want = ref.loss_fn(ref.model(torch.cat([p[0][0] for p in parts])), torch.cat([p[1] for p in parts]))
    out["want"] = float(want)
    return out


def _save_on_one_rank(root: str) -> dict[str, Any]:
    """Found by review: pp.save() on rank 0 alone (a DDP habit) while the others stepped waited the whole timeout,
    then raised a bare gloo timeout (and full_state_dict() on rank 0 alone aborted gloo). Every rank now agrees on
    the call first and is told; the pipeline goes on, and a save on every rank writes the checkpoint."""
    import pipe
    w = _gpt()
    pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=M, cost="flops", data_parallel=2)
    args, target = _batch(w, 0, pp.dp_rank)
    out: dict[str, Any] = {}
    try:
        if pp.ctx.rank == 0:
            pp.save(f"{root}/one-rank")
        else:
            pp.step(*args, target=target)
        out["error"] = "no error"
    except pipe.PipelineError as e:
        out["error"] = str(e)
    out["written"] = Path(f"{root}/one-rank").exists()
    out["loss"] = pp.step(*args, target=target)
    out["saved"] = pp.save(f"{root}/every-rank")
    return out


def four_body(rank: int, world: int, *, root: str) -> dict[str, Any]:
    import pipe
    from torch.distributed.device_mesh import init_device_mesh
    pipe.init()
    res: dict[str, Any] = {}
    cases = [(f"{name} {sched} {shard}", name, GPT if name == "gpt" else UNET,
              dict(data_parallel=2, dp_shard=shard, **SCHEDULES[sched]))
             for shard in SHARDS for sched in SCHEDULES for name in ("gpt", "unet") if name == "gpt" or
             _UNET_PAIRS[sched] == shard]  # (the GPT under each schedule and sharding, the U-Net under each once)
    for _, name, _, kw in cases:  # small buckets, so that the tiny models' grads make several
        if kw["dp_shard"] == "none":
            kw["dp_bucket_mb"] = 0.01
    user_mesh = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("pp", "dp", "tp"))  # "tp": left to the user
    import torch.distributed.distributed_c10d as c10d
    user_groups = set(c10d._world.pg_map)
    cases.append(("user mesh", "gpt", GPT, dict(mesh=user_mesh)))
    for case, name, kw, pipe_kw in cases:
        got = _case(name, kw, **pipe_kw)
        pp, opt = got.pop("pp"), got.pop("opt")
        shard = pipe_kw.get("dp_shard")
        if name == "gpt" and "schedule" not in pipe_kw and shard in SAVED:  # to be resumed by one replica
            pp.save(f"{root}/ckpt-{shard}", optimizer=opt)
            got["after"] = []
            for step in range(STEPS, STEPS + 2):
                args, target = _batch(_gpt(), step, pp.dp_rank)
                got["after"].append(pp.step(*args, target=target))
                opt.step()
                opt.zero_grad(set_to_none=True)
        res[case] = got
    for shard in ("optimizer", "full"):  # the unsharded replicas' checkpoint loaded into sharded ones
        w = _gpt()
        pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=M, cost="flops",
                           data_parallel=2, dp_shard=shard)
        opt = pp.build_optimizer(torch.optim.AdamW, lr=1e-2, eps=1e-4)
        assert pp.load(f"{root}/ckpt-none", optimizer=opt) == STEPS
        res[f"loaded into {shard}"] = []
        for step in range(STEPS, STEPS + 2):
            args, target = _batch(w, step, pp.dp_rank)
            res[f"loaded into {shard}"].append(pp.step(*args, target=target))
            opt.step()
            opt.zero_grad(set_to_none=True)
    for shard in SHARDS:
        res[f"two steps {shard}"] = _grads_after_two_steps(data_parallel=2, dp_shard=shard)
    res["ratio"] = _ratio_over_replicas()
    res["terms"] = _terms_over_replicas()
    res["ratio penalty"] = _terms_over_replicas("ratio penalty")
    res["refused replica"] = _one_replica_refuses()
    res["frozen on one rank"] = _frozen_on_one_rank()
    res["save on one rank"] = _save_on_one_rank(root)
    # states streamed in chunks: grads averaged after the step (said in the plan's notes), one bucket at a time
    res["streamed states"] = _case("gpt", GPT, data_parallel=2, offload="states", dp_bucket_mb=0.01)
    res["streamed states"]["notes"] = res["streamed states"].pop("pp").plan.notes
    res["streamed states"].pop("opt")
    res["errors"] = _errors()
    res["exported, full"] = _exported_and_sharded()
    res["batch norm, full"] = _batch_norm_sharded()
    # the pipelines above made their ("pp", "dp") mesh and their tied weights' groups once: no two groups
    # of this process's own hold the same ranks (the user's mesh, made above, may repeat them)
    import torch.distributed.distributed_c10d as c10d
    ours = [tuple(c10d.get_process_group_ranks(g)) for g in c10d._world.pg_map if g not in user_groups]
    assert len(ours) == len(set(ours)), sorted(ours)
    return res


def test_pipeline_times_data_parallel_on_4_ranks(tmp_path: Path) -> None:
    res = run_ranks("tests.test_data_parallel:four_body", 4, timeout=400, root=str(tmp_path))
    for r in res:
        frozen = r["frozen on one rank"]
        assert frozen["error"].startswith("the data-parallel replicas train different parameters") and \
            frozen["s"] < 20 and isinstance(frozen["then"], float), frozen
        one = r["save on one rank"]
        assert "made different calls" in one["error"] and "pp.save()" in one["error"], one["error"]
        assert not one["written"] and isinstance(one["loss"], float) and one["saved"], one
    resumed = run_ranks("tests.test_data_parallel:one_replica_body", 2, timeout=120, root=str(tmp_path))
    for r in resumed:
        for name, err in r["two steps"].items():
            assert err < 1e-5, (name, err)
    for shard in SAVED:  # dp=2 (sharded as saved) resumed by dp=1 with a plain AdamW: the losses go on
        torch.testing.assert_close(torch.tensor(resumed[0][shard]), torch.tensor(res[0][f"gpt 1f1b {shard}"]["after"]),
                                   rtol=1e-5, atol=1e-5, msg=_named(shard))
    for shard in ("optimizer", "full"):  # and what the unsharded replicas saved, resumed sharded
        torch.testing.assert_close(torch.tensor(res[0][f"loaded into {shard}"]),
                                   torch.tensor(res[0]["gpt 1f1b none"]["after"]), rtol=1e-5, atol=1e-5)
    for r in res:
        for shard in SHARDS:
            for name, err in r[f"two steps {shard}"].items():
                assert err < 1e-5, (shard, name, err)
        for name, err in r["ratio"].items():
            assert err < 1e-5, ("masked mean over replicas", name, err)
        for case in ("terms", "ratio penalty"):
            assert len(r[case]) > 1, r[case]  # (the loss, and a stage's parameters)
            for name, err in r[case].items():
                assert err < 1e-5, (case, "over replicas", name, err)
        refused = r["refused replica"]
        assert "not divisible into 4 microbatches" in refused["error"] or "planned shape" in refused["error"], refused
        assert refused["error"].startswith("replica 1 (global ranks [1, 3]) stopped") == (r is res[0] or r is res[2]), \
            refused  # (the mesh (pp, dp): replica 0 is global ranks 0 and 2)
        assert abs(refused["loss"] - refused["want"]) < 1e-5, refused
        assert ("forward" in refused) == (r is res[0] or r is res[2]), refused
        assert any("averaged after the step" in n for n in r["streamed states"]["notes"])
        streamed = r["streamed states"]
        torch.testing.assert_close(torch.tensor(streamed["losses"]), torch.tensor(streamed["ref"]),
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(*torch.tensor(streamed["norms"]).T, rtol=1e-5, atol=0)
        torch.testing.assert_close(*streamed["evaluated"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(*streamed["evaluated in eval mode"], rtol=1e-5, atol=1e-6)
        exported = r["exported, full"]
        assert exported.pop("tracer") == "torch.export.export", exported
        assert len(exported) == 4, exported
        for case, (got, want) in [*exported.items(), *r["batch norm, full"].items()]:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=_named(case))
    cases = [k for k in res[0] if k not in ("errors", "streamed states", "exported, full", "batch norm, full",
                                         "ratio", "terms",
                                         "ratio penalty", "refused replica", "save on one rank", "frozen on one rank")
             and not k.startswith(("loaded into", "two steps"))]
    assert len(cases) == len(SCHEDULES) * len(SHARDS) + len(SCHEDULES) + 1
    for case in cases:
        for r in res:
            got = r[case]
            assert got["dp"] == 2 and got["world"] == 2, case
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(got["ref"]), rtol=1e-5, atol=1e-5,
                                       msg=_named(case))
            torch.testing.assert_close(*got["evaluated"], rtol=1e-5, atol=1e-6, msg=_named(case))
            torch.testing.assert_close(*got["evaluated in eval mode"], rtol=1e-5, atol=1e-6, msg=_named(case))
            norms = torch.tensor(got["norms"])
            torch.testing.assert_close(norms[:, 0], norms[:, 1], rtol=1e-5, atol=0, msg=_named(case))
            assert bool((norms[:, 1] > CLIP).all()) and got["norms"] == res[0][case]["norms"], (case, got["norms"])
            for s, mem in got["memory"].items():  # the prediction counts what each rank keeps (the last step's peak)
                assert mem["peak_total"] <= mem["predicted_peak"] <= 1.05 * mem["peak_total"], (case, s, mem)
                assert mem["dp_shard_params"] == (2 if case.endswith("full") else 1), (case, mem)
                assert mem["dp_shard_optimizer"] == (1 if case.endswith("none") or case == "user mesh" else 2), mem
            if case.startswith("gpt") and case.endswith("none"):  # grads reduced while the final backward runs
                assert len(got["launched"]) >= 3 and all(ok for _, ok in got["launched"]), (case, got["launched"])
                assert sum(early for early, _ in got["launched"]) >= 2, (case, got["launched"])
            held = got["sharding"]
            if case.endswith("optimizer"):  # ZeRO-1: the two replicas split the state; parameters whole
                assert held["optimizer"] == "ZeroRedundancyOptimizer" and held["local"] == held["whole"], case
            if case.endswith("full"):  # FSDP: each replica holds about half of every parameter and its state
                assert held["local"] <= held["whole"] // 2 + 64 and held["state"] == 2 * held["local"], (case, held)
            if case.endswith("none"):
                assert held["state"] == 2 * held["whole"] and held["local"] == held["whole"], (case, held)
        if case.endswith("optimizer"):  # the state of the two replicas of a pipeline rank adds up to Adam's
            for r in (0, 2):  # mesh (pp, dp), the pipeline outermost: global ranks r and r + 1 hold one stage
                parts = [res[q][case]["sharding"] for q in (r, r + 1)]
                assert sum(p["state"] for p in parts) == 2 * parts[0]["whole"], (case, parts)
                assert all(0 < p["state"] < 2 * p["whole"] for p in parts), (case, parts)
    words = {"data_parallel=0": ["data_parallel must be a positive", "got 0"],
             "not divisible": ["world size 4 is not divisible", "data_parallel=3"],
             "no pp dimension": ["no 'pp'", "mesh_dim_names=('pp', 'dp')"],
             "dp_shard": ["dp_shard must be one of none, optimizer, full", "'zero3'"],
             "full with streamed states": ["dp_shard='full'", "offload='states'", "dp_shard='optimizer'"],
             "full with a weight shared on a rank": ["tok_emb.weight", "stages 0 and 3", "dp_shard='optimizer'"],
             "zero with a factory": ["ZeroRedundancyOptimizer", "torch.optim class", "build_optimizer"],
             "bucket size": ["dp_bucket_mb must be a number of MiB", "got True", "pass e.g. 25"],
             "full with a 0-dim parameter": ["takes no 0-dim parameter, and temperature is one", "shape [1]"]}
    for case, ws in words.items():
        assert len({r["errors"][case] for r in res}) == 1, case  # the same on every rank
        for word in ws:
            assert word in res[0]["errors"][case], (case, res[0]["errors"][case])


def _gpt() -> Any:
    import partition
    return partition.load("gpt", **GPT)


def one_replica_body(rank: int, world: int, *, root: str) -> dict[str, Any]:
    """dp=1 on 2 ranks resumes what dp=2 saved (unsharded, ZeRO-1, FSDP); each step's batch is both
    replicas' batches, in twice the microbatches."""
    import pipe
    pipe.init()
    out = {}
    for shard in SAVED:
        w = _gpt()
        pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=2 * M, cost="flops")
        opt = torch.optim.AdamW(list(pp.parameters()), lr=1e-2, eps=1e-4)
        assert pp.load(f"{root}/ckpt-{shard}", optimizer=opt) == STEPS
        losses = []
        for step in range(STEPS, STEPS + 2):
            parts = [_batch(w, step, j) for j in range(2)]
            losses.append(pp.step(torch.cat([p[0][0] for p in parts]), target=torch.cat([p[1] for p in parts])))
            opt.step()
            opt.zero_grad(set_to_none=True)
        out[shard] = losses
    out["two steps"] = _grads_after_two_steps()  # one replica: the tied embedding's sum of two steps
    return out


def _bn_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4))


class _Detached(torch.nn.Module):
    """A gain the forward reads through .detach() alone: the model leaves it no grad."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)
        self.gain = torch.nn.Parameter(torch.full((8,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)) * self.gain.detach())


def _no_grad_kept_none() -> dict[str, Any]:
    """Found by review: under data parallelism a parameter with no grad on the model got a zero grad (a view of its
    bucket), which AdamW's weight decay then moved (5.99e-3 off the model after 3 steps). Two steps: the first
    learns which parameters have grads, the second runs the buckets made of those; against one process over both
    replicas' batches."""
    import pipe
    loss_fn = torch.nn.functional.mse_loss
    pp = pipe.Pipeline(_Detached(), (torch.randn(2, 8),), loss_fn=loss_fn, example_target=torch.randn(2, 4),
                       microbatches=2, cost="flops", data_parallel=2, dp_bucket_mb=1e-4)
    ref = _Detached()
    out: dict[str, Any] = {"gain": [], "diff": []}
    for step in range(2):
        parts = [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g))
                 for g in (torch.Generator().manual_seed(10 * step + j) for j in range(2))]
        pp.step(*parts[pp.dp_rank][:1], target=parts[pp.dp_rank][1])
        loss_fn(ref(torch.cat([x for x, _ in parts])), torch.cat([t for _, t in parts])).backward()
        named = dict(pp.named_parameters())
        out["gain"].append(named["gain"].grad)
        out["diff"].append(max(float((named[n].grad - p.grad).abs().max()) for n, p in ref.named_parameters()
                               if p.grad is not None))
        for p in list(named.values()) + list(ref.parameters()):
            p.grad = None
    return out


def _uneven_mean() -> dict[str, Any]:
    """Found by review: with dynamic shapes a mean loss (mse) over replicas of 16 and 8 samples was the mean of the
    replicas' means, 1.251032 where one process over the 24 gives 1.259800 (grads 1.9e-2 off). Each microbatch now
    weighs by its samples over the batch's (every replica's): here 6 samples on one replica, 8 on the other."""
    import pipe
    loss_fn = torch.nn.functional.mse_loss
    pp = pipe.Pipeline(_Detached(), (torch.randn(2, 8),), loss_fn=loss_fn, example_target=torch.randn(2, 4),
                       microbatches=2, cost="flops", data_parallel=2, dynamic_shapes=True)
    ref = _Detached()
    parts = [(torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g))
             for n, g in ((6, torch.Generator().manual_seed(1)), (8, torch.Generator().manual_seed(2)))]
    x, t = parts[pp.dp_rank]
    got = {"loss": pp.step(x, target=t), "evaluate": pp.evaluate(x, target=t)}
    want = loss_fn(ref(torch.cat([x for x, _ in parts])), torch.cat([t for _, t in parts]))
    want.backward()
    named = dict(ref.named_parameters())
    got["diff"] = max(float((p.grad - named[n].grad).abs().max()) for n, p in pp.named_parameters()
                      if p.grad is not None)
    got["want"] = float(want)
    got["note"] = next(n for n in pp.plan.notes if n.startswith("loss:"))
    return got


def _a_group_on_one_replica(root: str, x: torch.Tensor, batch: torch.Tensor, target: torch.Tensor) -> list[Any]:
    """Found by review: a ZeRO group whose one parameter the other replica holds kept, on this replica, the learning
    rate it was built with when loaded, not the scheduler's it was saved with. The groups' lrs, saved and loaded."""
    import pipe
    from torch.distributed.optim import ZeroRedundancyOptimizer
    lrs = []
    for load in (False, True):
        pp = pipe.Pipeline(_bn_model(), (x,), loss_fn=lambda out, t: (out - t).pow(2).mean(), microbatches=2,
                           cost="flops", data_parallel=2, dp_shard="optimizer")
        named = dict(pp.named_parameters())
        opt = ZeroRedundancyOptimizer([p for n, p in named.items() if n != "5.bias"], optimizer_class=torch.optim.SGD,
                                      process_group=pp.dp_group, lr=0.1)
        opt.add_param_group({"params": [named["5.bias"]], "lr": 0.2})
        pp.attach_optimizer(opt)
        if load:
            pp.load(f"{root}-groups", optimizer=opt)
        else:
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
            pp.step(batch, target=target)
            opt.step()
            sched.step()
            pp.save(f"{root}-groups", optimizer=opt)
        lrs.append([g["lr"] for g in opt.param_groups])
    return lrs


def replicas_body(rank: int, world: int, *, root: str) -> dict[str, Any]:
    """Two replicas of a one-rank pipeline (ZeRO-1): batch norm's running statistics after a step, the learning
    rate an LR scheduler set after the optimizer's step as saved and resumed, and each replica's random state."""
    import pipe
    pipe.init()
    model = _bn_model()
    x = torch.randn(4, 8)
    pp = pipe.Pipeline(model, (x,), loss_fn=lambda out, t: (out - t).pow(2).mean(), microbatches=2, cost="flops",
                       data_parallel=2, dp_shard="optimizer")
    opt = pp.build_optimizer(torch.optim.AdamW, lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    g = torch.Generator().manual_seed(pp.dp_rank)  # each replica its own batch
    batch, target = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
    pp.step(batch, target=target)
    opt.step()
    sched.step()  # after the optimizer's step: the outer groups' lr only, until ZeRO's next step
    out: dict[str, Any] = {"buffers": {k: b.clone() for k, b in pp.local_buffers().items()}}
    ref = _bn_model()  # the first replica's microbatches, in order, through the unpartitioned model
    g = torch.Generator().manual_seed(0)
    first = torch.randn(8, 8, generator=g)
    for mb in first.chunk(2):
        ref(mb)
    out["ref"] = {k: b.clone() for k, b in ref.named_buffers()}
    torch.manual_seed(100 + pp.dp_rank)  # the replicas draw apart from here
    pp.save(root, optimizer=opt)
    out["drawn"] = torch.rand(3)
    model2 = _bn_model()
    pp2 = pipe.Pipeline(model2, (x,), loss_fn=lambda out, t: (out - t).pow(2).mean(), microbatches=2,
                        cost="flops", data_parallel=2, dp_shard="optimizer")
    opt2 = pp2.build_optimizer(torch.optim.AdamW, lr=1e-2)
    torch.manual_seed(7)
    pp2.load(root, optimizer=opt2)
    out["redrawn"] = torch.rand(3)
    out["lr"] = (opt.param_groups[0]["lr"], opt2.param_groups[0]["lr"], opt2.optim.param_groups[0]["lr"])
    out["group lr"] = _a_group_on_one_replica(root, x, batch, target)
    # found by review of the change: full_state_dict() on one replica alone (every replica holds the weights) waited
    # for the other replica's agreement on the call until the timeout; it is the pipeline's own, as before
    out["one replica exports"] = sorted(pp2.full_state_dict() or {}) if pp2.dp_rank == 0 else None
    out["no grad"] = _no_grad_kept_none()
    out["uneven mean"] = _uneven_mean()
    # found by review: replicas freezing different parameters of one size averaged one's grad into the other's
    # (the buckets are laid out by the parameters that require grad); both are told, and the step runs once alike
    frozen = "1.weight" if pp2.dp_rank == 0 else "1.bias"
    dict(pp2.named_parameters())[frozen].requires_grad_(False)
    try:
        pp2.step(batch, target=target)
        out["freeze apart"] = "no error"
    except pipe.PipelineError as e:
        out["freeze apart"] = str(e)
    dict(pp2.named_parameters())[frozen].requires_grad_(True)
    pp2.step(batch, target=target)
    # last (it stops the call): one replica clips while the other steps. The clip's all-gather of the norm over
    # the replicas paired with the step's check and both waited until the timeout; now both are told at once
    try:
        if pp2.dp_rank == 0:
            pp2.clip_grad_norm_(1.0)
        else:
            pp2.step(batch, target=target)
        out["one clips"] = "no error"
    except pipe.PipelineError as e:
        out["one clips"] = str(e)
    return out


def test_replicas_share_buffers_and_resume_their_own_lr_and_random_state(tmp_path: Path) -> None:
    res = run_ranks("tests.test_data_parallel:replicas_body", 2, timeout=120, root=str(tmp_path / "ckpt"))
    for r in res:  # the first replica's running statistics on both (DDP's broadcast_buffers)
        assert set(r["buffers"]) == set(r["ref"])
        for k in r["ref"]:
            torch.testing.assert_close(r["buffers"][k], r["ref"][k], msg=k)
        assert r["lr"] == (5e-3, 5e-3, 5e-3), r["lr"]  # the scheduler's, not the one ZeRO's last step copied
        assert r["group lr"] == [[0.05, 0.1], [0.05, 0.1]], r["group lr"]
        assert r["no grad"]["gain"] == [None, None] and max(r["no grad"]["diff"]) < 1e-6, r["no grad"]
    assert res[0]["one replica exports"] == sorted(_bn_model().state_dict()) and res[1]["one replica exports"] is None
    for r in res:
        uneven = r["uneven mean"]
        torch.testing.assert_close(uneven["loss"], uneven["want"], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(uneven["evaluate"], uneven["want"], rtol=1e-6, atol=1e-7)
        assert uneven["diff"] < 1e-6, uneven
        assert uneven["note"].startswith("loss: the mean of the microbatches' losses, each weighed by its samples "
                                         "over the batch's over every replica's batch"), uneven["note"]
        assert r["freeze apart"].startswith("the data-parallel replicas train different parameters (beyond those "
                                            "every replica freezes: replica 0 (global ranks [0]) freezes 1.weight; "
                                            "replica 1 (global ranks [1]) freezes 1.bias)"), r["freeze apart"]
        assert "the data-parallel replicas made different calls" in r["one clips"], r["one clips"]
        assert "replica 0 (global ranks [0]): pp.clip_grad_norm_(); replica 1 (global ranks [1]): pp.step()" \
            in r["one clips"], r["one clips"]
        assert torch.equal(r["redrawn"], r["drawn"])  # each replica's own random state back
    assert not torch.equal(res[0]["drawn"], res[1]["drawn"])


class _Constants(torch.nn.Module):
    """Batch norm beside a constant buffer (a mask of the sequence), traced by fx (`export=False`, batch norm a
    module it calls) or by torch.export only (a branch on a shape: batch norm as ops writing its statistics)."""

    def __init__(self, export: bool) -> None:
        super().__init__()
        self.export, self.lin, self.norm = export, torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)
        self.register_buffer("mask", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.export and x.shape[0] > 1:
            x = x * 1.0
        return self.norm(self.lin(x)) * self.mask


@pytest.mark.parametrize("export", [False, True])
def test_replicas_share_only_the_buffers_a_stage_writes(export: bool) -> None:
    """Replicas broadcast after each step the buffers their stages write (batch norm's statistics), not every buffer
    (constant masks and rotary frequencies, the same on every replica)."""
    import partition
    from pipe.replicas import written_buffers
    model = _Constants(export)
    gm = partition.trace(model, (torch.randn(2, 4),))
    assert gm.meta["fxpipe_tracer"] == ("torch.export.export" if export else "torch.fx.symbolic_trace")
    names = {id(b): n for n, b in gm.named_buffers()}
    assert sorted(names[id(b)] for b in written_buffers(gm)) == ["norm.num_batches_tracked", "norm.running_mean",
                                                                 "norm.running_var"]
