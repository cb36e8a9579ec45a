"""Per-node costs of a traced model: output bytes, parameters, bytes saved for backward, fwd/bwd time."""
from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["NodeCost", "node_costs", "preserve_state", "param_names", "FLOP_PER_MS", "BYTES_PER_MS"]

# The "flops" cost model's notional device: 20 GFLOP/s and 5 GB/s of memory traffic (a CPU
# core). Only ratios between nodes matter to the partitioner, and they are deterministic.
FLOP_PER_MS = 2.0e7
BYTES_PER_MS = 5.0e6


@dataclass
class NodeCost:
    """What one fx node costs. Bytes are per microbatch; times in milliseconds."""
    fwd_ms: float = 0.0
    bwd_ms: float = 0.0
    out_bytes: int = 0            # bytes of the tensors the node outputs
    is_tensor: bool = False       # the output is one tensor (may cross a stage boundary)
    requires_grad: bool = False   # the output is part of the autograd graph
    shape: tuple[int, ...] = ()
    dtype: str = ""
    saved_bytes: int = 0          # bytes saved for backward that are neither inputs, outputs nor params
    saves_output: bool = False    # backward keeps this node's output alive
    saved_inputs: set[str] = field(default_factory=set)  # input nodes whose values backward keeps
    params: tuple[str, ...] = ()  # canonical names of the parameters it reads
    buffer_bytes: int = 0         # bytes of buffers and constant tensors it reads


@contextlib.contextmanager
def preserve_state(module: torch.nn.Module) -> Iterator[None]:
    """Restore the module's buffers (e.g. batch-norm statistics), parameter grads and the RNG state."""
    saved = {n: b.detach().clone() for n, b in module.named_buffers()}
    grads = {n: p.grad for n, p in module.named_parameters()}
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        try:
            yield
        finally:
            for n, b in module.named_buffers():
                if n in saved:
                    b.copy_(saved[n])
            for n, p in module.named_parameters():
                p.grad = grads.get(n)


def param_names(model: torch.nn.Module) -> dict[int, str]:
    """id(parameter) -> its canonical name: the first name `named_parameters()` gives it."""
    return {id(p): n for n, p in model.named_parameters()}


def _fetch(gm: torch.fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _callable(gm: torch.fx.GraphModule, node: torch.fx.Node) -> Callable[..., Any]:
    if node.op == "call_module":
        return gm.get_submodule(str(node.target))
    if node.op == "call_method":
        name = str(node.target)
        return lambda self, *a, **k: getattr(self, name)(*a, **k)
    assert node.op == "call_function"
    return node.target  # type: ignore[return-value]


def _tensors(x: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]


def _nbytes(ts: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _node_params(gm: torch.fx.GraphModule, node: torch.fx.Node, names: dict[int, str]) -> tuple[list[str], int]:
    params: list[str] = []
    buffers = 0
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        params += [names[id(p)] for p in mod.parameters() if id(p) in names]
        buffers += _nbytes(list(mod.buffers()))
    for a in node.all_input_nodes:
        if a.op == "get_attr":
            v = _fetch(gm, str(a.target))
            if isinstance(v, torch.nn.Parameter) and id(v) in names:
                params.append(names[id(v)])
            else:
                buffers += _nbytes(_tensors(v))
    return sorted(set(params)), buffers


def _forward_values(gm: torch.fx.GraphModule, flat_inputs: list[Any]) -> dict[str, Any]:
    """Run the graph once with autograd on; every node's value by node name."""
    env: dict[str, Any] = {}
    placeholders = iter(flat_inputs)
    with torch.enable_grad():
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                env[node.name] = next(placeholders)
            elif node.op == "get_attr":
                env[node.name] = _fetch(gm, str(node.target))
            elif node.op != "output":
                args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: env[n.name])
                env[node.name] = _callable(gm, node)(*args, **kwargs)
    return env


def _profile(gm: torch.fx.GraphModule, node: torch.fx.Node, env: dict[str, Any], cost: "NodeCost",
             mode: str, repeats: int) -> None:
    fn = _callable(gm, node)
    param_ptrs = {p.untyped_storage().data_ptr() for p in gm.parameters()}

    def inputs() -> tuple[tuple[Any, ...], dict[str, Any], dict[int, str]]:
        ptrs: dict[int, str] = {}

        def prep(n: torch.fx.Node) -> Any:
            v = env[n.name]
            if n.op == "get_attr" or not isinstance(v, torch.Tensor):
                return v
            t = v.detach().requires_grad_(v.requires_grad)
            t = t.clone() if t.requires_grad else t  # a non-leaf, so in-place ops are allowed
            ptrs[t.untyped_storage().data_ptr()] = n.name
            return t
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), prep)
        return args, kwargs, ptrs

    fwd: list[float] = []
    bwd: list[float] = []
    for i in range(repeats + 1):
        args, kwargs, in_ptrs = inputs()
        saved: list[torch.Tensor] = []
        counter = FlopCounterMode(display=False) if mode == "flops" else contextlib.nullcontext()
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(
                lambda t: saved.append(t) or t, lambda t: t), counter:
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            t1 = time.perf_counter()
        fwd_flops = counter.get_total_flops() if isinstance(counter, FlopCounterMode) else 0
        outs = [t for t in _tensors(out) if t.requires_grad]
        counter = FlopCounterMode(display=False) if mode == "flops" else contextlib.nullcontext()
        t2 = t3 = 0.0
        if outs:
            grads = [torch.ones_like(t) for t in outs]
            with counter:
                t2 = time.perf_counter()
                torch.autograd.backward(outs, grads)
                t3 = time.perf_counter()
        bwd_flops = counter.get_total_flops() if isinstance(counter, FlopCounterMode) else 0
        if i == 0:  # the first run warms up; it also tells what backward saves
            _classify_saved(cost, saved, in_ptrs, param_ptrs, _tensors(out))
            if mode == "flops":
                moved = cost.out_bytes + sum(_nbytes(_tensors(env[a.name])) for a in node.all_input_nodes)
                cost.fwd_ms = fwd_flops / FLOP_PER_MS + moved / BYTES_PER_MS
                cost.bwd_ms = (bwd_flops / FLOP_PER_MS + 2 * moved / BYTES_PER_MS) if outs else 0.0
                return
            continue
        fwd.append((t1 - t0) * 1e3)
        bwd.append((t3 - t2) * 1e3)
    cost.fwd_ms = statistics.median(fwd)
    cost.bwd_ms = statistics.median(bwd)


