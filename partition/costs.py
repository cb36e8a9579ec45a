"""Per-node costs of a traced model: output bytes, parameters, bytes saved for backward, fwd/bwd time."""
from __future__ import annotations

import collections
import contextlib
import copy
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterator

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from partition.products import PRODUCTS, REFERENCE, product_flops, product_ratio

__all__ = ["COSTS", "NodeCost", "node_costs", "measure_once", "preserve_state", "param_names", "whole_graph_ms",
           "time_nodes", "FLOP_PER_MS", "BYTES_PER_MS"]

# How a plan's node costs can be found: timed op by op ("measured"), counted ("flops"), or counted with
# each matrix product priced by its shape's measured speed ("shaped")
COSTS = ("measured", "flops", "shaped")

# The "flops" cost model's notional device: 20 GFLOP/s and 5 GB/s of memory traffic (a CPU
# core). Only ratios between nodes matter to the partitioner, and they are deterministic.
FLOP_PER_MS = 2.0e7
BYTES_PER_MS = 5.0e6


@dataclass
class NodeCost:
    """What one fx node costs. Bytes are per microbatch; times in milliseconds.

    `saved` names every storage the node's backward keeps alive: the storage id is the
    node that allocated it (`"add_3"`, `"split#1"` for its second output storage) or, for a
    temporary only backward sees, `"mm@0"`. Several nodes saving one storage share its id,
    so a stage's activation memory is the sum over the distinct ids its nodes save.
    """
    fwd_ms: float = 0.0
    bwd_ms: float = 0.0
    out_bytes: int = 0            # bytes of the tensors the node outputs
    is_tensor: bool = False       # the output is one tensor (may cross a stage boundary)
    requires_grad: bool = False   # the output is part of the autograd graph
    shape: tuple[int, ...] = ()
    stride: tuple[int, ...] = ()
    dtype: str = ""
    saved: dict[str, int] = field(default_factory=dict)  # storage id -> bytes, kept for backward
    saved_bytes: int = 0          # of `saved`: temporaries the node allocated and only backward sees
    saves_output: bool = False    # of `saved`: the node's own output
    saved_inputs: set[str] = field(default_factory=set)  # of `saved`: nodes whose storages it keeps
    params: tuple[str, ...] = ()  # canonical names of the parameters it reads
    buffer_bytes: int = 0         # bytes of buffers and constant tensors it reads
    storage: str = ""             # the storage id its (first) output tensor lives in: a view's is its base's
    ref_ms: float = 0.0           # forward + backward by the FLOP model (deterministic): measured plans' tie-break


def storage_owner(sid: str) -> str:
    """The fx node that allocated a storage id of `NodeCost.saved`."""
    return sid.split("@")[0].split("#")[0]


@contextlib.contextmanager
def preserve_state(module: torch.nn.Module) -> Iterator[None]:
    """Leave the module as it was: its buffers' values (e.g. batch-norm statistics), parameter
    grads, training modes, the RNG state, its attributes (a tracer that registers a tensor
    constant on the module it traces has it removed again; one the forward sets, set back) and
    its hooks (a model that installs hooks on its first call, as Hugging Face's output capture
    does, has them removed: left, they would capture twice on the user's next call)."""
    saved = {n: b.detach().clone() for n, b in module.named_buffers()}
    grads = {n: p.grad for n, p in module.named_parameters()}
    mods = list(module.modules())
    kinds = ("_parameters", "_buffers", "_modules")
    shape = [(m.training, dict(vars(m)), {k: copy.copy(v) for k, v in vars(m).items() if type(v) in (dict, list, set)
                                         or isinstance(v, collections.OrderedDict)},
              set(m._parameters), set(m._buffers), set(m._modules)) for m in mods]
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            for m, (training, attrs, tables, params, bufs, subs) in zip(mods, shape):
                for d, keep in ((vars(m), attrs), (m._parameters, params), (m._buffers, bufs), (m._modules, subs)):
                    for k in [k for k in d if k not in keep]:
                        del d[k]
                for k, v in attrs.items():  # values the run replaced (an fx Proxy, a counter)
                    if k not in kinds and vars(m).get(k, v) is not v:
                        vars(m)[k] = v
                for k, table in tables.items():  # hook tables, containers the module holds, changed in place
                    now = vars(m).get(k)
                    if k in kinds or "hooks" in k:  # what the run added goes; what it removed (a lazy module's
                        if isinstance(now, dict):  # initializing hook, its parameters made) stays as it is
                            for x in [x for x in now if x not in table]:
                                del now[x]
                    elif isinstance(now, dict) and isinstance(table, dict) and (
                            now.keys() != table.keys() or any(now[x] is not table[x] for x in table)):
                        now.clear()
                        now.update(table)
                    elif isinstance(now, list) and isinstance(table, list) and (
                            len(now) != len(table) or any(a is not b for a, b in zip(now, table))):
                        now[:] = table
                    elif isinstance(now, set) and isinstance(table, set) and now != table:
                        now.clear()
                        now.update(table)
                m.training = training
            with torch.no_grad():
                for n, b in module.named_buffers():
                    if n in saved:
                        b.copy_(saved[n])
                for n, p in module.named_parameters():
                    p.grad = grads.get(n)


