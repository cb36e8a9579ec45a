"""memory.streams.Copier's CUDA ordering, on a CPU: torch.cuda's streams and events are replaced by a
record of which operation waits for which, and the activation offload runs through it. A copy is
placed by the event recorded right after it on its stream (the Copier records one per copy)."""
from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch

from memory.offload import ActivationOffload, Bundle
from memory.streams import Copier


class _Stream:
    """A fake CUDA stream: each operation waits for the one before it on the stream and for what it names."""

    def __init__(self, waits: dict[int, set[int]], name: str) -> None:
        self.waits, self.name, self.tail = waits, name, -1

    def op(self, *after: int) -> int:
        n = len(self.waits)
        self.waits[n] = {a for a in (self.tail, *after) if a >= 0}
        self.tail = n
        return n

    def wait_stream(self, other: "_Stream") -> None:
        self.op(other.tail)

    def wait_event(self, event: "_Event") -> None:
        self.op(event.at)

    def synchronize(self) -> None:
        pass


class _Event:
    def __init__(self) -> None:
        self.at = -1

    def record(self, stream: _Stream) -> None:
        self.at = stream.op()


@pytest.fixture
def device(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The fake device: the compute stream, the waits between operations, and what record_stream marked."""
    waits: dict[int, set[int]] = {}
    compute = _Stream(waits, "compute")
    current = [compute]
    marked: list[tuple[int, str]] = []

    @contextlib.contextmanager
    def stream(s: _Stream) -> Any:
        current.append(s)
        try:
            yield
        finally:
            current.pop()
    made = iter(["h2d", "d2h", "reloads"])
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: _Stream(waits, next(made)))
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.Tensor, "record_stream",
                        lambda t, s: marked.append((t.untyped_storage().data_ptr(), s.name)))

    def before(a: int, b: int) -> bool:
        """Operation a is done before operation b starts."""
        todo, seen = [b], set()
        while todo:
            for w in waits[todo.pop()]:
                if w == a:
                    return True
                if w not in seen:
                    seen.add(w)
                    todo.append(w)
        return False
    return compute, before, marked


def test_reloads_wait_for_their_offload_not_the_compute(device: Any) -> None:
    compute, before, marked = device
    copier = Copier(torch.device("cuda"))  # streams from the fake; buffers on the CPU
    copier.device = torch.device("cpu")
    assert [s.name for s in (copier.streams[True], copier.streams[False], copier.reloads)] == ["h2d", "d2h", "reloads"]
    acts = ActivationOffload(torch.device("cpu"), copier, lambda s, n: None, chunk_bytes=256)
    x0, x1 = torch.randn(8, 4), torch.randn(8, 4)
    b0, b1 = Bundle(acts, 0, 0), Bundle(acts, 0, 1)
    made0 = compute.op()                      # the forward of mb 0 makes x0
    h0 = b0.put(x0)
    fill0 = b0.filled.at
    assert before(made0, fill0)               # an offload copies what the compute has written
    assert (x0.untyped_storage().data_ptr(), "d2h") in marked  # x0's memory waits for that copy
    later = compute.op()                      # the forward of mb 1
    b1.put(x1)
    fill1 = b1.filled.at
    fetch = copier.copy(torch.empty(4), torch.zeros(4), to_device=True).at  # a parameter chunk's fetch
    acts.to_device(b0)                        # the RELOAD before mb 0's backward
    assert b0.dev is not None and len(b0.events) == 1
    reload = b0.events[0].at
    assert before(fill0, reload)              # a reload copies what its own offload wrote,
    assert not before(later, reload)          # beside the compute issued before it,
    assert not before(fill1, reload)          # not behind the offloads of later microbatches,
    assert not before(fetch, reload)          # nor behind fetches, which wait for the compute
    assert (b0.dev[0].untyped_storage().data_ptr(), "compute") in marked  # freed once the compute read it
    y = h0.unpack()                           # the backward reads the reloaded activation
    backward = compute.op()
    assert before(reload, backward)
    torch.testing.assert_close(y, x0, rtol=0, atol=0)
    chunk = b0.host[0].data_ptr()
    acts.release(b0)                          # mb 0's backward is done: its host chunk is free again
    b2 = Bundle(acts, 0, 2)
    b2.put(torch.randn(8, 4))
    assert b2.host[0].data_ptr() == chunk     # mb 2 offloads into it
    assert before(reload, b2.filled.at)       # the next offload into that chunk waits for the reload's read


def test_on_cpu_copies_happen_at_once() -> None:
    copier = Copier(torch.device("cpu"))
    src = torch.arange(6, dtype=torch.uint8)
    dst, event = copier.to_device(src)
    assert event is None and copier.bytes_h2d == 6 and torch.equal(dst, src)
    assert dst.untyped_storage().data_ptr() != src.untyped_storage().data_ptr()  # a copy, not the host buffer
