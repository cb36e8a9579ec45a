"""Exact min-max cut of a block chain into pipeline stages, communication and memory counted."""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field

import networkx as nx
import numpy as np
import numpy.typing as npt

from partition.errors import FxpipeError
from partition.plan import human_bytes

__all__ = [
    "Chain", "CostModel", "InfeasibleBudget", "PartitionError", "Solution",
    "balance_by_param_count", "balance_by_time", "chain_from_dag", "evaluate", "even_split",
    "min_feasible_budget", "solve", "stage_bytes", "stage_ms",
]

# Legend: n blocks, S stages, s stage index, boundary i sits before block i (0..n),
# stage s holds blocks [a, b) = [bounds[s], bounds[s+1]), k = 1 or S rows (1 when uniform).
Floats = npt.NDArray[np.float64]
Num = float | Floats
_INF = float("inf")


class PartitionError(FxpipeError, ValueError):
    """A partitioning request that cannot be met as asked; the message says how to fix it."""


class InfeasibleBudget(PartitionError):
    """No partition fits the memory budget; `needed_bytes` is the least uniform budget that does."""

    def __init__(self, message: str, needed_bytes: float) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes


def _floats(name: str, values: npt.ArrayLike, size: int | None) -> Floats:
    arr = np.array(values, dtype=np.float64).reshape(-1)
    if size is not None and arr.size != size:
        raise PartitionError(f"Chain.{name} has {arr.size} entries, expected {size}")
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise PartitionError(f"Chain.{name} must be finite and >= 0 (got min {arr.min()})")
    arr.setflags(write=False)
    return arr


@dataclass(frozen=True, eq=False)
class Chain:
    """n blocks in topological order; any sequences given are stored as read-only arrays."""

    fwd_ms: Floats  # (n,) forward time per block
    bwd_ms: Floats  # (n,) backward time per block
    act_bytes: Floats  # (n,) bytes saved for backward per mb
    params: Sequence[tuple[int, ...]]  # (n,) parameter ids each block uses
    param_bytes: dict[int, int]  # bytes per parameter id
    cut_bytes: Floats  # (n+1,) bytes live across boundary i; 0 at both ends
    names: Sequence[str] | None = None
    ref_ms: Floats | None = None  # (n,) fwd+bwd by a deterministic model (FLOPs): breaks near-ties stably
    _work: Floats = field(init=False, repr=False)  # (n+1,) prefix sum of fwd+bwd
    _act: Floats = field(init=False, repr=False)  # (n+1,) prefix sum of act_bytes

    def __post_init__(self) -> None:
        fwd = _floats("fwd_ms", self.fwd_ms, None)
        n = fwd.size
        if n == 0:
            raise PartitionError("Chain has no blocks; give at least one block")
        put = object.__setattr__
        put(self, "fwd_ms", fwd)
        put(self, "bwd_ms", _floats("bwd_ms", self.bwd_ms, n))
        put(self, "act_bytes", _floats("act_bytes", self.act_bytes, n))
        put(self, "cut_bytes", _floats("cut_bytes", self.cut_bytes, n + 1))
        put(self, "params", tuple(tuple(dict.fromkeys(p)) for p in self.params))
        put(self, "param_bytes", dict(self.param_bytes))
        if len(self.params) != n:
            raise PartitionError(f"Chain.params has {len(self.params)} entries, expected {n}")
        missing = {p for ps in self.params for p in ps} - set(self.param_bytes)
        if missing:
            raise PartitionError(f"parameter ids {sorted(missing)[:5]} are used by blocks "
                                 "but missing from Chain.param_bytes; add their sizes")
        if self.cut_bytes[0] != 0 or self.cut_bytes[n] != 0:
            raise PartitionError(f"Chain.cut_bytes[0] and [n] must be 0 (got "
                                 f"{self.cut_bytes[0]}, {self.cut_bytes[n]})")
        if self.names is not None:
            put(self, "names", tuple(self.names))
            if len(self.names) != n:
                raise PartitionError(f"Chain.names has {len(self.names)} entries, expected {n}")
        if self.ref_ms is not None:
            put(self, "ref_ms", _floats("ref_ms", self.ref_ms, n))
        put(self, "_work", np.concatenate([[0.0], np.cumsum(self.fwd_ms + self.bwd_ms)]))
        put(self, "_act", np.concatenate([[0.0], np.cumsum(self.act_bytes)]))

    @property
    def n(self) -> int:
        """Number of blocks."""
        return int(self.fwd_ms.size)


