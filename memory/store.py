"""Parameters and gradients in chunks with a host copy; the device holds the chunks in use (PatrickStar).

Every parameter is a view into its chunk's device buffer, whose storage is resized to zero
when the chunk leaves the device and refilled from the host copy when it comes back; views
that autograd saved stay valid objects and read correct values once the chunk is back
(FSDP's trick). Between steps parameters and grads are views into the host copies, so any
optimizer built from `pp.parameters()` steps them on the host.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.utils._python_dispatch import _disable_current_modes

from memory.chunks import Belady, Layout, choose_chunk_elems, pack
from memory.ledger import Ledger
from memory.streams import Copier, host_empty

__all__ = ["ChunkStore"]


class _Chunk:
    def __init__(self, cid: int, owner: int, dtype: torch.dtype, elems: int, device: torch.device) -> None:
        self.id, self.owner, self.dtype, self.elems = cid, owner, dtype, elems
        self.nbytes = elems * torch.empty((), dtype=dtype).element_size()
        self.host = host_empty(elems, dtype, device).zero_()
        self.host_grad = host_empty(elems, dtype, device).zero_()
        self.dev = torch.empty(elems, dtype=dtype, device=device)
        self.dev_grad = torch.empty(elems, dtype=dtype, device=device)
        self.members: list[tuple[torch.nn.Parameter, int, int]] = []  # (param, offset, numel)
        self.dev_views: list[torch.Tensor] = []   # made while the storage is allocated, kept across resizes
        self.dev_grad_views: list[torch.Tensor] = []
        self.resident = self.grad_loaded = self.dirty = False
        self.grad_zero = True      # the host grad copy is all zeros
        self.event: Any = None     # copy to the device in flight

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[o:o + n].view(p.shape) for p, o, n in self.members]

    def seal(self) -> None:
        """Make the device views, then free the device storage until the chunk is fetched."""
        self.dev_views, self.dev_grad_views = self.views(self.dev), self.views(self.dev_grad)
        self.dev.untyped_storage().resize_(0)
        self.dev_grad.untyped_storage().resize_(0)


class ChunkStore:
    """Chunks of the parameters of this rank's stages; one pool (capacity) per owning stage.

    `params[s]` lists stage s's parameters in the order its forward first reads them (each
    parameter once per rank); `units[s]` gives each the node that first reads it, whose parameters
    share a chunk where they fit (memory.chunks.pack). `use(group)` is called before a node runs
    (forward) and before its backward (from a hook on its output), with the chunks it reads; the store follows the
    step's use sequence (`set_sequence`) and logs every move in `log` ("F3", "P4", "E1").
    """

    def __init__(self, params: dict[int, list[tuple[str, torch.nn.Parameter]]], device: torch.device,
                 ledger: Ledger, copier: Copier, *, chunk_elems: dict[int, int] | None = None,
                 units: dict[int, list[int]] | None = None) -> None:
        self.device, self.ledger, self.copier = device, ledger, copier
        self.chunks: list[_Chunk] = []
        self.chunk_of: dict[int, int] = {}  # id(param) -> chunk
        self.layouts: dict[int, list[Layout]] = {}
        for s, named in params.items():
            by_dtype: dict[torch.dtype, list[tuple[str, torch.nn.Parameter, int]]] = {}
            unit = (units or {}).get(s) or list(range(len(named)))
            for (name, p), k in zip(named, unit):
                by_dtype.setdefault(p.dtype, []).append((name, p, k))
            self.layouts[s] = []
            for dtype, group in by_dtype.items():
                sizes = [(n, p.numel()) for n, p, _ in group]
                kinds = [k for _, _, k in group]
                elems = (chunk_elems or {}).get(s) or choose_chunk_elems([n for _, n in sizes], kinds)
                layout = pack(sizes, elems, units=kinds)
                self.layouts[s].append(layout)
                base = len(self.chunks)
                self.chunks += [_Chunk(base + k, s, dtype, elems, device) for k in range(layout.n_chunks)]
                for slot, (_, p, _) in zip(layout.slots, group):
                    c = self.chunks[base + slot.chunk]
                    c.members.append((p, slot.offset, slot.numel))
                    c.host[slot.offset:slot.offset + slot.numel].copy_(p.detach().reshape(-1))
                    self.chunk_of[id(p)] = c.id
        for ch in self.chunks:
            ch.seal()
        self.ptrs: set[int] = set()
        self.log: list[str] = []
        self.seq: list[tuple[int, ...]] = []
        self.pools: dict[int, Belady] = {}
        self.capacity: dict[int, int] = {}
        self.cursor, self.window = 0, (0, 0)
        self.backward = False
        self._kept: list[tuple[torch.nn.Parameter, torch.Tensor | None]] = []  # a pass's grads set aside
        self._on_device = False  # parameters are views of the device buffers (in a step or a pass)
        self._bind_host()

    # ----- the plan of a step -----
    def group(self, params: Sequence[torch.nn.Parameter]) -> tuple[int, ...]:
        return tuple(sorted({self.chunk_of[id(p)] for p in params if id(p) in self.chunk_of}))

    def set_sequence(self, seq: Sequence[tuple[int, ...]], capacity: dict[int, int]) -> None:
        """The step's use sequence and how many chunks each owning stage's pool may hold."""
        self.seq, self.capacity = list(seq), dict(capacity)

    def begin(self, window: tuple[int, int], backward: bool) -> None:
        """An action starts; its uses are seq[window[0]:window[1]]."""
        self.window, self.backward = window, backward
        self.cursor = max(self.cursor, window[0])

    def pin(self, group: tuple[int, ...], on: bool) -> None:
        if on:
            self.use(group)
        for c in group:
            pool = self.pools[self.chunks[c].owner]
            (pool.pinned.add if on else pool.pinned.discard)(c)

    # ----- moves -----
    def _locate(self, group: tuple[int, ...]) -> int:
        for pos in range(self.cursor, self.window[1]):
            if self.seq[pos] == group:
                self.cursor = pos + 1
                return pos
        return -1  # an unplanned use (e.g. recomputation): make it resident, follow the plan after

    def use(self, group: tuple[int, ...]) -> None:
        if not group:
            return
        pos = self._locate(group)
        at = pos if pos >= 0 else self.cursor - 1
        owners = sorted({self.chunks[c].owner for c in group})
        now = [e for o in owners for e in self.pools[o].use(at, tuple(c for c in group if self.chunks[c].owner == o))]
        # each pool prefetches at its own uses only: what it holds follows its stage's program alone
        later = [e for o in owners for e in self.pools[o].prefetch(pos)] if pos >= 0 else []
        chunks = [self.chunks[c] for c in group]
        if not now and not later and all(ch.event is None and (ch.grad_loaded or not self.backward) for ch in chunks):
            for ch in chunks:  # all there already (most uses): no copy to make or wait for
                ch.dirty = ch.dirty or self.backward
            return
        # Outside any dispatch mode (checkpointing, a user's mode): none may see or cache these copies.
        with _disable_current_modes(), torch.no_grad():
            self._run(now, now=True)
            self._run(later, now=False)
            for ch in chunks:
                if self.backward:
                    self._load_grad(ch)
                    ch.dirty = True
                self.copier.wait(ch.event)
                ch.event = None

    def _run(self, events: list[str], now: bool) -> None:
        for e in events:
            self.log.append(e)
            ch = self.chunks[int(e[1:])]
            if e[0] == "E":
                self._evict(ch)
            else:
                self._fetch(ch)
                if now:
                    self.copier.wait(ch.event)
                    ch.event = None

    def _fetch(self, ch: _Chunk) -> None:
        ch.dev.untyped_storage().resize_(ch.nbytes)
        ch.event = self.copier.copy(ch.dev, ch.host, to_device=True)
        ch.resident = True
        self.ptrs.add(ch.dev.untyped_storage().data_ptr())
        self.ledger.add(ch.owner, "params", ch.nbytes)

    def _load_grad(self, ch: _Chunk) -> None:
        if ch.grad_loaded:
            return
        ch.dev_grad.untyped_storage().resize_(ch.nbytes)
        if ch.grad_zero:
            ch.dev_grad.zero_()
        else:
            self.copier.wait(self.copier.copy(ch.dev_grad, ch.host_grad, to_device=True))
        ch.grad_loaded = True
        self.ledger.add(ch.owner, "grads", ch.nbytes)

    def _evict(self, ch: _Chunk) -> None:
        if ch.grad_loaded:
            if ch.dirty:
                self.copier.wait(self.copier.copy(ch.host_grad, ch.dev_grad, to_device=False))
                ch.grad_zero = False
            ch.dev_grad.untyped_storage().resize_(0)
            ch.grad_loaded = False
            self.ledger.add(ch.owner, "grads", -ch.nbytes)
        self.copier.wait(ch.event)
        ch.event = None
        self.ptrs.discard(ch.dev.untyped_storage().data_ptr())
        ch.dev.untyped_storage().resize_(0)
        ch.resident = ch.dirty = False
        self.ledger.add(ch.owner, "params", -ch.nbytes)

    # ----- steps -----
    def step_begin(self) -> None:
        """Parameters and grads become views of the device buffers (filled on use); the grads
        the user left (or None) are kept as torch would: accumulated into, or zeros."""
        self._start()
        for ch in self.chunks:
            grads = [p.grad for p, _, _ in ch.members]
            ch.grad_zero = all(g is None for g in grads)
            if not ch.grad_zero:
                for (p, o, n), g in zip(ch.members, grads):
                    region = ch.host_grad[o:o + n]
                    if g is None:
                        region.zero_()
                    elif g.data_ptr() != region.data_ptr():
                        region.copy_(g.detach().reshape(-1))
            for (p, _, _), v, gv in zip(ch.members, ch.dev_views, ch.dev_grad_views):
                p.grad = None
                p.data = v
                p.grad = gv
        self._on_device = True

    def _start(self) -> None:
        """Before a step or a pass: every chunk off the device (resident only after one that failed half-way),
        the pools planned over the use sequence set."""
        for ch in self.chunks:
            if ch.resident:
                self._evict(ch)
        if self._on_device:  # a step that failed half-way: its grads written back, every view the host's again
            self._bind_host()
        self.log, self.cursor = [], 0
        self.pools = {s: Belady([tuple(c for c in g if self.chunks[c].owner == s) for g in self.seq],
                                self.capacity.get(s, 2)) for s in self.layouts}

    def pass_begin(self) -> None:
        """A forward-only pass (evaluate, forward) over the use sequence set: parameters become views of the
        device buffers, filled on use, as in a step; their grads (host views between steps, or None) are
        set aside untouched, and pass_end puts them back."""
        self._start()
        self._kept = [(p, p.grad) for ch in self.chunks for p, _, _ in ch.members]
        for ch in self.chunks:
            for (p, _, _), v in zip(ch.members, ch.dev_views):
                p.grad = None
                p.data = v
        self._on_device = True

    def pass_end(self) -> None:
        """The pass's chunks off the device (no grad was loaded, so none is written back); parameters views
        of the host copies again, with the grads they had."""
        self.step_end()
        for p, g in self._kept:
            p.grad = g
        self._kept = []

    def step_end(self) -> None:
        """Every chunk goes back to the host (grads written back); parameters and grads become
        views of the host copies, where the optimizer steps them."""
        for ch in self.chunks:
            if ch.resident:
                self.log.append(f"E{ch.id}")
                self._evict(ch)
        self.copier.synchronize()
        self._bind_host()

    def _bind_host(self) -> None:
        self._on_device = False
        for ch in self.chunks:
            for (p, _, _), v, gv in zip(ch.members, ch.views(ch.host), ch.views(ch.host_grad)):
                p.grad = None
                p.data = v
                p.grad = None if ch.grad_zero else gv
