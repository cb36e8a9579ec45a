"""Materialize only this rank's stages of a model built on the meta device, and give them values.

A model built under `with torch.device("meta"):` holds shapes, not storage. pipe.Pipeline plans it
from shapes (partition.meta), splits it, and each rank allocates the tensors its own stages hold,
once each (a weight tied between modules, or between two stages on one rank, stays one tensor;
each stage on another rank holds its own copy, with the same values). Their values come from
`weights=`:

- a state dict of the unpartitioned model: a dict, a `.pt`/`.bin` (read with mmap and
  weights_only), a `.safetensors`, a folder of Hugging Face shards with its index, an fxpipe
  checkpoint or another torch.distributed.checkpoint folder; each rank reads only its tensors,
  and a missing tensor or a wrong shape is an error on every rank naming it (pipe.state_dicts);
- an init function `fn(module)` (or `Init(fn, seed)`), called on every module of the model,
  children before parents (as `Module.apply`), with torch's random generator seeded per module by
  `module_seed(seed, qualified name)`. The tensors a module holds directly are all allocated for
  its call on a rank that holds any of them (a module's draws are then those the unpartitioned
  model makes); tensors held elsewhere stay on the meta device, where writes do nothing. So a
  stage's values are those `initialize(model, fn, seed)` gives the unpartitioned model, for any
  init that writes a module's own tensors (reset_parameters, Hugging Face's `_init_weights`),
  and for one that also writes one child's tensor (GPT-2's scaled `c_proj`);
- nothing: `default_init(model)`, each module's `reset_parameters()` then the model's own
  `_init_weights(module)` when it has one, seeded as above.

Every floating-point tensor is allocated filled with NaN, so a tensor no source gave a value is
found and named (a state dict lacking it, an init that does not cover it).
"""
from __future__ import annotations

import copy
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import torch

from partition.errors import FxpipeError

__all__ = ["Init", "WeightsError", "default_init", "initialize", "module_seed", "allocate", "unset",
           "init_stages", "empty_like"]


class WeightsError(FxpipeError, ValueError):
    """A meta-device model whose stages cannot be given values as asked."""


@dataclass(frozen=True)
class Init:
    """An init function called on each module (`fn(module)`), seeded per module from `seed`;
    `fn=None` is the model's default_init."""
    fn: Callable[[torch.nn.Module], Any] | None = None
    seed: int = 0


def module_seed(seed: int, name: str) -> int:
    """The seed of the module `name` (its qualified name; "" for the model): CRC-32 of the name
    mixed with `seed`, so each module's draws depend on nothing else."""
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def default_init(model: torch.nn.Module) -> Callable[[torch.nn.Module], None] | None:
    """Each module's reset_parameters(), then the model's `_init_weights(module)` (Hugging Face's
    convention) if it has one; None when the model has neither anywhere."""
    own = getattr(model, "_init_weights", None)
    own = own if callable(own) else None
    if own is None and not any(callable(getattr(m, "reset_parameters", None)) for m in model.modules()):
        return None

    def fn(module: torch.nn.Module) -> None:
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()
        if own is not None:
            own(module)
    return fn


def _post_order(module: torch.nn.Module, prefix: str = "", seen: set[int] | None = None
                ) -> Iterator[tuple[str, torch.nn.Module]]:
    seen = set() if seen is None else seen
    if id(module) in seen:
        return
    seen.add(id(module))
    for name, child in module._modules.items():
        if child is not None:
            yield from _post_order(child, f"{prefix}.{name}" if prefix else name, seen)
    yield prefix, module


def _direct(module: torch.nn.Module) -> list[torch.Tensor]:
    return [t for table in (module._parameters, module._buffers) for t in table.values() if t is not None]


def _run_init(model: torch.nn.Module, fn: Callable[[torch.nn.Module], Any], seed: int) -> None:
    devices = sorted({t.device for t in (*model.parameters(), *model.buffers())
                      if t.device.type not in ("cpu", "meta")}, key=str)
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        for name, module in _post_order(model):
            torch.manual_seed(module_seed(seed, name))
            fn(module)