@dataclass(frozen=True)
class CostModel:
    """How stage time and stage memory are priced (see `_time` and `_memory`)."""

    bytes_per_ms: float = 1e6  # link bandwidth (1e6 B/ms ~ 1 GB/s)
    latency_ms: float = 0.05  # per transfer
    state_factor: float = 4.0  # bytes held per parameter byte (weight, grad, Adam state)
    in_flight: tuple[int, ...] | None = None  # (S,) mbs whose activations stage s keeps
    speeds: tuple[float, ...] | None = None  # (S,) relative device speed per stage
    memory_budget: float | tuple[float, ...] | None = None  # bytes per stage
    extra_bytes: float = 0.0  # fixed per-stage overhead
    params_every_stage: bool = False  # only stages that hold a parameter (so each rank has an optimizer)
    # recompute or activation offload may be planned (by memory/): count per mb in flight only the
    # received inputs and sent outputs, no saved activations (memory/ may recompute or offload any of
    # them, in regions finer than a block), so no split memory/ can fit is refused
    activation_floor: bool = False
    # measured costs are noisy: splits whose slowest stage is within this fraction of the fastest
    # split's count as equal, and among them the most even by Chain.ref_ms is taken (by the
    # measured times where the chain has no ref_ms), so a fresh measurement gives the same split
    tolerance: float = 0.0

    def __post_init__(self) -> None:
        if not self.bytes_per_ms > 0:
            raise PartitionError(f"CostModel.bytes_per_ms={self.bytes_per_ms} must be positive "
                                 "(inf prices transfers at latency_ms alone)")
        for name in ("latency_ms", "state_factor", "extra_bytes", "tolerance"):
            if not getattr(self, name) >= 0:
                raise PartitionError(f"CostModel.{name}={getattr(self, name)} must be >= 0")

    def transfer_ms(self, n_bytes: Num) -> Num:
        """Time to send one value of `n_bytes` (0 when nothing crosses)."""
        sent = self.latency_ms + np.asarray(n_bytes) / self.bytes_per_ms
        return np.where(np.asarray(n_bytes) > 0, sent, 0.0)


@dataclass(frozen=True)
class Solution:
    """A partition and its predicted per-stage time and memory."""

    bounds: tuple[int, ...]  # (S+1,) 0 = c_0 < ... < c_S = n
    bottleneck_ms: float
    stage_ms: tuple[float, ...]  # (S,)
    stage_bytes: tuple[float, ...]  # (S,)


def _time(compute: Num, speed: Num, comm_in: Num, comm_out: Num) -> Num:
    """T_s(a, b): the one definition of stage time, shared by the DP and the reports."""
    return compute / speed + comm_in + comm_out


def _memory(cost: CostModel, union: Num, in_flight: Num, act: Num, cut_in: Num,
            cut_out: Num) -> Num:
    """M_s(a, b): the one definition of stage memory, shared by the DP and the reports.

    Each microbatch in flight holds its saved activations, its received inputs (kept for
    their grads) and its sent outputs (the roots of its backward). With `activation_floor`
    (recompute or offload allowed) the saved activations are left to memory/: the figure is
    then less than any of its policies holds.
    """
    saved = 0.0 if cost.activation_floor else act
    return cost.state_factor * union + in_flight * (saved + cut_in + cut_out) + cost.extra_bytes


@dataclass(frozen=True)
class _PerStage:
    speed: Floats  # (S,)
    in_flight: Floats  # (S,)
    budget: Floats | None  # (S,)


def _check_stages(chain: Chain, n_stages: int) -> None:
    if n_stages < 1:
        raise PartitionError(f"n_stages must be at least 1 (got {n_stages})")
    if n_stages > chain.n:
        raise PartitionError(f"n_stages={n_stages} but the graph has only {chain.n} cuttable "
                             f"blocks; use at most {chain.n} stages or coarsen less")


