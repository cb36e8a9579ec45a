"""Per-stage memory plan from one budget: predicted peaks, the recompute knapsack, offload choices.

Pure: plain data in, no tensors or processes (numpy for the knapsack). Legend: A activation bytes
a microbatch saves for backward, L bytes the loss saves (last stage), R bytes a microbatch frees by
recomputing nodes on unpack, n microbatches in flight on the stage, F fixed bytes (model state and
communication buffers).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import numpy as np

from memory.chunks import residency
from memory.timeline import Point, default_points, peak_of, room_per_mb
from partition.costs import storage_owner
from partition.errors import FxpipeError
from partition.plan import human_bytes

__all__ = ["RECOMPUTE", "OFFLOAD", "BudgetError", "NodeInfo", "Region", "Chunking", "StageInfo", "StageChoice",
           "check_options", "choose", "knapsack", "human"]

RECOMPUTE = ("none", "full", "selective", "auto")
OFFLOAD = ("none", "activations", "states", "all")
COPY_BYTES_PER_MS = 5e6  # default host <-> device copy speed that prices offloading (5 GB/s)


class BudgetError(FxpipeError, ValueError):
    """The memory budget cannot be met; `needed_bytes` is the smallest per-stage budget that can."""

    def __init__(self, message: str, needed_bytes: float) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes


def check_options(recompute: str, offload: str) -> None:
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r} is not a policy; choose one of {', '.join(RECOMPUTE)}")
    if offload not in OFFLOAD:
        raise ValueError(f"offload={offload!r} is not an offload mode; choose one of {', '.join(OFFLOAD)}")


def human(x: float) -> str:
    return human_bytes(x, 2)


@dataclass(frozen=True)
class NodeInfo:
    """One fx node of a stage, as the recompute planner sees it (bytes per microbatch)."""
    name: str
    fwd_ms: float          # forward time: what recomputing it costs
    out_bytes: int = 0     # its output: what a recomputation holds for a moment in the backward
    remat_bytes: int = 0   # saved bytes that recomputing it on unpack frees (predicted; 0 when unknown)
    remat: bool = False    # may be recomputed on unpack (not a matmul, not random, a fresh output)
    params: bool = False   # reads parameters (not recomputed when they stream in chunks: states offload)
    temp_bytes: int = 0    # temporaries it saves for backward
    saved_by: tuple[str, ...] = ()  # nodes that may save its output (storage) for backward: () for views
    saved: tuple[tuple[str, int], ...] = ()  # storages it saves for backward, in order: (id, bytes) (partition
    # .costs ids: the owner node's name, '#k' for its k-th other output, '@k' for a temporary)
    reads: tuple[str, ...] = ()  # the stage's nodes whose storages its tensor inputs are (views: their base)


@dataclass(frozen=True)
class Region:
    """A run of a stage's nodes that can be checkpointed on its own (memory.regions; bytes per mb)."""
    nodes: tuple[str, ...]
    fwd_ms: float          # what recomputing it costs
    in_bytes: int          # values entering it from the stage's own nodes: a checkpoint keeps them
    entering: tuple[str, ...] = ()  # the nodes owning their storages


@dataclass(frozen=True)
class Chunking:
    """One cut of a stage's parameters into chunks (memory.chunks), for streaming them (states offload)."""
    elems: int             # elements of one chunk
    nbytes: int            # bytes of one chunk's parameters (its grads take as much again)
    count: int             # chunks of the stage
    need: int              # chunks one node needs at once (one more lets prefetch work)
    groups: tuple[tuple[int, ...], ...] = ()  # the chunks each parameter node reads, in forward order


@dataclass(frozen=True)
class StageInfo:
    """What the planner needs to know about one stage (bytes per microbatch unless noted)."""
    index: int
    nodes: tuple[NodeInfo, ...]
    act_bytes: int         # A: saved for backward without recompute
    loss_bytes: int        # L: saved by the loss (last stage only)
    in_flight: int         # n
    param_bytes: int
    comm_bytes: int        # peak bytes of communication buffers over a step
    chunkings: tuple[Chunking, ...] = ()  # the chunk sizes states offload may stream the parameters in
    microbatches: int = 1
    copy_bytes_per_ms: float = COPY_BYTES_PER_MS  # what offloading costs, against the nodes' fwd_ms
    regions: tuple[Region, ...] = ()  # checkpointable on their own (none under zero-bubble schedules)
    points: tuple[Point, ...] = ()  # memory.timeline's points of the stage's program (() : from n and comm)
    actions: tuple[str, ...] = ()  # its compute actions' kinds in program order (what Point.act indexes)
    fused_points: tuple[Point, ...] = ()  # under zero bubble, the points with its B a BW and its W gone:
    # what the stage runs when it recomputes (memory.fused_backward), its activations freed at BW

    def timeline(self) -> tuple[Point, ...]:
        return self.points or default_points(self.in_flight, self.comm_bytes)


