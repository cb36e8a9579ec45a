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

    CUDA: every copy runs on one side stream after the compute stream's work so far (so a
    buffer being filled is no longer in use); `copy` returns an event that `wait` makes the
    compute stream wait for before it reads the buffer. CPU: the copy happens at once and
    the event is None, which is the stand-in for a stream that is always done.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.side: Any = torch.cuda.Stream(device) if self.cuda else None
        self.bytes_h2d = 0
        self.bytes_d2h = 0

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, to_device: bool) -> Any:
        n = src.numel() * src.element_size()
        if to_device:
            self.bytes_h2d += n
        else:
            self.bytes_d2h += n
        if not self.cuda:
            dst.copy_(src)
            return None
        compute = torch.cuda.current_stream(self.device)
        self.side.wait_stream(compute)
        with torch.cuda.stream(self.side):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.side)
        return event

    def hold(self, t: torch.Tensor) -> None:
        """Keep `t`'s memory from reuse until the side stream's copies so far are done (CUDA)."""
        if self.cuda:
            t.record_stream(self.side)

    def wait(self, event: Any) -> None:
        """Make the compute stream wait until the copy behind `event` is done."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def synchronize(self) -> None:
        """Block the host until every copy issued so far is done (before the host reads buffers)."""
        if self.cuda:
            self.side.synchronize()
