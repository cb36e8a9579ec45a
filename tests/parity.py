"""Test bodies shared by the runtime tests: a pipelined step against the unpartitioned model."""
from __future__ import annotations

from typing import Any

import torch

import partition


def batch_weights(targets: list[Any]) -> list[float]:
    """Each microbatch's weight in the batch's loss, worked out here from the targets alone (not by
    partition.reduction): an integer target tensor counts its entries other than -100 (cross entropy's
    ignore_index: the test workloads' losses, masked-LM labels) over the batch's, anything else 1/M."""
    if not all(isinstance(t, torch.Tensor) and not t.is_floating_point() for t in targets):
        return [1.0 / len(targets)] * len(targets)
    counts = [float((t != -100).sum()) for t in targets]
    return [c / sum(counts) for c in counts]


def reference_step(w: partition.Workload, args: tuple[Any, ...], target: Any, M: int,
                   kwargs: dict[str, Any] | None = None) -> float:
    """Loss and grads of the unpartitioned model over the same microbatches, each microbatch's loss
    weighed as in the batch's (batch_weights: 1/M, or its count of targets)."""
    from pipe.runtime import split_microbatches
    mbs = split_microbatches((args, kwargs or {}), M)
    tgts = split_microbatches(target, M, "target") if target is not None else [None] * M
    total = 0.0
    for (a, k), t, weight in zip(mbs, tgts, batch_weights(tgts)):
        loss = w.loss_fn(w.model(*a, **k), t) * weight
        loss.backward()
        total += float(loss.detach())
    return total


def check_step(pp: Any, loss: float, ref: Any, args: Any, kwargs: dict[str, Any], target: Any, M: int,
               opt: torch.optim.Optimizer, ref_opt: torch.optim.Optimizer, label: str) -> None:
    """One step of `pp` against the plain model `ref`: the same loss, every grad by name, and the
    same parameters after both optimizers step (then grads are cleared on both)."""
    ref_loss = reference_step(ref, args, target, M, kwargs)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    ref_params = dict(ref.model.named_parameters())
    for name, p in pp.named_parameters():
        rp = ref_params[name]
        if rp.grad is None:
            assert p.grad is None, f"{name} got a grad the model's did not ({label}): an optimizer would step it"
            continue
        assert p.grad is not None, f"{name} got no grad ({label})"
        torch.testing.assert_close(p.grad, rp.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{label} {name}: {m}")
    opt.step()
    opt.zero_grad(set_to_none=True)
    ref_opt.step()
    ref_opt.zero_grad(set_to_none=True)
    for name, p in pp.named_parameters():
        torch.testing.assert_close(p, ref_params[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{label} {name}: {m}")


def parity_body(rank: int, world: int, *, spec: str, model_args: dict[str, Any],
                schedules: list[tuple[Any, ...]], M: int, steps: int = 3, fused: bool = False,
                expect_vocab: bool = False, nccl_like: bool = False, compile: Any = False,
                cost: str = "flops") -> dict[str, list[float]]:
    """For each (schedule, stages per rank[, microbatches: M unless given]): `steps` Adam steps in
    parity with the plain model.

    `fused`: plan with the loss in the graph (example_target=), else outside (trace_loss=False);
    `expect_vocab`: and check that the plan spread the LM head and its loss over stages
    (partition.rewrite.vocab_parallel);
    `nccl_like`: messages through tests.nccl_like (NCCL's matching and per-pair order); `compile`:
    Pipeline(compile=...); `cost`: how the plans are costed."""
    out = {f"{name}/v{v}": one_schedule(rank, world, spec, model_args, name, own[0] if own else M, v, steps, fused,
                                        expect_vocab, nccl_like, compile, cost) for name, v, *own in schedules}
    # the pipelines built one after another made the tied weights' group once (or used the default group):
    # the default group and at most the group of ranks 0 and world-1 (the embedding's and the head's)
    import torch.distributed.distributed_c10d as c10d
    groups = [sorted(c10d.get_process_group_ranks(g)) for g in c10d._world.pg_map]
    assert len(groups) <= 2 and all(g in (list(range(world)), [0, world - 1]) for g in groups), groups
    return out


def one_schedule(rank: int, world: int, spec: str, model_args: dict[str, Any], schedule: str, M: int,
                 v: int, steps: int, fused: bool = False, expect_vocab: bool = False,
                 nccl_like: bool = False, compile: Any = False, cost: str = "flops") -> list[float]:
    import pipe
    from tests.nccl_like import NcclLike
    pipe.init()
    w = partition.load(spec, **model_args)
    ref = partition.load(spec, **model_args)
    pp = pipe.Pipeline(w.model, w.example_args, example_kwargs=w.example_kwargs, loss_fn=w.loss_fn,
                       microbatches=M, schedule=schedule, stages_per_rank=v, cost=cost,
                       example_target=w.example_target if fused else None, trace_loss=fused,
                       transport=NcclLike() if nccl_like else None, compile=compile)
    if compile:  # said in the plan; under zero bubble every backward is BW (a compiled backward is one function)
        from pipe.schedules import Action
        assert any(n.startswith("compile: ") for n in pp.plan.notes), pp.plan.notes
        kinds = {x.kind for x in pp.program if isinstance(x, Action)}
        assert kinds == ({"F", "BW"} if pp.has_w else {"F", "B"}), kinds
    assert pp.plan.loss == fused
    assert pp.plan.cost == cost, (pp.plan.cost, cost)
    if expect_vocab:
        vocab = [r for r in pp.plan.rewrites if list(r[2:]) == ["vocab"]]
        assert vocab, pp.plan.rewrites
        on = [s.index for s in pp.plan.stages if any(n.startswith(f"{vocab[0][0]}_vocab") for n in s.nodes)]
        assert len(on) >= 2, f"the head's slices sit on stages {on} only"
    # eps=1e-6: with the default 1e-8 Adam turns grads at float-noise level (1e-9, where
    # summation order alone differs) into full-size steps, so parameters would compare noise.
    opt = torch.optim.Adam(list(pp.parameters()), lr=1e-3, eps=1e-6)
    ref_opt = torch.optim.Adam(ref.model.parameters(), lr=1e-3, eps=1e-6)
    ref_params = dict(ref.model.named_parameters())
    losses = []
    for step in range(steps):
        args, kwargs, target = w.batch(w.microbatch_size * M, step)
        loss = pp.step(*args, target=target, **kwargs)
        check_step(pp, loss, ref, args, kwargs, target, M, opt, ref_opt, f"rank {rank}")
        names = [name for name, _ in pp.named_parameters()]
        losses.append(loss)
    from pipe.schedules import Action as _Action
    # the step's timeline: a post per batch of the program, each between the rank's compute actions
    assert len(pp.posts) == sum(not isinstance(x, _Action) for x in pp.program), (len(pp.posts), pp.program)
    spans = sorted((e.start, e.end) for e in pp.timeline + pp.posts)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "posts overlap compute actions"
    all_names: list[Any] = [None] * world
    import torch.distributed as dist
    dist.all_gather_object(all_names, names)
    assert set().union(*all_names) == set(ref_params), "ranks together must hold every parameter"
    return losses