@dataclass
class StageChoice:
    """The memory plan of one stage."""
    stage: int
    recompute: str                      # none, full, selective or auto
    full: bool = False                  # whole-stage checkpoint per microbatch
    remat: frozenset[str] = frozenset()  # nodes whose outputs are recomputed on unpack
    regions: tuple[tuple[str, ...], ...] = ()  # node runs checkpointed each on its own
    of_regions: int = 0                 # how many regions the stage has
    offload_activations: bool = False
    offload_states: bool = False
    resident_chunks: int = 0            # parameter chunks the device holds at once (states offload)
    chunk_elems: int = 0                # elements of one of them
    predicted_peak: float = 0.0
    peak_if_grads_kept: float = 0.0     # the predicted peak when grads exist as the step begins
    param_bytes: float = 0.0            # the stage's parameters (their optimizer state scales with them)
    recompute_ms: float = 0.0           # extra forward time per microbatch
    move_ms: float = 0.0                # host <-> device copy time per microbatch (offload)
    parts: dict[str, float] = field(default_factory=dict)

    @property
    def cost_ms(self) -> float:
        return self.recompute_ms + self.move_ms

    @property
    def plain(self) -> bool:
        """Neither recompute nor offload: autograd keeps what the forward saves, as it would alone."""
        return not (self.recomputes or self.offload_activations or self.offload_states)

    @property
    def recomputes(self) -> bool:
        """Runs some of its forward again in the backward (a checkpoint, or saves recomputed on unpack)."""
        return self.checkpointed or bool(self.remat)

    @property
    def checkpointed(self) -> bool:
        return self.full or bool(self.regions)

    def recomputed_nodes(self, stage_nodes: int) -> int:
        """How many of the stage's `stage_nodes` fx nodes run again per microbatch: all under a whole-stage
        checkpoint, else those of its checkpointed regions and those recomputed on unpack."""
        return stage_nodes if self.full else sum(len(r) for r in self.regions) + len(self.remat)

    def label(self) -> str:
        """Short description for the plan table, e.g. 'remat 12+act' or 'full+states'."""
        text = self.recompute
        if self.recompute == "auto":
            text = "full" if self.full else (f"remat {len(self.remat)}" if self.remat else "none")
            if self.regions:
                text = f"ckpt {len(self.regions)}/{self.of_regions}" + (f"+remat {len(self.remat)}" if self.remat
                                                                        else "")
        extra = [x for x, on in (("act", self.offload_activations), ("states", self.offload_states)) if on]
        return "+".join([text] + extra)


def knapsack(weights: Sequence[float], values: Sequence[float], capacity: float, resolution: int = 2000
             ) -> list[int]:
    """Indices of a 0/1 knapsack solution: the most value with total weight <= capacity.

    Exact on weights rounded up to capacity/resolution (so the result never exceeds the
    capacity); O(n * resolution) time with numpy. Items of weight 0 are always taken.
    """
    if capacity < 0:
        return []
    free = [i for i, w in enumerate(weights) if w <= 0]
    items = [i for i, w in enumerate(weights) if w > 0 and values[i] > 0]
    if not items:
        return free
    unit = max(capacity / resolution, 1e-12)
    g = functools.reduce(math.gcd, [int(weights[i]) for i in items])
    if g >= unit and all(float(weights[i]).is_integer() for i in items):
        unit = g  # a common divisor at least as coarse: exact
    w = [int(math.ceil(weights[i] / unit - 1e-9)) for i in items]
    q = min(resolution, int(capacity / unit + 1e-9))
    best = np.zeros(q + 1)                                 # best[c]: most value within weight c
    take = np.zeros((len(items), q + 1), dtype=bool)
    for k, (i, wk) in enumerate(zip(items, w)):
        if wk > q:
            continue
        cand = best[:q + 1 - wk] + values[i]
        better = cand > best[wk:]
        take[k, wk:] = better
        best[wk:] = np.where(better, cand, best[wk:])
    chosen, c = [], q
    for k in range(len(items) - 1, -1, -1):
        if take[k, c]:
            chosen.append(items[k])
            c -= w[k]
    return sorted(free + chosen)


