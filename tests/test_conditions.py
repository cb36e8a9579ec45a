"""Models as users write them, on 2 ranks through the NCCL-semantics transport: in-place ops (an inplace
ReLU after a linear layer that zero bubble splits, a cut right before one), autocast (values crossing
stages in bfloat16), a module of the user's kept whole that reads its parameter twice (zero bubble
with offloaded activations), batch norm in recomputed stages, torch.dropout under 'selective', targets
ignored unevenly over the microbatches (one wholly), losses written by hand as a .sum() or a masked mean
(one microbatch wholly masked), float16 with dynamic loss scaling, a loss pairing the samples
(in-batch negatives) and batch norm, each said in the plan's notes. Parity with the unpartitioned model,
step by step."""
from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn
import torch.distributed as dist
import torch.nn.functional as F

from partition.workload import Workload
from tests.mp import run_ranks

D = 16


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(self.act(self.a(x)))


class Inplace(nn.Module):
    """Residual blocks whose first linear's output an inplace ReLU writes, then a chain of linear layers
    each written in place by the next op (F.relu(..., inplace=True), .mul_): cuts fall before such writes."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[_Block() for _ in range(3)])
        self.chain = nn.ModuleList([nn.Linear(D, D) for _ in range(4)])
        self.head = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(x)
        for i, lin in enumerate(self.chain):
            h = F.relu(lin(h), inplace=True) if i % 2 else lin(h).mul_(0.5)
        return self.head(h)


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(D, D), nn.GELU())])
        self.head = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.net(x))


class Hooked(Chain):
    """Found by review: zero bubble's W computed a hooked nn.Linear's weight grads from the input before its
    forward pre-hook and the grad of the output after its forward hook (a weight grad halved)."""

    def __init__(self) -> None:
        super().__init__()
        self.net[2].register_forward_hook(lambda m, i, o: o * 2)
        self.head.register_forward_pre_hook(lambda m, i: (i[0] * 0.5 + 1,))


class Twice(nn.Module):
    """Kept whole (leaf_modules): reads its parameter twice, (x * g) * g."""

    def __init__(self) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.rand(D) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.g) * self.g


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lins = nn.ModuleList([nn.Linear(D, D) for _ in range(4)])
        self.scales = nn.ModuleList([Twice() for _ in range(4)])
        self.head = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin, s in zip(self.lins, self.scales):
            x = s(torch.tanh(lin(x)))
        return self.head(x)


class Normed(nn.Module):
    """Batch norm after each linear layer: recomputing a stage or region must not update its statistics twice."""

    def __init__(self) -> None:
        super().__init__()
        self.lins = nn.ModuleList([nn.Linear(D, D) for _ in range(4)])
        self.norms = nn.ModuleList([nn.BatchNorm1d(D) for _ in range(4)])
        self.head = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin, norm in zip(self.lins, self.norms):
            x = x + torch.tanh(norm(lin(x)))
        return self.head(x)


class Attn(nn.Module):
    """torch.dropout (the builtin attention code calls) after a softmax: 'selective' must not recompute it."""

    def __init__(self) -> None:
        super().__init__()
        self.lins = nn.ModuleList([nn.Linear(D, D) for _ in range(4)])
        self.outs = nn.ModuleList([nn.Linear(D, D) for _ in range(4)])
        self.head = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin, out in zip(self.lins, self.outs):
            x = x + out(torch.dropout(torch.softmax(lin(x), -1), 0.3, self.training))
        return self.head(x)


class WritesInput(nn.Module):
    """Writes its input in place first and reads it again last: the last stage must read the written value."""

    def __init__(self) -> None:
        super().__init__()
        self.lins = nn.ModuleList([nn.Linear(D, D) for _ in range(6)])
        self.head = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2.0)
        h = x
        for lin in self.lins:
            h = torch.tanh(lin(h))
        return self.head(h + x)


class OwnLoss(nn.Module):
    """A model computing its own loss from a labels input (as Hugging Face's do), returned with its logits."""

    def __init__(self) -> None:
        super().__init__()
        self.lins = nn.ModuleList([nn.Linear(D, D) for _ in range(4)])
        self.head = nn.Linear(D, 5)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        for lin in self.lins:
            x = torch.tanh(lin(x))
        logits = self.head(x)
        return {"loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten()), "logits": logits}


class OwnMaskedMean(nn.Module):
    """A model computing its own loss as a masked mean written by hand: (per-token loss * mask).sum() / mask.sum()."""

    def __init__(self) -> None:
        super().__init__()
        self.lins = nn.ModuleList([nn.Linear(D, D) for _ in range(4)])
        self.head = nn.Linear(D, 5)

    def forward(self, x: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        for lin in self.lins:
            x = torch.tanh(lin(x))
        logits = self.head(x)
        per = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view_as(mask)
        return {"loss": (per * mask).sum() / mask.sum(), "logits": logits}


class SeqFirst(nn.Module):
    """Sequence-first and token-flattened outputs (batch along dim 1, and folded into dim 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.lins = nn.ModuleList([nn.Linear(D, D) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> Any:
        for lin in self.lins:
            x = torch.tanh(lin(x))                       # [b, T, D]
        return x.transpose(0, 1), x.flatten(0, 1)


class Unused(nn.Module):
    """In-place writes whose results the code does not use (h.mul_(0.5) as a statement): with the loss in
    the graph, forward()'s stages are cut without it, and the dead-code pass took those writes for pure."""

    def __init__(self) -> None:
        super().__init__()
        self.lins = nn.ModuleList([nn.Linear(D, D) for _ in range(4)])
        self.head = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.lins:
            h = lin(x)
            h.mul_(0.5)
            F.relu(h, inplace=True)
            x = x + h
        return self.head(x)


class Positions(nn.Module):
    """Integer and boolean non-persistent buffers (BERT's position ids, a causal mask): no state dict holds them."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("position_ids", torch.arange(D), persistent=False)
        self.register_buffer("keep", torch.ones(D, dtype=torch.bool), persistent=False)
        self.lins = nn.ModuleList([nn.Linear(D, D) for _ in range(2)])
        self.head = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = (x + self.position_ids.float()).masked_fill(~self.keep, 0.0)
        for lin in self.lins:
            x = torch.tanh(lin(x))
        return self.head(x)


def _batch(batch_size: int, step: int) -> tuple[tuple[Any, ...], torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return (torch.randn(batch_size, D, generator=g),), torch.randn(batch_size, 4, generator=g)


def _workload(cls: type[nn.Module]) -> Workload:
    torch.manual_seed(0)
    return Workload(name=cls.__name__, model=cls(), example_args=_batch(2, 0)[0], loss_fn=F.mse_loss,
                    make_batch=_batch, microbatch_size=2, leaf_modules=(Twice,))


def _grads_close(pp: Any, ref: nn.Module, label: str, rtol: float = 1e-4, atol: float = 1e-6) -> None:
    want = dict(ref.named_parameters())
    for name, p in pp.named_parameters():
        if want[name].grad is None:  # frozen
            assert p.grad is None, f"{label}: {name} got a grad the model's did not"
            continue
        assert p.grad is not None, f"{label}: {name} got no grad"
        torch.testing.assert_close(p.grad, want[name].grad, rtol=rtol, atol=atol, msg=lambda m: f"{label} {name}: {m}")


def _two_steps(cls: type[nn.Module], M: int, label: str, **kwargs: Any) -> Any:
    """A pipeline of `cls` trained two Adam steps in parity with the unpartitioned model (tests.parity)."""
    import pipe
    from tests.nccl_like import NcclLike
    from tests.parity import check_step
    w, ref = _workload(cls), _workload(cls)
    pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=M, cost="flops", trace_loss=False,
                       transport=NcclLike(), **kwargs)
    opt = torch.optim.Adam(list(pp.parameters()), lr=1e-3, eps=1e-6)
    ref_opt = torch.optim.Adam(ref.model.parameters(), lr=1e-3, eps=1e-6)
    for step in range(2):
        args, _, target = w.batch(w.microbatch_size * M, step)
        loss = pp.step(*args, target=target)
        check_step(pp, loss, ref, args, {}, target, M, opt, ref_opt, label)
    return pp, ref


TINY_GPT = dict(n_layer=2, d_model=32, n_head=2, seq_len=16, vocab=64)


def _ignored(target: torch.Tensor, M: int, seed: int) -> torch.Tensor:
    """Tokens -100 (ignored) unevenly: microbatch 0 wholly, the other rows' first few by row."""
    t = target.clone()
    for i in range(t.shape[0]):
        t[i, :(3 * i + seed) % t.shape[1]] = -100
    t[:t.shape[0] // M] = -100
    return t


def _ignored_targets(rank: int, M: int) -> dict[str, Any]:
    """The tiny GPT with unevenly ignored targets, its loss in the graph (1f1b) and outside (zb-h1): two
    Adam steps with the whole batch's loss and grads (each microbatch weighs by its counted targets), and
    evaluate's loss the whole batch's."""
    import partition
    import pipe
    from tests.nccl_like import NcclLike
    out = {}
    for schedule, fused in (("1f1b", True), ("zb-h1", False)):
        w, ref = partition.load("gpt", **TINY_GPT), partition.load("gpt", **TINY_GPT)
        pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=M, cost="flops",
                           schedule=schedule, transport=NcclLike(),
                           **(dict(example_target=w.example_target) if fused else dict(trace_loss=False)))
        assert pp.plan.loss == fused
        opt = torch.optim.Adam(list(pp.parameters()), lr=1e-3)
        ref_opt = torch.optim.Adam(ref.model.parameters(), lr=1e-3)
        for step in range(2):
            args, _, target = w.batch(w.microbatch_size * M, step)
            target = _ignored(target, M, step)
            loss = pp.step(*args, target=target)
            want = ref.loss_fn(ref.model(*args), target)
            want.backward()
            torch.testing.assert_close(loss, float(want), rtol=1e-5, atol=1e-6)
            _grads_close(pp, ref.model, f"ignored targets {schedule} step {step}")
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad(set_to_none=True)
        args, _, target = w.batch(w.microbatch_size * M, 7)
        target = _ignored(target, M, 1)
        with torch.no_grad():
            torch.testing.assert_close(pp.evaluate(*args, target=target), float(ref.loss_fn(ref.model(*args), target)),
                                       rtol=1e-5, atol=1e-6)
        out[schedule] = [n for n in pp.plan.notes if n.startswith("loss:")]
    return out


def _by_microbatch(w: Any, model: nn.Module, args: tuple[Any, ...], target: torch.Tensor, M: int,
                   scaler: Any = None) -> float:
    """The model's loss over the batch's microbatches one by one (the pipeline's ops, in its order), each
    loss / M (scaled by `scaler` for its backward), the grads accumulated."""
    want = 0.0
    for x, t in zip(args[0].chunk(M), target.chunk(M)):
        part = w.loss_fn(model(x), t) / M
        (part if scaler is None else scaler.scale(part)).backward()
        want += float(part.detach())
    return want


def _summed(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return ((o - t) ** 2).sum()


def _masked(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    mask = (t > 0).float()
    return (((o - t) ** 2) * mask).sum() / mask.sum()


def _masked_floor(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    mask = t > 0
    return (((o - t) ** 2) * mask).sum() / mask.sum().clamp(min=1)


def _selected(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """A mean over the values a mask selects (labels missing: found by review, averaged over the microbatches)."""
    m = t > 0
    return F.mse_loss(o[m], t[m])


def _sums_and_ratios(rank: int, M: int) -> dict[str, Any]:
    """Losses written by hand, a microbatch's mask all 0: a .sum() over the samples (was averaged: loss and grads
    1/M of the batch's) and masked means, clamped or not (were averaged; each microbatch's numerator now over the
    batch's divisor), and an mse_loss over the values a mask selects (weighed by their count), trained two steps
    in parity on 1f1b and zb-h1; a model's own masked mean through step, evaluate in eval mode (stages traced
    again) and forward()."""
    import pipe
    from tests.nccl_like import NcclLike
    notes = {}
    for loss_fn in (_summed, _masked, _masked_floor, _selected):
        for schedule in ("1f1b", "zb-h1"):
            w, ref = _workload(Chain), _workload(Chain)
            pp = pipe.Pipeline(w.model, w.example_args, loss_fn=loss_fn, microbatches=M, cost="flops",
                               schedule=schedule, example_target=_batch(2, 0)[1], transport=NcclLike())
            assert pp.plan.loss
            label = f"{loss_fn.__name__} {schedule} rank {rank}"
            for step in range(2):
                args, _, target = w.batch(w.microbatch_size * M, step)
                target[:w.microbatch_size] = -1.0  # microbatch 0: every term masked
                loss = pp.step(*args, target=target)
                want = loss_fn(ref.model(*args), target)
                want.backward()
                torch.testing.assert_close(loss, float(want), rtol=1e-5, atol=1e-6, msg=lambda m: f"{label}: {m}")
                _grads_close(pp, ref.model, label)
                for p in (*pp.parameters(), *ref.model.parameters()):
                    p.grad = None
            notes[loss_fn.__name__] = [n for n in pp.plan.notes if n.startswith("loss:")]
    torch.manual_seed(0)
    own, ref_own = OwnMaskedMean(), OwnMaskedMean()
    ref_own.load_state_dict(own.state_dict())
    x, labels, mask = torch.randn(2 * M, 3, D), torch.randint(0, 5, (2 * M, 3)), torch.ones(2 * M, 3)
    mask[:2] = 0
    mask[2:4, 1:] = 0
    pp = pipe.Pipeline(own, (x[:2], labels[:2], mask[:2]), loss_fn=lambda out, _: out["loss"], microbatches=M,
                       cost="flops", example_target=labels[:2], transport=NcclLike())
    assert pp.plan.loss
    loss = pp.step(x, labels, mask, target=labels)
    want = ref_own(x, labels, mask)
    want["loss"].backward()
    torch.testing.assert_close(loss, float(want["loss"]), rtol=1e-5, atol=1e-6)
    _grads_close(pp, ref_own, f"a model's own masked mean rank {rank}")
    with torch.no_grad():
        torch.testing.assert_close(pp.forward(x, labels, mask)["loss"], want["loss"].detach(), rtol=1e-5, atol=1e-6)
    pp.eval()
    ref_own.eval()
    with torch.no_grad():
        want = ref_own(x, labels, mask)
        torch.testing.assert_close(pp.evaluate(x, labels, mask, target=labels), float(want["loss"]), rtol=1e-5,
                                   atol=1e-6)
        got = pp.forward(x, labels, mask)
    torch.testing.assert_close(got["loss"], want["loss"], rtol=1e-5, atol=1e-6)
    notes["own"] = [n for n in pp.plan.notes if n.startswith("loss:")]
    return notes


def frozen_tied_body(rank: int, world: int) -> dict[str, Any]:
    """Found by review: a tied weight (the GPT's embedding and head, on both ranks) frozen on every rank keeps no
    grad, as on the model; its grad summed over the holders was set to zeros, so AdamW's weight decay moved it and
    every later loss drifted. Frozen on one rank only, the step is refused on both, before anything runs (found by
    review: refused after the step, its grads accumulated and the process group torn down): unfrozen on both,
    the pipeline trains on in parity."""
    import partition
    import pipe
    from tests.nccl_like import NcclLike
    pipe.init()
    M = 4
    w, ref = partition.load("gpt", **TINY_GPT), partition.load("gpt", **TINY_GPT)
    for m in (w.model, ref.model):
        m.tok_emb.weight.requires_grad_(False)
    pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=M, cost="flops",
                       example_target=w.example_target, transport=NcclLike())
    frozen = dict(pp.named_parameters())["tok_emb.weight"]
    before = frozen.detach().clone()
    opt = torch.optim.AdamW(list(pp.parameters()), lr=1e-2, weight_decay=0.1, eps=1e-6)
    ref_opt = torch.optim.AdamW(ref.model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6)  # (eps: not rounding)
    for step in range(2):
        args, _, target = w.batch(w.microbatch_size * M, step)
        loss = pp.step(*args, target=target)
        want = ref.loss_fn(ref.model(*args), target)
        want.backward()
        torch.testing.assert_close(loss, float(want), rtol=1e-5, atol=1e-6)
        assert frozen.grad is None, "a frozen tied weight got a grad"
        _grads_close(pp, ref.model, f"frozen tied weight step {step} rank {rank}")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad(set_to_none=True)
    assert torch.equal(frozen, before), "the optimizer moved a frozen tied weight"
    for n, p in ref.model.named_parameters():
        torch.testing.assert_close(dict(pp.named_parameters()).get(n, p), p, rtol=1e-5, atol=1e-5)
    if rank == 0:
        frozen.requires_grad_(True)  # unfrozen on this rank only
    args, _, target = w.batch(w.microbatch_size * M, 2)
    try:
        pp.step(*args, target=target)
        return {"frozen on one rank": "trained"}
    except pipe.PipelineError as e:
        out = {"frozen on one rank": str(e)}
    assert all(p.grad is None for _, p in pp.named_parameters()), "the refused step left grads"
    frozen.requires_grad_(True)
    ref.model.tok_emb.weight.requires_grad_(True)
    loss = pp.step(*args, target=target)
    want = ref.loss_fn(ref.model(*args), target)
    want.backward()
    torch.testing.assert_close(loss, float(want), rtol=1e-5, atol=1e-6)
    _grads_close(pp, ref.model, f"unfrozen rank {rank}")
    out["over budget"] = _over_budget_after_the_optimizer()
    return out


def _over_budget_after_the_optimizer() -> dict[str, Any]:
    """Found by review: an optimizer holding more state than the plan counted (Adam with amsgrad: three copies),
    measured at its first step, put a stage over its budget; the next step raised it inside the step on that rank
    alone, the other waiting on it, and the process group was torn down, so the fix could not be tried in the
    process. Now refused on every rank before anything runs; a pipeline with the budget named then trains."""
    import re
    import time

    import partition
    import pipe
    w = partition.load("gpt", **TINY_GPT)
    probe = pipe.Pipeline(copy.deepcopy(w.model), w.example_args, loss_fn=w.loss_fn, microbatches=4, cost="flops",
                          memory_budget="1GiB")
    peaks = [max(c.predicted_peak for c in probe.memory.choices.values())] * 2
    dist.all_gather_object(peaks, peaks[0])
    budget = int(max(peaks) * 1.02)
    pp = pipe.Pipeline(copy.deepcopy(w.model), w.example_args, loss_fn=w.loss_fn, microbatches=4, cost="flops",
                       memory_budget=budget)
    opt = torch.optim.Adam(pp.parameters(), lr=1e-3, amsgrad=True)
    args, _, target = w.batch(w.microbatch_size * 4, 0)
    pp.step(*args, target=target)
    opt.step()
    opt.zero_grad()
    start = time.monotonic()
    try:
        pp.step(*args, target=target)
        return {"refused": "ran"}
    except ValueError as e:
        out: dict[str, Any] = {"refused": f"{type(e).__name__}: {e}", "s": time.monotonic() - start}
    named = [int(x) for x in re.findall(r"memory_budget >= (\d+)", out["refused"])]
    figure = [max(named or [0])] * 2
    dist.all_gather_object(figure, figure[0])
    pp = pipe.Pipeline(copy.deepcopy(w.model), w.example_args, loss_fn=w.loss_fn, microbatches=4, cost="flops",
                       memory_budget=max(figure), optimizer=torch.optim.Adam)
    out["then"] = pp.step(*args, target=target)
    return out


def _closure(rank: int, M: int) -> str:
    """Found by review: a loss_fn reading a parameter through a closure (a regulariser on the first stage's
    weight) is refused: traced into the graph it was a constant (its grads lost), run on the last rank it trained
    that rank's copy. The step that ends the process group: last."""
    import partition
    import pipe
    from tests.nccl_like import NcclLike
    w = partition.load("gpt", **TINY_GPT)
    lin = w.model.blocks[0].mlp.fc.weight  # held by the first stage's rank
    reg = lambda o, t: w.loss_fn(o, t) + 0.01 * lin.pow(2).sum()  # noqa: E731
    pp = pipe.Pipeline(w.model, w.example_args, loss_fn=reg, microbatches=M, cost="flops",
                       example_target=w.example_target, transport=NcclLike())
    assert not pp.plan.loss and any("a parameter reached through a closure" in n for n in pp.plan.notes), \
        pp.plan.notes
    args, _, target = w.batch(w.microbatch_size * M, 0)
    try:
        pp.step(*args, target=target)
        return "trained"
    except Exception as e:  # noqa: BLE001 - the last rank's own error; the first's: that the last stopped
        return f"{type(e).__name__}: {e}"


def _grad_scaler(rank: int, M: int) -> dict[str, Any]:
    """float16 autocast with pp.make_grad_scaler against torch.amp.GradScaler on the model, microbatch by
    microbatch (the same ops): a first scale that overflows skips the step on both, then steps at the backed-off
    scale train alike; an inf in one rank's grads skips the step on every rank, and every scale backs off."""
    import partition
    import pipe
    from tests.nccl_like import NcclLike
    w, ref = partition.load("gpt", **TINY_GPT), partition.load("gpt", **TINY_GPT)
    pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=M, cost="flops",
                       transport=NcclLike())
    kw = dict(init_scale=2.0 ** 40, backoff_factor=2.0 ** -24)
    scaler, ref_scaler = pp.make_grad_scaler(**kw), torch.amp.GradScaler("cpu", **kw)
    opt = torch.optim.Adam(list(pp.parameters()), lr=1e-3)
    ref_opt = torch.optim.Adam(ref.model.parameters(), lr=1e-3)
    out: dict[str, Any] = {"scales": []}
    for step in range(3):
        args, _, target = w.batch(w.microbatch_size * M, step)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = pp.step(*args, target=target)
            want = _by_microbatch(w, ref.model, args, target, M, ref_scaler)
        assert loss == want, (step, loss, want)  # not scaled
        for sc, o in ((scaler, opt), (ref_scaler, ref_opt)):
            sc.unscale_(o)  # (where a loop clips)
        if step > 0:  # (step 0's overflowed: inf and NaN)
            _grads_close(pp, ref.model, f"float16 step {step}", rtol=1e-3, atol=1e-6)
        for sc, o in ((scaler, opt), (ref_scaler, ref_opt)):
            sc.step(o)
            sc.update()
            o.zero_grad(set_to_none=True)
        out["scales"].append((scaler.get_scale(), ref_scaler.get_scale()))
    want_params = dict(ref.model.named_parameters())
    for n, p in pp.named_parameters():
        torch.testing.assert_close(p, want_params[n], rtol=1e-4, atol=1e-6, msg=lambda m: f"float16 {n}: {m}")
    args, _, target = w.batch(w.microbatch_size * M, 9)
    with torch.autocast("cpu", dtype=torch.float16):
        pp.step(*args, target=target)
    if rank == 1:  # an overflow on one rank only
        next(iter(pp.parameters())).grad.view(-1)[0] = float("inf")
    before = [p.detach().clone() for p in pp.parameters()]
    scale = scaler.get_scale()
    scaler.step(opt)
    scaler.update()
    out["skipped everywhere"] = all(torch.equal(a, p) for a, p in zip(before, pp.parameters()))
    out["backed off"] = scaler.get_scale() == scale * 2.0 ** -24
    return out


class Pairwise(nn.Module):
    """Two towers and the similarity of every two samples, logits [B, B], as CLIP's in-batch negatives."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D))
        self.b = nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.a(x) @ self.b(z).t()


def _contrastive(logits: torch.Tensor, _: Any) -> torch.Tensor:
    """CLIP's loss; it reads no target."""
    labels = torch.arange(logits.shape[0], device=logits.device)
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


def _pairs(rank: int, M: int) -> dict[str, Any]:
    """Found by review: a loss pairing the samples (in-batch negatives) was said to be the batch's mean (each
    microbatch pairs its own samples only: 1.403 where the batch's is 2.785), forward() concatenated the [4, 4]
    logits into [16, 4], and a step without a target was refused though the loss reads none. The plan now says the
    loss is NOT the batch's, forward() refuses, and step(x, z) runs, each microbatch's loss of its own pairs."""
    import pipe
    from tests.nccl_like import NcclLike
    torch.manual_seed(0)
    model, ref = Pairwise(), Pairwise()
    ref.load_state_dict(model.state_dict())
    x, z = torch.randn(4 * M, D), torch.randn(4 * M, D)
    pp = pipe.Pipeline(model, (x[:4], z[:4]), loss_fn=_contrastive, microbatches=M, cost="flops",
                       transport=NcclLike())
    out: dict[str, Any] = {"notes": [n for n in pp.plan.notes if n.startswith("loss:")]}
    loss = pp.step(x, z)
    want = sum(_contrastive(ref(a, b), None) for a, b in zip(x.chunk(M), z.chunk(M))) / M
    want.backward()
    torch.testing.assert_close(loss, float(want), rtol=1e-5, atol=1e-6)
    _grads_close(pp, ref, f"contrastive rank {rank}")
    try:
        with torch.no_grad():
            pp.forward(x, z)
        out["forward"] = "formed"
    except pipe.PipelineError as e:
        out["forward"] = str(e)
    return out


class Float32Region(nn.Module):
    """A region the model runs in float32 under any autocast (`autocast(enabled=False)`: rotary angles, a router),
    kept whole (leaf_modules=) so that its context runs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            return torch.tanh(self.lin(x.float()))


class AskingRegion(Float32Region):
    """The region as transformers writes it (Ernie 4.5's router): `maybe_autocast` enters it only when an autocast
    is in force, so a trace made without one has no region to see."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.utils.generic import maybe_autocast
        with maybe_autocast("cpu", enabled=False):
            return torch.tanh(self.lin(x.float()))


class WithRegions(nn.Module):
    def __init__(self, region: type[nn.Module] = Float32Region) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, 4)
        self.regions = nn.ModuleList([region() for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.a(x))
        for r in self.regions:
            x = r(x)
        return self.head(torch.tanh(self.b(x)))


class RegionAtTop(WithRegions):
    """The float32 region in the model's own forward, which no module can keep whole."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.a(x))
        with torch.autocast("cpu", enabled=False):
            for r in self.regions:
                x = torch.tanh(r.lin(x.float()))
        return self.head(torch.tanh(self.b(x)))


class ExportedNormed(nn.Module):
    """Batch norm in a model only torch.export traces (a branch on a shape): its graph writes the running
    statistics back after the op that saved them."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(D, D), nn.BatchNorm1d(D), nn.Tanh()) for _ in range(4)])
        self.head = nn.Linear(D, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 1:
            x = x * 1.0
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


def _exported_batch_norm(M: int) -> None:
    """Found by review of the change: the run-time check of saved tensors' versions took batch norm's running
    statistics for activations; torch.export's graph writes them back after the op saved them, so every step of
    such a model was refused ("PyTorch's own backward refuses this model too", which it does not). Buffers are
    module state: they train as the model (the microbatches' statistics)."""
    import pipe
    from tests.nccl_like import NcclLike
    for kw in (dict(schedule="1f1b"), dict(schedule="zb-h1", recompute="selective")):
        torch.manual_seed(0)
        model, ref = ExportedNormed(), ExportedNormed()
        ref.load_state_dict(model.state_dict())
        (x,), t = _batch(4 * M, 3)
        pp = pipe.Pipeline(model, (x[:4],), loss_fn=F.mse_loss, microbatches=M, cost="flops", example_target=t[:4],
                           transport=NcclLike(), **kw)
        assert pp.plan.tracer == "torch.export.export"
        loss = pp.step(x, target=t)
        want = 0.0
        for xm, tm in zip(x.chunk(M), t.chunk(M)):
            part = F.mse_loss(ref(xm), tm) / M
            part.backward()
            want += float(part)
        torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-7)
        _grads_close(pp, ref, f"exported batch norm {kw}")


def _float32_regions(M: int) -> dict[str, Any]:
    """Found by review: a model's own `autocast(enabled=False)` region ran at the autocast's precision (fx records no
    context manager: every grad off, the loss 6e-5 off), and the backward ran inside the user's autocast around
    step(), so a float32 region's backward matmuls ran in bfloat16 even kept whole (grads 4e-5 off on 5e-3). Now the
    module switching autocast is kept whole (the plan's notes say so), the backward runs outside the autocast as
    torch's AMP runs it, and a recomputation (selective) under the forward's autocast. A region in the model's own
    forward, which no module keeps, is refused under an autocast (and trains without one)."""
    import pipe
    from tests.nccl_like import NcclLike
    out: dict[str, Any] = {}
    for region, kw in ((Float32Region, dict(schedule="1f1b")), (Float32Region, dict(schedule="zb-h1")),
                       (Float32Region, dict(schedule="1f1b", recompute="selective")),
                       (Float32Region, dict(schedule="1f1b", leaf_modules=(Float32Region,))),
                       (AskingRegion, dict(schedule="zb-h1"))):
        torch.manual_seed(0)
        model, ref = WithRegions(region), WithRegions(region)
        ref.load_state_dict(model.state_dict())
        pp = pipe.Pipeline(model, (torch.randn(2, D),), loss_fn=F.mse_loss, microbatches=M, cost="flops",
                           example_target=torch.randn(2, 4), transport=NcclLike(), **kw)
        out.setdefault(f"{region.__name__} notes", [n for n in pp.plan.notes if n.startswith("kept whole")])
        (x,), t = _batch(2 * M, 7)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = pp.step(x, target=t)
        want = 0.0
        for xm, tm in zip(x.chunk(M), t.chunk(M)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                part = F.mse_loss(ref(xm), tm) / M
            part.backward()
            want += float(part)
        torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-7)
        _grads_close(pp, ref, f"float32 regions under autocast {kw}", rtol=1e-5, atol=1e-7)
    torch.manual_seed(0)
    top = RegionAtTop()
    pp = pipe.Pipeline(top, (torch.randn(2, D),), loss_fn=F.mse_loss, microbatches=M, cost="flops",
                       example_target=torch.randn(2, 4), transport=NcclLike())
    (x,), t = _batch(2 * M, 7)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            pp.step(x, target=t)
        out["at top"] = "ran"
    except pipe.PipelineError as e:
        out["at top"] = str(e)
    out["at top without autocast"] = pp.step(x, target=t)
    return out


def conditions_body(rank: int, world: int) -> dict[str, Any]:
    import pipe
    from tests.nccl_like import NcclLike
    pipe.init()
    out: dict[str, Any] = {"clones": [], "notes": {}}
    M = 4
    # in-place writes: zero bubble splits the linear layers whose outputs are written; cuts before writes
    for schedule, v in (("1f1b", 1), ("zb-h1", 1), ("zbv", 2)):
        pp, _ = _two_steps(Inplace, M, f"inplace {schedule} rank {rank}", schedule=schedule, stages_per_rank=v)
        out["clones"] += [f"{schedule} stage {s}" for s in pp.local for n in pp.stages[s].graph.nodes
                          if n.op == "call_method" and n.target == "clone"]
        out["notes"][schedule] = [n for n in pp.plan.notes if "in place" in n]
    # autocast: values cross stages in bfloat16, learned at the first step, then received as such
    for schedule in ("1f1b", "zb-h1"):
        w, ref = _workload(Chain), _workload(Chain)
        pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=M, schedule=schedule,
                           cost="flops", trace_loss=False, transport=NcclLike())
        for step in range(2):
            args, _, target = w.batch(w.microbatch_size * M, step)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = pp.step(*args, target=target)
                want = _by_microbatch(w, ref.model, args, target, M)
            assert loss == want, (schedule, step, loss, want)  # the same ops in the same order
            _grads_close(pp, ref.model, f"autocast {schedule} step {step}", rtol=1e-3, atol=1e-5)
        out[f"learned {schedule}"] = {str(k): sorted({str(d) for d in v.values()}) for k, v in pp._cut_dtypes.items()}
        args, _, target = w.batch(w.microbatch_size * M, 5)
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
            got = pp.evaluate(*args, target=target)
            want = sum(float(w.loss_fn(ref.model(x), t)) for x, t in zip(args[0].chunk(M), target.chunk(M))) / M
        assert got == want, (schedule, got, want)
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():  # (zb-h1's stages read version
            assert pp.evaluate(*args, target=target) == want, schedule  # counters, which inference tensors lack)
        for within in (torch.no_grad, torch.inference_mode):  # found by review: trained on zero grads
            try:
                with within():
                    pp.step(*args, target=target)
                out[f"step under {within.__name__} {schedule}"] = "trained"
            except pipe.PipelineError as e:
                out[f"step under {within.__name__} {schedule}"] = str(e)
    # built under autocast (its plan's dtypes bfloat16), stepped without: the plain dtypes are learned too; an
    # evaluate under autocast before any step learns its dtypes once
    w, ref = _workload(Chain), _workload(Chain)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=M, cost="flops",
                           trace_loss=False, transport=NcclLike())
    args, _, target = w.batch(w.microbatch_size * M, 0)
    loss = pp.step(*args, target=target)
    want = sum(float(w.loss_fn(ref.model(x), t)) for x, t in zip(args[0].chunk(M), target.chunk(M))) / M
    assert abs(loss - want) < 1e-5, (loss, want)
    assert "" in pp._cut_dtypes
    w = _workload(Chain)
    pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=M, cost="flops", trace_loss=False,
                       transport=NcclLike())
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        pp.evaluate(*args, target=target)
        assert "cpu bfloat16" in pp._cut_dtypes  # the next pass receives without headers
        pp.evaluate(*args, target=target)
    # a meta model given a state dict: its integer and boolean non-persistent buffers were left 0 and False, unseen
    with torch.device("meta"):
        meta = Positions()
    try:
        pipe.Pipeline(meta, _batch(2, 0)[0], loss_fn=F.mse_loss, microbatches=M, cost="flops", trace_loss=False,
                      transport=NcclLike(), weights=Positions().state_dict())
        raise AssertionError("a meta model's non-persistent buffers were taken from a state dict without values")
    except pipe.PipelineError as e:
        assert "keep, position_ids of Positions (on the meta device) got no value" in str(e), str(e)
        assert "the model's own init" in str(e) and "no value marks a boolean one" in str(e), str(e)
    with torch.device("meta"):  # the init of parameters alone (reset_parameters) wrote no buffer: the position
        meta = Positions()  # ids stayed 0 (a boolean buffer has no value to mark it unwritten)
    try:
        pipe.Pipeline(meta, _batch(2, 0)[0], loss_fn=F.mse_loss, microbatches=M, cost="flops", trace_loss=False,
                      transport=NcclLike())
        raise AssertionError("a meta model's integer and boolean buffers were left 0 and False by its init")
    except pipe.PipelineError as e:
        assert "position_ids of Positions (on the meta device) got no value from the init function" in str(e), e
    # hooked linear layers under zero bubble: their W by autograd, hooks and all
    _two_steps(Hooked, M, f"hooked linears zb-h1 rank {rank}", schedule="zb-h1")
    # an input that requires grad: refused on every rank (each rank would keep its stages' part of its grad)
    w = _workload(Chain)
    pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=M, cost="flops", trace_loss=False,
                       transport=NcclLike())
    args, _, target = w.batch(w.microbatch_size * M, 0)
    try:
        pp.step(args[0].requires_grad_(), target=target)
        out["input grad"] = "trained"
    except pipe.PipelineError as e:
        out["input grad"] = str(e)
    # a module of the user's that reads its parameter twice, under zero bubble with offloaded activations
    _two_steps(Scaled, M, f"leaf module rank {rank}", schedule="zb-h1", offload="activations", leaf_modules=(Twice,))
    # batch norm in stages recomputed whole: its statistics as the model's forwards left them
    pp, ref = _two_steps(Normed, M, f"batch norm recomputed rank {rank}", recompute="full")
    mine = pp.local_buffers()
    assert any("running_mean" in k for k in mine), mine
    out["batch norm notes"] = [n for n in pp.plan.notes if n.startswith("batch norm")]
    for k, b in ref.model.named_buffers():
        if k in mine:
            torch.testing.assert_close(mine[k], b, msg=lambda m: f"recomputed batch norm {k}: {m}")
    # forward() with the loss in the graph: the stages without it keep the model's in-place writes
    w, ref = _workload(Unused), _workload(Unused)
    pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=M, cost="flops",
                       example_target=_batch(2, 0)[1], transport=NcclLike())
    assert pp.plan.loss
    args, _, _ = w.batch(w.microbatch_size * M, 3)
    with torch.no_grad():
        torch.testing.assert_close(pp.forward(*args), ref.model(*args), msg=lambda m: f"forward: {m}")
    # an input written in place (x.mul_) and read after the write on a later stage: it reads the written value
    w, ref = _workload(WritesInput), _workload(WritesInput)
    pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=M, cost="flops", trace_loss=False,
                       transport=NcclLike())
    args, _, target = w.batch(w.microbatch_size * M, 0)
    loss = pp.step(args[0].clone(), target=target)
    want = w.loss_fn(ref.model(args[0].clone()), target)
    want.backward()
    torch.testing.assert_close(loss, float(want), rtol=1e-5, atol=1e-6)
    _grads_close(pp, ref.model, f"input written in place rank {rank}")
    out["received written input"] = [n.name for s in pp.local for n in pp.stages[s].graph.nodes
                                     if n.op == "placeholder" and n.name.startswith("mul_")]
    # a model's own loss over labels ignored unevenly: step and forward() give the batch's (forward averaged it),
    # with the loss outside the graph and in it (forward()'s stages then cut without it, their outputs gathered)
    labels = torch.randint(0, 5, (2 * M, 3))
    labels[:2] = -100
    labels[2:4, 1:] = -100
    x = torch.randn(2 * M, 3, D)
    own_loss = lambda out, _: out["loss"]  # noqa: E731
    cast = lambda out, _: out["loss"].float()  # noqa: E731 - forward() averaged the model's loss (found by review)
    for where, loss_fn in ((dict(trace_loss=False), own_loss), (dict(example_target=labels[:2]), own_loss),
                           (dict(example_target=labels[:2]), cast)):
        torch.manual_seed(0)
        own, ref_own = OwnLoss(), OwnLoss()
        ref_own.load_state_dict(own.state_dict())
        pp = pipe.Pipeline(own, (x[:2], labels[:2]), loss_fn=loss_fn, microbatches=M,
                           cost="flops", transport=NcclLike(), **where)
        assert pp.plan.loss == ("example_target" in where)
        loss = pp.step(x, labels, target=labels)
        want = ref_own(x, labels)
        want["loss"].backward()
        torch.testing.assert_close(loss, float(want["loss"]), rtol=1e-5, atol=1e-6)
        _grads_close(pp, ref_own, f"a model's own loss rank {rank} {where.keys()}")
        with torch.no_grad():
            got = pp.forward(x, labels)
        torch.testing.assert_close(got["loss"], want["loss"].detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["logits"], want["logits"].detach())
    # forward() lays outputs out as the model does: along dim 1, and along dim 0 with every microbatch alike
    torch.manual_seed(0)
    seq, ref = SeqFirst(), SeqFirst()
    ref.load_state_dict(seq.state_dict())
    pp = pipe.Pipeline(seq, (torch.randn(2, 4, D),), loss_fn=lambda o, t: o[0].pow(2).mean(), microbatches=M,
                       cost="flops", trace_loss=False, transport=NcclLike())
    x = torch.randn(2, 4, D).repeat(M, 1, 1)  # a repeated prompt
    with torch.no_grad():
        for got, want in zip(pp.forward(x), ref(x)):
            torch.testing.assert_close(got, want, msg=lambda m: f"forward's layout: {m}")
    # 'selective' with torch.dropout: the grads of the same draws as without recomputation
    grads = []
    for recompute in ("none", "selective"):
        w = _workload(Attn)
        pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=M, cost="flops",
                           trace_loss=False, transport=NcclLike(), recompute=recompute)
        args, _, target = w.batch(w.microbatch_size * M, 0)
        torch.manual_seed(10 + rank)
        pp.step(*args, target=target)
        grads.append({n: p.grad for n, p in pp.named_parameters()})
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, msg=lambda m: f"selective with torch.dropout {n}: {m}")
    out["float32 regions"] = _float32_regions(M)
    _exported_batch_norm(M)
    out["ignored targets"] = _ignored_targets(rank, M)
    out["sums and ratios"] = _sums_and_ratios(rank, M)
    out["grad scaler"] = _grad_scaler(rank, M)
    out["pairs"] = _pairs(rank, M)
    out["closure"] = _closure(rank, M)  # (last: its refused step ends the process group)
    return out


