"""A training workload (model, one example microbatch, loss, data) and how to load one by name."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from partition.errors import FxpipeError

__all__ = [
    "BUNDLED",
    "Workload",
    "WorkloadError",
    "WorkloadTypeError",
    "factory_of",
    "load",
    "parse_overrides",
]

# Bare names that `load` resolves to `bench.models:<name>`.
BUNDLED: tuple[str, ...] = ("gpt", "gpt_wide_vocab", "gpt_text", "mlp", "resnet", "unet")
_BUNDLED_MODULE = "bench.models"

_FORMS = (
    "expected 'package.module:factory', 'path/file.py:factory', "
    f"or one of the bundled names: {', '.join(BUNDLED)}"
)


class WorkloadError(FxpipeError, ValueError):
    """A workload spec or override that cannot be resolved; the message says why and how to fix it."""


class WorkloadTypeError(WorkloadError, TypeError):
    """A factory that returned something other than a `Workload`."""


@dataclass(kw_only=True)
class Workload:
    """Everything the partitioner, the runtime and the benchmarks need to train one model.

    `example_args` is ONE microbatch of positional inputs. `loss_fn(output, target)`
    returns the scalar mean loss over a microbatch. `make_batch(batch_size, step)`
    returns `(args, target)` or `(args, kwargs, target)` whose tensors have `batch_size`
    along dim 0, the same for the same `step` (`batch` normalises both forms).
    `layer_prefixes` names the repeated layers in order, for baselines that split by layer (may be empty).
    `leaf_modules` are module types torch.fx should trace as one op (their forward has control flow).
    """

    name: str
    model: torch.nn.Module
    example_args: tuple[Any, ...]
    example_kwargs: dict[str, Any] = field(default_factory=dict)
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    make_batch: Callable[[int, int], tuple[Any, ...]]
    microbatch_size: int
    tokens_per_sample: int = 1
    layer_prefixes: tuple[str, ...] = ()
    leaf_modules: tuple[type[torch.nn.Module], ...] = ()  # module types fx keeps whole (partition.trace)

    def __post_init__(self) -> None:
        if not isinstance(self.example_args, tuple):
            raise TypeError(
                f"Workload {self.name!r}: example_args must be a tuple of positional inputs, "
                f"got {type(self.example_args).__name__}; wrap a single tensor as (x,)"
            )
        if self.microbatch_size < 1 or self.tokens_per_sample < 1:
            raise ValueError(
                f"Workload {self.name!r}: microbatch_size and tokens_per_sample must be >= 1 "
                f"(microbatch_size: {self.microbatch_size}, "
                f"tokens_per_sample: {self.tokens_per_sample})"
            )
        modules = dict(self.model.named_modules())
        missing = [p for p in self.layer_prefixes if p not in modules]
        if missing:
            raise ValueError(
                f"Workload {self.name!r}: layer_prefixes {missing} are not modules of the model; "
                "use qualified names from model.named_modules(), e.g. 'blocks.0'"
            )

    def batch(self, batch_size: int, step: int) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
        """(args, kwargs, target) of one batch, whichever form make_batch returns."""
        got = self.make_batch(batch_size, step)
        if len(got) == 3:
            return tuple(got[0]), dict(got[1]), got[2]
        return tuple(got[0]), {}, got[1]

    @property
    def example_target(self) -> Any:
        """One microbatch's target (of batch 0), e.g. for planning with the loss in the graph."""
        return self.batch(self.microbatch_size, 0)[2]


def load(spec: str, **kwargs: Any) -> Workload:
    """Build the workload named by `spec`, passing `kwargs` to its factory.

    `spec` is `package.module:factory`, `path/file.py:factory` (relative to the
    current directory), or a bundled name such as `gpt` (= `bench.models:gpt`).
    A file is imported once per process (cached by its absolute path).
    """
    factory = factory_of(spec)
    target, attr = _split_spec(spec)
    tried = f"file {target!r}" if _is_path(target) else f"module {target!r}"
    try:
        result = factory(**kwargs)
    except Exception as err:
        call = f"{attr}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})"
        raise WorkloadError(
            f"workload {spec!r}: calling {call} from {tried} failed: {type(err).__name__}: {err}"
        ) from err
    if not isinstance(result, Workload):
        raise WorkloadTypeError(
            f"workload {spec!r}: factory {attr!r} from {tried} returned "
            f"{type(result).__name__} ({result!r:.80}), expected a partition.workload.Workload"
        )
    return result