Streaming = tuple[Chunking, int] | None  # a chunking and how many of its chunks stay resident; None: no streaming


def _state(st: StageInfo, optim_factor: float, stream: Streaming) -> float:
    """Model state on the device: everything (stream None), or the resident chunks of params and grads."""
    if stream is None:
        return st.param_bytes * (2.0 + optim_factor)
    return 2.0 * stream[1] * stream[0].nbytes


def _per_mb(st: StageInfo, kind: str, offload: bool, freed: float = 0.0, transient: float = 0.0
            ) -> tuple[float, float, float]:
    """(kept, bundle, work) bytes of a plan, per microbatch (memory.timeline): kind 'full' (whole-stage
    checkpoint: a microbatch keeps nothing of its own, its backward recomputes it all), else what a
    microbatch saves less `freed` (recomputed on unpack), on the device or (offloaded) back on it
    before its backward, with `transient` (recomputed outputs alive in the backward) as work."""
    if kind == "full":
        return st.loss_bytes, 0.0, st.act_bytes
    if offload:  # recomputing on unpack frees little then (a recipe's inputs are on the host)
        return 0.0, st.act_bytes - freed + st.loss_bytes, transient
    return st.act_bytes - freed + st.loss_bytes, 0.0, transient


def _profile(st: StageInfo, stream: Streaming) -> list[float] | None:
    """Streamed params and grads on the device at each of the stage's points, as the store moves its chunks
    (memory.chunks.residency over the stage's uses: a forward's in forward order, a backward's reversed);
    None without streaming, without the program's points, or under zero bubble (its W visits the
    parameter nodes in the order it differentiates them, and pins the ones several nodes read)."""
    if stream is None or not st.actions or not st.points or not stream[0].groups or "W" in st.actions:
        return None
    ch, r = stream
    seq: list[tuple[int, ...]] = []
    windows, backward = [], []
    for kind in st.actions:
        groups = list(ch.groups) if kind == "F" else list(ch.groups[::-1])
        windows.append((len(seq), len(seq) + len(groups)))
        seq += groups
        backward += [kind != "F"] * len(groups)
    held = residency(seq, backward, r)
    during, end, last = [], [], 0
    for a, b in windows:
        during.append(max([last] + [most for most, _ in held[a:b]]))
        last = held[b - 1][1] if b > a else last
        end.append(last)
    return [0.0 if p.act < 0 else float((during if p.during else end)[p.act] * ch.nbytes) for p in st.points]


def _predict(c: StageChoice, st: StageInfo, state: float, kept: float, bundle: float, work: float,
             profile: list[float] | None = None, work_end: float | None = None) -> None:
    """The plan's predicted peak, by kind at the point of the program where the stage holds the most.
    `state` holds the grads (when chunks stream, the resident chunks' params and grads alike): a step
    that begins without them (torch's zero_grad) has them from the stage's first backward on; streamed
    chunks load their grads from the host only in a backward, whatever the step began with. `profile`:
    the streamed state at each point (memory.chunks.residency), in place of `state`; `work_end`: the
    working set still held as a backward ends (its messages move then), when less than `work`."""
    if profile is not None:
        peak, acts, comm, held = peak_of(st.points, kept, bundle, work, 0.0, profile, work_end)
        c.parts = {"state": held, "activations": acts, "comm": comm}
        c.predicted_peak = c.peak_if_grads_kept = peak
        c.param_bytes = float(st.param_bytes)
        return
    grads = state / 2 if c.offload_states else float(st.param_bytes)
    fixed = state - grads
    peak, acts, comm, held = peak_of(st.timeline(), kept, bundle, work, grads, work_end=work_end)
    c.parts = {"state": fixed + held, "activations": acts, "comm": comm}
    c.predicted_peak = fixed + peak
    c.peak_if_grads_kept = c.predicted_peak if c.offload_states else \
        fixed + grads + peak_of(st.timeline(), kept, bundle, work, work_end=work_end)[0]
    c.param_bytes = float(st.param_bytes)


