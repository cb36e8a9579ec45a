"""What a stage holds at every point of its rank's lowered program (pure, no torch): the memory model's
walk, which the planner evaluates for each policy instead of multiplying a per-microbatch figure by
the microbatches in flight and adding every kind's own peak.

A point is (k, b, w, c, g, a, d): k microbatches keep their saved activations on the device, b
microbatches' offloaded activations are back on it (a RELOAD brings them ahead of their backward),
w = 1 while the stage's own backward runs (its recompute working set is alive), c bytes of
communication buffers (memory.buffers) are held, and g = 1 once the stage's first backward of the
step has begun (its parameters' grads exist from then on, when the step began without them, as after
torch's zero_grad()), a is the index of the stage's latest compute action and d = 1 while it computes
(which tells where streamed parameter chunks are: memory.chunks.residency). A policy gives
per-microbatch bytes (kept, bundle, work) and the grads' bytes; the stage's peak beside its fixed
state is the largest k * kept + b * bundle + w * work + c + g * grads over its points (plus the
streamed chunks' bytes at each, when they stream). The rules are the memory manager's:
- F of (s, mb) ends with its saved activations held (k + 1);
- the backward of (s, mb) that frees them (B, or W under zero bubble, or BW) ends with k - 1; a B
  that does not free them sends its offloaded copy back to the host;
- the RELOAD of (s, mb) comes right after the compute action before its backward (pipe.lower's
  with_reloads), and its copy stays on the device until that backward ends;
- communication buffers move where memory.buffers says, what an action makes before what it consumed
  goes (both exist when it ends).
"""
from __future__ import annotations

from typing import Any, Collection, Iterable, Mapping, NamedTuple, Sequence

from memory.buffers import CommBuffers

__all__ = ["Point", "stage_points", "stage_actions", "default_points", "peak_of", "room_per_mb"]


class Point(NamedTuple):
    kept: int      # microbatches whose saved activations are on the device
    bundles: int   # microbatches whose offloaded activations are back on the device
    working: int   # 1 while the stage's own backward runs
    comm: int      # communication buffer bytes held
    grads: int = 1  # 1 once the stage's first backward of the step has begun
    act: int = -1   # the stage's compute actions begun so far, less one (-1: none yet)
    during: int = 0  # 1 while that action computes (0: after it)


def _is_batch(x: Any) -> bool:
    return isinstance(x, tuple) and not hasattr(x, "kind")


def _reload_points(items: Sequence[Any]) -> dict[int, list[tuple[int, int]]]:
    """Item index -> the (stage, mb) whose RELOAD follows it (-1: before the first item)."""
    out: dict[int, list[tuple[int, int]]] = {}
    last = -1
    for i, x in enumerate(items):
        if _is_batch(x):
            continue
        if x.kind in ("B", "W", "BW"):
            out.setdefault(last, []).append((x.stage, x.mb))
        if x.kind in ("F", "B", "W", "BW"):
            last = i
    return out


def _with_bw(items: Sequence[Any], fused: Collection[int]) -> list[Any]:
    """A rank's program with the B of each stage in `fused` a BW and its W gone (pipe.lower.fuse_backward's
    pass, on the items as they are)."""
    return [x._replace(kind="BW") if not _is_batch(x) and x.stage in fused and x.kind == "B" else x
            for x in items if _is_batch(x) or x.stage not in fused or x.kind != "W"]


