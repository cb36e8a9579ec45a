"""Chunks after PatrickStar, pure: packing tensors in use order, the chunk size, and the move order.

Legend: a chunk holds whole tensors, packed in the order the stage first uses them (a node's
parameters together where they fit, so a node needs one chunk); a use
sequence is one group of chunks per parameter-reading node visit (a node whose tensors span
two chunks needs both at once); events are "F3" fetch chunk 3 for use now, "P4" prefetch
chunk 4 ahead of its use, "E1" evict chunk 1 (to the host).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Iterable, Sequence

__all__ = ["Slot", "Layout", "pack", "node_units", "chunk_sizes", "choose_chunk_elems", "use_sequence", "Belady",
           "plan_moves", "residency"]


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


def _runs(sizes: Sequence[tuple[str, int]], units: Sequence[int] | None, align: int) -> list[int]:
    """For each tensor that starts a unit (consecutive tensors of one unit id), the elements the whole
    unit spans from an aligned start; 0 for the others (each tensor is its own unit without `units`)."""
    if units is None:
        return [n for _, n in sizes]
    runs = [0] * len(sizes)
    head = 0
    for i, (_, n) in enumerate(sizes):
        if i and units[i] != units[i - 1]:
            head = i
        runs[head] = _align(runs[head], align) + n
    return runs


def pack(sizes: Sequence[tuple[str, int]], chunk_elems: int, align: int = 16, units: Sequence[int] | None = None
         ) -> Layout:
    """Pack (name, numel) in the given order into chunks of `chunk_elems`; each tensor starts at a
    multiple of `align` elements and never spans two chunks, and the tensors of one unit (`units`:
    an id per tensor, a node's parameters) share a chunk when the unit fits in one. O(n)."""
    biggest = max([n for _, n in sizes] + [1])
    if chunk_elems < biggest:
        raise ValueError(f"chunk of {chunk_elems} elements cannot hold a tensor of {biggest}; use a chunk "
                         f"size >= {biggest}")
    runs = _runs(sizes, units, align)
    slots, chunk, used = [], 0, 0
    for (name, n), run in zip(sizes, runs):
        start = _align(used, align)
        whole = run if 0 < run <= chunk_elems else n  # a unit starts here: keep it together when it can be
        if start + whole > chunk_elems and used > 0:
            chunk, start = chunk + 1, 0
        slots.append(Slot(name, chunk, start, n))
        used = start + n
    return Layout(chunk_elems, tuple(slots), chunk + 1 if sizes else 0)


def node_units(groups: Sequence[Sequence[str]]) -> tuple[list[str], list[int]]:
    """Parameter names in first-use order (`groups`: each node's, in node order) and, for each, the
    node that first reads it: the units `pack` keeps in one chunk, so one node needs one chunk."""
    order: dict[str, int] = {}
    for k, g in enumerate(groups):
        for name in g:
            order.setdefault(name, k)
    return list(order), list(order.values())


def chunk_sizes(sizes: Sequence[int], units: Sequence[int] | None = None, *, align: int = 16) -> list[int]:
    """Chunk sizes (elements) worth planning with, smallest first: the least that holds every unit
    whole (the least memory a streamed stage can hold) and the one wasting the least padding."""
    if not sizes:
        return []
    named = [("", n) for n in sizes]
    least = _align(max(_runs(named, units, align)), align)
    return sorted({least, choose_chunk_elems(sizes, units, align=align)})


def choose_chunk_elems(sizes: Sequence[int], units: Sequence[int] | None = None, *, align: int = 16,
                       min_chunks: int = 4, tries: int = 64) -> int:
    """The chunk size (elements) wasting the least padding, from the largest tensor (or unit) up to
    total / min_chunks (so a stage has about `min_chunks` chunks or more); ties go to the
    smaller size. O(tries * n)."""
    if not sizes:
        return align
    named = [("", n) for n in sizes]
    lo = _align(max(_runs(named, units, align)), align)
    hi = max(lo, _align(-(-sum(_align(n, align) for n in sizes) // min_chunks), align))
    step = max(align, _align((hi - lo) // tries, align))
    best_waste, best = -1, lo
    for c in range(lo, hi + 1, step):
        waste = pack(named, c, align, units).waste
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


def residency(seq: Sequence[tuple[int, ...]], backward: Sequence[bool], capacity: int) -> list[tuple[int, int]]:
    """Per use of one pool's `seq` (`backward[i]`: the use is a backward's), the most and the last count
    of chunk buffers on the device around it and its prefetch: params of resident chunks, plus the grads
    of those a backward used since they came (memory.store loads grads on a backward's use, and drops
    them with the chunk). What the memory model adds to a streamed stage's points."""
    b = Belady(seq, capacity)
    grads: set[int] = set()
    out = []
    for pos, group in enumerate(seq):
        most = 0
        for k in range(2):  # the store's order: fetch, prefetch, then grads
            events = b.use(pos, group) if k == 0 else b.prefetch(pos)
            grads -= {int(e[1:]) for e in events if e[0] == "E"}
            most = max(most, len(b.resident) + len(grads))
        if backward[pos]:
            grads.update(group)
        most = max(most, len(b.resident) + len(grads))
        out.append((most, len(b.resident) + len(grads)))
    return out