def param_names(model: torch.nn.Module) -> dict[int, str]:
    """id(parameter) -> its canonical name: the first name `named_parameters()` gives it."""
    return {id(p): n for n, p in model.named_parameters()}


def attr_of(gm: torch.nn.Module, target: str) -> Any:
    """The attribute a get_attr target names ("layers.0.weight"), from `gm` down."""
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def node_callable(gm: torch.fx.GraphModule, node: torch.fx.Node) -> Callable[..., Any]:
    """What a call node calls: its submodule, a method of its first argument, or its function."""
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
            v = attr_of(gm, str(a.target))
            if isinstance(v, torch.nn.Parameter) and id(v) in names:
                params.append(names[id(v)])
            else:
                buffers += _nbytes(_tensors(v))
    return sorted(set(params)), buffers


def _is_call(node: torch.fx.Node) -> bool:
    return node.op in ("call_function", "call_method", "call_module")


def _grad_outputs(value: Any) -> list[torch.Tensor]:
    return [t for t in _tensors(value) if t.requires_grad and t.is_floating_point()]


@dataclass
class _Pass:
    """One forward pass of the whole graph, node by node, with what it observed."""
    env: dict[str, Any]
    fwd_ms: dict[str, float]
    saved: dict[str, dict[str, int]]          # node -> storage id -> bytes
    storage: dict[str, str]                   # node -> storage id of its first output tensor
    fn_owner: dict[Any, str]                  # autograd node -> the fx node whose forward made it
    outputs: list[torch.Tensor]               # model outputs that backward starts from


def storage_key(t: torch.Tensor) -> int:
    """The identity of a tensor's storage, shared by its views; also on the meta device, where
    every storage's data pointer is 0."""
    return int(t.untyped_storage()._cdata)


class _Storages:
    """Names every storage a pass allocates after the node that allocated it."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        self.skip = {storage_key(t) for t in [*gm.parameters(), *gm.buffers()]}
        self.owner: dict[int, str] = {}
        self.size: dict[str, int] = {}
        self.count: dict[tuple[str, bool], int] = {}

    def add(self, name: str, value: Any, temporary: bool = False) -> list[str]:
        ids = []
        for t in _tensors(value):
            st = t.untyped_storage()
            ptr = storage_key(t)
            if ptr in self.skip or st.nbytes() == 0:
                continue
            if ptr not in self.owner:
                k = self.count.get((name, temporary), 0)
                self.count[(name, temporary)] = k + 1
                sid = f"{name}@{k}" if temporary else (name if k == 0 else f"{name}#{k}")
                self.owner[ptr] = sid
                self.size[sid] = st.nbytes()
            ids.append(self.owner[ptr])
        return ids


def _claim(name: str, value: Any, fn_owner: dict[Any, str]) -> None:
    """Mark the autograd nodes first reachable from this fx node's outputs as its backward."""
    todo: list[Any] = [t.grad_fn for t in _tensors(value) if t.grad_fn is not None]
    while todo:
        fn = todo.pop()
        if fn is None or fn in fn_owner:
            continue
        fn_owner[fn] = name
        todo.extend(f for f, _ in fn.next_functions)


def _clock(module: Any, inputs: list[Any]) -> Callable[[], float]:
    """perf_counter, after waiting for the GPU when the work runs there (kernels start asynchronously)."""
    owner = getattr(module, "__self__", module)
    params = list(owner.parameters()) if isinstance(owner, torch.nn.Module) else []
    if not any(t.is_cuda for t in _tensors((params, inputs))):
        return time.perf_counter

    def now() -> float:
        torch.cuda.synchronize()
        return time.perf_counter()
    return now


