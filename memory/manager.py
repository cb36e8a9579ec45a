"""PlannedMemory: the MemoryManager that carries out each stage's plan (recompute, offload) and keeps the ledger."""
from __future__ import annotations

import contextlib
import functools
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence, cast

import torch
import torch.fx
import torch.utils._pytree as pytree

from memory.base import MemoryManager
from memory.buffers import CommBuffers, comm_peaks
from memory.budget import BudgetError, StageChoice, human
from memory.ledger import Ledger
from memory.offload import ActivationOffload, Bundle, Handle, offloadable
from memory.recompute import Markers, Recipe, Recomputed, Remat, instrument, make_recipe, with_markers
from memory.regions import Checkpointed, checkpoint_regions
from memory.store import ChunkStore
from memory.streams import Copier
from partition.trace import SAVED_WRITTEN_FIX

__all__ = ["PlannedMemory", "optimizer_state_factor", "factory_state_factor"]

Act = tuple[int, str, int]  # (stage, kind, mb)


def _act(a: Any) -> Act:
    s, kind, mb = tuple(a)
    return int(s), str(kind), int(mb)


class _Storages:
    """Storages counted once each, by address. An address whose storage has been freed no longer
    counts (the allocator may give it to a new tensor, which must be counted then)."""

    def __init__(self) -> None:
        self.refs: dict[int, int] = {}  # data_ptr -> weak reference to its storage

    def __contains__(self, ptr: object) -> bool:
        ref = self.refs.get(ptr) if isinstance(ptr, int) else None
        if ref is None:
            return False
        if torch.UntypedStorage._expired(ref):
            torch.UntypedStorage._free_weak_ref(ref)
            del self.refs[ptr]  # type: ignore[arg-type]
            return False
        return True

    def add(self, t: torch.Tensor) -> None:
        """Hold t's storage; callers check `ptr not in` first (which drops an expired entry)."""
        st = t.untyped_storage()
        self.refs[st.data_ptr()] = cast(int, st._weak_ref())  # an int handle, typed as a storage

    def clear(self) -> None:
        for ref in self.refs.values():
            torch.UntypedStorage._free_weak_ref(ref)
        self.refs.clear()

    def __del__(self) -> None:
        self.clear()


@dataclass
class _Held:
    """What one (stage, mb) holds between its forward and the end of its backward."""
    acts: int = 0                                   # bytes kept on the device (counted once per storage)
    ptrs: _Storages = field(default_factory=_Storages)
    recompute: int = 0                              # bytes recomputed for the backward running now
    rptrs: _Storages = field(default_factory=_Storages)
    bundle: Bundle | None = None                    # offloaded activations
    inputs: set[int] = field(default_factory=set)   # storages of the model inputs (kept, never offloaded)


class _Saved:
    """A tensor autograd saved, kept as it is, with its version then: saved-tensor hooks turn off autograd's own
    check that a saved tensor was not written in place before the backward reads it, so unpack makes it."""
    __slots__ = ("t", "version")

    def __init__(self, t: torch.Tensor) -> None:
        self.t, self.version = t, t._version

    def unpack(self) -> torch.Tensor:
        t = self.t
        if t._version != self.version:  # autograd's own error, as its check would raise it
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"a {list(t.shape)} {str(t.dtype).removeprefix('torch.')} tensor the forward saved at version "
                f"{self.version} is at version {t._version} (PyTorch's own backward refuses this model too); "
                f"{SAVED_WRITTEN_FIX}")
        return t


def _storage(t: torch.Tensor) -> tuple[int, int]:
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes()


# One optimizer hook for the process, registered once and never removed: removing a hook when a
# manager is collected could mutate torch's hook table while an optimizer's step iterates it.
_COUNTED: weakref.WeakSet[PlannedMemory] = weakref.WeakSet()
_OPTIM_HOOK: Any = None


# tensors the size of a parameter an optimizer keeps per parameter (torch.optim), before its options
_STATE_TENSORS = {"Adam": 2, "AdamW": 2, "NAdam": 2, "RAdam": 2, "Adamax": 2, "Adadelta": 2, "Rprop": 2,
                  "Adagrad": 1, "ASGD": 1, "RMSprop": 1, "SGD": 0}


