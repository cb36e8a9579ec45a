"""Matrix products priced by their shape (cost="shaped"): each distinct product's time on this machine against
a reference product, timed alternately, once per process.

A FLOP count prices every product alike per FLOP, but a product's speed depends on its shape and on the
device: on one CPU core (torch 2.13), timed op by op in the graph, the linear layers of a d=256 GPT took
0.20 ms per notional ms and those of a d=128 one 0.23. Timing each shape against one reference in
alternation, one call of each, and taking the median of the ratios, leaves out most of the machine's drift
(its speed moves 10-30% over minutes here). One call at a time, as a pipeline runs a product between other
ops: timed in a loop, a product whose weights fit the cache runs faster than it will in the pipeline.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["PRODUCTS", "REFERENCE", "product_flops", "product_ratio", "ratios_measured"]

# the aten products priced by shape: the indices of their two factors among the op's arguments
PRODUCTS = {"aten::mm": (0, 1), "aten::addmm": (1, 2), "aten::bmm": (0, 1), "aten::baddbmm": (1, 2)}
REFERENCE = (256, 256, 256)  # the reference product (m, k, n): float32, contiguous, on the op's device
_ROUNDS = 21  # alternations of one call of the product and one of the reference; the median ratio counts

_RATIOS: dict[Hashable, float] = {}  # measured ratios by product (op, tensors' shapes, strides, dtypes, device)


def product_flops(name: str, args: tuple[Any, ...]) -> int:
    """FLOPs of one product as torch's FlopCounterMode counts them: 2 m k n (times the batch)."""
    i, j = PRODUCTS[name]
    a, b = args[i], args[j]
    batch = a.shape[0] if a.dim() == 3 else 1
    return 2 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]


def _tensor_sig(t: torch.Tensor) -> Hashable:
    return tuple(t.shape), tuple(t.stride()), str(t.dtype)


def _like(t: torch.Tensor, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """A tensor of the same shape, strides and dtype on `device`, of random values from `gen` (its own storage)."""
    span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s > 0)
    base = torch.randn(span, device=device, generator=gen).to(t.dtype) if t.is_floating_point() else \
        torch.zeros(span, dtype=t.dtype, device=device)
    return base.as_strided(t.shape, t.stride())


def _once_s(fn: Callable[[], Any], sync: Callable[[], None]) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def product_ratio(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], device: torch.device | None = None
                  ) -> float:
    """This product's time over the reference product's on `device` (default: its tensors'): measured on
    first sight of its shape (fresh tensors of the same shapes, strides and dtypes, outside any dispatch
    mode, drawn from a generator of its own: the caller's random state is left as it was), then remembered
    for the process."""
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    device = device if device is not None else tensors[0].device
    if device.type == "meta":
        raise ValueError("cost='shaped' times each matrix product on the device the plan is for, and this plan's is "
                         "the meta device; name the target device (partition.plan(..., device='cuda')), or "
                         "plan with cost='flops' (FLOP counts alone)")
    key = (func._schema.name, tuple(_tensor_sig(t) for t in tensors), str(device),
           tuple((k, v) for k, v in sorted((kwargs or {}).items()) if not isinstance(v, torch.Tensor)))
    if key in _RATIOS:
        return _RATIOS[key]
    sync: Callable[[], None] = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    gen = torch.Generator(device=device).manual_seed(0)
    with _disable_current_modes(), torch.no_grad():
        fresh_args, fresh_kwargs = pytree.tree_map(
            lambda x: _like(x, device, gen) if isinstance(x, torch.Tensor) else x, (args, kwargs or {}))
        m, k, n = REFERENCE
        ra, rb = torch.randn(m, k, device=device, generator=gen), torch.randn(k, n, device=device, generator=gen)

        def op() -> Any:
            return func(*fresh_args, **fresh_kwargs)

        def ref() -> Any:
            return torch.mm(ra, rb)
        for f in (op, ref, op, ref):  # warm up
            f()
        ratios = [_once_s(op, sync) / _once_s(ref, sync) for _ in range(_ROUNDS)]
    _RATIOS[key] = statistics.median(ratios)
    return _RATIOS[key]


def ratios_measured() -> int:
    """How many product shapes this process has timed."""
    return len(_RATIOS)
