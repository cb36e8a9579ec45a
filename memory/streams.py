"""Host <-> device copies: on CUDA on a side stream ordered by events; on CPU done at once (same code)."""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["Copier", "host_empty", "measure_speeds"]


def host_empty(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host buffer: pinned when the compute device is a GPU (fast, asynchronous copies)."""
    return torch.empty(n, dtype=dtype, pin_memory=device.type == "cuda")


def measure_speeds(device: torch.device, seconds: float = 0.05) -> tuple[float, float]:
    """(matmul FLOP per ms, host <-> device copy bytes per ms) on `device`, timed for about
    `seconds` each: what recomputing and offloading cost here, to price them against each other."""
    import time
    cuda = device.type == "cuda"
    n = 2048 if cuda else 256
    a = torch.randn(n, n, device=device)

    def timed(fn: Any) -> float:
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        reps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds or reps < 2:
            fn()
            reps += 1
            if cuda:
                torch.cuda.synchronize(device)
        return (time.perf_counter() - t0) * 1e3 / reps
    flop_per_ms = 2 * n ** 3 / timed(lambda: a @ a)
    nbytes = 16 << 20
    host = host_empty(nbytes, torch.uint8, device)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    copy_per_ms = nbytes / timed(lambda: dev.copy_(host, non_blocking=cuda))
    return float(flop_per_ms), float(copy_per_ms)


class Copier:
    """Copies between host and device buffers, counted.

    CUDA: copies to the device and copies to the host run on side streams, one each way, so a copy
    never queues behind one the other way still in flight (the link copies both ways at once). `copy`
    runs after the compute stream's work so far (what it reads is written, what it overwrites is no
    longer read) and returns an event that `wait` makes the compute stream wait for before it reads
    the buffer. `to_device` runs on a third stream and makes the buffer it fills there, so it waits
    only for the event it is given, not for the compute stream nor behind `copy`'s fetches that do:
    the caching allocator hands that stream only memory whose readers on the compute stream are done
    (`record_stream`). CPU: copies happen at once and events are None, the stand-in for a stream that
    is always done.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.streams: dict[bool, Any] = {w: torch.cuda.Stream(device) for w in (True, False)} if self.cuda else {}
        self.reloads: Any = torch.cuda.Stream(device) if self.cuda else None  # to_device's
        self.bytes_h2d = 0
        self.bytes_d2h = 0

    def _count(self, src: torch.Tensor, to_device: bool) -> None:
        n = src.numel() * src.element_size()
        if to_device:
            self.bytes_h2d += n
        else:
            self.bytes_d2h += n

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, to_device: bool) -> Any:
        """Copy `src` into `dst` after the compute stream's work so far; the copy's event."""
        self._count(src, to_device)
        if not self.cuda:
            dst.copy_(src)
            return None
        side = self.streams[to_device]
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(side)
        return event

    def to_device(self, src: torch.Tensor, after: Any = None) -> tuple[torch.Tensor, Any]:
        """A new device tensor holding host `src`, and its copy's event: the copy waits for event `after`
        (what filled `src`), not for the compute stream, so it can run beside the compute issued before it."""
        self._count(src, True)
        if not self.cuda:
            return src.to(self.device, copy=True), None
        side = self.reloads
        with torch.cuda.stream(side):
            if after is not None:
                side.wait_event(after)
            dst = torch.empty(src.shape, dtype=src.dtype, device=self.device)
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(side)
        dst.record_stream(torch.cuda.current_stream(self.device))  # freed only once the compute has read it
        return dst, event

    def hold(self, t: torch.Tensor) -> None:
        """Keep `t`'s memory from reuse until the copies to the host so far are done (CUDA)."""
        if self.cuda:
            t.record_stream(self.streams[False])

    def wait(self, event: Any) -> None:
        """Make the compute stream wait until the copy behind `event` is done."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def synchronize(self) -> None:
        """Block the host until every copy issued so far is done (before the host reads buffers)."""
        for side in [*self.streams.values(), *([self.reloads] if self.cuda else [])]:
            side.synchronize()
