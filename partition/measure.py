"""Measured costs block by block on the target device, one unit's weights at a time.

For a model on the meta device (or one whose weights sit elsewhere than where the pipeline will
run) the whole graph cannot be run to time it. Consecutive coarsened blocks (partition.graph) are
grouped into units (`segments`: at most a 64th of the parameters or 4 MiB, or one block); each
unit is cut out as a GraphModule of its own (partition.split.subgraph), its parameters and
buffers are allocated on the target device (random values where the model has none: timing does
not depend on them; the model's own values otherwise), its inputs are made from the shapes the
analysis recorded (the example's own tensors where it reads a model input; random floats and zero
integers where it reads another block's output), and it is timed as node_costs times a whole
graph: node by node, fitted to clean runs of the unit, with the bytes saved for backward observed
there. The unit is then freed, so the peak is one unit's weights plus one microbatch's
activations of it. The units are swept several times and each node takes the median.

Ranks with devices of their own may share the work (`Share`): rank r measures the units k with
k % world == r and the results are gathered, so every rank holds the same costs. pipe does so on
accelerators; on the CPU, where ranks share the cores, every rank measures every unit at once, as
the pipeline will load them. The caller's rank 0 decides the plan either way (pipe broadcasts it),
so noise between ranks cannot make two plans.
"""
from __future__ import annotations

import copy
import ctypes
import gc
import hashlib
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Sequence

import numpy as np

import torch
import torch.fx

from partition.costs import NodeCost, node_costs, preserve_state, storage_owner, time_nodes, whole_graph_ms
from partition.meta import retarget
from partition.split import subgraph

__all__ = ["Share", "calibrate", "measure_blocks", "materialize", "segments", "signature", "signatures",
           "release_memory"]


@dataclass
class Share:
    """How the ranks split the measurement: this rank, how many, and a gather of one object per
    rank (every rank gets the list); the defaults measure everything here."""
    rank: int = 0
    world: int = 1
    gather: Callable[[Any], list[Any]] | None = None


def release_memory(generation: int = 2) -> None:
    """Collect garbage up to `generation` (1 frees what was made since the last collections, fast;
    2 walks every object, slow on a large heap) and hand the C heap's free pages back to the system
    (glibc's malloc_trim), so a freed block's weights leave the resident set instead of staying in
    the process's heap."""
    gc.collect(generation)
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # another C library: its own policy holds
        pass


def materialize(module: torch.nn.Module, device: torch.device) -> None:
    """Give every meta parameter and buffer of `module` (in place; a tensor tied between
    submodules stays one) storage on `device`: small random values for floating point, zeros
    otherwise; real ones are moved to `device`."""
    made: dict[int, torch.Tensor] = {}
    for m in module.modules():
        for table in (m._parameters, m._buffers):
            for k, t in table.items():
                if t is None:
                    continue
                if id(t) not in made:
                    with torch.no_grad():
                        if not t.is_meta:
                            new = t.detach().to(device)
                        elif t.is_floating_point():  # a uniform draw: cheaper than normal, the same to time
                            new = torch.empty(t.shape, dtype=t.dtype, device=device).uniform_(-0.05, 0.05)
                        else:
                            new = torch.zeros(t.shape, dtype=t.dtype, device=device)
                    made[id(t)] = torch.nn.Parameter(new, t.requires_grad) if isinstance(
                        t, torch.nn.Parameter) else new
                table[k] = made[id(t)]  # type: ignore[assignment]
    for m in module.modules():  # tensor constants torch.export keeps as plain attributes
        for name, value in list(vars(m).items()):
            if isinstance(value, torch.Tensor):
                setattr(m, name, torch.zeros(value.shape, dtype=value.dtype, device=device) if value.is_meta
                        else value.to(device))


def _input(cost: NodeCost, device: torch.device) -> torch.Tensor:
    """A stand-in for another block's output: its shape, stride and dtype on `device`."""
    dtype = getattr(torch, cost.dtype)
    t = torch.empty_strided(cost.shape, cost.stride or _contiguous(cost.shape), dtype=dtype, device=device)
    if t.is_floating_point():
        t.normal_()
        t.requires_grad_(cost.requires_grad)
    else:
        t.zero_()
    return t


def _contiguous(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(stride))


def _example(x: Any, device: torch.device) -> Any:
    """A model input for the block: the example's tensor on `device` (zeros for a meta one)."""
    if not isinstance(x, torch.Tensor):
        return x
    if x.is_meta:
        return torch.zeros(x.shape, dtype=x.dtype, device=device)
    return x.detach().to(device).requires_grad_(x.requires_grad)


