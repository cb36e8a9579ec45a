"""Action timing on the device: CUDA events on CUDA (read once after the step), perf_counter on CPU.

On a GPU the host only launches kernels, so host clocks around an action would measure launch
time. A DeviceClock records an event before and after each action on the current stream and
resolves them after the step, with one synchronization, into milliseconds on the host clock's
axis (the step's first event is placed at the host time it was recorded), so timelines of
several ranks line up as well as their host clocks do.
"""
from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from pipe.simulate import Event, Timeline

__all__ = ["Clock", "HostClock", "DeviceClock", "clock_for", "gather"]


class Clock:
    """mark() -> an opaque mark now; span(action, start, end) keeps one timed action; resolve() ->
    [(action, start_ms, end_ms)] for the step, and forgets them."""

    def __init__(self) -> None:
        self.spans: list[tuple[Any, Any, Any]] = []

    def begin(self) -> None:
        self.spans = []

    def mark(self) -> Any:
        raise NotImplementedError

    def span(self, action: Any, start: Any, end: Any) -> None:
        self.spans.append((action, start, end))

    def resolve(self) -> list[tuple[Any, float, float]]:
        raise NotImplementedError


class HostClock(Clock):
    """perf_counter: the CPU runs the action while the host waits, so host time is device time."""

    def mark(self) -> float:
        return time.perf_counter()

    def resolve(self) -> list[tuple[Any, float, float]]:
        out = [(a, s * 1e3, e * 1e3) for a, s, e in self.spans]
        self.spans = []
        return out


class DeviceClock(Clock):
    """CUDA events on the current stream: an action's time is what the device spent on it."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.base: tuple[Any, float] | None = None  # (event, host ms when it was recorded)

    def begin(self) -> None:
        super().begin()
        self.base = (self.mark(), time.perf_counter() * 1e3)

    def mark(self) -> Any:
        e = torch.cuda.Event(enable_timing=True)
        e.record(torch.cuda.current_stream(self.device))
        return e

    def resolve(self) -> list[tuple[Any, float, float]]:
        if self.base is None:
            raise RuntimeError("DeviceClock.resolve() before begin()")
        torch.cuda.synchronize(self.device)  # once per step, after every action was launched
        event, host_ms = self.base
        out = [(a, host_ms + event.elapsed_time(s), host_ms + event.elapsed_time(e)) for a, s, e in self.spans]
        self.spans = []
        return out


def clock_for(device: torch.device) -> Clock:
    """The clock that measures device time on `device`."""
    return DeviceClock(device) if device.type == "cuda" else HostClock()


def gather(pp: Any) -> Timeline | None:
    """pp.gather_timeline: the last step's measured timeline of every rank of the pipeline, on rank 0 (a
    pipe.simulate.Timeline, None elsewhere; collective)."""
    parts: list[Any] = [None] * pp.world
    if pp.world > 1:
        dist.all_gather_object(parts, (pp.timeline, pp.collectives, pp.posts), group=pp.pp_group)
    else:
        parts = [(pp.timeline, pp.collectives, pp.posts)]
    if pp.rank != 0:
        return None
    events, collectives, posts = ([e for p in parts for e in p[i]] for i in range(3))
    t0 = min((e.start for e in events + collectives), default=0.0)

    def shifted(group: list[Event]) -> list[Event]:
        return [Event(e.rank, e.action, e.start - t0, e.end - t0) for e in group]
    return Timeline(shifted(events), pp.world, shifted(collectives), shifted(posts))