def empty_like(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor like `t` on `device`: NaN when floating point (so one nothing wrote
    is found), else zeros."""
    new = torch.empty(t.shape, dtype=t.dtype, device=device)
    new.fill_(float("nan") if new.is_floating_point() or new.is_complex() else _UNSET.get(new.dtype, 0))
    if isinstance(t, torch.nn.Parameter):
        return torch.nn.Parameter(new, requires_grad=t.requires_grad)
    return new


def allocate(modules: list[torch.nn.Module], device: torch.device
             ) -> tuple[list[torch.nn.Module], dict[int, torch.Tensor]]:
    """Copies of `modules` (one deepcopy, so what they share stays shared) whose meta parameters
    and buffers are new tensors on `device` (see _empty), and id(meta tensor) -> its new tensor.
    Tensors not on the meta device (constants the trace kept) are moved to `device`."""
    memo: dict[int, Any] = {}
    made: dict[int, torch.Tensor] = {}
    for m in modules:
        for sub in m.modules():
            for t in _direct(sub):
                if id(t) not in memo:
                    memo[id(t)] = made[id(t)] = empty_like(t, device) if t.is_meta else t.to(device)
            for k, v in vars(sub).items():
                if isinstance(v, torch.Tensor) and id(v) not in memo:
                    if v.is_meta:
                        raise WeightsError(f"the traced graph keeps a constant tensor {k!r} on the meta device, which "
                                           "has no value to give it; create that tensor in forward (it is traced as "
                                           "an op) or register it as a buffer")
                    memo[id(v)] = v.to(device)
    return copy.deepcopy(modules, memo), made


def initialize(model: torch.nn.Module, fn: Callable[[torch.nn.Module], Any] | None = None, seed: int = 0,
               device: torch.device | str = "cpu") -> torch.nn.Module:
    """The unpartitioned `model` (on the meta device) as a new module on `device`, initialised as
    the pipeline initialises its stages: `fn` (default_init when None) on each module, seeded per
    module. The model itself is left as it is."""
    fn = fn or default_init(model)
    if fn is None:
        raise WeightsError(f"{type(model).__name__} has no reset_parameters() on any module and no _init_weights; "
                           "pass an init function")
    (out,), _ = allocate([model], torch.device(device))
    _run_init(out, fn, seed)
    return out


def init_stages(model: torch.nn.Module, made: dict[int, torch.Tensor], fn: Callable[[torch.nn.Module], Any],
                seed: int) -> None:
    """Initialise the tensors `made` (id of the model's meta tensor -> this rank's tensor) as
    `initialize(model, fn, seed)` would: a copy of the model holds them, every module holding any of
    them holds its other tensors as scratch, and the rest stays on the meta device."""
    device = next(iter(made.values())).device if made else torch.device("cpu")
    memo: dict[int, Any] = dict(made)
    for sub in model.modules():
        direct = _direct(sub)
        if any(id(t) in made for t in direct):
            for t in direct:
                if id(t) not in memo:
                    memo[id(t)] = empty_like(t, device)
    shadow = copy.deepcopy(model, memo)
    _run_init(shadow, fn, seed)


# what an integer tensor allocated for a source holds until the source writes it (its dtype's least value)
_UNSET = {d: torch.iinfo(d).min for d in (torch.int8, torch.int16, torch.int32, torch.int64)}


def unset(named: Mapping[str, torch.Tensor]) -> list[str]:
    """Names of the tensors no source gave a value: floating-point ones still all NaN, integer ones still all their
    dtype's least value (a source writing through .data or a file read into the storage bumps no version counter,
    so the values tell); checked a million elements at a time, so the check allocates little."""
    def all_unset(t: torch.Tensor) -> bool:
        flat = t.detach().reshape(-1)
        floating = t.is_floating_point() or t.is_complex()
        return all(bool((torch.isnan(part) if floating else part == _UNSET[t.dtype]).all())
                   for part in flat.split(1 << 20))
    return [n for n, t in named.items() if (t.is_floating_point() or t.is_complex() or t.dtype in _UNSET)
            and t.numel() and all_unset(t)]