def segments(members: list[list[str]], costs: dict[str, NodeCost], param_bytes: dict[str, int],
             parts: int = 64, least: int = 4 << 20, kinds: Sequence[Hashable] | None = None) -> list[list[int]]:
    """Consecutive blocks grouped into units measured together: each holds at most a `parts`-th of
    the model's parameter bytes (but `least` bytes may always go together, so a small model is not
    timed in dozens of tiny pieces), or one block where a block alone holds more.

    `kinds` (one per block; equal for blocks of the same structure, `signature`) align the units with
    the model's repetition: where the kinds repeat with a period (a transformer's layers), the first
    period is grouped and every later one is cut at the same places, so that their units are alike
    and measured once (measure_blocks)."""
    held = [sum(param_bytes.get(p, 0) for p in {p for u in block for p in costs[u].params}) for block in members]
    cap = max(max(held, default=0), sum(param_bytes.values()) / parts, least)

    def greedy(lo: int, hi: int) -> list[list[int]]:
        out: list[list[int]] = [[]]
        total = 0
        for b in range(lo, hi):
            if out[-1] and total + held[b] > cap:
                out.append([])
                total = 0
            out[-1].append(b)
            total += held[b]
        return out if out[-1] else []
    start, period, count = _repetition(kinds) if kinds is not None else (0, 0, 0)
    if count < 2:
        return greedy(0, len(members))
    first = greedy(start, start + period)
    repeated = [[b + k * period for b in unit] for k in range(count) for unit in first]
    return greedy(0, start) + repeated + greedy(start + count * period, len(members))


def _repetition(kinds: Sequence[Hashable]) -> tuple[int, int, int]:
    """(start, period, count): the longest stretch of `kinds` that is one period repeated `count` times,
    the period the one that most positions agree with (the shortest among equals)."""
    ids: dict[Hashable, int] = {}
    a = np.array([ids.setdefault(k, len(ids)) for k in kinds])
    n = len(a)
    best = (0, 0)
    for p in range(1, n // 2 + 1):
        agree = int(np.count_nonzero(a[:-p] == a[p:]))
        if agree > best[0]:
            best = (agree, p)
    agree, p = best
    if p == 0 or agree < p:  # not one whole period repeated
        return 0, 0, 0
    same = np.concatenate([[False], a[:-p] == a[p:], [False]]).astype(np.int8)
    edges = np.flatnonzero(np.diff(same))  # runs of agreement: [starts, ends) alternating
    runs = list(zip(edges[::2], edges[1::2]))
    lo, hi = max(runs, key=lambda r: r[1] - r[0])
    count = (hi - lo + p) // p  # positions lo..hi-1 agree with the one p later: blocks lo..hi-1+p repeat
    return int(lo), p, int(count)


def _target(gm: torch.fx.GraphModule, node: torch.fx.Node) -> Any:
    """What a node runs, by kind and shape, not by name: a module's type, settings and tensors' shapes,
    an attribute's shape, a function's qualified name."""
    def tensor(t: torch.Tensor) -> tuple[Any, ...]:
        return tuple(t.shape), str(t.dtype), t.requires_grad
    if node.op == "call_module":
        m = gm.get_submodule(str(node.target))
        return (type(m).__module__, type(m).__qualname__, m.extra_repr(), m.training,
                tuple((k, tensor(t)) for k, t in (*m.named_parameters(), *m.named_buffers())))
    if node.op == "get_attr":
        obj: Any = gm
        for part in str(node.target).split("."):
            obj = getattr(obj, part)
        return tensor(obj) if isinstance(obj, torch.Tensor) else type(obj).__qualname__
    t = node.target
    return t if isinstance(t, str) else f"{getattr(t, '__module__', '')}.{getattr(t, '__qualname__', t)}"


def signature(gm: torch.fx.GraphModule, nodes: Sequence[str], costs: dict[str, NodeCost]) -> tuple[str, list[str]]:
    """The structure of the nodes `nodes` of `gm` (in graph order) as a hash, equal for two sets of nodes
    that compute alike whatever their names (two layers of a transformer), and the order that maps
    one onto the other: the nodes, with each value read from outside (another block's output, a
    model input, an attribute) at its first use, described by its shape."""
    return signatures(gm, [nodes], costs)[0]


def signatures(gm: torch.fx.GraphModule, sets: Sequence[Sequence[str]],
               costs: dict[str, NodeCost]) -> list[tuple[str, list[str]]]:
    """`signature` of each set of nodes, the graph indexed once."""
    by_name = {n.name: n for n in gm.graph.nodes}
    inputs = {n.name: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}

    def one(nodes: Sequence[str]) -> tuple[str, list[str]]:
        pos: dict[str, int] = {}
        order: list[str] = []
        parts: list[Any] = []

        def ref(a: torch.fx.Node) -> torch.fx.Node:
            if a.name not in pos:  # read from outside: described once
                pos[a.name] = len(order)
                order.append(a.name)
                c = costs.get(a.name)
                parts.append(("input", inputs[a.name]) if a.op == "placeholder" else
                             ("attr", _target(gm, a)) if a.op == "get_attr" else
                             ("value", c.shape, c.stride, c.dtype, c.requires_grad) if c is not None else
                             ("value", a.op, _target(gm, a)))
            return a
        for u in nodes:
            node = by_name[u]
            torch.fx.node.map_arg((node.args, node.kwargs), ref)
            args = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: f"%{pos[a.name]}")
            pos[u] = len(order)
            order.append(u)
            parts.append((node.op, _target(gm, node), repr(args)))
        return hashlib.sha1(repr(parts).encode()).hexdigest(), order
    return [one(nodes) for nodes in sets]