def _per_stage(cost: CostModel, n_stages: int, *, budget: bool = True) -> _PerStage:
    def vector(name: str, given: float | Sequence[float] | None, default: float) -> Floats:
        if given is None:
            return np.full(n_stages, default)
        if np.ndim(given) == 0:
            return np.full(n_stages, float(given))  # type: ignore[arg-type]
        arr = np.array(given, dtype=np.float64)
        if arr.size != n_stages:
            raise PartitionError(f"cost.{name} has {arr.size} entries but n_stages={n_stages}; "
                                 f"give one per stage")
        return arr

    speed = vector("speeds", cost.speeds, 1.0)
    if np.any(~(speed > 0)) or not np.all(np.isfinite(speed)):
        raise PartitionError(f"cost.speeds must be positive and finite (got {cost.speeds})")
    in_flight = vector("in_flight", cost.in_flight, 1.0)
    if np.any(~(in_flight >= 0)):
        raise PartitionError(f"cost.in_flight must be >= 0 (got {cost.in_flight})")
    limit = None
    if budget and cost.memory_budget is not None:
        limit = vector("memory_budget", cost.memory_budget, _INF)
        for s, v in enumerate(limit):
            if not v > 0:
                raise PartitionError(f"memory_budget for stage {s} is {v}; it must be positive "
                                     "(bytes per stage), or None for no limit")
    return _PerStage(speed, in_flight, limit)


def _column(values: Floats) -> Floats:
    """(S,) -> (k, 1): one row when every stage shares the value (broadcasts to all)."""
    return values[:1, None] if np.all(values == values[0]) else values[:, None]


def _union_rows(chain: Chain) -> Iterator[npt.NDArray[np.int64]]:
    """For b = 1..n, (b,) bytes of the union of parameters used by blocks [a, b), a < b.

    A parameter is in the union iff its last use before b is >= a, so with `last` the
    bytes keyed by last-use position, the row is a reverse cumulative sum of `last[:b]`.
    """
    last = np.zeros(chain.n, dtype=np.int64)
    where: dict[int, int] = {}
    for b in range(1, chain.n + 1):
        for p in chain.params[b - 1]:
            if p in where:
                last[where[p]] -= chain.param_bytes[p]
            last[b - 1] += chain.param_bytes[p]
            where[p] = b - 1
        yield np.cumsum(last[b - 1::-1])[::-1]


def _comm(chain: Chain, cost: CostModel) -> Floats:
    """(n+1,) activation forward plus gradient backward across each boundary."""
    return np.asarray(2.0 * cost.transfer_ms(chain.cut_bytes), dtype=np.float64)


def _memory_rows(chain: Chain, cost: CostModel, per: _PerStage) -> Iterator[Floats]:
    """For b = 1..n, (k, b) memory of a last stage [a, b) for every a < b."""
    in_flight, cut, act = _column(per.in_flight), chain.cut_bytes, chain._act
    for b, union in enumerate(_union_rows(chain), start=1):
        yield np.asarray(_memory(cost, union.astype(np.float64), in_flight, act[b] - act[:b],
                                 cut[:b], cut[b]))


def _time_rows(chain: Chain, cost: CostModel, per: _PerStage, *, limit: float = _INF,
               square: bool = False) -> Iterator[Floats]:
    """For b = 1..n, (k, b) time of a last stage [a, b); inf where memory or `limit` forbid.
    `square`: the square of the stage's time by Chain.ref_ms where the chain has them."""
    comm, work, speed = _comm(chain, cost), chain._work, _column(per.speed)
    ref = work if chain.ref_ms is None else np.concatenate([[0.0], np.cumsum(chain.ref_ms)])
    mems = _memory_rows(chain, cost, per) if per.budget is not None else None
    budget = _column(per.budget) if per.budget is not None else None
    held = np.concatenate([[0], np.cumsum([len(p) > 0 for p in chain.params])])  # (n+1,) blocks with params
    for b in range(1, chain.n + 1):
        t = np.asarray(_time(work[b] - work[:b], speed, comm[:b], comm[b]))
        if cost.params_every_stage:
            t = np.where(held[b] - held[:b] > 0, t, _INF)
        if mems is not None and budget is not None:
            t = np.where(next(mems) <= budget, t, _INF)
        if limit < _INF:
            t = np.where(t <= limit, t, _INF)
        if square:
            r = np.asarray(_time(ref[b] - ref[:b], speed, comm[:b], comm[b]))
            t = np.where(np.isfinite(t), r * r, _INF)
        yield t