def test_inplace_ops_autocast_and_leaf_modules_train_as_the_model() -> None:
    res = run_ranks("tests.test_conditions:conditions_body", 2, timeout=240)
    clones = [c for r in res for c in r["clones"]]
    assert clones, "no cut fell right before an in-place write: the case is not exercised"
    assert any(r["notes"]["zb-h1"] for r in res), [r["notes"] for r in res]  # its W took the autograd call, said
    assert not any(r["notes"]["1f1b"] for r in res)
    for schedule in ("1f1b", "zb-h1"):  # rank 1 received bfloat16 values, learned at the first step
        assert res[1][f"learned {schedule}"] == {"cpu bfloat16": ["torch.bfloat16"]}, res[1]
        assert res[0]["ignored targets"][schedule] == [  # the plan says how the batch's loss is formed
            "loss: the batch's, each microbatch's cross_entropy weighs by its targets other than ignore_index=-100 "
            "over the batch's"], res[0]["ignored targets"]
    assert res[1]["received written input"], res[1]  # the last stage received x as written, not its own copy
    for r in res:
        for within in ("no_grad", "inference_mode"):
            for schedule in ("1f1b", "zb-h1"):
                assert r[f"step under {within} {schedule}"].startswith(f"step() under torch.{within}(): no grads "
                                                                         "can be computed"), r
        assert r["input grad"].startswith("the input args[0] requires grad, but a step computes the grads of the "
                                          "model's parameters only"), r["input grad"]
    notes = res[0]["sums and ratios"]
    assert notes["_summed"] == ["loss: the batch's, the sum of the microbatches' (sum_1: a .sum() over the samples)"]
    assert notes["_masked_floor"] == ["loss: the batch's, sum_1 (a .sum() over the samples) / sum_2: each "
                                      "microbatch's numerator over the batch's divisor, at least 1 (computed from the "
                                      "inputs)"], notes
    assert all("numerator over the batch's divisor" in n[0] for n in (notes["_masked"], notes["own"])), notes
    assert notes["_selected"] == ["loss: the batch's, each microbatch's mse_loss weighs by its target's elements (the "
                                  "values a mask selects) over the batch's"], notes
    for r in res:  # the first step overflowed and was skipped on both, as on the model; then none did
        scales = r["grad scaler"]["scales"]
        assert scales == [(2.0 ** 16, 2.0 ** 16)] * 3, scales
        assert r["grad scaler"]["skipped everywhere"] and r["grad scaler"]["backed off"], r["grad scaler"]
    assert res[1]["closure"].startswith("PipelineError: loss_fn reads blocks.0.mlp.fc.weight, which requires grad, "
                                        "other than through the model's output"), res[1]["closure"]
    assert "rank 1 does not train it" in res[1]["closure"], res[1]["closure"]
    assert "because rank 1" in res[0]["closure"], res[0]["closure"]
    for r in res:
        regions = r["float32 regions"]
        for region in ("Float32Region", "AskingRegion"):
            assert regions[f"{region} notes"] == [
                f"kept whole: tests.test_conditions.{region}, whose forward switches torch.autocast or asks whether "
                "one is in force (a region at another precision, or one entered only under an autocast), which a "
                "traced graph does not keep; whole, it runs as written under the autocast around each call"], regions
        assert regions["at top"].startswith("this step call runs under an autocast (cpu bfloat16), but RegionAtTop's "
                                            "own forward enters a torch.autocast, which torch.fx.symbolic_trace's "
                                            "graph does not keep"), regions
        assert isinstance(regions["at top without autocast"], float)
    for r in res:
        assert r["batch norm notes"] and "normalizes each microbatch by its own samples' statistics" in \
            r["batch norm notes"][0], r["batch norm notes"]
        pairs = r["pairs"]
        assert len(pairs["notes"]) == 1 and pairs["notes"][0].startswith(
            "loss: NOT the batch's, the mean of the microbatches' losses: the loss pairs the samples of a "
            "microbatch"), pairs["notes"]
        assert pairs["forward"].startswith("the model's output leaf 0 pairs the samples of a microbatch (shape "
                                           "[4, 4] on one, [8, 8] on two"), pairs["forward"]


def test_a_frozen_tied_weight_keeps_no_grad_and_frozen_on_one_rank_is_refused_on_both() -> None:
    res = run_ranks("tests.test_conditions:frozen_tied_body", 2, timeout=180)
    for r in res:
        assert r["frozen on one rank"].startswith("the tied parameters tok_emb.weight are frozen (requires_grad="
                                                  "False) on some of the ranks holding them"), r
        over = r["over budget"]
        assert "this optimizer" in over["refused"] and over["s"] < 10, over  # (BudgetError, or the other's word)
    assert any(r["over budget"]["refused"].startswith("BudgetError: ") for r in res), res
    assert res[0]["over budget"]["then"] == res[1]["over budget"]["then"], res


