# .venv/bin/python -m bench.bench_solver
"""Wall time of partition.solve on synthetic transformer-like chains (n blocks, S stages)."""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

import numpy as np

from partition.solve import Chain, CostModel, min_feasible_budget, solve


def synthetic_chain(n: int, seed: int = 0) -> Chain:
    """Alternating attention/MLP blocks, a residual stream on every cut, tied embedding/head."""
    rng = np.random.default_rng(seed)
    fwd = rng.uniform(0.5, 1.5, n)  # ms
    params = [(i,) for i in range(n)]
    params[0] = params[-1] = (0,)  # the embedding doubles as the output head
    param_bytes = {i: int(rng.integers(1, 8)) * 2**22 for i in range(n)}
    cut = np.r_[0, rng.integers(1, 4, n - 1) * 2**20, 0]  # residual stream, plus skips
    act = (rng.integers(1, 16, n) * 2**20).astype(np.float64)
    return Chain(fwd, 2 * fwd, act, params, param_bytes, cut.astype(np.float64))


def best_of(repeats: int, fn: Callable[[], object]) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    print(f"{'n':>5} {'S':>2} {'no budget s':>12} {'budget s':>9} {'min budget s':>13}"
          f" {'bottleneck ms':>14} {'slowest/mean':>12}")
    for n in (500, 1000, 2000):
        chain = synthetic_chain(n)
        for S in (2, 4, 8):
            plain = CostModel(in_flight=tuple(range(S, 0, -1)))  # 1F1B with M >= S
            needed = min_feasible_budget(chain, S, plain)
            tight = CostModel(in_flight=plain.in_flight, memory_budget=1.05 * needed)
            t_plain = best_of(3, partial(solve, chain, S, plain))
            t_tight = best_of(3, partial(solve, chain, S, tight))
            t_need = best_of(3, partial(min_feasible_budget, chain, S, plain))
            sol = solve(chain, S, tight)
            imbalance = sol.bottleneck_ms / (sum(sol.stage_ms) / S)
            print(f"{n:>5} {S:>2} {t_plain:>12.3f} {t_tight:>9.3f} {t_need:>13.3f}"
                  f" {sol.bottleneck_ms:>14.1f} {imbalance:>12.3f}")


if __name__ == "__main__":
    main()