def _dp(n: int, n_stages: int, rows: Iterator[Floats], *, add: bool
        ) -> tuple[Floats, npt.NDArray[np.intp]]:
    """best[s, b] = min over a of max (or sum) of best[s-1, a] and rows(b)[s, a]."""
    best = np.full((n_stages, n + 1), _INF)  # (S, n+1)
    arg = np.zeros((n_stages, n + 1), dtype=np.intp)  # (S, n+1) start of the last stage
    lanes = np.arange(n_stages - 1)
    for b, row in zip(range(1, n + 1), rows):
        best[0, b] = row[0, 0]
        if n_stages > 1:
            tail = row[1:] if row.shape[0] > 1 else row
            prev = best[:-1, :b]
            cand = prev + tail if add else np.maximum(prev, tail)  # (S-1, b)
            arg[1:, b] = np.argmin(cand, axis=1)
            best[1:, b] = cand[lanes, arg[1:, b]]
    return best, arg


def min_feasible_budget(chain: Chain, n_stages: int, cost: CostModel = CostModel()) -> float:
    """Smallest uniform per-stage memory budget some partition fits (min-max DP on memory)."""
    _check_stages(chain, n_stages)
    per = _per_stage(cost, n_stages, budget=False)
    best, _ = _dp(chain.n, n_stages, _memory_rows(chain, cost, per), add=False)
    return float(best[n_stages - 1, chain.n])


def solve(chain: Chain, n_stages: int, cost: CostModel = CostModel()) -> Solution:
    """Exact partition minimising the slowest stage time subject to per-stage memory budgets.

    Source: the min-max linear partition problem (Skiena, The Algorithm Design Manual,
    sec. 8.5) as used by PipeDream's planner: D[s][b] = min_a max(D[s-1][a], T_s(a, b)),
    with stages whose M_s(a, b) exceeds the budget excluded inside the recurrence.
    Complexity O(S n^2) time, vectorised over (s, a) for each b; O(S n) memory.
    Ties: a second DP of the same cost keeps the optimal bottleneck (times 1 + the cost
    model's `tolerance`) as a bound and minimises the sum of squared stage times (the most even
    partition; by the chain's deterministic `ref_ms` where it has them, so that measurement
    noise within the tolerance does not move the cuts); exact ties left after that go to the
    earliest cut (smallest start of each later stage).
    """
    _check_stages(chain, n_stages)
    per = _per_stage(cost, n_stages)
    n = chain.n
    best, _ = _dp(n, n_stages, _time_rows(chain, cost, per), add=False)
    bottleneck = float(best[n_stages - 1, n])
    if not np.isfinite(bottleneck):
        needed = min_feasible_budget(chain, n_stages, cost)
        raise InfeasibleBudget(
            f"no split of {n} blocks into {n_stages} stages fits memory_budget="
            f"{cost.memory_budget} bytes: it needs at least {human_bytes(needed, 2)} per stage "
            f"(uniform budget of {needed:.0f} bytes); raise the budget, use more stages, or "
            "reduce activation memory with recompute/offload", needed)
    limit = bottleneck * (1.0 + cost.tolerance)
    spread, arg = _dp(n, n_stages, _time_rows(chain, cost, per, limit=limit, square=True), add=True)
    assert np.isfinite(spread[n_stages - 1, n]), "second pass lost the optimum"
    bounds = [n]
    for s in range(n_stages - 1, 0, -1):
        bounds.append(int(arg[s, bounds[-1]]))
    bounds.append(0)
    return evaluate(chain, tuple(reversed(bounds)), cost)


def _check_bounds(chain: Chain, bounds: Sequence[int]) -> None:
    ok = len(bounds) >= 2 and bounds[0] == 0 and bounds[-1] == chain.n
    if not ok or any(a > b for a, b in itertools.pairwise(bounds)):
        raise PartitionError(f"bounds {tuple(bounds)} must rise from 0 to n={chain.n}")