def _forward(gm: torch.fx.GraphModule, flat_inputs: list[Any], *, observe_saved: bool,
             clock: Callable[[], float] = time.perf_counter) -> _Pass:
    """Run the graph once with autograd on, timing each node and claiming its autograd nodes."""
    p = _Pass(env={}, fwd_ms={}, saved={}, storage={}, fn_owner={}, outputs=[])
    storages = _Storages(gm)
    packed: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(t)
        # an alias without autograd history: the node's own output saved as itself would close a
        # reference cycle through autograd's C++ graph (output -> grad_fn -> saved output), which
        # Python's collector cannot free, and every activation and parameter of the pass would leak
        return t.detach()

    hooks = (torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if observe_saved
             else contextlib.nullcontext())
    placeholders = iter(flat_inputs)
    env = p.env
    with torch.enable_grad(), hooks:
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                env[node.name] = next(placeholders)
                storages.add(node.name, env[node.name])
            elif node.op == "get_attr":
                env[node.name] = attr_of(gm, str(node.target))
                storages.skip |= {storage_key(t) for t in _tensors(env[node.name])}
            elif node.op == "output":
                p.outputs = _grad_outputs(torch.fx.node.map_arg(node.args[0], lambda n: env[n.name]))
            else:
                args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: env[n.name])
                fn = node_callable(gm, node)
                packed.clear()
                t0 = clock()
                value = fn(*args, **kwargs)
                p.fwd_ms[node.name] = (clock() - t0) * 1e3
                env[node.name] = value
                _claim(node.name, value, p.fn_owner)
                if observe_saved:
                    p.storage[node.name] = next(iter(storages.add(node.name, value)), "")
                    ids = storages.add(node.name, packed, temporary=True)
                    packed.clear()  # autograd keeps the hooks, so a tensor left here would keep its graph
                    p.saved[node.name] = {sid: storages.size[sid] for sid in ids}
    return p


SHARED = ""  # _backward_ms's key for the gradient accumulation of parameters several nodes read


def _backward_ms(p: _Pass, clock: Callable[[], float] = time.perf_counter,
                 shared: frozenset[int] = frozenset()) -> dict[str, float]:
    """Backward from the pass's outputs; the time since the previous autograd node finished goes to
    the fx node that owns the autograd node finishing now (single-threaded CPU engine order).

    The accumulation of a parameter in `shared` (ids of tied weights) goes to SHARED instead: in
    one graph it sums the grads of all its readers, while a pipeline sums them across stages
    once per step (an all-reduce), so no stage does that work per microbatch.
    """
    marks: list[tuple[str, float]] = []

    def owner(fn: Any, u: str) -> str:
        return SHARED if id(getattr(fn, "variable", None)) in shared else u
    handles = [fn.register_hook(lambda *_, u=owner(fn, u): marks.append((u, clock())))
               for fn, u in p.fn_owner.items()]
    grads = [torch.ones_like(t) for t in p.outputs]
    try:
        t0 = clock()
        if p.outputs:
            torch.autograd.backward(p.outputs, grads)
    finally:
        for h in handles:
            h.remove()
    out: dict[str, float] = {}
    for u, t in marks:
        out[u] = out.get(u, 0.0) + (t - t0) * 1e3
        t0 = t
    return out


def _clean_once(module: Callable[..., Any], inputs: list[Any], clock: Callable[[], float] = time.perf_counter,
                calls: int = 1, held: list[int] | None = None) -> tuple[float, float]:
    """Forward and backward ms of one uninstrumented call, backward from ones on its float outputs; with
    `calls` > 1, per call of that many made back to back between two reads of the clock (forwards, then
    their backwards): on a GPU the host then runs ahead of the device as in a step, and the latency of
    starting the device and of waiting for it is shared by the calls instead of priced into each.
    `held` (CUDA): gets the device bytes the forwards keep for their backwards."""
    before = torch.cuda.memory_allocated() if held is not None else 0
    with torch.enable_grad():
        t0 = clock()
        outs = [_grad_outputs(module(*inputs)) for _ in range(calls)]
        t1 = clock()
    if held is not None:
        held.append(torch.cuda.memory_allocated() - before)
    grads = [[torch.ones_like(t) for t in o] for o in outs]
    t2 = clock()
    for o, g in zip(outs, grads):
        if o:
            torch.autograd.backward(o, g)
    return (t1 - t0) * 1e3 / calls, (clock() - t2) * 1e3 / calls