def stage_points(programs: Mapping[int, Sequence[Any]], place: Sequence[int], recv: Sequence[int],
                 send: Sequence[int], zero_bubble: bool, fused: Collection[int] = ()
                 ) -> dict[int, tuple[Point, ...]]:
    """Per stage, the distinct points of its rank's program (`programs`: every rank's lowered program,
    items compute actions or batches; RELOADs are implied, as if every stage offloaded). `fused`: stages
    whose backward runs as BW, their W gone (a recomputing stage under zero bubble: memory.fused_backward)."""
    S = len(place)
    seen: dict[int, dict[Point, None]] = {s: {} for s in range(S)}
    for rank, items in programs.items():
        items = _with_bw(items, fused) if fused else items
        bufs = CommBuffers(place, rank, recv, send, zero_bubble)
        comm, kept, grads, acts = [0] * S, [0] * S, [0] * S, [-1] * S
        on: list[set[int]] = [set() for _ in range(S)]
        working = running = -1  # the stage whose backward runs, whose action computes

        def mark(s: int) -> None:
            seen[s][Point(kept[s], len(on[s]), int(working == s), comm[s], grads[s], acts[s],
                          int(running == s))] = None

        def move(moves: Iterable[tuple[int, int]]) -> None:
            for s, n in moves:
                comm[s] += n
                mark(s)
        reloads = _reload_points(items)
        for s, mb in reloads.get(-1, []):
            on[s].add(mb)
        for i, x in enumerate(items):
            if _is_batch(x):
                move(bufs.batch(x))
                continue
            s, kind, mb = x.stage, x.kind, x.mb
            if kind not in ("F", "B", "W", "BW"):
                continue
            if kind == "F":
                kept[s] += 1
            else:
                working, grads[s] = s, 1
            acts[s] += 1
            running = s
            mark(s)
            running = -1
            move(bufs.after(s, kind, mb))
            working = -1
            if kind == "BW" or kind == ("W" if zero_bubble else "B"):
                kept[s] -= 1
                on[s].discard(mb)
            elif kind == "B":
                on[s].discard(mb)
            mark(s)
            for t, m in reloads.get(i, []):
                on[t].add(m)
                mark(t)
    return {s: tuple(p) for s, p in seen.items()}


def stage_actions(programs: Mapping[int, Sequence[Any]]) -> dict[int, tuple[str, ...]]:
    """Per stage, the kinds of its compute actions in its rank's program order (Point.act indexes them)."""
    out: dict[int, list[str]] = {}
    for items in programs.values():
        for x in items:
            if not _is_batch(x) and x.kind in ("F", "B", "W", "BW"):
                out.setdefault(x.stage, []).append(x.kind)
    return {s: tuple(k) for s, k in out.items()}


def default_points(in_flight: int, comm_bytes: int) -> tuple[Point, ...]:
    """The points of a stage known only by its microbatches in flight and its buffer peak: all of them
    at once, with two offloaded microbatches back (the one in backward and the next)."""
    n = max(in_flight, 1)
    return (Point(n, min(n, 2), 1, comm_bytes, during=1),)


def peak_of(points: Sequence[Point], kept: float, bundle: float, work: float, grads: float = 0.0,
            state: Sequence[float] | None = None, work_end: float | None = None) -> tuple[float, float, float, float]:
    """(peak, activations, buffers and grads (and `state`) at it): the largest k * kept + b * bundle +
    w * work + c + g * grads, plus state[i] at point i when given (streamed model state); `work_end`
    in place of `work` once the backward's compute is over (as its messages move), when given."""
    best = (0.0, 0.0, 0.0, 0.0)
    for i, p in enumerate(points):
        acts = p.kept * kept + p.bundles * bundle + p.working * (work if p.during or work_end is None else work_end)
        held = p.grads * grads + (state[i] if state is not None else 0.0)
        total = acts + p.comm + held
        if total > best[0]:
            best = (total, acts, float(p.comm), held)
    return best


def room_per_mb(points: Sequence[Point], room: float, bundle: float, work: float) -> float:
    """The most bytes each microbatch may keep so that every point fits in `room` (below 0: none fits)."""
    most = float("inf")
    for p in points:
        left = room - p.bundles * bundle - p.working * work - p.comm
        if p.kept == 0:
            if left < 0:
                return float("-inf")
        else:
            most = min(most, left / p.kept)
    return most