def stage_ms(chain: Chain, bounds: Sequence[int], cost: CostModel = CostModel()
             ) -> tuple[float, ...]:
    """T_s of every stage of any partition (an empty stage only forwards its input)."""
    _check_bounds(chain, bounds)
    per = _per_stage(cost, len(bounds) - 1, budget=False)
    comm, work = _comm(chain, cost), chain._work
    return tuple(float(_time(work[b] - work[a], per.speed[s], comm[a], comm[b]))
                 for s, (a, b) in enumerate(itertools.pairwise(bounds)))


def stage_bytes(chain: Chain, bounds: Sequence[int], cost: CostModel = CostModel()
                ) -> tuple[float, ...]:
    """M_s of every stage of any partition; tied parameters count once per stage."""
    _check_bounds(chain, bounds)
    per = _per_stage(cost, len(bounds) - 1, budget=False)
    act, cut, out = chain._act, chain.cut_bytes, []
    for s, (a, b) in enumerate(itertools.pairwise(bounds)):
        union = sum(chain.param_bytes[p] for p in set().union(*chain.params[a:b]))
        out.append(float(_memory(cost, float(union), per.in_flight[s], act[b] - act[a],
                                 cut[a], cut[b])))
    return tuple(out)


def evaluate(chain: Chain, bounds: Sequence[int], cost: CostModel = CostModel()) -> Solution:
    """The Solution record of any given partition (baselines, even splits)."""
    times = stage_ms(chain, bounds, cost)
    return Solution(tuple(bounds), max(times), times, stage_bytes(chain, bounds, cost))


def chain_from_dag(g: nx.DiGraph, order: Sequence[Hashable] | None = None) -> Chain:
    """Chain of the nodes of `g` in `order` (default: topological, ties by insertion order).

    Nodes carry fwd_ms, bwd_ms, act_bytes and params (default ()); g.graph["param_bytes"]
    maps parameter ids to bytes; edges carry `bytes` of the value their source produces
    (a node's value is the largest `bytes` on its out-edges). cut_bytes[i] sums each value
    made before i and read at or after i once, however many later nodes read it.
    """
    if order is None:
        rank = {v: i for i, v in enumerate(g.nodes)}
        try:
            order = list(nx.lexicographical_topological_sort(g, key=rank.__getitem__))
        except nx.NetworkXUnfeasible:
            raise PartitionError("the graph has a cycle; pass a DAG") from None
    pos = {v: i for i, v in enumerate(order)}
    if len(pos) != len(order) or set(pos) != set(g.nodes):
        raise PartitionError(f"order has {len(order)} entries for {len(g)} nodes; list "
                             "every node exactly once")
    n = len(order)
    delta = np.zeros(n + 2, dtype=np.int64)  # value enters at pos[u]+1, leaves after last read
    for u in order:
        reads = [(pos[v], size) for _, v, size in g.out_edges(u, data="bytes")]
        for p, size in reads:
            if p <= pos[u] or size is None:
                raise PartitionError(f"edge {u!r} -> {order[p]!r} goes backwards in the order "
                                     "or lacks its 'bytes' attribute")
        if reads:
            size = max(int(sz) for _, sz in reads)
            delta[pos[u] + 1] += size
            delta[max(p for p, _ in reads) + 1] -= size

    def attr(v: Hashable, key: str) -> float:
        if key not in g.nodes[v]:
            raise PartitionError(f"node {v!r} lacks attribute {key!r}")
        return float(g.nodes[v][key])

    return Chain(
        fwd_ms=np.array([attr(v, "fwd_ms") for v in order]),
        bwd_ms=np.array([attr(v, "bwd_ms") for v in order]),
        act_bytes=np.array([attr(v, "act_bytes") for v in order]),
        params=[tuple(g.nodes[v].get("params", ())) for v in order],
        param_bytes=dict(g.graph.get("param_bytes", {})),
        cut_bytes=np.cumsum(delta)[: n + 1].astype(np.float64),
        names=[str(v) for v in order])


def _baseline_check(n: int, n_stages: int, what: str) -> None:
    if not 1 <= n_stages <= n:
        raise PartitionError(f"n_stages={n_stages} must be between 1 and the number of "
                             f"{what} ({n})")