def back_to_back(clean_ms: float, synced: bool, held_bytes: int = 0, free_bytes: int = 0, target_ms: float = 25.0,
                 most: int = 32) -> int:
    """How many calls _clean_once makes of a graph whose one call took `clean_ms` (forward and backward):
    one where the clock does not wait for a device (`synced` False: the CPU), else enough to fill
    `target_ms`, at most `most`, and no more than a quarter of the device's `free_bytes` holds of the
    `held_bytes` each call's forward keeps. On an H200 a model's costs measured unit by unit
    (partition.measure), each unit timed alone between two waits, came to 1.6x the whole graph's
    (bench/gpu_check.py: costs): a unit's many small kernels at the start of its backward wait for the
    host to launch them, a wait that a step hides behind the kernels queued before. With 2 ms of calls
    it was still 1.13x forward and 1.52x backward (a transformer block's 2 ms took one call); a whole
    graph of 20 ms, one call, was within 10% of the step's actions."""
    if not synced or clean_ms <= 0:
        return 1
    fits = free_bytes // (4 * held_bytes) if held_bytes > 0 else most
    return max(1, min(most, fits, math.ceil(target_ms / clean_ms)))


def whole_graph_ms(module: Callable[..., Any], inputs: list[Any], repeats: int = 5,
                   warmup: int = 1) -> tuple[float, float]:
    """Median forward and backward ms of `module(*inputs)` after `warmup` calls (at least one), per call of
    the clean runs (on a GPU several back to back: back_to_back).

    For a traced model pass `gm.forward`, which takes the placeholders in order (torch.export's
    module checks, in a hook, that it is called as the model was).
    """
    clock = _clock(module, inputs)
    _, calls = _first_clean(module, inputs, clock)
    more = max(warmup, 1) - 1  # warm-ups after the first
    runs = [_clean_once(module, inputs, clock, calls) for _ in range(repeats + more)][more:]
    return statistics.median(f for f, _ in runs), statistics.median(b for _, b in runs)


def _first_clean(module: Callable[..., Any], inputs: list[Any], clock: Callable[[], float]
                 ) -> tuple[tuple[float, float], int]:
    """A first clean call (a warm-up) and how many calls the next clean runs make back to back (back_to_back:
    one on the CPU; on a GPU from its time and the device memory its forward kept)."""
    synced = clock is not time.perf_counter  # (a CUDA clock: _clock)
    held: list[int] | None = [] if synced else None
    first = _clean_once(module, inputs, clock, 1, held)
    if not held:
        return first, 1
    return first, back_to_back(sum(first), synced, held[0], torch.cuda.mem_get_info()[0])


def _fit(times: dict[str, float], total: float) -> dict[str, float]:
    """Per-node times that add up to a clean measurement of the whole graph.

    The node-by-node run pays a fixed interpreter (or hook) overhead per node that the
    generated code does not; it is taken off every node equally, then any remaining
    difference is spread in proportion. A clean total below 1/20 of the nodes' sum is no
    measurement of them (on a loaded machine the backward's, the clean pass's less the shared
    weights' accumulation, came out at 0 or below, and stages holding transformer blocks were
    priced a backward of 0 ms, found by review): the nodes are fitted to that floor.
    """
    n = sum(1 for t in times.values() if t > 0)
    if n == 0:
        return {u: 0.0 for u in times}
    total = max(total, 0.05 * sum(times.values()))
    extra = max(sum(times.values()) - total, 0.0) / n
    lowered = {u: max(t - extra, 0.05 * t) for u, t in times.items()}
    s = sum(lowered.values())
    return {u: t * total / s if s > 0 else 0.0 for u, t in lowered.items()}


def time_nodes(gm: torch.fx.GraphModule, flat_inputs: list[Any], costs: dict[str, NodeCost], repeats: int) -> None:
    """Measured fwd/bwd ms of the nodes in `costs` (in place): node_costs' timing without its observed
    pass, for a caller that has the bytes already; no tied weights are set apart."""
    _measure(gm, flat_inputs, costs, repeats, frozenset())


