"""Per-stage memory plan from one budget: predicted peaks, the recompute knapsack, offload choices.

Pure (numpy only). Legend: A activation bytes a microbatch saves for backward, L bytes the
loss saves (last stage), H bytes kept by selective checkpointing per microbatch, n
microbatches in flight on the stage, F fixed bytes (model state and communication buffers).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

__all__ = ["RECOMPUTE", "OFFLOAD", "BudgetError", "NodeInfo", "StageInfo", "StageChoice", "check_options",
           "comm_peak", "choose", "knapsack", "human"]

RECOMPUTE = ("none", "full", "selective", "auto")
OFFLOAD = ("none", "activations", "states", "all")
COPY_BYTES_PER_MS = 5e6  # default host <-> device copy speed that prices offloading (5 GB/s)


class BudgetError(ValueError):
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
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(x) < 1024:
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.2f} {unit}"
        x /= 1024
    return f"{x:.2f} TiB"


@dataclass(frozen=True)
class NodeInfo:
    """One fx node of a stage, as the recompute planner sees it."""
    name: str
    fwd_ms: float          # forward time: what recomputing it costs
    kept_bytes: int        # what selective checkpointing caches per microbatch when it keeps the node
    matmul: bool = False   # matmul / convolution / attention: kept by the 'selective' policy


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
    chunk_bytes: int = 0   # bytes of one parameter chunk (params; grads take as much again)
    n_chunks: int = 0
    min_resident: int = 0  # chunks one node needs at once (states offload; one more lets prefetch work)
    microbatches: int = 1
    copy_bytes_per_ms: float = COPY_BYTES_PER_MS  # what offloading costs, against the nodes' fwd_ms


@dataclass
class StageChoice:
    """The memory plan of one stage."""
    stage: int
    recompute: str                      # none, full, selective or auto
    keep: frozenset[str] | None = None  # nodes whose outputs checkpointing keeps (None: no checkpoint)
    offload_activations: bool = False
    offload_states: bool = False
    resident_chunks: int = 0            # parameter chunks the device holds at once (states offload)
    predicted_peak: float = 0.0
    recompute_ms: float = 0.0           # extra forward time per microbatch
    move_ms: float = 0.0                # host <-> device copy time per microbatch (offload)
    parts: dict[str, float] = field(default_factory=dict)

    @property
    def cost_ms(self) -> float:
        return self.recompute_ms + self.move_ms

    @property
    def checkpointed(self) -> bool:
        return self.keep is not None

    def label(self) -> str:
        """Short description for the plan table, e.g. 'auto 12/40+act' or 'full+states'."""
        text = self.recompute
        if self.recompute == "auto":
            text = "none" if self.keep is None else ("full" if not self.keep else f"keep {len(self.keep)}")
        extra = [x for x, on in (("act", self.offload_activations), ("states", self.offload_states)) if on]
        return "+".join([text] + extra)


def comm_peak(recv_bytes: int, send_bytes: int, microbatches: int, in_flight: int) -> int:
    """Upper bound of communication buffers on a stage, as if every receive were posted at step start
    and every send held until the step ends (pipe.exchange posts 2 ahead and frees sends as they
    complete, so the real figure is lower). Per microbatch the received activation lives until its
    backward and the grad sent back after it: M x recv at any time. The M grad buffers go one by
    one at the backwards while the outputs sent pile up, at most `in_flight` ahead: (M + n) x send."""
    return microbatches * recv_bytes + (microbatches + max(in_flight, 1)) * send_bytes


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


def _state(st: StageInfo, optim_factor: float, resident: int | None) -> float:
    """Model state on the device: everything (resident None), or `resident` chunks of params and grads."""
    if resident is None:
        return st.param_bytes * (2.0 + optim_factor)
    return 2.0 * resident * st.chunk_bytes


def _acts(st: StageInfo, kept: float | None, offload: bool) -> float:
    """Activation peak: kept=None means no checkpoint; else H bytes kept per microbatch."""
    n = max(st.in_flight, 1)
    held = min(n, 2) if offload else n  # offloaded: the microbatch in backward and the prefetched one
    if kept is None:
        return held * (st.act_bytes + st.loss_bytes)
    return n * kept + st.act_bytes + held * st.loss_bytes


def _move_ms(st: StageInfo, resident: int | None) -> float:
    """Copy time per microbatch of streaming chunks: with every chunk resident, one fetch and one
    write-back a step; else each microbatch's forward fetches the absent share of the params and
    its backward the params and grads (in and out)."""
    if resident is None or not st.n_chunks:
        return 0.0
    per_step = 2.0 * st.param_bytes / max(st.microbatches, 1)
    absent = max(0.0, 1.0 - resident / st.n_chunks)
    return (per_step + absent * 4.0 * st.param_bytes) / st.copy_bytes_per_ms


def _residents(st: StageInfo) -> list[int]:
    """Resident chunk counts worth trying: from what one node needs up to every chunk (8 at most)."""
    lo, hi = st.min_resident, st.n_chunks
    if hi - lo <= 8:
        return list(range(lo, hi + 1))
    return sorted({lo + round(k * (hi - lo) / 7) for k in range(8)})


def _candidates(st: StageInfo, recompute: str, offload: str, budget: float | None,
                optim_factor: float) -> list[StageChoice]:
    """Every plan the options allow for a stage, with its predicted peak and cost (ms per microbatch).

    Under 'auto' the offload modes are permissions: a stage offloads only where it pays.
    """
    s, n = st.index, max(st.in_flight, 1)
    acts_ok = offload in ("activations", "all")
    states_ok = offload in ("states", "all") and st.n_chunks > 0
    total_ms = sum(x.fwd_ms for x in st.nodes)
    if recompute == "auto":
        residents: list[int | None] = [None] + (_residents(st) if states_ok else [])
        kinds = ["none"] + (["act"] if acts_ok else []) + ["keep", "full"]
    else:
        residents = [None]
        if states_ok:
            residents = list(_residents(st)) if budget is not None else [min(st.n_chunks, st.min_resident + 1)]
        kinds = [recompute]
    out = []
    for r in residents:
        state = _state(st, optim_factor, r)
        for kind in kinds:
            keep: frozenset[str] | None = None
            if kind == "selective":
                keep = frozenset(x.name for x in st.nodes if x.matmul)
            elif kind == "full":
                keep = frozenset()
            elif kind == "keep":
                if budget is None:
                    continue
                room = budget - state - st.comm_bytes - st.act_bytes - n * st.loss_bytes
                if room < 0:
                    continue
                idx = knapsack([x.kept_bytes for x in st.nodes], [x.fwd_ms for x in st.nodes], room / n)
                keep = frozenset(st.nodes[i].name for i in idx)
                if len(keep) == len(st.nodes):
                    continue  # keeping everything is no recompute at all
            act_off = kind == "act" or (acts_ok and recompute != "auto")
            kept = None if keep is None else float(sum(x.kept_bytes for x in st.nodes if x.name in keep))
            acts = _acts(st, kept, act_off)
            c = StageChoice(s, recompute, keep, offload_activations=act_off, offload_states=r is not None,
                            resident_chunks=r or 0,
                            recompute_ms=0.0 if keep is None else total_ms - sum(
                                x.fwd_ms for x in st.nodes if x.name in keep),
                            move_ms=_move_ms(st, r) + (2 * (st.act_bytes + st.loss_bytes) / st.copy_bytes_per_ms
                                                       if act_off else 0.0))
            c.parts = {"state": state, "activations": acts, "comm": float(st.comm_bytes)}
            c.predicted_peak = state + acts + st.comm_bytes
            out.append(c)
    return out


def choose(stages: Sequence[StageInfo], *, recompute: str, offload: str, budget: float | None,
           optim_factor: float = 2.0) -> list[StageChoice]:
    """One StageChoice per stage, the least costly that fits the budget (ties: the smaller peak);
    BudgetError, with the smallest feasible budget, when a stage cannot fit."""
    check_options(recompute, offload)
    out = []
    for st in stages:
        fitting = [c for c in _candidates(st, recompute, offload, budget, optim_factor)
                   if budget is None or c.predicted_peak <= budget]
        if not fitting:
            raise _infeasible(stages, recompute, offload, budget or 0.0, optim_factor, st.index)
        out.append(min(fitting, key=lambda c: (c.cost_ms, c.predicted_peak)))
    return out


def _least(st: StageInfo, recompute: str, offload: str, optim_factor: float) -> StageChoice:
    """The plan with the smallest peak stage `st` can reach with these options."""
    return min(_candidates(st, recompute, offload, 0.0, optim_factor), key=lambda c: c.predicted_peak)


def _infeasible(stages: Sequence[StageInfo], recompute: str, offload: str, budget: float, optim_factor: float,
                first: int) -> BudgetError:
    asked = max(_least(st, recompute, offload, optim_factor).predicted_peak for st in stages)
    bests = [_least(st, "full", "all", optim_factor) for st in stages]
    c = max(bests, key=lambda c: c.predicted_peak)
    best = c.predicted_peak
    parts = ", ".join(f"{k} {human(v)}" for k, v in c.parts.items())
    if best > budget:
        return BudgetError(
            f"memory_budget={human(budget)} ({budget:.0f} bytes) per stage cannot be met even with "
            f"recompute='full' and offload='all': stage {c.stage} needs at least {human(best)} ({parts}). "
            f"The smallest feasible budget is {best:.0f} bytes; fix: give memory_budget >= {best:.0f}, use "
            "more stages, fewer or smaller microbatches", best)
    return BudgetError(
        f"memory_budget={human(budget)} ({budget:.0f} bytes) per stage is not met on stage {first} with "
        f"recompute={recompute!r} and offload={offload!r}; those need at least {human(asked)} ({asked:.0f} "
        f"bytes). Fix: give memory_budget >= {asked:.0f}, or recompute='auto' and offload='all' (they reach "
        f"{human(best)}, {best:.0f} bytes)", asked)