def even_split(n_units: Sequence[int] | int, n_stages: int, *, n_blocks: int | None = None
               ) -> tuple[int, ...]:
    """Equal unit count per stage, as GPipe's uniform balance / DeepSpeed's 'uniform'.

    `n_units` is a block count (every block a unit) or the sorted start positions of the
    "layer" units among `n_blocks` blocks; blocks before the first unit go to stage 0,
    blocks after the last start to the last stage. The first `len % S` stages get one more.
    """
    if isinstance(n_units, int):
        starts, n = list(range(n_units)), n_units
    else:
        starts = list(n_units)
        if n_blocks is None:
            raise PartitionError("even_split with unit positions needs n_blocks=")
        n = n_blocks
        if any(not 0 <= x < y <= n for x, y in zip(starts, starts[1:] + [n])):
            raise PartitionError(f"unit positions must rise within [0, {n}) (got {starts})")
    _baseline_check(len(starts), n_stages, "units")
    q, r = divmod(len(starts), n_stages)
    inner = [starts[s * q + min(s, r)] for s in range(1, n_stages)]
    return (0, *inner, n)


def balance_by_param_count(weights: Sequence[float], n_stages: int) -> tuple[int, ...]:
    """DeepSpeed's partition_method='parameters' (ds_utils.partition_balanced), in spirit.

    Each prefix keeps the split that minimises heaviest minus lightest part weight and is
    extended from there (ties go to the later cut); O(S n^2). Not min-max optimal.
    """
    w = np.asarray(weights, dtype=np.float64)
    n = w.size
    _baseline_check(n, n_stages, "blocks")
    pre = np.concatenate([[0.0], np.cumsum(w)])
    hi = np.full((n_stages + 1, n + 1), _INF)  # heaviest part of the kept split
    lo = np.full((n_stages + 1, n + 1), _INF)  # lightest part of the kept split
    cut = np.zeros((n_stages + 1, n + 1), dtype=np.intp)
    hi[0, 0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, n_stages) + 1):
            ks = np.arange(j - 1, i)
            part = pre[i] - pre[ks]
            top, bottom = np.maximum(hi[j - 1, ks], part), np.minimum(lo[j - 1, ks], part)
            spread = top - bottom
            pick = spread.size - 1 - int(np.argmin(spread[::-1]))
            hi[j, i], lo[j, i], cut[j, i] = top[pick], bottom[pick], ks[pick]
    bounds = [n]
    for j in range(n_stages, 0, -1):
        bounds.append(int(cut[j, bounds[-1]]))
    return tuple(reversed(bounds))


def balance_by_time(times: Sequence[float], n_stages: int) -> tuple[int, ...]:
    """torchgpipe's balance_by_time (balance.blockpartition), reimplemented from the paper.

    Bárány & Grinberg, "Block partitions of sequences" (2015): normalise to [0, 1], start
    from equal counts, and move one element at a time into the lightest block from its
    neighbour on the heaviest block's side until heaviest <= lightest + 1. Greedy, not
    min-max optimal; may leave a stage empty (bounds then repeat).
    """
    x = np.asarray(times, dtype=np.float64)
    n = x.size
    _baseline_check(n, n_stages, "blocks")
    span = x.max() - x.min()
    norm = (x - x.min()) / span if span > 0 else np.zeros(n)
    pre = np.concatenate([[0.0], np.cumsum(norm)])
    splits = [n // n_stages * (s + 1) for s in range(n_stages - 1)] + [n]

    def sizes() -> list[float]:
        return [float(pre[b] - pre[a]) for a, b in zip([0] + splits[:-1], splits)]

    p = -1  # the heaviest block, fixed until a move changes it (step 1 of the paper)
    for _ in range(n * n * n_stages + 16):  # the paper proves termination; this guards floats
        now = sizes()
        if p < 0:
            p = max(range(n_stages), key=lambda s: (now[s], s))  # last heaviest, as torchgpipe
        q = min(range(n_stages), key=lambda s: (now[s], s))  # first lightest
        if now[p] <= now[q] + 1:
            break
        h = q - 1 if p < q else q + 1  # the neighbour of q on p's side gives one element
        if splits[h] == (splits[h - 1] if h > 0 else 0):
            break  # the donor block is empty: nothing left to move
        if p < q:
            splits[h] -= 1
        else:
            splits[q] += 1
        if h == p:
            p = -1
    return (0, *splits)