def _measure(gm: torch.fx.GraphModule, flat_inputs: list[Any], costs: dict[str, NodeCost], repeats: int,
             shared: frozenset[int]) -> None:
    """Node-by-node passes alternate with clean passes, so a change in load hits both alike."""
    fwd_runs: list[dict[str, float]] = []
    bwd_runs: list[dict[str, float]] = []
    clean: list[tuple[float, float]] = []
    clock = _clock(gm, flat_inputs)
    calls = 1  # the clean pass's calls back to back, from the warm-up round's time
    for i in range(repeats + 1):
        p = _forward(gm, flat_inputs, observe_saved=False, clock=clock)
        bwd = _backward_ms(p, clock, shared)
        fwd = p.fwd_ms
        del p  # its values would crowd the clean pass's memory
        if not i:  # the first round warms up
            _, calls = _first_clean(gm.forward, flat_inputs, clock)
            continue
        fwd_runs.append(fwd)
        bwd_runs.append(bwd)
        clean.append(_clean_once(gm.forward, flat_inputs, clock, calls))
    fwd = _fit({u: statistics.median(r.get(u, 0.0) for r in fwd_runs) for u in costs},
               statistics.median(f for f, _ in clean))
    bwd = _fit({u: statistics.median(r.get(u, 0.0) for r in bwd_runs) for u in costs},
               statistics.median(b for _, b in clean) - statistics.median(r.get(SHARED, 0.0) for r in bwd_runs))
    for u, c in costs.items():
        c.fwd_ms, c.bwd_ms = fwd[u], bwd[u]


class _Traffic(TorchDispatchMode):
    """Bytes of memory traffic under it: each aten op's tensor inputs read and outputs written.
    Views (a reshape that needs no copy, a transpose, a slice) move nothing; an in-place op reads
    and writes its tensor; a new uninitialised tensor is written by the op that fills it. Also the
    work of elementwise functions beyond their traffic (exp, tanh, erf...), as FLOPs (`flops`):
    _ELEMENT_FLOPS per element of the op's largest tensor; and CPU attention's products (_CPU_ATTENTION).
    With `shaped`, each matrix product is priced apart (`product_ms`: its measured time over the
    reference product's, times the reference's notional price; partition.products) and its FLOPs
    (`product_flops`, to take off the FLOP counter's total) and traffic are not counted."""

    def __init__(self, shaped: bool = False, device: torch.device | None = None) -> None:
        super().__init__()
        self.device = device
        self.bytes = 0
        self.flops = 0.0
        self.shaped = shaped
        self.product_ms = 0.0
        self.product_flops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func._schema.name
        if func.is_view or name in _ALIASING or name.startswith(("aten::empty", "aten::new_empty")):
            return out
        if self.shaped and name in PRODUCTS:
            self.product_ms += product_ratio(func, args, kwargs or {}, self.device) * _REFERENCE_MS
            self.product_flops += product_flops(name, args)
            return out
        per = _ELEMENT_FLOPS.get(name)
        if name in _CPU_ATTENTION:
            q, k, v = args[_CPU_ATTENTION[name][0]:_CPU_ATTENTION[name][0] + 3]
            self.flops += _CPU_ATTENTION[name][1] * 2 * q.shape[:-1].numel() * k.shape[-2] * (q.shape[-1] + v.shape[-1])
        elif per is not None:
            if name == "aten::gelu" and (kwargs or {}).get("approximate", args[1] if len(args) > 1 else "none") \
                    == "tanh":
                per = _ELEMENT_FLOPS["aten::tanh"]
            self.flops += per * max((t.numel() for t in _tensors((args, kwargs, out))), default=0)
        written = _nbytes(_tensors(out))
        if name in _GATHERS:  # reads the rows it returns, and its indices
            self.bytes += 2 * written + _nbytes([t for t in _tensors((args, kwargs)) if not t.is_floating_point()])
        else:
            self.bytes += _nbytes(_tensors((args, kwargs))) + written
        return out


# What an elementwise function costs beyond its memory traffic, in FLOPs per element (of its largest
# tensor: a row reduction's input): the measured time of each on one CPU core (torch 2.13, 2.7M float32
# elements) over what the same core takes per FLOP in a linear layer, less the op's traffic price. A
# multiply or an add costs its traffic alone; these run 2-10x theirs (tanh 2.8 ns per element against an
# add's 0.27). Ops absent cost their traffic.
_ELEMENT_FLOPS = {"aten::exp": 30.0, "aten::exp_": 30.0, "aten::log": 40.0, "aten::log_": 40.0,
                  "aten::tanh": 170.0, "aten::erf": 70.0, "aten::gelu": 12.0, "aten::gelu_backward": 40.0,
                  "aten::_softmax": 20.0, "aten::_log_softmax": 24.0, "aten::logsumexp": 80.0}

