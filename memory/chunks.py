"""Chunks after PatrickStar, pure: packing tensors in use order, the chunk size, and the move order.

Legend: a chunk holds whole tensors, packed in the order the stage first uses them; a use
sequence is one group of chunks per parameter-reading node visit (a node whose tensors span
two chunks needs both at once); events are "F3" fetch chunk 3 for use now, "P4" prefetch
chunk 4 ahead of its use, "E1" evict chunk 1 (to the host).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Iterable, Sequence

__all__ = ["Slot", "Layout", "pack", "choose_chunk_elems", "use_sequence", "Belady", "plan_moves"]


@dataclass(frozen=True)
class Slot:
    """Where one tensor lives: chunk index and element offset inside it."""
    name: str
    chunk: int
    offset: int
    numel: int


@dataclass(frozen=True)
class Layout:
    chunk_elems: int
    slots: tuple[Slot, ...]
    n_chunks: int

    @property
    def waste(self) -> int:
        """Padding elements: chunk capacity not holding any tensor."""
        return self.n_chunks * self.chunk_elems - sum(s.numel for s in self.slots)

    def of(self, name: str) -> Slot:
        return next(s for s in self.slots if s.name == name)


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


def pack(sizes: Sequence[tuple[str, int]], chunk_elems: int, align: int = 16) -> Layout:
    """Pack (name, numel) in the given order into chunks of `chunk_elems`; each tensor starts at a
    multiple of `align` elements and never spans two chunks. O(n)."""
    biggest = max([n for _, n in sizes] + [1])
    if chunk_elems < biggest:
        raise ValueError(f"chunk of {chunk_elems} elements cannot hold a tensor of {biggest}; use a chunk "
                         f"size >= {biggest}")
    slots, chunk, used = [], 0, 0
    for name, n in sizes:
        start = _align(used, align)
        if start + n > chunk_elems and used > 0:
            chunk, start = chunk + 1, 0
        slots.append(Slot(name, chunk, start, n))
        used = start + n
    return Layout(chunk_elems, tuple(slots), chunk + 1 if sizes else 0)


def choose_chunk_elems(sizes: Sequence[int], *, align: int = 16, min_chunks: int = 4, tries: int = 64) -> int:
    """The chunk size (elements) wasting the least padding, from the largest tensor up to
    total / min_chunks (so a stage has about `min_chunks` chunks or more); ties go to the
    smaller size. O(tries * n)."""
    if not sizes:
        return align
    lo = _align(max(sizes), align)
    hi = max(lo, _align(-(-sum(_align(n, align) for n in sizes) // min_chunks), align))
    step = max(align, _align((hi - lo) // tries, align))
    best_waste, best = -1, lo
    for c in range(lo, hi + 1, step):
        waste = pack([("", n) for n in sizes], c, align).waste
        if best_waste < 0 or waste < best_waste:
            best_waste, best = waste, c
    return best


def use_sequence(actions: Sequence[tuple[int, str, int]], forward: dict[int, list[tuple[int, ...]]],
                 weight: dict[int, list[tuple[int, ...]]] | None = None) -> list[tuple[int, ...]]:
    """The chunk groups this rank uses in a step, in order: F visits a stage's parameter nodes
    in forward order, B in reverse, W (weight grads, node by node) in `weight` order."""
    seq: list[tuple[int, ...]] = []
    for stage, kind, _ in actions:
        groups = forward.get(stage, [])
        if kind == "F":
            seq += groups
        elif kind == "B":
            seq += groups[::-1]
        else:
            seq += (weight or forward).get(stage, [])
    return [g for g in seq if g]


class Belady:
    """Which chunks the device holds: fetch on use, evict the chunk used farthest in the future
    (Belady's OPT; the schedule gives the future), prefetch the next group's first absent chunk.

    Both the pure planner (`plan_moves`) and the runtime store drive this one class, so the
    runtime's moves are the planned ones whenever its uses follow the sequence.
    """

    def __init__(self, seq: Sequence[tuple[int, ...]], capacity: int, resident: Iterable[int] = ()) -> None:
        need = max([len(g) for g in seq] + [1])
        if capacity < need:
            raise ValueError(f"a parameter node needs {need} chunks at once but the device may hold {capacity}; "
                             f"allow at least {need} resident chunks")
        self.seq, self.capacity = list(seq), capacity
        self.where: dict[int, list[int]] = {}
        for i, g in enumerate(self.seq):
            for c in g:
                self.where.setdefault(c, []).append(i)
        self.resident: list[int] = list(resident)
        self.pinned: set[int] = set()

    def next_use(self, chunk: int, pos: int) -> float:
        """Index of the first group after `pos` that uses `chunk` (inf: never again this step)."""
        ps = self.where.get(chunk, [])
        k = bisect.bisect_right(ps, pos)
        return ps[k] if k < len(ps) else float("inf")

    def _victim(self, pos: int, keep: set[int]) -> int | None:
        cands = [c for c in self.resident if c not in keep and c not in self.pinned]
        if not cands:
            return None
        return max(cands, key=lambda c: (self.next_use(c, pos), -c))

    def use(self, pos: int, group: tuple[int, ...]) -> list[str]:
        """Make `group` resident for the use at `pos` (pos may be -1 for an unplanned use)."""
        events: list[str] = []
        for c in group:
            if c in self.resident:
                continue
            if len(self.resident) >= self.capacity:
                v = self._victim(pos, set(group))
                if v is None:
                    raise RuntimeError(f"no chunk can leave the device to make room for chunk {c} "
                                       f"(resident {self.resident}, pinned {sorted(self.pinned)})")
                self.resident.remove(v)
                events.append(f"E{v}")
            self.resident.append(c)
            events.append(f"F{c}")
        return events

    def prefetch(self, pos: int) -> list[str]:
        """Bring the first absent chunk of the next groups ahead of its use, when a slot is free or
        a resident chunk is needed later than it."""
        if len(self.resident) >= len(self.where):
            return []  # every chunk this pool uses is on the device
        for q in range(pos + 1, len(self.seq)):
            absent = [c for c in self.seq[q] if c not in self.resident]
            if not absent:
                continue
            c = absent[0]
            events: list[str] = []
            if len(self.resident) >= self.capacity:
                v = self._victim(pos, set(self.seq[pos]) if pos >= 0 else set())
                if v is None or self.next_use(v, pos) <= q:
                    return []
                self.resident.remove(v)
                events.append(f"E{v}")
            self.resident.append(c)
            return events + [f"P{c}"]
        return []


def plan_moves(seq: Sequence[tuple[int, ...]], capacity: int, *, prefetch: bool = True,
               resident: Iterable[int] = ()) -> list[str]:
    """Every fetch, prefetch and eviction over one step's use sequence, in order."""
    b = Belady(seq, capacity, resident)
    events: list[str] = []
    for pos, group in enumerate(seq):
        events += b.use(pos, group)
        if prefetch:
            events += b.prefetch(pos)
    return events