def factory_of(spec: str) -> Callable[..., Any]:
    """The factory `spec` names (see load), imported but not called; WorkloadError naming the forms when
    there is none (a launcher checks this before it starts its processes)."""
    target, attr = _split_spec(spec)
    if _is_path(target):
        module, tried = _import_file(spec, target), f"file {target!r}"
    else:
        module, tried = _import_module(spec, target), f"module {target!r}"
    factory = getattr(module, attr, None)
    if factory is None:
        public = sorted(n for n in vars(module) if not n.startswith("_"))
        raise WorkloadError(
            f"workload {spec!r}: {tried} has no attribute {attr!r} "
            f"(public names: {', '.join(public) or 'none'}); {_FORMS}"
        )
    if not callable(factory):
        raise WorkloadError(
            f"workload {spec!r}: {tried} attribute {attr!r} is a "
            f"{type(factory).__name__}, not a callable factory; {_FORMS}"
        )
    return factory


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """Turn `["n_layer=4", "lr=1e-3", "tie=false", "act=gelu"]` into typed factory kwargs."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise WorkloadError(
                f"model argument {item!r} is not key=value with a Python identifier as key; "
                "write it like --model-arg n_layer=4"
            )
        if key in out:
            raise WorkloadError(f"model argument {key!r} is given twice ({items}); keep one")
        out[key] = _parse_value(raw.strip())
    return out


def _parse_value(raw: str) -> Any:
    """Read a command-line value as bool, int, float, or else str."""
    lowered = raw.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw


def _split_spec(spec: str) -> tuple[str, str]:
    """Return (module or file path, factory attribute) for a spec, or raise WorkloadError."""
    if not isinstance(spec, str) or not spec.strip():
        raise WorkloadError(f"workload spec {spec!r} is empty; {_FORMS}")
    parts = spec.split(":")
    if len(parts) == 1:
        if spec in BUNDLED:
            return _BUNDLED_MODULE, spec
        raise WorkloadError(
            f"workload {spec!r} is not a bundled name and has no ':factory' part; {_FORMS}"
        )
    if len(parts) != 2 or not parts[0] or not parts[1]:
        raise WorkloadError(
            f"workload {spec!r} must have exactly one ':' between a non-empty module or "
            f"file path and a factory name (found {len(parts) - 1}); {_FORMS}"
        )
    return parts[0], parts[1]


def _is_path(target: str) -> bool:
    return target.endswith(".py") or "/" in target or os.sep in target


def _import_module(spec: str, name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except Exception as err:
        raise WorkloadError(
            f"workload {spec!r}: importing module {name!r} failed: "
            f"{type(err).__name__}: {err}; {_FORMS}"
        ) from err


def _import_file(spec: str, path: str) -> ModuleType:
    full = os.path.abspath(path)
    if not os.path.isfile(full):
        raise WorkloadError(
            f"workload {spec!r}: file {path!r} not found (resolved to {full!r} from "
            f"cwd {os.getcwd()!r}); {_FORMS}"
        )
    # A stable, unique module name per file, registered so dataclasses and pickling work.
    stem = os.path.splitext(os.path.basename(full))[0]
    digest = hashlib.sha1(full.encode()).hexdigest()[:10]
    name = f"_fxpipe_workload_{''.join(c if c.isalnum() else '_' for c in stem)}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    loader_spec = importlib.util.spec_from_file_location(name, full)
    if loader_spec is None or loader_spec.loader is None:
        raise WorkloadError(f"workload {spec!r}: file {path!r} cannot be imported; {_FORMS}")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module
    try:
        loader_spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        raise WorkloadError(
            f"workload {spec!r}: executing file {path!r} failed: "
            f"{type(err).__name__}: {err}; {_FORMS}"
        ) from err
    return module