# CPU's fused attention, which torch's FlopCounterMode has no formula for: (index of the query among the
# op's arguments, products relative to the forward's two, Q K^T and P V). Its backward makes P again and
# four products of that size (2.5x); measured on one core it runs 2.7-4.5x the forward's time.
_CPU_ATTENTION = {"aten::_scaled_dot_product_flash_attention_for_cpu": (0, 1.0),
                  "aten::_scaled_dot_product_flash_attention_for_cpu_backward": (1, 3.0)}

# the notional price of partition.products' reference product (float32): its FLOPs and its traffic
_REFERENCE_MS = (2 * REFERENCE[0] * REFERENCE[1] * REFERENCE[2] / FLOP_PER_MS
                 + 4 * (REFERENCE[0] * REFERENCE[1] + REFERENCE[1] * REFERENCE[2] + REFERENCE[0] * REFERENCE[2])
                 / BYTES_PER_MS)

# aten ops that return their input's storage though not declared views (reshape's copy-free path)
_ALIASING = frozenset({"aten::_unsafe_view", "aten::lift_fresh", "aten::_reshape_alias"})
# aten ops that read only the rows of a table their indices pick (an embedding reads a few of its rows)
_GATHERS = frozenset({"aten::embedding", "aten::index_select", "aten::gather", "aten::index"})


# _count_flops's answers by what decides them (_counted_as): a model's layers repeat the same ops on the same shapes,
# and a plan analyses its graph again with rewrites (partition.planner.Analysis.with_rewrites)
_COUNTED: dict[Hashable, tuple[float, float]] = {}
# modules whose work is decided by their type, repr, mode and tensors' shapes (a user's module may read anything)
_PLAIN_MODULES = (torch.nn.Linear, torch.nn.Bilinear, torch.nn.Embedding, torch.nn.LayerNorm, torch.nn.GroupNorm,
                  torch.nn.RMSNorm, torch.nn.modules.batchnorm._BatchNorm, torch.nn.modules.conv._ConvNd,
                  torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Identity, torch.nn.GELU,
                  torch.nn.ReLU, torch.nn.SiLU, torch.nn.Tanh, torch.nn.Sigmoid, torch.nn.Softmax, torch.nn.LogSoftmax,
                  torch.nn.modules.pooling._MaxPoolNd, torch.nn.modules.pooling._AvgPoolNd,
                  torch.nn.modules.pooling._AdaptiveAvgPoolNd, torch.nn.Flatten)


# the modules of the functions a graph calls that are torch's own (and Python's operators)
_TORCH_FUNCTIONS = frozenset({"torch", "torch.functional", "torch.nn.functional", "torch._C._nn", "_operator",
                              "operator", "torch._C._VariableFunctions", "torch.fft", "torch.linalg", "torch.special"})


class _Unkeyed(Exception):
    """A value _signature cannot key."""


def _signature(x: Any) -> Hashable:
    """What of `x` a node's FLOPs and traffic can depend on: a tensor's kind, shape, strides, dtype, device and
    whether it requires grad (not its values; a mask's are refused: index_put's backward selects as many elements as
    it sets); a plain value itself."""
    if isinstance(x, torch.Tensor):
        if x.layout != torch.strided or x.dtype == torch.bool:
            raise _Unkeyed
        return type(x), tuple(x.shape), x.stride(), x.dtype, x.device.type, x.requires_grad
    if isinstance(x, (list, tuple)):
        return type(x), tuple(_signature(y) for y in x)
    if isinstance(x, dict):
        return dict, tuple((k, _signature(v)) for k, v in x.items())
    if isinstance(x, slice):
        return slice, _signature(x.start), _signature(x.stop), _signature(x.step)
    if x is None or isinstance(x, (bool, int, float, str, torch.dtype, torch.device, torch.memory_format,
                                   torch.layout)):
        return type(x), x
    raise _Unkeyed