def _move_ms(st: StageInfo, stream: Streaming) -> float:
    """Copy time per microbatch of streaming chunks: with every chunk resident, one fetch and one
    write-back a step; else each microbatch's forward fetches the absent share of the params and
    its backward the params and grads (in and out)."""
    if stream is None or not stream[0].count:
        return 0.0
    per_step = 2.0 * st.param_bytes / max(st.microbatches, 1)
    absent = max(0.0, 1.0 - stream[1] / stream[0].count)
    return (per_step + absent * 4.0 * st.param_bytes) / st.copy_bytes_per_ms


def _streamed(st: StageInfo, stream: Streaming) -> dict[str, Any]:
    """A StageChoice's fields for a streaming."""
    if stream is None:
        return {}
    return {"offload_states": True, "resident_chunks": stream[1], "chunk_elems": stream[0].elems,
            "move_ms": _move_ms(st, stream)}


def _streamings(st: StageInfo) -> list[Streaming]:
    """Streamings worth trying: each chunking with resident counts from what one node needs up to every
    chunk (8 at most)."""
    out: list[Streaming] = []
    for ch in st.chunkings:
        lo, hi = ch.need, ch.count
        counts = range(lo, hi + 1) if hi - lo <= 8 else sorted({lo + round(k * (hi - lo) / 7) for k in range(8)})
        out += [(ch, r) for r in counts]
    return out


def _transient(nodes: Sequence[NodeInfo]) -> float:
    """Recomputed outputs alive at once in a backward: the manager holds the last two."""
    return float(sum(sorted((x.out_bytes for x in nodes), reverse=True)[:2]))


def _ring_peak(st: StageInfo, rematted: Sequence[NodeInfo]) -> tuple[float, float]:
    """Recomputed outputs alive at once in a backward as the manager holds them (the last two it made),
    at most and as the backward ends: it unpacks the saves in reverse order of the nodes that saved them,
    each node's own in an order not known here, so any two neighbours may be held together: two saves
    next to each other in one node, or either end of a node with either end of the next one. As the
    backward ends (its messages move while the last two are held) the most too: autograd reaches the nodes
    in an order of its own, not the graph's reversed where branches meet (found by review: the last node's
    pair fell 98 KB short on a Hugging Face Llama). From the stage's saves when known, else the two largest
    outputs."""
    mine = {x.name: x.out_bytes for x in rematted}
    if not mine or not any(x.saved for x in st.nodes):
        return _transient(rematted), _transient(rematted)
    runs = [r for r in ([sid for sid in dict.fromkeys(s for s, _ in x.saved) if sid in mine]
                        for x in reversed(st.nodes)) if r]
    if not runs:  # no save is a recomputed output's (built under an autocast, a node saves the copy the op casts)
        return _transient(rematted), _transient(rematted)

    def pairs(a: list[str], b: list[str] | None) -> float:
        inside = [mine[u] + mine[v] for u, v in zip(a, a[1:])]
        across = [mine[u] + mine[v] for u in {a[0], a[-1]} for v in {b[0], b[-1]} if u != v] if b else []
        return float(max(inside + across + [mine[u] for u in a]))
    peak = max(pairs(a, b) for a, b in zip(runs, runs[1:] + [None]))
    return peak, peak


def _walk_saves(st: StageInfo, remat: frozenset[str], offload: bool, chosen: Sequence[Region] = ()
                ) -> tuple[float, list[NodeInfo], set[str]]:
    """(bytes, recomputed nodes, storage ids) a microbatch keeps when the nodes in `remat` are recomputed
    on unpack and the `chosen` regions checkpointed, decided save by save as the memory manager does: a
    storage a recipe stands for is not kept when every storage the recipe reads is held on the device by
    then (offloaded, none is); a checkpointed region keeps what enters it and none of its nodes' saves.
    Storages made on another stage or given to the model are not counted (held anyway)."""
    mine = {x.name: x for x in st.nodes}
    starts = {r.nodes[0]: r for r in chosen}
    off = {m for r in chosen for m in r.nodes}
    held: set[str] = set()
    kept, rematted = 0.0, {}
    for x in st.nodes:
        for o in starts[x.name].entering if x.name in starts else ():
            if o in mine and o not in held:
                held.add(o)
                kept += mine[o].out_bytes
        if x.name in off:
            continue
        for sid, nb in x.saved:
            owner = storage_owner(sid)
            if owner not in mine or sid in held:
                continue
            if owner in remat and sid == owner and not (offload and mine[owner].reads) and \
                    all(r in held for r in mine[owner].reads):
                rematted[owner] = mine[owner]
                continue
            held.add(sid)
            kept += nb
    return kept, list(rematted.values()), held


