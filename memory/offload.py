"""Chunked activation offload: tensors a microbatch saves for backward go to host chunks as they are
saved (saved_tensors_hooks), and come back to the device ahead of the backward that needs them."""
from __future__ import annotations

from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from memory.streams import Copier, host_empty

__all__ = ["Bundle", "Handle", "ActivationOffload", "offloadable"]

ALIGN = 64  # bytes; every tensor starts at a multiple of this inside its chunk


def offloadable(t: torch.Tensor) -> bool:
    """Strided tensors of nonzero size, other than lazy conjugate or negative views (their storage holds the
    values before the conjugation or negation, which a copy of it would lose). The memory manager asks only
    for what the forward made: parameters, received values and model inputs never reach a bundle; leaves
    that need no grad (batch norm's statistics, pooling indices) are made by the forward too."""
    return t.numel() > 0 and t.layout == torch.strided and not t.is_conj() and not t.is_neg()


class Handle:
    """What autograd stores instead of an offloaded tensor: where its storage went, and its view of it."""
    __slots__ = ("bundle", "index", "dtype", "size", "stride", "offset")

    def __init__(self, bundle: "Bundle", index: int, t: torch.Tensor) -> None:
        self.bundle, self.index, self.dtype = bundle, index, t.dtype
        self.size, self.stride, self.offset = tuple(t.shape), t.stride(), t.storage_offset()

    def unpack(self) -> torch.Tensor:
        return self.bundle.get(self)


class Bundle:
    """The offloaded activations of one (stage, mb): host chunks, and device chunks while on device."""

    def __init__(self, owner: "ActivationOffload", stage: int, mb: int) -> None:
        self.owner, self.stage, self.mb = owner, stage, mb
        self.host: list[torch.Tensor] = []        # uint8 chunks
        self.dev: list[torch.Tensor] | None = None
        self.events: list[Any] = []                # the reloads' copies, until the compute stream waits for them
        self.filled: Any = None                    # the last copy to the host chunks (the copies run in order)
        self.used: list[int] = []                  # bytes used in each host chunk
        self.entries: list[tuple[int, int, int]] = []  # per storage: chunk, start, bytes
        self.keys: dict[int, tuple[StorageWeakRef, int, int]] = {}  # storage address -> the storage (weakly),
        # its entry, its version (views share it)
        self.stalls = 0

    @property
    def nbytes(self) -> int:
        """Bytes the bundle takes on the device (the used part of each chunk)."""
        return sum(self.used)

    def put(self, t: torch.Tensor) -> Handle:
        """Offload `t`: its storage is copied once per microbatch however many views of it are saved
        (as the ledger counts a storage once), and `t` comes back as the same view of that copy."""
        storage = t.untyped_storage()
        ptr, n = storage.data_ptr(), storage.nbytes()
        seen = self.keys.get(ptr)
        # the same storage, unchanged: not a new one at a freed address (the storage copied is alive, whichever
        # tensor holds it: a view saved after the one copied has died; and it is this one, not one moved away by
        # a resize, found by review), not written since it was copied
        ref = StorageWeakRef(storage)
        if seen is not None and seen[2] == t._version and not seen[0].expired() and seen[0].cdata == ref.cdata:
            return Handle(self, seen[1], t)
        o = self.owner
        start = -(-self.used[-1] // ALIGN) * ALIGN if self.used else 0
        if not self.host or start + n > self.host[-1].numel():
            self.host.append(o.take(max(n, o.chunk_bytes)))
            self.used.append(0)
            start = 0
        c = len(self.host) - 1
        self.used[c] = start + n
        whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
        self.filled = o.copier.copy(self.host[c][start:start + n], whole, to_device=False)
        o.copier.hold(t)  # its device memory waits for the copy, without stalling the host
        self.entries.append((c, start, n))
        self.keys[ptr] = (ref, len(self.entries) - 1, t._version)
        return Handle(self, len(self.entries) - 1, t)

    def get(self, h: "Handle") -> torch.Tensor:
        if self.dev is None:  # nothing reloaded it ahead (the program's RELOAD): the backward waits
            self.stalls += 1
            self.owner.stalls += 1
            self.owner.to_device(self)
        assert self.dev is not None
        for e in self.events:
            self.owner.copier.wait(e)
        self.events.clear()
        c, start, n = self.entries[h.index]
        flat = self.dev[c][start:start + n].view(h.dtype)  # as_strided's offset counts from the chunk's start
        return flat.as_strided(h.size, h.stride, flat.storage_offset() + h.offset)


class ActivationOffload:
    """Host chunks (pinned on CUDA, reused from a free list) and the moves of whole bundles.

    `on_device(stage, delta)` is told how many device bytes bundles take or give back.
    """

    def __init__(self, device: torch.device, copier: Copier, on_device: Any, chunk_bytes: int = 4 << 20) -> None:
        self.device, self.copier, self.on_device = device, copier, on_device
        self.chunk_bytes = chunk_bytes
        self.free: list[torch.Tensor] = []
        self.stalls = 0  # bundles read before they were brought back, since the start

    def take(self, n: int) -> torch.Tensor:
        for i, c in enumerate(self.free):
            if c.numel() >= n:
                return self.free.pop(i)
        return host_empty(n, torch.uint8, self.device)

    def to_device(self, b: Bundle) -> None:
        """Copy a bundle's chunks to the device (asynchronously on CUDA; `get` waits for them)."""
        if b.dev is not None or not b.host:
            return
        b.dev = []
        for h, n in zip(b.host, b.used):  # beside the compute issued so far: they wait only for the bundle's offload
            d, event = self.copier.to_device(h[:n], after=b.filled)
            b.events.append(event)
            b.dev.append(d)
        self.on_device(b.stage, b.nbytes)

    def drop_device(self, b: Bundle) -> None:
        """The device copies go; the host chunks still hold the values."""
        if b.dev is None:
            return
        for e in b.events:
            self.copier.wait(e)
        b.events.clear()
        b.dev = None
        self.on_device(b.stage, -b.nbytes)

    def release(self, b: Bundle) -> None:
        """The microbatch's backward is done: device copies go, host chunks return to the free list."""
        self.drop_device(b)  # the compute stream now waits for the reloads; a chunk's next offload waits for it
        self.free += [c for c in b.host if c.numel() == self.chunk_bytes]
        b.host.clear()
        b.used.clear()
        b.entries.clear()
        b.keys.clear()
        b.filled = None