def _counted_as(gm: torch.fx.GraphModule, node: torch.fx.Node, env: dict[str, Any], shaped: bool,
                device: torch.device | None) -> Hashable | None:
    """What decides _count_flops's answer for `node`: what it calls, the signatures of its inputs and of the
    output it gave (an output sized by the values, a mask's selection, is told apart by that), the pricing; None
    where that is not known (a user's module or function, a mask, a value without a signature)."""
    try:
        if node.op == "call_module":
            mod = gm.get_submodule(str(node.target))
            hooked = any(getattr(mod, h) for h in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                                                   "_backward_pre_hooks"))
            if hooked or not type(mod).__module__.startswith("torch.nn.modules.") or \
                    not isinstance(mod, _PLAIN_MODULES):  # (a parametrized layer's class is made elsewhere)
                return None
            what: Hashable = (type(mod), repr(mod), mod.training,
                              tuple(_signature(t) for t in (*mod.parameters(), *mod.buffers())))
        elif node.op == "call_method" or isinstance(node.target, (torch._ops.OpOverload,
                                                                  torch._ops.OpOverloadPacket)) or \
                getattr(node.target, "__module__", None) in _TORCH_FUNCTIONS:
            what = (node.op, node.target)
            hash(what)
        else:  # (a user's function, torch.fx.wrap's leaf, may do any work its values decide)
            return None
        inputs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: env[n.name])
        return what, _signature(inputs), _signature(env[node.name]), shaped, str(device)
    except (_Unkeyed, TypeError):
        return None


def _count_flops(gm: torch.fx.GraphModule, node: torch.fx.Node, env: dict[str, Any], cost: NodeCost,
                 shaped: bool = False, device: torch.device | None = None) -> tuple[float, float]:
    """The node's forward and backward run in isolation: their FLOPs and the bytes their aten ops
    read and write (views none), as (fwd, bwd) ms of the notional device; with `shaped`, its matrix
    products priced by their shapes' measured speed on `device` (default: their tensors'; _Traffic). Counted once
    for each op, module and signature of its inputs (_counted_as)."""
    key = _counted_as(gm, node, env, shaped, device)
    if key is not None and key in _COUNTED:
        return _COUNTED[key]
    found = _counted(gm, node, env, shaped, device)
    if key is not None:
        if len(_COUNTED) >= 100_000:
            _COUNTED.clear()
        _COUNTED[key] = found
    return found


def _counted(gm: torch.fx.GraphModule, node: torch.fx.Node, env: dict[str, Any], shaped: bool,
             device: torch.device | None) -> tuple[float, float]:
    """_count_flops's answer, counted."""
    fn = node_callable(gm, node)
    leaves: list[torch.Tensor] = []  # what the grads are taken of: the node's inputs and parameters
    if isinstance(fn, torch.nn.Module):
        leaves += [p for p in fn.parameters() if p.requires_grad]

    def prep(n: torch.fx.Node) -> Any:
        v = env[n.name]
        if n.op == "get_attr":
            leaves.extend(t for t in _tensors(v) if t.requires_grad)
            return v

        def fresh(x: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return x
            t = x.detach().requires_grad_(x.requires_grad)
            if not t.requires_grad:
                return t
            leaves.append(t)
            return t.clone()  # a non-leaf, so in-place ops are allowed
        return pytree.tree_map(fresh, v)

    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), prep)
    with torch.enable_grad(), FlopCounterMode(display=False) as fwd, _Traffic(shaped, device) as fwd_bytes:
        out = fn(*args, **kwargs)
    outs = [t for t in _tensors(out) if t.requires_grad]
    if not outs:
        return _priced(fwd, fwd_bytes), 0.0
    seeds = [torch.ones_like(t) for t in outs]
    # grads returned, not accumulated: a leaf's accumulation is not part of the node's backward
    with FlopCounterMode(display=False) as bwd, _Traffic(shaped, device) as bwd_bytes:
        torch.autograd.grad(outs, leaves, seeds, allow_unused=True)
    return _priced(fwd, fwd_bytes), _priced(bwd, bwd_bytes)


def _priced(flops: FlopCounterMode, traffic: _Traffic) -> float:
    """ms on the notional device of what ran under the two counters."""
    return ((flops.get_total_flops() - traffic.product_flops + traffic.flops) / FLOP_PER_MS
            + traffic.bytes / BYTES_PER_MS + traffic.product_ms)


_ONCE: dict[Hashable, dict[str, NodeCost]] | None = None  # measured costs by graph, inside measure_once()


