"""A generated zoo of small models: every way of being called (positional, keyword, optional,
non-tensor and nested inputs) times every way of returning (tensor, tuple, list, dict, nested
dict, dataclass, ModelOutput), each with a loss that reads the output as users write it."""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable

import torch
import torch.nn.functional as F
from transformers.utils import ModelOutput

from partition.workload import Workload

__all__ = ["BASE_CALLS", "CALLS", "OUTPUTS", "cases", "workload", "Pair", "ZooOutput"]

D = 8  # feature width


@dataclasses.dataclass
class Pair:
    """A plain dataclass output (torch's pytree does not know it until fxpipe registers it)."""
    logits: torch.Tensor
    aux: torch.Tensor


@dataclasses.dataclass
class ZooOutput(ModelOutput):
    """A Hugging Face style output: a dict, a tuple and an object at once."""
    logits: torch.Tensor | None = None
    aux: torch.Tensor | None = None


def _pack(kind: str, y: torch.Tensor, h: torch.Tensor) -> Any:
    """The model's output of kind `kind` from its prediction y and an auxiliary tensor h."""
    return {"tensor": lambda: y, "tuple1": lambda: (y,), "tuple2": lambda: (y, h), "list": lambda: [y, h],
            "dict": lambda: {"logits": y, "aux": h}, "nested": lambda: {"out": {"logits": y}, "aux": (h,)},
            "dataclass": lambda: Pair(y, h), "modeloutput": lambda: ZooOutput(logits=y, aux=h)}[kind]()


# how each output kind is read by its loss, as users write it
LOSSES: dict[str, Callable[[Any, torch.Tensor], torch.Tensor]] = {
    "tensor": lambda out, t: F.mse_loss(out, t),
    "tuple1": lambda out, t: ((out[0] - t) ** 2).mean(),
    "tuple2": lambda out, t: F.mse_loss(out[0], t) + 0.1 * out[1].pow(2).mean(),
    "list": lambda out, t: F.mse_loss(out[0], t) + 0.1 * out[-1].abs().mean(),
    "dict": lambda out, t: F.mse_loss(out["logits"], t) + 0.1 * out["aux"].mean(),
    "nested": lambda out, t: F.mse_loss(out["out"]["logits"], t) + 0.1 * out["aux"][0].pow(2).mean(),
    "dataclass": lambda out, t: F.mse_loss(out.logits, t) + 0.1 * out.aux.pow(2).mean(),
    "modeloutput": lambda out, t: F.mse_loss(out.logits, t) + 0.05 * (out[1].pow(2).mean() + out["aux"].mean()),
}
OUTPUTS = tuple(LOSSES)


class _Body(torch.nn.Module):
    def __init__(self, out: str) -> None:
        super().__init__()
        self.out = out
        self.a = torch.nn.Linear(D, 2 * D)
        self.b = torch.nn.Linear(2 * D, 2 * D)
        self.c = torch.nn.Linear(2 * D, 2 * D)
        self.d = torch.nn.Linear(2 * D, D)

    def body(self, x: torch.Tensor, mask: torch.Tensor | None = None, scale: float = 1.0) -> Any:
        h = torch.tanh(self.a(x))  # (B, 2D)
        if mask is not None:
            h = h * mask.repeat(1, 2)
        h = self.b(h) * scale
        return _pack(self.out, self.d(torch.relu(self.c(torch.relu(h)))), h)


class Positional(_Body):
    def forward(self, x: torch.Tensor) -> Any:
        return self.body(x)


class KeywordMask(_Body):
    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> Any:
        return self.body(x, mask)


class PositionalMask(_Body):
    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> Any:
        return self.body(x, mask)


class Scaled(_Body):
    def forward(self, x: torch.Tensor, scale: float = 1.0, use_mask: bool = False) -> Any:
        return self.body(x, torch.ones_like(x) if use_mask else None, scale)


class DictInput(_Body):
    def forward(self, batch: dict[str, torch.Tensor]) -> Any:
        return self.body(batch["x"], batch["mask"])


class Attention(_Body):
    """A module that returns a tuple inside the graph: nn.MultiheadAttention gives (output, weights)."""

    def __init__(self, out: str) -> None:
        super().__init__(out)
        self.attn = torch.nn.MultiheadAttention(D, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> Any:
        seq = x.view(x.shape[0], 2, D // 2).repeat(1, 1, 2)  # (B, 2, D)
        y, _ = self.attn(seq, seq, seq)
        return self.body(x + y.mean(1))


class Gate(torch.nn.Module):
    """Control flow on a tensor's value: neither fx nor export can trace it, as one op (leaf) it runs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.abs().mean() > 10:
            return x.clamp(-10, 10)
        return x


class Leaf(_Body):
    def __init__(self, out: str) -> None:
        super().__init__(out)
        self.gate = Gate()

    def forward(self, x: torch.Tensor) -> Any:
        return self.body(self.gate(x))


class Constant(_Body):
    """A tensor constant in forward (fx registers it on the module it traces) and a parameter
    under two names (`tied` is `a`)."""

    def __init__(self, out: str) -> None:
        super().__init__(out)
        self.tied = self.a

    def forward(self, x: torch.Tensor) -> Any:
        return self.body(x + torch.tensor([0.5, -0.5] * (D // 2)) + 0.1 * self.tied(x)[:, :D])


CALLS = {"positional": Positional, "keyword": KeywordMask, "positional2": PositionalMask, "constants": Scaled,
         "dict_input": DictInput, "attention": Attention, "leaf": Leaf, "constant": Constant}
BASE_CALLS = ("positional", "keyword", "positional2", "constants", "dict_input")


def _inputs(call: str, x: torch.Tensor, mask: torch.Tensor) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """(args, kwargs) of a call of kind `call`."""
    return {"positional": lambda: ((x,), {}), "keyword": lambda: ((x,), {"mask": mask}),
            "positional2": lambda: ((x, mask), {}), "constants": lambda: ((x,), {"scale": 0.5, "use_mask": True}),
            "dict_input": lambda: (({"x": x, "mask": mask},), {})}.get(call, lambda: ((x,), {}))()


class _Batches:
    def __init__(self, call: str) -> None:
        self.call = call

    def __call__(self, batch_size: int, step: int) -> tuple[tuple[Any, ...], dict[str, Any], torch.Tensor]:
        g = torch.Generator().manual_seed(100 + step)
        x = torch.randn(batch_size, D, generator=g)
        mask = (torch.rand(batch_size, D, generator=g) > 0.3).float()
        args, kwargs = _inputs(self.call, x, mask)
        return args, kwargs, torch.randn(batch_size, D, generator=g)


def workload(call: str, out: str, seed: int = 0) -> Workload:
    torch.manual_seed(seed)
    model = CALLS[call](out)
    batch = _Batches(call)
    args, kwargs, _ = batch(2, 0)
    return Workload(name=f"{call}-{out}", model=model, example_args=args, example_kwargs=kwargs,
                    loss_fn=LOSSES[out], make_batch=batch, microbatch_size=2,
                    leaf_modules=(Gate,) if call == "leaf" else ())


def cases() -> list[tuple[str, str]]:
    """Every (call, output) combination of the plain calls (5 x 8 = 40), and the models with
    tuple-returning modules, a leaf module and tensor constants with two output kinds each."""
    special = [c for c in CALLS if c not in BASE_CALLS]
    return list(itertools.product(BASE_CALLS, OUTPUTS)) + list(itertools.product(special, ("tuple2", "modeloutput")))