def _kept_bytes(st: StageInfo, remat: frozenset[str], offload: bool) -> tuple[float, list[NodeInfo]]:
    """What a microbatch saves when the nodes in `remat` are recomputed on unpack (_walk_saves), and the
    nodes recomputed."""
    kept, rematted, _ = _walk_saves(st, remat, offload)
    return kept, rematted


def _freed(st: StageInfo, remat: list[NodeInfo], offload: bool) -> tuple[float, list[NodeInfo]]:
    """(bytes a microbatch frees by recomputing `remat` on unpack, the nodes that are recomputed): from
    the saves of the stage's nodes when they are known, else each node's own figure (none offloaded)."""
    if not any(x.saved for x in st.nodes):
        return (0.0 if offload else float(sum(x.remat_bytes for x in remat))), remat
    names = frozenset(x.name for x in remat)
    every, _ = _kept_bytes(st, frozenset(), offload)
    kept, rematted = _kept_bytes(st, names, offload)
    return every - kept, rematted


def _remattable(st: StageInfo, states: bool) -> list[NodeInfo]:
    """Nodes that may be recomputed on unpack; with streamed state chunks, not those reading parameters
    (their chunk could push out the one the backward op recomputing them is using)."""
    return [x for x in st.nodes if x.remat and not (states and x.params)]


def _remat_set(st: StageInfo, room: float, states: bool) -> list[NodeInfo] | None:
    """The nodes to recompute on unpack so that n microbatches' activations fit in `room`, at the least
    recompute time: a knapsack keeps the outputs worth the most time per byte. None: they cannot fit."""
    items = [x for x in _remattable(st, states) if x.remat_bytes > 0]
    transient = _transient(items)
    need = st.act_bytes + st.loss_bytes - room_per_mb(st.timeline(), room, 0.0, transient)  # each must free
    total = sum(x.remat_bytes for x in items)
    if need > total:
        return None
    kept = set(knapsack([x.remat_bytes for x in items], [x.fwd_ms for x in items], total - max(need, 0.0)))
    return [x for i, x in enumerate(items) if i not in kept]


def _saved_bound(st: StageInfo, off: set[str]) -> float:
    """Upper bound of what a microbatch saves when the nodes in `off` save nothing (checkpointed): the
    outputs some other node may save, the others' temporaries, the model inputs."""
    return float(sum(x.out_bytes for x in st.nodes if any(y not in off for y in x.saved_by))
                 + sum(x.temp_bytes for x in st.nodes if x.name not in off))


def _recomputed_bound(st: StageInfo, region: Region) -> float:
    """Upper bound of what recomputing a region saves again: outputs of its nodes saved inside it, and
    its temporaries (what enters it is held already)."""
    inside = set(region.nodes)
    return float(sum(x.out_bytes for x in st.nodes if x.name in inside
                     and any(y in inside for y in x.saved_by))
                 + sum(x.temp_bytes for x in st.nodes if x.name in inside))


def _region_saves(st: StageInfo, chosen: Sequence[Region], remat: frozenset[str]
                  ) -> tuple[float, float, float] | None:
    """(kept, work, work as the backward ends) per microbatch when the `chosen` regions are checkpointed
    and the nodes in `remat` recomputed on unpack, save by save as the memory manager counts them: a
    microbatch keeps the storages the other nodes save (once; a recipe's when what it reads is not held)
    and those entering a checkpointed region; the backward recomputes one region at a time, saving again
    what its nodes save beyond those (the first region is recomputed last). None: saves not known."""
    if not any(x.saved for x in st.nodes) or any(r.in_bytes and not r.entering for r in chosen):
        return None
    mine = {x.name: x for x in st.nodes}
    kept, _, held = _walk_saves(st, remat, False, chosen)
    again = []
    for r in chosen:
        inside, seen, n = set(r.nodes), set(), 0.0
        for m in r.nodes:
            for sid, nb in mine[m].saved if m in mine else ():
                if storage_owner(sid) in inside and sid not in held and sid not in seen:
                    seen.add(sid)
                    n += nb
        again.append(n)
    ring = _ring_peak(st, [mine[m] for m in remat if m in mine])
    first = min(range(len(chosen)), key=lambda i: st.regions.index(chosen[i]))
    return kept, max(again) + ring[0], again[first] + ring[1]


