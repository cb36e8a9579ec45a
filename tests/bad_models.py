"""Workload factories that go wrong on purpose, for the error-table tests (MODEL = tests/bad_models.py:NAME)."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from bench import models
from partition.workload import Workload


class _Branchy(torch.nn.Module):
    """Python control flow on a tensor's value, and a result no tracer can express."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> Any:
        y = self.lin(x)
        if y.sum().item() > 0:
            return {"values": y, "extra": object()}
        return {"values": -y, "extra": object()}


def _mse(out: Any, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out["values"] if isinstance(out, dict) else out, target)


def _pair(batch_size: int, step: int) -> tuple[tuple[Any, ...], torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return (torch.randn(batch_size, 8, generator=g),), torch.randn(batch_size, 8, generator=g)


def untraceable() -> Workload:
    torch.manual_seed(0)  # every rank builds the same values (pipe.Pipeline compares them), as the bundled factories
    x, y = _pair(2, 0)
    return Workload(name="untraceable", model=_Branchy(), example_args=x, loss_fn=_mse, make_batch=_pair,
                    microbatch_size=2)


def one_block() -> Workload:
    """A single linear layer: the graph cannot be cut into two stages."""
    torch.manual_seed(0)
    x, _ = _pair(2, 0)
    return Workload(name="one_block", model=torch.nn.Linear(8, 8), example_args=x, loss_fn=_mse,
                    make_batch=_pair, microbatch_size=2)


def no_loss() -> Workload:
    w = models.mlp(depth=2, width=16, in_features=8)
    w.loss_fn = None  # type: ignore[assignment]
    return w


class _Longer:
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __call__(self, batch_size: int, step: int) -> tuple[tuple[Any, ...], torch.Tensor]:
        (idx,), tgt = self.inner(batch_size, step)
        if step == 0:  # the example (and its target) as planned; the batches trained on are longer
            return (idx,), tgt
        return (torch.cat([idx, idx], 1),), torch.cat([tgt, tgt], 1)


def wrong_shape() -> Workload:
    """Batches twice as long as the example the plan was made for."""
    w = models.gpt(n_layer=2, d_model=32, n_head=2, seq_len=16, vocab=64)
    w.make_batch = _Longer(w.make_batch)
    return w


class _ValueAt:
    """The batches of `inner` with x[0, 0] set to `value` at step `step`."""
    def __init__(self, inner: Any, step: int, value: float) -> None:
        self.inner, self.step, self.value = inner, step, value

    def __call__(self, batch_size: int, step: int) -> tuple[tuple[Any, ...], torch.Tensor]:
        (x,), y = self.inner(batch_size, step)
        if step == self.step:
            x = x.clone()
            x[0, 0] = self.value
        return (x,), y


def nan_data() -> Workload:
    """Finite data except one NaN input at step 1."""
    w = models.mlp(depth=4, width=16, in_features=8)
    w.make_batch = _ValueAt(w.make_batch, 1, float("nan"))
    return w


class _SqrtGate(torch.nn.Module):
    """x + sqrt(g * |x[:, :1]|): finite for any finite x, but g's grad is 0 x inf = NaN where x[:, 0] is 0."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner, self.g = inner, torch.nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x + torch.sqrt(self.g * x[:, :1].abs()))


def nan_grad() -> Workload:
    """A finite loss at every step, but at step 1 (from 0) a NaN grad: a first input feature of exactly 0 under a
    square root (an overflow in a backward)."""
    w = models.mlp(depth=4, width=16, in_features=8)
    w.model = _SqrtGate(w.model)
    w.make_batch = _ValueAt(w.make_batch, 1, 0.0)
    w.layer_prefixes = tuple(f"inner.{p}" for p in w.layer_prefixes)
    return w


class _Changed:
    """The GPT's batches as at step 0 (what the plan is made from), changed by `how` after it."""

    def __init__(self, inner: Any, how: Any) -> None:
        self.inner, self.how = inner, how

    def __call__(self, batch_size: int, step: int) -> tuple[Any, ...]:
        args, target = self.inner(batch_size, step)
        return self.how(args, {}, target) if step > 0 else (args, {}, target)


def _gpt() -> Workload:
    return models.gpt(n_layer=2, d_model=32, n_head=2, seq_len=16, vocab=64)


def _with_batches(how: Any) -> Workload:
    w = _gpt()
    w.make_batch = _Changed(w.make_batch, how)
    return w


def extra_input() -> Workload:
    """An attention mask the plan was not made with: it would be dropped silently."""
    return _with_batches(lambda a, k, t: (a, {"attention_mask": torch.ones_like(a[0])}, t))


def index_out_of_range() -> Workload:
    """Token ids past the vocabulary at step 1: the embedding on stage 0 raises IndexError."""
    return _with_batches(lambda a, k, t: ((a[0] + 1000,), k, t))


def _per_token(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none")


def non_scalar_loss() -> Workload:
    """A loss with reduction='none': one number per token, not one per microbatch."""
    w = _gpt()
    w.loss_fn = _per_token
    return w


class _NoTarget:
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __call__(self, batch_size: int, step: int) -> tuple[tuple[Any, ...], Any]:
        return self.inner(batch_size, step)[0], None


def forgotten_target() -> Workload:
    """Batches without a target; the loss reads one."""
    w = _gpt()
    w.make_batch = _NoTarget(w.make_batch)
    return w


def _rank() -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_initialized() else 0


class _PerRank:
    """At step 1 on, each rank's batch as a data loader sharded over the world would give it: batch
    `step * world + rank` (DistributedSampler's default), where a pipeline wants one for all its ranks."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __call__(self, batch_size: int, step: int) -> tuple[tuple[Any, ...], torch.Tensor]:
        return self.inner(batch_size, step if step == 0 else 2 * step + _rank())


def batch_per_rank() -> Workload:
    """Each rank of the pipeline given its own batch (same shapes, other samples) from step 1."""
    w = _gpt()
    w.make_batch = _PerRank(w.make_batch)
    return w


def shape_on_one_rank() -> Workload:
    """Rank 1 alone given batches twice as long as planned, from step 1."""
    return _with_batches(lambda a, k, t: ((torch.cat([a[0], a[0]], 1),), k, torch.cat([t, t], 1)) if _rank() == 1
                         else (a, k, t))


class _TrainOnlyNoise(torch.nn.Module):
    """Two layers, the second only in training mode: its eval-mode graph is not the one a plan cuts."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.a(x))
        return self.b(x) + x if self.training else x


def mode_branch() -> Workload:
    """Traced in training mode, a model whose eval mode skips a layer: refused in eval mode (ModeError)."""
    torch.manual_seed(0)
    x, _ = _pair(2, 0)
    return Workload(name="mode_branch", model=_TrainOnlyNoise(), example_args=x, loss_fn=_mse, make_batch=_pair,
                    microbatch_size=2)