def _runnable(gm: torch.fx.GraphModule, nodes: list[str], stage_of: dict[str, int], costs: dict[str, NodeCost],
              flat_inputs: list[Any], device: torch.device, name: str) -> tuple[torch.fx.GraphModule, list[Any]]:
    """The nodes `nodes` of `gm` (a unit or a stage) as a module of their own with tensors on `device`
    (random values for meta ones), and inputs for it: stand-ins for the values made by other nodes
    of `stage_of`, the example's own tensors for the model inputs it reads."""
    own = set(nodes)
    by_name = {n.name: n for n in gm.graph.nodes}
    order = {n: i for i, n in enumerate(by_name)}
    output = next(n for n in gm.graph.nodes if n.op == "output")
    recv = sorted({a.name for u in nodes for a in by_name[u].all_input_nodes
                   if a.name in stage_of and a.name not in own}, key=order.__getitem__)
    sends = [by_name[u] for u in nodes if {x.name for x in by_name[u].users} - own or output in by_name[u].users]
    unit, inputs, _ = subgraph(gm, own, stage_of, recv, sends, name)
    unit = copy.deepcopy(unit)  # the model's modules stay as they are (meta, or on their device)
    materialize(unit, device)
    retarget(unit, device)
    return unit, [_input(costs[r], device) for r in recv] + [_example(flat_inputs[i], device) for i in inputs]


def _drop_grad(p: torch.Tensor) -> None:
    p.grad = None


def calibrate(gm: torch.fx.GraphModule, costs: dict[str, NodeCost], members: list[list[str]], bounds: Sequence[int],
              flat_inputs: list[Any], device: torch.device, *, repeats: int = 3,
              share: Share | None = None) -> list[tuple[float, float]]:
    """Time each stage of `bounds` (block bounds over `members`) whole on `device`, one stage's weights at a
    time (random values for meta ones), and scale its nodes' forward and backward ms in `costs`, in place,
    so that the stage's sums are what it measured: units timed alone miss what a stage run as one does
    (its caches, the allocator's state, the time ops lose or gain to their neighbours). Returns the
    measured (fwd ms, bwd ms) of every stage: the median of `repeats` runs after two warm-up runs, each
    parameter's gradient freed as soon as backward has made it (so the peak is the stage's weights and
    one microbatch's activations, not its gradients too; on a GPU the activations of the calls timed back
    to back, partition.costs.back_to_back, at most a quarter of the free device memory). This rank times
    its share of the stages, the stages s with s % world == rank (the pipeline's loop placement: with pipe,
    the stages it will run), and the rest is gathered through `share`; every rank must pass the same
    bounds."""
    share = share or Share()
    stage_of = {n: b for b, block in enumerate(members) for n in block}
    nodes = [[u for b in range(lo, hi) for u in members[b]] for lo, hi in zip(bounds[:-1], bounds[1:])]
    mine: dict[int, tuple[float, float]] = {}
    for s in range(share.rank, len(nodes), share.world):
        stage, flat = _runnable(gm, nodes[s], stage_of, costs, flat_inputs, device, f"Stage{s}")
        hooks = [p.register_post_accumulate_grad_hook(_drop_grad) for p in stage.parameters() if p.requires_grad]
        with preserve_state(stage):
            mine[s] = whole_graph_ms(stage.forward, flat, repeats, warmup=2)
        for h in hooks:
            h.remove()
        del stage, flat, hooks
        release_memory(1)
    parts = [mine] if share.gather is None else share.gather(mine)
    got = {s: t for part in parts for s, t in part.items()}
    out = []
    for s, stage_nodes in enumerate(nodes):
        fwd, bwd = got[s]
        for total, key in ((fwd, "fwd_ms"), (bwd, "bwd_ms")):
            was = sum(getattr(costs[u], key) for u in stage_nodes)
            for u in stage_nodes:
                c = costs[u]
                setattr(c, key, getattr(c, key) * total / was if was > 0 else total / len(stage_nodes))
        out.append((fwd, bwd))
    return out