def _classify_saved(cost: NodeCost, saved: list[torch.Tensor], in_ptrs: dict[int, str],
                    param_ptrs: set[int], outs: list[torch.Tensor]) -> None:
    out_ptrs = {t.untyped_storage().data_ptr() for t in outs}
    seen: set[int] = set()
    for t in saved:
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen or ptr in param_ptrs:
            continue
        seen.add(ptr)
        if ptr in in_ptrs:
            cost.saved_inputs.add(in_ptrs[ptr])
        elif ptr in out_ptrs:
            cost.saves_output = True
        else:
            cost.saved_bytes += t.untyped_storage().nbytes()


def node_costs(gm: torch.fx.GraphModule, flat_inputs: list[Any], *, cost: str = "measured",
               names: dict[int, str] | None = None, repeats: int = 5) -> dict[str, NodeCost]:
    """Cost of every call node of `gm` on one example microbatch.

    cost="measured" times each node's forward and backward in isolation (median of
    `repeats` after a warm-up) on the inputs' device; cost="flops" counts FLOPs and bytes
    moved (deterministic). Saved-for-backward bytes are observed with saved_tensors_hooks
    and attributed once: to the node that allocated them, or to the producer of a saved input.
    """
    if cost not in ("measured", "flops"):
        raise ValueError(f"cost must be 'measured' or 'flops', got {cost!r}")
    names = names if names is not None else param_names(gm)
    out: dict[str, NodeCost] = {}
    with preserve_state(gm):
        env = _forward_values(gm, flat_inputs)
        for node in gm.graph.nodes:
            if node.op not in ("call_function", "call_method", "call_module"):
                continue
            value = env[node.name]
            ts = _tensors(value)
            params, buffers = _node_params(gm, node, names)
            c = NodeCost(out_bytes=_nbytes(ts), is_tensor=isinstance(value, torch.Tensor),
                         requires_grad=any(t.requires_grad for t in ts), params=tuple(params),
                         buffer_bytes=buffers)
            if isinstance(value, torch.Tensor):
                c.shape, c.dtype = tuple(value.shape), str(value.dtype).removeprefix("torch.")
            _profile(gm, node, env, c, cost, repeats)
            out[node.name] = c
    return out