def _region_plans(st: StageInfo, state: float, stream: Streaming) -> list[StageChoice]:
    """Checkpoint the k regions freeing the most bytes per ms (k = 1..K), with or without recomputing
    the other regions' cheap nodes on unpack; with streamed model state (`stream`), or all of
    it on the device (None). Bounds, not estimates: a microbatch keeps at most what the other regions
    may save (or A) and what enters the checkpointed ones; the backward recomputes one checkpointed
    region at a time (its chunks fetched as the recomputation reads them)."""
    # the 2% that A carries on top of the plan's figure (memory.build), for what the bounds cannot see:
    # storages wider than the tensors saved (a microbatch of the model inputs is a view of the batch)
    margin = st.act_bytes * 0.02 / 1.02
    freed = {r.nodes: _recomputed_bound(st, r) - r.in_bytes for r in st.regions}
    regs = sorted(st.regions, key=lambda r: -freed[r.nodes] / max(r.fwd_ms, 1e-9))
    nodes = {x.name: x for x in st.nodes}
    out = []
    for k in range(1, len(regs) + 1):
        chosen, rest = regs[:k], regs[k:]
        off = {m for r in chosen for m in r.nodes}
        others = [nodes[m] for r in rest for m in r.nodes if m in nodes and nodes[m].remat
                  and not (stream is not None and nodes[m].params)]  # as _remattable
        for remat in ([], [x for x in others if x.remat_bytes > 0]):
            kept = min(float(st.act_bytes), _saved_bound(st, off) + margin) - sum(x.remat_bytes for x in remat) \
                + sum(r.in_bytes for r in chosen)
            work = max(_recomputed_bound(st, r) for r in chosen) + _transient(remat)
            work_end = None
            exact = _region_saves(st, chosen, frozenset(x.name for x in remat))
            if exact is not None:  # the saves are known: the figures the manager will count, and 2% of them
                kept, work, work_end = 1.02 * exact[0], exact[1], exact[2]
            c = StageChoice(st.index, "auto", remat=frozenset(x.name for x in remat),
                            regions=tuple(r.nodes for r in sorted(chosen, key=st.regions.index)),
                            of_regions=len(regs), **_streamed(st, stream),
                            recompute_ms=sum(r.fwd_ms for r in chosen) + sum(x.fwd_ms for x in remat))
            _predict(c, st, state, kept + st.loss_bytes, 0.0, work, work_end=work_end)
            out.append(c)
    return out


def _candidates(st: StageInfo, recompute: str, offload: str, budget: float | None,
                optim_factor: float) -> list[StageChoice]:
    """Every plan the options allow for a stage, with its predicted peak and cost (ms per microbatch).

    Under 'auto' the offload modes are permissions: a stage offloads only where it pays.
    """
    s = st.index
    bw = replace(st, points=st.fused_points) if st.fused_points else st  # where a recomputing plan is walked
    acts_ok = offload in ("activations", "all")
    states_ok = offload in ("states", "all") and bool(st.chunkings)
    total_ms = sum(x.fwd_ms for x in st.nodes)
    if recompute == "auto":
        streams: list[Streaming] = [None]
        streams += _streamings(st) if states_ok else []
        kinds = ["none"] + (["act"] if acts_ok else []) + ["remat", "full"]
    else:
        streams = [None]
        if states_ok:  # without a budget: the default chunking, with one chunk more than a node needs (prefetch)
            ch = st.chunkings[-1]
            streams = _streamings(st) if budget is not None else [(ch, min(ch.count, ch.need + 1))]
        kinds = [recompute]
    out = []
    for r in streams:
        state = _state(st, optim_factor, r)
        profile = _profile(st, r)  # where the streamed chunks are: the same for every kind of plan
        for kind in kinds:
            remat: list[NodeInfo] = []
            if kind == "selective":
                remat = _remattable(st, r is not None)
            elif kind == "remat":
                if budget is None:
                    continue
                got = _remat_set(bw, budget - state, r is not None)
                if got == [] and bw is not st:  # it fits once its backward runs as BW, which recomputing
                    # anything brings (memory.fused_backward): its cheapest node that frees memory
                    got = sorted((x for x in _remattable(st, r is not None) if x.remat_bytes > 0),
                                 key=lambda x: x.fwd_ms)[:1]
                if not got:
                    continue
                remat = got
            act_off = kind == "act" or (acts_ok and recompute != "auto")
            freed, rematted = _freed(st, remat, act_off)
            ring = _ring_peak(st, rematted)
            per_mb = _per_mb(st, "full" if kind == "full" else "keep", act_off, freed, ring[0])
            c = StageChoice(s, recompute, full=kind == "full", remat=frozenset(x.name for x in remat),
                            offload_activations=act_off, **_streamed(st, r),
                            recompute_ms=total_ms if kind == "full" else sum(x.fwd_ms for x in remat))
            if act_off:
                c.move_ms += 2 * (st.act_bytes + st.loss_bytes) / st.copy_bytes_per_ms
            # a whole-stage checkpoint fetches chunks again as it recomputes: bounded by `state` instead
            _predict(c, bw if c.recomputes else st, state, *per_mb, profile=None if kind == "full" else profile,
                     work_end=None if kind == "full" else ring[1])
            out.append(c)
        if recompute == "auto" and len(st.regions) > 1:
            out += _region_plans(st, state, r)
    return out


