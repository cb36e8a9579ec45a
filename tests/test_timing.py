"""pipe.timing: the clock the runtime times actions with (host time on CPU; CUDA events are checked by
bench/gpu_check.py on a GPU)."""
import time

import torch

from pipe.timing import DeviceClock, HostClock, clock_for


def test_host_clock_spans_in_ms_in_order_and_forgotten_after_resolve() -> None:
    clock = clock_for(torch.device("cpu"))
    assert isinstance(clock, HostClock)
    clock.begin()
    for name in ("a", "b"):
        start = clock.mark()
        time.sleep(0.01)
        clock.span(name, start, clock.mark())
    spans = clock.resolve()
    assert [a for a, _, _ in spans] == ["a", "b"]
    (_, s0, e0), (_, s1, e1) = spans
    assert 9.0 <= e0 - s0 < 1000 and s1 >= e0 and e1 - s1 >= 9.0
    assert clock.resolve() == []


def test_cuda_devices_get_event_clocks() -> None:
    assert isinstance(clock_for(torch.device("cuda", 0)), DeviceClock)  # built without touching CUDA