def _local(t: torch.Tensor) -> torch.Tensor:
    """A tensor's part on this rank (a DTensor's local shard)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def local_optimizer(opt: torch.optim.Optimizer) -> torch.optim.Optimizer | None:
    """The local optimizer of torch's ZeroRedundancyOptimizer (it keeps this rank's shard's state);
    None for any other optimizer."""
    inner = getattr(opt, "optim", None)
    return inner if type(opt).__name__ == "ZeroRedundancyOptimizer" and inner is not None else None


def optimizer_state_factor(opt: torch.optim.Optimizer) -> float | None:
    """Bytes of state `opt` will keep per parameter byte, from its kind and options (None: a kind this
    does not know; its first step tells). ZeroRedundancyOptimizer: its local optimizer's over the
    ranks that share the state."""
    inner = local_optimizer(opt)
    if inner is not None:
        f = optimizer_state_factor(inner)
        return None if f is None else f / max(1, int(getattr(opt, "world_size", 1)))
    n = _STATE_TENSORS.get(type(opt).__name__)
    if n is None:
        return None
    most = 0
    for g in opt.param_groups:
        extra = int(bool(g.get("amsgrad"))) + int(bool(g.get("momentum"))) + int(bool(g.get("centered")))
        most = max(most, n + extra)
    return float(most)


def factory_state_factor(factory: Any) -> float:
    """Bytes of state per parameter byte the optimizer `factory` (a torch.optim class, or a callable
    taking the parameters) keeps: by its kind and options, or else measured after one step of it on a
    parameter of its own."""
    p = torch.nn.Parameter(torch.zeros(64))
    try:
        opt = factory([p])
    except Exception as e:  # noqa: BLE001 - the user's factory: name what failed
        raise ValueError(f"optimizer={factory!r} must build an optimizer from a list of parameters "
                         f"(e.g. functools.partial(torch.optim.SGD, lr=0.1)); calling it failed: {e}") from e
    if not isinstance(opt, torch.optim.Optimizer):
        raise ValueError(f"optimizer={factory!r} built {type(opt).__name__}, not a torch.optim.Optimizer")
    f = optimizer_state_factor(opt)
    if f is None:
        p.grad = torch.ones_like(p)
        try:
            opt.step()
        except Exception as e:  # noqa: BLE001 - an optimizer this cannot step alone (a closure, sparse grads)
            raise ValueError(f"optimizer={factory!r}: fxpipe does not know {type(opt).__name__}'s state and one "
                             f"step of it on a probe parameter failed ({type(e).__name__}: {e}); leave "
                             "optimizer= out (memory is then planned for Adam's two copies of the parameters) "
                             "and pp.attach_optimizer(opt) once it is built") from e
        f = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values()
                if isinstance(t, torch.Tensor) and t.numel() > 1) / (p.numel() * p.element_size())
    return float(f)


def _count_optimizers(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for me in list(_COUNTED):
        me._count_optimizer(opt)


class PlannedMemory(MemoryManager):
    """Runs `choices` (one per stage, from memory.budget.choose) on this rank's `modules`.

    `param_nodes[s]`: node -> names of the parameters it reads (partition's StageIO);
    `actions`: this rank's schedule as (stage, kind, mb); `recv_bytes`/`send_bytes`: per
    stage and microbatch, for the communication buffers the ledger counts (memory.buffers, at
    the program's batches and compute actions); `place`: each stage's rank.
    """

    def __init__(self, *, choices: Sequence[StageChoice], modules: dict[int, torch.fx.GraphModule],
                 param_nodes: dict[int, dict[str, list[str]]], actions: Sequence[Act],
                 recv_bytes: Sequence[int], send_bytes: Sequence[int], device: torch.device,
                 budget: float | None = None,
                 chunk_elems: dict[int, int] | None = None,
                 place: Sequence[int] | None = None, optim_factor: float = 2.0) -> None:
        self.choices = {c.stage: c for c in choices}
        self.optim_factor = optim_factor  # optimizer state per parameter byte the choices were predicted with
        self.optim_known: set[int] = set()  # stages whose optimizer state was measured after a step
        self._param_bytes: dict[int, int] = {}  # per local stage, its resident parameters' bytes (step_begin)
        self._factor: dict[int, float] = {}  # stage -> the optimizer factor its prediction counts now
        self.over_budget: BudgetError | None = None  # the optimizer measured at its first step puts a stage over
        self._said_over: set[int] = set()  # stages whose measured peak went over the budget, said once
        self._held_state: Callable[[int], tuple[int, int]] | None = None  # count_state_with
        self._state_extra = 0.0  # state bytes per parameter byte besides the optimizer's (count_state_with)
        self.local = sorted(modules)
        # where each stage runs (pipe.schedules.placement); without it: the local stages here, the others elsewhere
        self.place = list(place) if place is not None else [0 if s in modules else -1 for s in range(len(recv_bytes))]
        self.actions = [_act(a) for a in actions]
        self.recv, self.send = list(recv_bytes), list(send_bytes)
        self.device, self.budget = device, budget
        self.zero_bubble = any(k == "W" for _, k, _ in self.actions)
        self.planned_comm: dict[int, int] = {}
        self.ledger = Ledger(self.local, device)
        self.copier = Copier(device)
        self.held: dict[tuple[int, int], _Held] = {}
        self.cur: tuple[int, int] = (-1, -1)       # (stage, mb) whose forward runs
        self.bwd: tuple[int, int] = (-1, -1)       # (stage, mb) whose backward runs
        self.modules = modules
        self.owned: dict[int, list[tuple[str, torch.nn.Parameter]]] = {}
        units: dict[int, list[int]] = {}  # per local stage, the node that first reads each owned parameter
        seen: set[int] = set()
        for s in self.local:  # each parameter once, with the first local stage that reads it, in use order
            named = [(k, n, modules[s].get_parameter(n)) for k, ns in enumerate(param_nodes[s].values()) for n in ns]
            named += [(len(named) + k, n, p) for k, (n, p) in enumerate(modules[s].named_parameters())]
            self.owned[s], units[s] = [], []
            for k, n, p in named:
                if id(p) not in seen:
                    seen.add(id(p))
                    self.owned[s].append((n, p))
                    units[s].append(k)
        self.offloaded = [s for s in self.local if self.choices[s].offload_states]
        self.store = ChunkStore({s: self.owned[s] for s in self.offloaded}, device, self.ledger, self.copier,
                                chunk_elems=chunk_elems, units=units) if self.offloaded else None
        self.acts = ActivationOffload(device, self.copier, self._bundle_bytes) \
            if any(self.choices[s].offload_activations for s in self.local) else None
        self.param_ptrs: set[int] = set()
        self.buffer_ptrs: set[int] = set()  # the stages' buffers (module state, never version-checked)
        self._groups: dict[int, dict[int, tuple[int, ...]]] = {}   # stage -> marker index -> chunk group
        self._fwd_groups: dict[int, list[tuple[int, ...]]] = {}
        self._w_groups: dict[int, list[tuple[int, ...]]] = {}
        self._multi: dict[int, tuple[int, ...]] = {}
        self._node_index: dict[int, dict[str, int]] = {}
        self._calls: dict[int, list[torch.fx.Node]] = {}
        self._recipes: dict[int, tuple[Any, Recipe]] = {}   # storage -> (weak ref to the output, recipe)
        self._ring: list[tuple[int, torch.Tensor]] = []     # recomputed outputs alive: (stage, value)
        self._windows: dict[Act, tuple[int, int]] = {}   # action -> its span of the chunk sequence
        self._pinned: tuple[int, ...] = ()
        # forward-only passes (evaluate, forward) over streamed chunks: each forward-only module's use sequence
        self._pass_groups: weakref.WeakKeyDictionary[torch.nn.Module, list[tuple[int, ...]]] = \
            weakref.WeakKeyDictionary()
        self._pass_windows: dict[Act, tuple[int, int]] = {}
        for s in self.local:
            self._instrument(s, modules[s], param_nodes[s])
            if s not in self.offloaded:
                self.ledger.set(s, "params", sum(p.numel() * p.element_size() for _, p in self.owned[s]))
        self._optim_hook()

    # ----- set-up -----
    def _instrument(self, s: int, gm: torch.fx.GraphModule, param_nodes: dict[str, list[str]]) -> None:
        # with streamed chunks the markers go in first and each region takes its nodes' markers along, so
        # recomputing a region fetches its chunks again
        streamed = self.store is not None and s in self.offloaded
        if self.choices[s].regions and not streamed:
            checkpoint_regions(gm, self.choices[s].regions, functools.partial(self._region, s))
        nodes = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
        calls = [n.name for n in nodes]
        index = {name: i for i, name in enumerate(calls)}
        self._node_index[s], self._calls[s] = index, nodes
        c = self.choices[s]
        before: dict[str, int] = {}
        after: dict[str, int] = {}
        remat = {n: index[n] for n in c.remat if n in index}
        if self.store is not None:
            groups = {index[n]: self.store.group([gm.get_parameter(p) for p in ps])
                      for n, ps in param_nodes.items() if n in index}
            self._groups[s] = {i: g for i, g in groups.items() if g}
            self._fwd_groups[s] = [self._groups[s][index[n]] for n in calls if index[n] in self._groups[s]]
            for n in calls:
                if index[n] in self._groups[s]:
                    before[n] = after[n] = index[n]
        for n in [n for n in remat if remat[n] in self._groups.get(s, {})]:
            del remat[n]  # the planner leaves these out when chunks stream; never recompute them then
        if before or after or remat:
            instrument(gm, Markers(functools.partial(self._before_node, s), functools.partial(self._after_node, s),
                                   functools.partial(self._remat_node, s)), before, after, remat)
        if self.choices[s].regions and streamed:
            checkpoint_regions(gm, with_markers(gm, self.choices[s].regions), functools.partial(self._region, s))

    def _optim_hook(self) -> None:
        _COUNTED.add(self)
        global _OPTIM_HOOK
        if _OPTIM_HOOK is None:
            from torch.optim.optimizer import register_optimizer_step_post_hook
            _OPTIM_HOOK = register_optimizer_step_post_hook(_count_optimizers)

    def set_weight_order(self, stage: int, nodes: Sequence[str], multi: Sequence[torch.nn.Parameter]) -> None:
        """Zero-bubble: W visits `nodes` (the parameter nodes it differentiates) in this order, and B
        accumulates the grads of `multi` (parameters read by several nodes) after its pass."""
        if self.store is None:
            return
        index, groups = self._node_index[stage], self._groups[stage]
        self._w_groups[stage] = [groups[index[n]] for n in nodes if index.get(n) in groups]
        self._multi[stage] = self.store.group(multi)

    def fused_backward(self, stage: int) -> bool:
        """Under zero-bubble schedules a recomputing stage computes its weight grads in B, and its W does
        nothing: a checkpoint recomputes for one backward only, and W's matrix products need the linear
        layers' inputs kept from the forward, which recompute exists not to keep (W's autograd call per
        node over a graph B kept instead measured 1.5-2x its predicted step)."""
        return self.zero_bubble and self.choices[stage].recomputes

    def plain(self, stage: int) -> bool:
        return self.choices[stage].plain

    def _region(self, s: int, k: int, sub: torch.fx.GraphModule) -> torch.nn.Module:
        return Checkpointed(sub, entering=functools.partial(self._count_entering, s),
                            again=functools.partial(self._region_again, s), recomputed=self._count_recomputed)

    def wrap_stage(self, stage: int, module: torch.nn.Module) -> torch.nn.Module:
        if not self.choices[stage].full:
            return module
        return Recomputed(module, recomputed=self._count_recomputed)

    # ----- counting -----
    def _is_param(self, t: torch.Tensor) -> bool:
        ptr = t.untyped_storage().data_ptr()
        return ptr in self.param_ptrs or (self.store is not None and ptr in self.store.ptrs)

    def _held_elsewhere(self, t: torch.Tensor) -> bool:
        """A parameter, or a leaf that requires grad (a received input, counted as a message buffer), or a
        view of one: its memory is not the microbatch's activations."""
        base = t if t._base is None else t._base
        return self._is_param(t) or (base.is_leaf and base.requires_grad)

    def _count_entering(self, s: int, args: tuple[Any, ...]) -> None:
        """A checkpointed region keeps its inputs until the backward: count them as saved."""
        if self.cur[0] != s:
            return
        h = self.held[self.cur]
        for t in args:
            if isinstance(t, torch.Tensor) and not self._held_elsewhere(t) and \
                    t.untyped_storage().data_ptr() not in h.inputs:
                ptr, n = _storage(t)
                if ptr not in h.ptrs:
                    h.ptrs.add(t)
                    h.acts += n
                    self.ledger.add(s, "activations", n)

    def _region_again(self, s: int) -> None:
        """The backward recomputes another region: the one recomputed before is done and freed (a region
        is recomputed when the grads reach it, after those of every region it feeds)."""
        h = self.held.get(self.bwd)
        if h is not None and self.bwd[0] == s:
            self.ledger.add(s, "recompute", -h.recompute)
            h.recompute = 0
            h.rptrs.clear()

    def _count_recomputed(self, t: torch.Tensor) -> None:
        s, mb = self.bwd
        h = self.held.get((s, mb))
        if h is None:
            return
        ptr, n = _storage(t)
        if ptr in h.ptrs or ptr in h.rptrs or ptr in h.inputs or self._held_elsewhere(t):
            return
        h.rptrs.add(t)
        h.recompute += n
        self.ledger.add(s, "recompute", n)

    def _pack(self, t: torch.Tensor) -> Any:
        s, mb = self.cur
        h = self.held[(s, mb)]
        ptr = t.untyped_storage().data_ptr()
        if self._held_elsewhere(t) or ptr in h.inputs:
            return t  # a parameter, a received value or a model input: not the microbatch's activations (and views
            # the runtime made, a microbatch of the batch, whose versions its other microbatches' writes move too)
        if self._recipes:
            found = self._recipes.get(ptr)
            if found is not None and found[0]() is not None and self._ready(found[1], t, s, mb, h):
                return Remat(found[1], t)
        if h.bundle is not None and t.device == self.device and offloadable(t):
            return h.bundle.put(t)
        ptr, n = _storage(t)
        if ptr not in h.ptrs:
            h.ptrs.add(t)
            h.acts += n
            self.ledger.add(s, "activations", n)
        # a buffer (batch norm's statistics, which torch.export's graph writes back after the op saved them) is
        # module state, not the microbatch's activation: autograd reads none of it after such a write
        return t if ptr in self.buffer_ptrs else _Saved(t)

    def _ready(self, r: Recipe, t: torch.Tensor, s: int, mb: int, h: _Held) -> bool:
        """The recipe may stand for `t`: same microbatch, `t` unchanged since the node made it, and every
        input held anyway (a parameter, a received activation, a model input, or saved on the device): it frees memory
        and holds none."""
        if (r.stage, r.mb) != (s, mb) or t._version != r.version:
            return False
        return all(self._held_elsewhere(x) or x.untyped_storage().data_ptr() in h.ptrs
                   or x.untyped_storage().data_ptr() in h.inputs for x in r.inputs)

    def _unpack(self, x: Any) -> torch.Tensor:
        if isinstance(x, Remat):
            return self._recompute(x)
        return x.unpack() if isinstance(x, (_Saved, Handle)) else x

    def _recompute(self, x: Remat) -> torch.Tensor:
        """The backward needs a recomputed output: make it (chunks of its parameters resident), and keep
        the last two alive and counted, which covers an op unpacking two of them."""
        r = x.recipe
        g = self._groups.get(r.stage, {}).get(r.index)
        if g and self.store is not None:
            self.store.use(g)
        value = r.alive()
        if value is None:
            if len(self._ring) >= 2:
                self._drop_ring(1)
            value = r.compute()
            self._ring.append((r.stage, value))
            self.ledger.add(r.stage, "recompute", r.nbytes)
        return value.as_strided(x.size, x.stride, x.offset)

    def _drop_ring(self, k: int) -> None:
        for stage, v in self._ring[:k]:
            self.ledger.add(stage, "recompute", -v.untyped_storage().nbytes())
        del self._ring[:k]

    def _remat_node(self, s: int, i: int, value: Any, inputs: tuple[Any, ...]) -> None:
        """After a node that may be recomputed: record its recipe while its output lives."""
        if not torch.is_grad_enabled() or self.cur[0] != s:
            return
        r = make_recipe(self.modules[s], self._calls[s][i], value, inputs, s, self.cur[1], i)
        if r is None:
            return
        ptr = value.untyped_storage().data_ptr()
        recipes = self._recipes

        def gone(ref: Any) -> None:
            if recipes.get(ptr, (None,))[0] is ref:
                del recipes[ptr]
        self._recipes[ptr] = (weakref.ref(value, gone), r)

    def _bundle_bytes(self, stage: int, delta: int) -> None:
        self.ledger.add(stage, "activations", delta)

    def count_state_with(self, held: Callable[[int], tuple[int, int]],
                         params: dict[int, list[tuple[str, torch.nn.Parameter]]], extra: float) -> None:
        """Stages whose parameters and grads something else holds (FSDP under dp_shard="full": a shard
        of each, and the gathered copy and its grads during a step): `held(stage)` -> (parameter
        bytes, grad bytes) on the device now, which the ledger then counts after every action;
        `params[s]`: the parameters an optimizer steps (the shards); `extra`: state bytes per
        parameter byte kept besides the optimizer's (the shard of the parameters)."""
        self._held_state = held
        self._state_extra = extra
        self.owned.update(params)
        for s in self.local:
            self._count_grads(s)

    def _count_grads(self, s: int) -> None:
        if self._held_state is not None:
            params, grads = self._held_state(s)
            self.ledger.set(s, "params", params)
            self.ledger.set(s, "grads", grads)
        elif s not in self.offloaded:
            self.ledger.set(s, "grads", sum(p.grad.numel() * p.grad.element_size()
                                            for _, p in self.owned[s] if p.grad is not None))

    def attach_optimizer(self, opt: torch.optim.Optimizer, factor: float | None = None) -> None:
        """The optimizer that will step this rank's parameters: the predicted peaks count the state it
        keeps (`factor` bytes per parameter byte, else by its kind now; measured after its first step)
        instead of the planned Adam's two copies; BudgetError when the budget is then not met (the
        plan is not made again)."""
        self.optim_known.clear()  # its first step measures it again
        self.over_budget = None  # what an earlier optimizer's first step found is not this one's
        f = optimizer_state_factor(opt) if factor is None else factor
        if f is not None:
            self._repredict({s: f for s in self.choices})

    def _repredict(self, factors: dict[int, float]) -> None:
        """Each stage's predicted peak with `factors[s]` optimizer bytes per parameter byte on the device
        (none for a stage streaming its state: its optimizer steps host views)."""
        for s, f in factors.items():
            c = self.choices[s]
            if c.offload_states:
                continue
            f += self._state_extra
            delta = c.param_bytes * (f - self._factor.get(s, self.optim_factor))
            c.predicted_peak += delta
            c.peak_if_grads_kept += delta
            c.parts["state"] = c.parts.get("state", 0.0) + delta
            self._factor[s] = f
        over = [c for c in self.choices.values() if self.budget is not None and c.predicted_peak > self.budget]
        if over:
            c = max(over, key=lambda c: c.predicted_peak)
            raise BudgetError(
                f"memory_budget={human(self.budget or 0)} per stage is not met on stage {c.stage} with this "
                f"optimizer: its state takes {self._factor[c.stage]:.1f} bytes per parameter byte (the plan "
                f"assumed {self.optim_factor:.1f}), which puts the stage at {human(c.predicted_peak)}. Fix: give "
                f"memory_budget >= {c.predicted_peak:.0f}, or offload='states' (the optimizer then steps on "
                "the host)", c.predicted_peak)

    def _count_optimizer(self, opt: torch.optim.Optimizer) -> None:
        for s in self.local:  # an offloaded stage's optimizer steps host views: its state lives on the host
            if s in self.offloaded:
                continue
            mine = {id(p) for _, p in self.owned[s]}
            if not any(id(p) in mine for group in opt.param_groups for p in group["params"]):
                continue  # another pipeline's optimizer
            state = (local_optimizer(opt) or opt).state  # ZeRO: the shard's, kept by its local optimizer
            n = sum(_local(v).numel() * v.element_size() for p, st in state.items() if id(p) in mine
                    for v in st.values() if isinstance(v, torch.Tensor) and v.device.type == self.device.type
                    and v.dim() > 0)
            self.ledger.set(s, "optimizer", n)
            params = sum(p.numel() * p.element_size() for _, p in self.owned[s])
            if s not in self.optim_known and params:  # the first step: what the optimizer really keeps
                self.optim_known.add(s)
                try:
                    self._repredict({s: n / params})
                except BudgetError as e:  # inside torch's step: raised by the pipeline's next step
                    self.over_budget = e

    # ----- markers in the stage graphs -----
    def _before_node(self, s: int, i: int) -> None:
        g = self._groups.get(s, {}).get(i)
        if g and self.store is not None:
            self.store.use(g)

    def _after_node(self, s: int, i: int, value: Any) -> None:
        g = self._groups.get(s, {}).get(i)
        if not g or not torch.is_grad_enabled():
            return
        for t in pytree.tree_leaves(value):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(functools.partial(self._before_backward_node, g))

    def _before_backward_node(self, g: tuple[int, ...], grad: torch.Tensor) -> None:
        if self.store is not None:
            self.store.use(g)

    # ----- forward-only passes -----
    def stream_forward_only(self, stage: int, gm: torch.fx.GraphModule, param_nodes: dict[str, list[str]]) -> None:
        """A forward-only module of `stage` other than its training one (the stage cut from the other mode's
        trace, or the stage without the loss), whose parameters are the stage's: where they stream in chunks,
        each node that reads some first fetches their chunks (in place); `param_nodes`: node -> the
        parameters it reads (partition.split.param_nodes_of)."""
        store = self.store
        if store is None:
            return
        calls = [n.name for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
        # (any local stage: one that does not stream may read a parameter another stage here streams, tied)
        groups = {i: g for i, n in enumerate(calls)
                  if (g := store.group([gm.get_parameter(p) for p in param_nodes.get(n, [])]))}
        if groups:
            instrument(gm, Markers(lambda i: store.use(groups[i]), lambda i, value: None),
                       {calls[i]: i for i in groups}, {})
        self._pass_groups[gm] = [groups[i] for i in sorted(groups)]

    @contextlib.contextmanager
    def forward_only(self, program: Sequence[Any], modules: dict[int, torch.nn.Module | None]) -> Iterator[None]:
        """A forward-only program (its F actions) runs inside, each stage through `modules[stage]` (None: its
        training module): streamed chunks follow the pass's own use sequence, their grads left as they were."""
        store = self.store
        if store is None:
            yield
            return
        seq: list[tuple[int, ...]] = []
        windows: dict[Act, tuple[int, int]] = {}
        for x in program:
            if not (hasattr(x, "kind") and x.kind == "F"):
                continue
            m = modules.get(x.stage)
            assert m is None or m in self._pass_groups, f"stage {x.stage}'s forward-only module reads chunks unseen"
            groups = self._fwd_groups.get(x.stage, []) if m is None else self._pass_groups[m]
            windows[_act(x)] = (len(seq), len(seq) + len(groups))
            seq += groups
        store.set_sequence(seq, {s: max(self.choices[s].resident_chunks, 1) for s in self.offloaded})
        self._windows = {}  # the step's sequence is made again at its next begin
        self._pass_windows = windows
        store.pass_begin()
        try:
            yield
        finally:
            store.pass_end()
            self._pass_windows = {}

    def before_forward_only(self, action: Any) -> None:
        """An F action of the forward-only program starts (inside forward_only)."""
        window = self._pass_windows.get(_act(action))
        if window is not None and self.store is not None:
            self.store.begin(window, backward=False)

    # ----- the hooks the interpreter calls -----
    def _sequence(self) -> None:
        seq: list[tuple[int, ...]] = []
        self._windows = {}
        for s, kind, mb in self.actions:
            groups = self._fwd_groups.get(s, [])
            if kind in ("B", "BW"):
                groups = groups[::-1]
            elif kind == "W":  # a fused stage has no W in the program: its BW walks the groups like B
                groups = self._w_groups.get(s, [])
            self._windows[(s, kind, mb)] = (len(seq), len(seq) + len(groups))
            seq += groups
        assert self.store is not None
        self.store.set_sequence(seq, {s: max(self.choices[s].resident_chunks, 1) for s in self.offloaded})

    def step_begin(self) -> None:
        for (s, _), h in list(self.held.items()):  # left by a step that failed half-way
            self.ledger.add(s, "activations", -h.acts)
            self.ledger.add(s, "recompute", -h.recompute)
            if h.bundle is not None and self.acts is not None:
                self.acts.release(h.bundle)
        self.held.clear()
        self._recipes.clear()
        if self._ring:
            self._drop_ring(len(self._ring))
        for s in self.local:  # buffers of a step that failed half-way are gone with its exchange
            self.ledger.set(s, "comm", 0)
        self.ledger.step_begin()
        self._pinned = ()
        if self.store is not None:
            if not self._windows:
                self._sequence()
            self.store.step_begin()
        self.param_ptrs = {_local(p).untyped_storage().data_ptr() for s in self.local if s not in self.offloaded
                           for _, p in self.owned[s]}
        self.buffer_ptrs = {b.untyped_storage().data_ptr() for s in self.local for b in self.modules[s].buffers()}
        self._param_bytes = {s: sum(p.numel() * p.element_size() for _, p in self.owned[s]) for s in self.local}
        self._comm = CommBuffers(self.place, self.place[self.local[0]], self.recv, self.send, self.zero_bubble)
        for s in self.local:
            self._count_grads(s)
            c = self.choices[s]
            if self.ledger.now[s]["grads"] > 0 and c.peak_if_grads_kept > c.predicted_peak:
                c.predicted_peak = c.peak_if_grads_kept  # grads kept across steps (no zero_grad to None)

    @contextlib.contextmanager
    def forward(self, stage: int, mb: int, inputs: Sequence[Any] = ()) -> Iterator[None]:
        """The forward of (stage, mb) runs inside: what it saves is counted, offloaded or recomputed.
        `inputs`: its model inputs (and targets), which the runtime holds anyway."""
        self.cur = (stage, mb)
        h = self.held.setdefault((stage, mb), _Held())
        h.inputs |= {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
        if self.acts is not None and self.choices[stage].offload_activations and h.bundle is None:
            h.bundle = Bundle(self.acts, stage, mb)
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def _frees(self, kind: str) -> bool:
        return kind == "BW" or kind == ("W" if self.zero_bubble else "B")

    def before(self, action: Any) -> None:
        s, kind, mb = _act(action)
        if kind in ("B", "W", "BW"):
            self.bwd = (s, mb)  # offloaded activations came back with the RELOAD before this action
            if s not in self.offloaded:  # the grads it makes are counted from its start (as planned)
                self.ledger.set(s, "grads", max(self.ledger.now[s]["grads"], self._param_bytes.get(s, 0)))
        if self.store is not None:
            self.store.begin(self._windows[(s, kind, mb)], backward=kind != "F")
            if kind == "B" and self.zero_bubble and self._multi.get(s):
                self._pinned = self._multi[s]
                self.store.pin(self._pinned, True)

    def after(self, action: Any) -> None:
        s, kind, mb = _act(action)
        h = self.held.get((s, mb))
        if self._pinned and self.store is not None:
            self.store.pin(self._pinned, False)
            self._pinned = ()
        self._count_comm(self._comm.after(s, kind, mb))
        if kind in ("B", "W", "BW") and self._ring:
            self._drop_ring(len(self._ring))
        if self._held_state is not None and kind == "F":  # the parameters gathered for the forward
            self._count_grads(s)
        if h is not None and kind in ("B", "W", "BW"):
            self.ledger.add(s, "recompute", -h.recompute)
            h.recompute = 0
            h.rptrs.clear()
            if self._frees(kind):
                self.ledger.add(s, "activations", -h.acts)
                if h.bundle is not None and self.acts is not None:
                    self.acts.release(h.bundle)
                del self.held[(s, mb)]
            elif h.bundle is not None and self.acts is not None:
                self.acts.drop_device(h.bundle)
            self._count_grads(s)

    def posted(self, batch: Sequence[Any]) -> None:
        self._count_comm(self._comm.batch(batch))

    def _count_comm(self, moves: list[tuple[int, int]]) -> None:
        for stage, n in moves:
            self.ledger.add(stage, "comm", n)

    def set_program(self, program: Sequence[Any]) -> None:
        self.actions = [_act(x) for x in program if hasattr(x, "kind") and x.kind in ("F", "B", "W", "BW")]
        self._windows = {}  # the chunk sequence follows the program: made again at the next step
        peaks = comm_peaks({self.place[self.local[0]]: program}, self.place, self.recv, self.send, self.zero_bubble)
        self.planned_comm = {s: peaks[s] for s in self.local}  # what the ledger will count (the passes free earlier)

    def reload_stages(self) -> list[int]:
        return [s for s in self.local if self.choices[s].offload_activations]

    def reload(self, stage: int, mb: int) -> None:
        """The program's RELOAD action: bring (stage, mb)'s offloaded activations back to the device
        ahead of its backward (pipe.lower.with_reloads places it one compute action ahead)."""
        h = self.held.get((stage, mb))
        if h is not None and h.bundle is not None and self.acts is not None:
            self.acts.to_device(h.bundle)

    def step_end(self) -> None:
        assert not self.held, f"activations of (stage, mb) {sorted(self.held)} outlived their backward"
        if self.store is not None:
            self.store.step_end()
        self._count_comm(self._comm.end())
        if self._held_state is not None:
            for s in self.local:
                self._count_grads(s)

    # ----- what it did -----
    def over_measured(self) -> list[str]:
        """Each stage whose measured peak went over the budget, said once: what its memory plan did not price
        (its prediction is then below the measurement), with the budget that would have it met."""
        if self.budget is None:
            return []
        rep, said = self.ledger.report(), []
        for s in self.local:
            peak, c = rep[s]["peak_total"], self.choices[s]
            if peak <= self.budget or s in self._said_over:
                continue
            self._said_over.add(s)
            under = peak - c.predicted_peak
            said.append(f"stage {s} ({c.label()}) measured a peak of {human(peak)} ({peak} B), over memory_budget="
                        f"{human(self.budget)} per stage: its memory plan predicted {human(c.predicted_peak)}, "
                        f"{human(max(under, 0))} below the measurement (what the plan does not price); give "
                        f"memory_budget={int(self.budget - max(under, 0))} for a plan that keeps it within "
                        f"{int(self.budget)} B")
        return said

    def report(self) -> dict[int, dict[str, int]]:
        out = self.ledger.report()
        for s in self.local:
            c = self.choices[s]
            out[s]["predicted_peak"] = int(c.predicted_peak)
            out[s]["predicted_comm"] = self.planned_comm.get(s, int(c.parts.get("comm", 0)))
            if self.budget is not None:
                out[s]["budget"] = int(self.budget)
            out[s]["resident_chunks"] = c.resident_chunks
        if self.store is not None:
            for s in self.local:
                out[s]["host_state_bytes"] = sum(2 * ch.nbytes for ch in self.store.chunks if ch.owner == s)
        out_bytes = {"h2d_bytes": self.copier.bytes_h2d, "d2h_bytes": self.copier.bytes_d2h,
                     "reload_stalls": self.acts.stalls if self.acts is not None else 0}
        for s in self.local:
            out[s].update(out_bytes)
        return out

    def describe(self) -> str:
        """One line per local stage: the policy and the peak, predicted and measured."""
        rep = self.report()
        lines = []
        for s in self.local:
            c, r = self.choices[s], rep[s]
            kinds = ", ".join(f"{k} {human(r['peak_' + k])}" for k in
                              ("params", "grads", "optimizer", "activations", "recompute", "comm"))
            budget = "-" if self.budget is None else human(self.budget)
            predicted = human(c.predicted_peak)
            lines.append(f"stage {s}: {c.label()}; peak {human(r['peak_total'])} (predicted "
                         f"{predicted}, budget {budget}); {kinds}")
        return "\n".join(lines)