def measure_blocks(gm: torch.fx.GraphModule, costs: dict[str, NodeCost], members: list[list[str]],
                   flat_inputs: list[Any], device: torch.device, param_bytes: dict[str, int], *,
                   repeats: int = 5, sweeps: int = 3, share: Share | None = None) -> None:
    """Time the blocks of `members` on `device`, in units of consecutive blocks (`segments`: at most a
    64th of the parameters or 4 MiB each, or one block, aligned with the model's repetition), and
    write each node's measured times and saved bytes into `costs`, in place.

    Units of one structure (`signature`: a transformer's layers) are measured once, and every unit
    like it takes the figures, node by node in the order that maps one onto the other. Of the units
    to measure, this rank measures its share and the rest is gathered through `share`. They are swept
    `sweeps` times, each time materialized, timed (a warm-up round, then `repeats // sweeps` rounds, at
    least one) and freed, and each node takes the median over the sweeps: a burst of load on the
    machine then hits one sample of a unit, not all of them. A storage made outside the unit it is
    measured in keeps the size and identity the whole-graph analysis found (a view across a unit
    boundary is one storage, not two)."""
    share = share or Share()
    stage_of = {n: b for b, block in enumerate(members) for n in block}
    units = segments(members, costs, param_bytes, kinds=[sig for sig, _ in signatures(gm, members, costs)])
    shapes = signatures(gm, [[u for b in unit for u in members[b]] for unit in units], costs)
    first: dict[str, int] = {}  # a structure -> the unit measured for it
    like = [first.setdefault(sig, k) for k, (sig, _) in enumerate(shapes)]
    measured = sorted(set(like))
    found_saved: dict[str, dict[str, int]] = {}  # a measured node -> its saved storages (the first sweep)
    made: dict[int, set[str]] = {}  # a measured unit -> the nodes whose storages it allocates
    times: dict[str, list[tuple[float, float]]] = {}
    for sweep in range(sweeps):
        for k in measured[share.rank::share.world]:
            nodes = [u for b in units[k] for u in members[b]]
            own = set(nodes)
            unit, flat = _runnable(gm, nodes, stage_of, costs, flat_inputs, device, f"Unit{k}")
            rounds = max(1, repeats // sweeps)
            if sweep == 0:  # the bytes too (one observed pass); later sweeps only time
                found = node_costs(unit, flat, cost="measured", repeats=rounds, reference=False)
                found_saved.update((u, found[u].saved) for u in nodes)
                made[k] = own | {n.name for n in unit.graph.nodes if n.name not in stage_of and n.op != "placeholder"}
            else:
                found = {n.name: NodeCost() for n in unit.graph.nodes if n.op.startswith("call")}
                with preserve_state(unit):
                    time_nodes(unit, flat, found, rounds)
            for u in nodes:
                times.setdefault(u, []).append((found[u].fwd_ms, found[u].bwd_ms))
            del unit, flat, found
            release_memory(1)  # the unit's modules: young objects in reference cycles (fx's per-module classes)
    mine: dict[str, dict[str, Any]] = {
        u: dict(saved=found_saved[u], made=made[k], fwd_ms=statistics.median(f for f, _ in times[u]),
                bwd_ms=statistics.median(b for _, b in times[u]))
        for k in measured[share.rank::share.world] for u in (x for b in units[k] for x in members[b])}
    parts = [mine] if share.gather is None else share.gather(mine)
    got = {u: fields for part in parts for u, fields in part.items()}
    for k, unit_blocks in enumerate(units):
        rename = dict(zip(shapes[like[k]][1], shapes[k][1]))  # the measured unit's names -> this unit's
        source = dict(zip(shapes[k][1], shapes[like[k]][1]))
        for u in (x for b in unit_blocks for x in members[b]):
            fields = got[source[u]]
            c = costs[u]
            made_here = {rename.get(x, x) for x in fields["made"]}
            saved = {}
            for sid, nb in fields["saved"].items():
                owner = storage_owner(sid)
                saved[rename.get(owner, owner) + sid[len(owner):]] = nb
            saved = {sid: nb for sid, nb in saved.items() if storage_owner(sid) in made_here}
            saved.update({sid: nb for sid, nb in c.saved.items() if storage_owner(sid) not in made_here})
            c.saved = saved
            c.saved_bytes = sum(nb for sid, nb in saved.items() if "@" in sid)
            c.saves_output = u in {storage_owner(sid) for sid in saved if "@" not in sid}
            c.saved_inputs = {storage_owner(sid) for sid in saved if "@" not in sid} - {u}
            c.fwd_ms, c.bwd_ms = fields["fwd_ms"], fields["bwd_ms"]