def choose(stages: Sequence[StageInfo], *, recompute: str, offload: str, budget: float | None,
           optim_factor: float = 2.0, most: tuple[str, str] = ("auto", "all")) -> list[StageChoice]:
    """One StageChoice per stage, the least costly that fits the budget (ties: the smaller peak);
    BudgetError, with the smallest feasible budget, when a stage cannot fit, and what the most recompute
    and offload the pipeline allows (`most`: compiled stages allow neither recompute nor streamed state)
    would reach."""
    check_options(recompute, offload)
    out = []
    for st in stages:
        fitting = [c for c in _candidates(st, recompute, offload, budget, optim_factor)
                   if budget is None or c.predicted_peak <= budget]
        if not fitting:
            raise _infeasible(stages, recompute, offload, budget or 0.0, optim_factor, st.index, most)
        out.append(min(fitting, key=lambda c: (c.cost_ms, c.predicted_peak)))
    return out


def _least(st: StageInfo, recompute: str, offload: str, optim_factor: float) -> StageChoice:
    """The plan with the smallest peak stage `st` can reach with these options."""
    return min(_candidates(st, recompute, offload, 0.0, optim_factor), key=lambda c: c.predicted_peak)


def _infeasible(stages: Sequence[StageInfo], recompute: str, offload: str, budget: float, optim_factor: float,
                first: int, most: tuple[str, str] = ("auto", "all")) -> BudgetError:
    asked = max(_least(st, recompute, offload, optim_factor).predicted_peak for st in stages)
    bests = [_least(st, *most, optim_factor) for st in stages]
    c = max(bests, key=lambda c: c.predicted_peak)
    best = c.predicted_peak
    parts = ", ".join(f"{k} {human(v)}" for k, v in c.parts.items())
    if best > budget:
        return BudgetError(
            f"memory_budget={human(budget)} ({budget:.0f} bytes) per stage cannot be met even with "
            f"recompute={most[0]!r} and offload={most[1]!r}{_why_most(most)}: stage {c.stage} needs at least "
            f"{human(best)} ({parts}). "
            f"The smallest feasible budget for these stages is {best:.0f} bytes (the stages cut at this budget: "
            "another budget may cut them otherwise, needing more or less); fix: give memory_budget >= "
            f"{best:.0f}, use more stages, fewer or smaller microbatches", best)
    return BudgetError(
        f"memory_budget={human(budget)} ({budget:.0f} bytes) per stage is not met on stage {first} with "
        f"recompute={recompute!r} and offload={offload!r}; those need at least {human(asked)} ({asked:.0f} "
        f"bytes). Fix: give memory_budget >= {asked:.0f}"
        + (f", or recompute={most[0]!r} and offload={most[1]!r}{_why_most(most)} (they reach {human(best)}, "
           f"{best:.0f} bytes)" if (most[0], most[1]) != (recompute, offload) else ""), asked)


def _why_most(most: tuple[str, str]) -> str:
    return "" if most == ("auto", "all") else " (the most compiled stages allow)"