@contextlib.contextmanager
def measure_once() -> Iterator[None]:
    """Inside it, node_costs measures a graph once and hands every later call on the same graph
    (its code, parameter names and input shapes) a copy of those costs: several pipelines of one
    model built in a row (bench schedules' candidates) are then priced alike, not each at the
    machine's speed of the moment it was measured. Nested uses share the outermost's costs."""
    global _ONCE
    outer = _ONCE
    _ONCE = {} if outer is None else outer
    try:
        yield
    finally:
        _ONCE = outer


def _once_key(gm: torch.fx.GraphModule, flat_inputs: list[Any], names: dict[int, str], repeats: int,
              reference: bool) -> Hashable:
    def sig(x: Any) -> Hashable:
        if isinstance(x, torch.Tensor):
            return tuple(x.shape), x.dtype, str(x.device), x.requires_grad
        return repr(x)
    return gm.code, tuple(sorted(names.values())), tuple(sig(x) for x in flat_inputs), repeats, reference


def node_costs(gm: torch.fx.GraphModule, flat_inputs: list[Any], *, cost: str = "measured",
               names: dict[int, str] | None = None, repeats: int = 5, reference: bool = True,
               device: torch.device | None = None) -> dict[str, NodeCost]:
    """Cost of every call node of `gm` on one example microbatch.

    Bytes saved for backward come from one forward pass of the whole graph under
    saved_tensors_hooks, each storage named after the node that allocated it.
    cost="measured" runs the whole graph node by node (median of `repeats` after a
    warm-up), times each node's forward, gives each node the backward time of the autograd
    nodes its forward created, and fits both to a clean timing of the whole graph.
    cost="flops" counts FLOPs and bytes moved per node in isolation (deterministic); both give
    that count as `ref_ms`, which measured plans break near-ties with (stable across launches);
    `reference=False` skips that count for measured costs (a caller that has it already).
    cost="shaped" counts as "flops" does but prices each matrix product by its shape's speed on
    `device` (default: the model's), timed against a reference product once per process
    (partition.products): on the meta device a plan for another device names it.
    """
    if cost not in COSTS:
        raise ValueError(f"cost must be one of {', '.join(map(repr, COSTS))}, got {cost!r}")
    names = names if names is not None else param_names(gm)
    key = _once_key(gm, flat_inputs, names, repeats, reference) if cost == "measured" and _ONCE is not None else None
    if key is not None and key in _ONCE:  # type: ignore[operator]
        return copy.deepcopy(_ONCE[key])  # type: ignore[index]
    out: dict[str, NodeCost] = {}
    with preserve_state(gm):
        p = _forward(gm, flat_inputs, observe_saved=True)
        for node in gm.graph.nodes:
            if not _is_call(node):
                continue
            value = p.env[node.name]
            ts = _tensors(value)
            params, buffers = _node_params(gm, node, names)
            c = NodeCost(out_bytes=_nbytes(ts), is_tensor=isinstance(value, torch.Tensor),
                         requires_grad=any(t.requires_grad for t in ts), params=tuple(params),
                         buffer_bytes=buffers, saved=p.saved.get(node.name, {}),
                         storage=p.storage.get(node.name, ""))
            if isinstance(value, torch.Tensor):
                c.shape, c.dtype = tuple(value.shape), str(value.dtype).removeprefix("torch.")
                c.stride = tuple(value.stride())
            for sid, nb in c.saved.items():
                if "@" in sid:
                    c.saved_bytes += nb
                elif storage_owner(sid) == node.name:
                    c.saves_output = True
                else:
                    c.saved_inputs.add(storage_owner(sid))
            out[node.name] = c
        for node in gm.graph.nodes:
            if _is_call(node) and (reference or cost != "measured"):
                c = out[node.name]
                fwd_ms, bwd_ms = _count_flops(gm, node, p.env, c, shaped=cost == "shaped", device=device)
                c.ref_ms = fwd_ms + bwd_ms
                if cost != "measured":
                    c.fwd_ms, c.bwd_ms = fwd_ms, bwd_ms
        if cost == "measured":
            del p
            readers: dict[str, int] = {}
            for c in out.values():
                for name in c.params:
                    readers[name] = readers.get(name, 0) + 1
            tied = frozenset(i for i, name in names.items() if readers.get(name, 0) > 1)
            _measure(gm, flat_inputs, out, repeats, tied)
    if key is not None and _ONCE is not None:
        _ONCE[key] = copy.deepcopy(out)
    return out
