"""partition.solve against brute force over every set of cuts, with costs from the definitions."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from dataclasses import dataclass

import networkx as nx
import numpy as np
import pytest

from partition.solve import (
    Chain,
    CostModel,
    InfeasibleBudget,
    PartitionError,
    balance_by_param_count,
    balance_by_time,
    chain_from_dag,
    even_split,
    min_feasible_budget,
    solve,
    stage_bytes,
    stage_ms,
)

COMPUTE_ONLY = CostModel(bytes_per_ms=math.inf, latency_ms=0.0)


@dataclass
class Raw:
    """A chain as plain lists, priced by `brute` straight from the definitions."""

    fwd: list[float]
    bwd: list[float]
    act: list[int]
    params: list[set[int]]
    sizes: dict[int, int]
    cut: list[int]  # (n+1,)

    def chain(self) -> Chain:
        return Chain(self.fwd, self.bwd, self.act, [tuple(sorted(p)) for p in self.params],
                     self.sizes, self.cut)


def brute_costs(raw: Raw, bounds: tuple[int, ...], cost: CostModel
                ) -> tuple[list[float], list[float]]:
    """Stage times and stage bytes of one partition, by the definitions (sets, plain sums)."""
    S = len(bounds) - 1
    speeds = cost.speeds or (1.0,) * S
    in_flight = cost.in_flight or (1,) * S

    def transfer(nbytes: float) -> float:
        return 0.0 if nbytes == 0 else cost.latency_ms + nbytes / cost.bytes_per_ms

    times, mems = [], []
    for s in range(S):
        a, b = bounds[s], bounds[s + 1]
        work = sum(raw.fwd[i] + raw.bwd[i] for i in range(a, b))
        times.append(work / speeds[s] + 2 * transfer(raw.cut[a]) + 2 * transfer(raw.cut[b]))
        used: set[int] = set()
        for i in range(a, b):
            used |= raw.params[i]
        saved = 0 if cost.activation_floor else sum(raw.act[a:b])  # memory/ plans them (recompute, offload)
        held = in_flight[s] * (saved + raw.cut[a] + raw.cut[b])
        mems.append(cost.state_factor * sum(raw.sizes[p] for p in used) + held + cost.extra_bytes)
    return times, mems


def partitions(n: int, S: int) -> list[tuple[int, ...]]:
    return [(0, *cuts, n) for cuts in itertools.combinations(range(1, n), S - 1)]


def budgets(cost: CostModel, S: int) -> list[float]:
    b = cost.memory_budget
    return [math.inf] * S if b is None else [b] * S if isinstance(b, (int, float)) else list(b)


def brute(raw: Raw, S: int, cost: CostModel) -> tuple[float, float]:
    """(best bottleneck within the budget or inf, least uniform budget any partition fits)."""
    best, needed, limit = math.inf, math.inf, budgets(cost, S)
    for bounds in partitions(len(raw.fwd), S):
        times, mems = brute_costs(raw, bounds, cost)
        needed = min(needed, max(mems))
        if all(m <= lim for m, lim in zip(mems, limit)):
            best = min(best, max(times))
    return best, needed


def random_cost(rng: random.Random, raw: Raw, S: int) -> CostModel:
    comm = rng.random() < 0.6
    cost = CostModel(
        bytes_per_ms=rng.uniform(50, 2000) if comm else math.inf,
        latency_ms=rng.uniform(0, 1) if comm else 0.0,
        state_factor=rng.choice([1.0, 2.0, 4.0]),
        in_flight=tuple(rng.randint(0, 4) for _ in range(S)) if rng.random() < 0.5 else None,
        speeds=tuple(rng.uniform(0.5, 2) for _ in range(S)) if rng.random() < 0.5 else None,
        extra_bytes=float(rng.choice([0, 100])), activation_floor=rng.random() < 0.3)
    kind = rng.choice(["none", "uniform", "per_stage", "tight", "short"])
    if kind == "none":
        return cost
    _, needed = brute(raw, S, cost)
    if needed < 1:  # nothing to hold: only a positive budget is valid
        kind = "uniform"
    if kind == "uniform":
        budget: float | tuple[float, ...] = needed + rng.uniform(0.5, 3000)
    elif kind == "tight":
        budget = needed  # integer bytes: exactly feasible
    elif kind == "short":
        budget = needed - 0.5  # just infeasible
    else:  # per stage, feasible for some random partition
        bounds = rng.choice(partitions(len(raw.fwd), S))
        budget = tuple(m + rng.randint(0, 800) for m in brute_costs(raw, bounds, cost)[1])
    return CostModel(**{**cost.__dict__, "memory_budget": budget})


def random_raw(rng: random.Random, n: int) -> Raw:
    pool = {p: rng.randint(1, 1000) for p in range(rng.randint(0, n + 2))}
    params = [set(rng.sample(sorted(pool), rng.randint(0, min(3, len(pool)))))
              for _ in range(n)]
    cut = [0] + [rng.choice([0, rng.randint(1, 5000)]) for _ in range(n - 1)] + [0]
    work = [rng.choice([0.0, rng.uniform(0, 10)]) for _ in range(2 * n)]
    return Raw(work[:n], work[n:], [rng.randint(0, 1000) for _ in range(n)], params, pool, cut)


def check_against_brute(raw: Raw, S: int, cost: CostModel) -> None:
    chain = raw.chain()
    best, needed = brute(raw, S, cost)
    assert min_feasible_budget(chain, S, cost) == needed  # integer bytes: exact
    if best == math.inf:
        with pytest.raises(InfeasibleBudget) as err:
            solve(chain, S, cost)
        assert err.value.needed_bytes == needed
        assert "needs at least" in str(err.value)
        return
    sol = solve(chain, S, cost)
    times, mems = brute_costs(raw, sol.bounds, cost)
    assert sol.bottleneck_ms == pytest.approx(best, rel=1e-9, abs=1e-12)
    assert max(times) == pytest.approx(best, rel=1e-9, abs=1e-12)
    assert sol.stage_ms == pytest.approx(times, rel=1e-9, abs=1e-12)
    assert list(sol.stage_bytes) == mems
    assert all(m <= lim for m, lim in zip(sol.stage_bytes, budgets(cost, S)))
    assert len(sol.bounds) == S + 1 and all(a < b for a, b in zip(sol.bounds, sol.bounds[1:]))


@pytest.mark.parametrize("seed", range(300))
def test_solve_matches_brute_force_on_random_chains(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 10)
    S = rng.randint(1, min(4, n))
    raw = random_raw(rng, n)
    check_against_brute(raw, S, random_cost(rng, raw, S))


@pytest.mark.parametrize("seed", range(100))
def test_chain_from_dag_matches_brute_force_on_random_dags(seed: int) -> None:
    rng = random.Random(1000 + seed)
    n = rng.randint(1, 12)
    order = [f"v{i}" for i in rng.sample(range(100), n)]  # the topological order
    value = {v: rng.randint(1, 4000) for v in order}
    g = nx.DiGraph(param_bytes={p: rng.randint(1, 500) for p in range(4)})
    for v in rng.sample(order, n):  # insertion order differs from the topological order
        g.add_node(v, fwd_ms=rng.uniform(0, 5), bwd_ms=rng.uniform(0, 9),
                   act_bytes=rng.randint(0, 900), params=tuple(rng.sample(range(4), 1)))
    for i, j in itertools.combinations(range(n), 2):
        if rng.random() < (0.5 if j == i + 1 else 0.15):  # chains plus long skips
            g.add_edge(order[i], order[j], bytes=value[order[i]])
    chain = chain_from_dag(g, order)
    # the crossing bytes straight from the edges: each value once per boundary it crosses
    pos = {v: i for i, v in enumerate(order)}
    cut = [sum(value[u] for u in {u for u, v in g.edges if pos[u] < i <= pos[v]})
           for i in range(n + 1)]
    nodes = [g.nodes[v] for v in order]
    raw = Raw([d["fwd_ms"] for d in nodes], [d["bwd_ms"] for d in nodes],
              [d["act_bytes"] for d in nodes], [set(d["params"]) for d in nodes],
              g.graph["param_bytes"], cut)
    assert list(chain.cut_bytes) == cut
    S = rng.randint(1, min(4, n))
    check_against_brute(raw, S, random_cost(rng, raw, S))


def test_chain_from_dag_default_order_is_insertion_order_among_ready_nodes() -> None:
    g = nx.DiGraph(param_bytes={})
    for v in ["x", "b", "a", "y"]:
        g.add_node(v, fwd_ms=1.0, bwd_ms=1.0, act_bytes=0)
    g.add_edge("x", "a", bytes=10)
    g.add_edge("x", "b", bytes=10)
    g.add_edge("a", "y", bytes=3)
    g.add_edge("b", "y", bytes=5)
    chain = chain_from_dag(g)
    assert chain.names == ("x", "b", "a", "y")
    #                 boundary:  0   1       2       3  4
    assert list(chain.cut_bytes) == [0, 10, 10 + 5, 5 + 3, 0]  # x sent once to a and b


def test_tied_parameter_counts_once_per_stage() -> None:
    chain = Chain([1.0] * 4, [1.0] * 4, [0] * 4, [(7,), (), (), (7,)], {7: 100}, [0] * 5)
    cost = CostModel(state_factor=1.0)
    assert stage_bytes(chain, (0, 4), cost) == (100.0,)
    assert stage_bytes(chain, (0, 2, 4), cost) == (100.0, 100.0)
    assert solve(chain, 1, CostModel(state_factor=1.0, memory_budget=100)).bounds == (0, 4)


def test_infeasible_budget_reports_needed_bytes_in_human_units() -> None:
    gib = 2**30
    chain = Chain([1.0] * 3, [2.0] * 3, [0] * 3, [(0,), (1,), (2,)],
                  {0: 3 * gib, 1: gib, 2: gib}, [0] * 4)
    cost = CostModel(state_factor=1.0, memory_budget=2 * gib)
    with pytest.raises(InfeasibleBudget, match=r"needs at least 3\.00 GiB per stage") as err:
        solve(chain, 2, cost)
    assert err.value.needed_bytes == 3 * gib
    assert "more stages" in str(err.value) and "recompute" in str(err.value)
    fits = CostModel(state_factor=1.0, memory_budget=err.value.needed_bytes)
    assert solve(chain, 2, fits).bounds == (0, 1, 3)


@pytest.mark.parametrize("n_stages, cost, match", [
    (0, CostModel(), r"n_stages must be at least 1 \(got 0\)"),
    (5, CostModel(), r"only 4 cuttable blocks; use at most 4 stages or coarsen less"),
    (2, CostModel(memory_budget=0.0), r"memory_budget for stage 0 is 0.0; it must be positive"),
    (2, CostModel(memory_budget=(1e9, -1.0)), r"stage 1 is -1.0"),
    (2, CostModel(memory_budget=(1e9,) * 3), r"memory_budget has 3 entries but n_stages=2"),
    (2, CostModel(speeds=(1.0, 1.0, 1.0)), r"speeds has 3 entries but n_stages=2"),
    (3, CostModel(in_flight=(3, 2)), r"in_flight has 2 entries but n_stages=3"),
])
def test_errors_name_the_constraint_and_fix(n_stages: int, cost: CostModel, match: str) -> None:
    chain = Chain([1.0] * 4, [1.0] * 4, [0] * 4, [()] * 4, {}, [0] * 5)
    with pytest.raises(PartitionError, match=match) as err:
        solve(chain, n_stages, cost)
    assert isinstance(err.value, ValueError)


def test_ties_prefer_the_most_even_partition() -> None:
    chain = Chain([1.0, 1.0, 1.0, 1.0, 10.0], [0.0] * 5, [0] * 5, [()] * 5, {}, [0] * 6)
    sol = solve(chain, 3, COMPUTE_ONLY)
    assert sol.bounds == (0, 2, 4, 5) and sol.stage_ms == (2.0, 2.0, 10.0)


def test_dp_beats_max_min_and_greedy_baselines() -> None:
    weights = [8.0, 3.0, 5.0, 8.0, 6.0]
    chain = Chain(weights, [0.0] * 5, [0] * 5, [()] * 5, {}, [0] * 6)
    sol = solve(chain, 3, COMPUTE_ONLY)
    assert (sol.bounds, sol.stage_ms) == ((0, 2, 4, 5), (11.0, 13.0, 6.0))
    deepspeed = balance_by_param_count(weights, 3)  # spread 14 - 8 = 6 beats 13 - 6 = 7
    assert (deepspeed, stage_ms(chain, deepspeed, COMPUTE_ONLY)) == ((0, 1, 3, 5), (8.0, 8.0, 14.0))
    torchgpipe = balance_by_time(weights, 3)
    assert (torchgpipe, stage_ms(chain, torchgpipe, COMPUTE_ONLY)) == ((0, 1, 4, 5), (8.0, 16.0, 6.0))


def test_baselines_on_literals() -> None:
    assert balance_by_time([1, 2, 3, 4, 5, 6], 2) == (0, 4, 6)  # torchgpipe's own test
    assert balance_by_time([0, 0], 2) == (0, 1, 2)
    assert balance_by_param_count([1, 1, 1, 1], 2) == (0, 2, 4)
    assert even_split(10, 3) == (0, 4, 7, 10)
    assert even_split([1, 3, 5, 7], 2, n_blocks=9) == (0, 5, 9)  # embedding/head ride along
    with pytest.raises(PartitionError, match="needs n_blocks"):
        even_split([1, 3], 2)
    with pytest.raises(PartitionError, match="between 1 and the number of blocks"):
        balance_by_time([1.0], 2)


def test_stage_ms_counts_both_directions_on_each_boundary() -> None:
    chain = Chain([1.0, 2.0], [3.0, 4.0], [0, 0], [(), ()], {}, [0, 1000, 0])
    cost = CostModel(bytes_per_ms=100.0, latency_ms=0.5, speeds=(1.0, 2.0))
    #                         compute  fwd act + bwd grad (0.5 + 10 each)
    assert stage_ms(chain, (0, 1, 2), cost) == (4.0 + 21.0, 3.0 + 21.0)


def test_large_chain_is_fast_and_balanced() -> None:
    rng = np.random.default_rng(0)
    n = 2000
    chain = Chain(rng.uniform(1, 2, n), rng.uniform(2, 4, n), rng.integers(0, 10**6, n),
                  [(i,) for i in range(n)], {i: 10**6 for i in range(n)},
                  np.r_[0, rng.integers(0, 10**5, n - 1), 0])
    sol = solve(chain, 8, CostModel(in_flight=tuple(range(8, 0, -1))))
    assert max(sol.stage_ms) / (sum(sol.stage_ms) / 8) < 1.01


@pytest.mark.parametrize("seed", range(100))
def test_params_every_stage_matches_brute_force_over_stages_that_hold_parameters(seed: int) -> None:
    rng = random.Random(1000 + seed)
    n = rng.randint(2, 9)
    S = rng.randint(2, min(4, n))
    raw = random_raw(rng, n)
    raw.params = [p if rng.random() < 0.6 else set() for p in raw.params]  # blocks without parameters
    if sum(1 for p in raw.params if p) < S:
        raw.params[0] = raw.params[0] or {0}
        raw.sizes.setdefault(0, 4)
        for i in rng.sample(range(1, n), S - 1):
            raw.params[i] = raw.params[i] or {0}
    cost = COMPUTE_ONLY.__class__(bytes_per_ms=math.inf, latency_ms=0.0, params_every_stage=True)
    best = min(max(brute_costs(raw, bounds, cost)[0]) for bounds in partitions(n, S)
               if all(set().union(*raw.params[a:b]) for a, b in zip(bounds, bounds[1:])))
    sol = solve(raw.chain(), S, cost)
    assert sol.bottleneck_ms == pytest.approx(best, rel=1e-9, abs=1e-12)
    assert all(set().union(*raw.params[a:b]) for a, b in zip(sol.bounds, sol.bounds[1:])), sol.bounds


def test_a_parameterless_stage_only_when_asked_for() -> None:
    """The cheapest split of three puts the parameter-free block alone on a stage; with
    params_every_stage such a split is excluded (none is left for three stages, one for two)."""
    raw = Raw(fwd=[5.0, 5.0, 5.0], bwd=[5.0, 5.0, 5.0], act=[0, 0, 0], params=[{0}, {1}, set()],
              sizes={0: 4, 1: 4}, cut=[0, 0, 0, 0])
    free = solve(raw.chain(), 3, COMPUTE_ONLY)
    held = solve(raw.chain(), 2, CostModel(bytes_per_ms=math.inf, latency_ms=0.0, params_every_stage=True))
    assert free.bounds == (0, 1, 2, 3)
    assert held.bounds == (0, 1, 3)
    with pytest.raises(InfeasibleBudget):
        solve(raw.chain(), 3, CostModel(bytes_per_ms=math.inf, latency_ms=0.0, params_every_stage=True))


def test_measured_noise_within_the_tolerance_keeps_the_cuts() -> None:
    """Costs measured again (each block off by up to 30%, the whole run up to 2x slower) give the
    same split when near-ties go by the deterministic reference; by the measured times they do not."""
    rng = np.random.default_rng(0)
    ref = np.tile([0.3, 1.0, 0.2, 2.0, 0.5], 12)  # a transformer-like repeat of small and big ops
    n = ref.size

    def measured(r: np.random.Generator) -> Chain:
        t = ref * r.uniform(0.7, 1.3, n) * r.uniform(1.0, 2.0)
        return Chain(fwd_ms=t / 3, bwd_ms=2 * t / 3, act_bytes=np.ones(n), params=[(i,) for i in range(n)],
                     param_bytes={i: 1 for i in range(n)}, cut_bytes=np.r_[0.0, np.full(n - 1, 10.0), 0.0],
                     ref_ms=ref)
    for stages in (2, 4):
        stable = {solve(measured(rng), stages, CostModel(tolerance=0.1)).bounds for _ in range(30)}
        noisy = {solve(dataclasses.replace(measured(rng), ref_ms=None), stages, CostModel()).bounds
                 for _ in range(30)}
        assert len(stable) == 1, stable
        assert len(noisy) > 1  # what the tolerance removes
        c = measured(rng)
        best, fastest = solve(c, stages, CostModel(tolerance=0.1)), solve(c, stages, CostModel())
        assert fastest.bottleneck_ms <= best.bottleneck_ms <= 1.1 * fastest.bottleneck_ms
