"""The point-to-point transport the runtime uses, and the failure protocol: a lost rank or a failed one
named by every other rank (start-up and the end of a job are pipe.launch)."""
from __future__ import annotations

import contextlib
import datetime
import time
from typing import Any, Iterator, Protocol, Sequence

import torch
import torch.distributed as dist

from partition.errors import FxpipeError, first_line

__all__ = ["PeerLost", "RemoteError", "guarded", "fail_everywhere", "first_failure", "report_lost", "follow_lost",
           "DEFAULT_TIMEOUT_S", "Transport", "TorchTransport", "Work", "alloc_layout", "to_layout"]


class PeerLost(FxpipeError, RuntimeError):
    """Another rank died or stopped answering within the timeout. `peer`: the rank waited on, when
    known; `early`: the wait failed well before the timeout (that peer's process ended)."""

    def __init__(self, message: str, peer: int | None = None, early: bool = False) -> None:
        super().__init__(message)
        self.peer, self.early = peer, early


class RemoteError(FxpipeError, RuntimeError):
    """Another rank failed with an error of its own, and this rank stopped with it."""


DEFAULT_TIMEOUT_S = 300.0
_ERROR_KEY, _FAILURES_KEY = "fxpipe/error", "fxpipe/failures"
_LOST_KEY = "fxpipe/lost/"  # + rank: the rank it could not reach
_DONE_KEY = "fxpipe/done/"  # + rank: that rank is leaving (finish), its failure named
_ALIVE_KEY = "fxpipe/alive/"  # + rank: that rank answered the roll call after a collective failed
_KEPT: list[Any] = []  # the store outlives the process group it served, for the failure protocol
_TIMEOUT_S = [DEFAULT_TIMEOUT_S]  # the process group's timeout (init's timeout_s)
_FAILED = [False]  # this rank saw the job fail: a lost rank, another rank's error, or its own
_STOPPED: list[str] = []  # why this rank's process groups were torn down (stopped), each time one was
_STORE_OP_S = 5.0  # the longest a store operation of the failure protocol waits


@contextlib.contextmanager
def guarded(what: str, peer: int | None = None, every: bool = False) -> Iterator[None]:
    """Communication inside is with other ranks: any failure of it is PeerLost, naming `what` and
    the peer, and whether it failed early (before half the timeout: the peer's process ended). `every`:
    a collective over every rank of the job, whose failure names the lost ranks by a roll call in the
    store (collectives)."""
    start = time.monotonic()
    try:
        yield
    except PeerLost:
        raise
    except Exception as e:  # gloo and NCCL raise RuntimeError subclasses of many kinds
        if every and peer is None and dist.is_initialized() and dist.get_world_size() > 1:
            raise _roll_call(what, e, time.monotonic() - start) from e
        _FAILED[0] = True
        who = "another rank" if peer is None else f"rank {peer}"
        early = time.monotonic() - start < _TIMEOUT_S[0] / 2
        raise PeerLost(f"{what} with {who} failed ({type(e).__name__}: {first_line(e)})", peer, early) from e


def _from_collective(e: BaseException) -> bool:
    """Whether `e` was raised inside one of torch.distributed's collectives (its frames pass through
    distributed_c10d): gloo's "Connection closed by peer", a timeout, NCCL's errors."""
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.replace("\\", "/").endswith("torch/distributed/distributed_c10d.py"):
            return True
        tb = tb.tb_next
    return False


@contextlib.contextmanager
def collectives(what: str) -> Iterator[None]:
    """A phase whose communication is collectives over every rank (building the pipeline): when one fails,
    this rank raises PeerLost naming the ranks that do not answer a roll call in the store (a rank whose
    process ended or froze), or RemoteError when a rank published an error of its own first."""
    start = time.monotonic()
    try:
        yield
    except Exception as e:
        named = e.peer is not None if isinstance(e, PeerLost) else not _from_collective(e)
        if named or not dist.is_initialized() or dist.get_world_size() == 1:
            raise  # (the rank named already, this rank's own error, or no process group: a usage error)
        raise _roll_call(what, e, time.monotonic() - start) from e


def _roll_call(what: str, e: BaseException, took: float) -> Exception:
    """After a collective failed: every surviving rank marks itself alive, and the ranks that have not
    within a tenth of the timeout (1 s to 15 s) are the lost ones."""
    _FAILED[0] = True
    me, world = dist.get_rank(), dist.get_world_size()
    store = _store()
    lost: list[int] = []
    with contextlib.suppress(Exception):  # the store may be gone with rank 0
        store.set(f"{_ALIVE_KEY}{me}", "1")
        deadline = time.monotonic() + min(max(1.0, _TIMEOUT_S[0] / 10), 15.0)
        while True:
            lost = [r for r in range(world) if r != me and not store.check([f"{_ALIVE_KEY}{r}"])]
            if not lost or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    early = took < _TIMEOUT_S[0] / 2
    if lost:
        report_lost(lost[0])
    first = first_failure()  # (and this rank's process group torn down, as after a step's failure)
    if first is not None:
        return RemoteError(f"rank {me} stopped while {what} because {first}")
    if lost:
        named = f"rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))}"
        return PeerLost(f"rank {me} lost {named} while {what} ({type(e).__name__}: {first_line(e)}); that process "
                        "died or stopped answering within the timeout; see its output", lost[0], early)
    return PeerLost(f"rank {me} lost another rank while {what} ({type(e).__name__}: {first_line(e)}); every rank "
                    "answered the roll call after it, so see the others' output", None, early)


def _store() -> Any:
    """The rendezvous store, kept for after the teardown, each operation bounded by a few seconds
    (were its host unreachable, each would wait the whole timeout)."""
    store = dist.distributed_c10d._get_default_store()
    layer: Any = store
    while layer is not None:  # PrefixStores around the TCPStore: each has a timeout of its own
        layer.set_timeout(datetime.timedelta(seconds=min(_STORE_OP_S, _TIMEOUT_S[0])))
        layer = getattr(layer, "underlying_store", None)
    _KEPT.append(store)
    return store


def report_lost(peer: int) -> None:
    """Tell every rank that this one could not reach `peer` (at once, before anything else, so the
    ranks waiting on this one can follow the chain to the rank that died or froze)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        with contextlib.suppress(Exception):
            _store().set(f"{_LOST_KEY}{dist.get_rank()}", str(peer))


def follow_lost(peer: int, early: bool, me: int) -> tuple[int, list[int]]:
    """The rank that was really lost, and the chain to it: from `peer`, the rank this one could
    not reach, follow what each rank reported it could not reach (report_lost) to a rank that
    reported nothing. A peer whose process ended (`early`) has reported already, if it ever will;
    one that timed out may be waiting on its own peer, so its report gets longer to arrive
    (a tenth of the timeout, 1 s to 15 s: a survivor ends within the timeout + 30 s). Works after
    this rank's process group is torn down."""
    chain = [peer]
    store = _store() if dist.is_initialized() else (_KEPT[-1] if _KEPT else None)  # kept past a teardown
    if store is None:
        return peer, chain
    patience = 1.0 if early else min(max(1.0, _TIMEOUT_S[0] / 10), 15.0)
    while len(chain) <= 64:
        key = f"{_LOST_KEY}{chain[-1]}"
        try:
            store.wait([key], datetime.timedelta(seconds=patience))
            nxt = int(store.get(key).decode())
        except Exception:  # no report in time: this rank is the one lost
            break
        if nxt in chain or nxt == me:  # ranks waiting on each other: stop at the first repeat
            break
        chain.append(nxt)
    return chain[-1], chain


def fail_everywhere(message: str) -> None:
    """This rank failed with `message`: publish it in the store (the first failure of the job wins)
    and tear the process group down; the ranks waiting on this one read it when they wake (see
    _stop for when that is)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    _FAILED[0] = True
    store = _store()
    with contextlib.suppress(Exception):  # the store may be gone with a dead rank 0
        if int(store.add(_FAILURES_KEY, 1)) == 1:
            store.set(_ERROR_KEY, message)
    _stop(message)


def first_failure(timeout_s: float = 1.0) -> str | None:
    """After communication failed: the message of the rank that failed first, or None when no rank
    published one within `timeout_s` (that rank died or hangs: a lost peer). Tears down this
    rank's process group too."""
    if not dist.is_initialized():
        return None
    _FAILED[0] = True
    store = _store()
    message = None
    with contextlib.suppress(Exception):
        store.wait([_ERROR_KEY], datetime.timedelta(seconds=timeout_s))
        message = store.get(_ERROR_KEY).decode()
    _stop(message or "a rank was lost")
    return message


def stopped() -> str | None:
    """Why this rank's process group was last torn down after a failure (stopped), or None if none was."""
    return _STOPPED[-1] if _STOPPED else None


def stops() -> int:
    """How many times this rank's process group was torn down after a failure (a pipeline built before the last
    one has lost its groups; one built after, on a group the user started again, has not)."""
    return len(_STOPPED)


def _stop(why: str) -> None:
    """Abort this rank's process group (`why`: the failure, as later calls name it). Under gloo a rank waiting on
    this one wakes when this process exits (its pending operations hold the connections open until then), and
    reads the first failure from the store (see finish for how long a rank stays for the others)."""
    _STOPPED.append(why)
    if dist.get_backend() == "nccl":
        dist.distributed_c10d._abort_process_group()
    else:
        dist.destroy_process_group()


class Work(Protocol):
    def wait(self) -> Any: ...

    def is_completed(self) -> bool: ...


class Transport(Protocol):
    """Point-to-point messages between ranks: a batch of ("send" | "recv", tensor, peer) posted as one
    group, matched per pair in issue order (no tags, as NCCL matches); a Work per op."""

    def batch(self, ops: Sequence[tuple[str, torch.Tensor, int]]) -> list[Work]: ...


class _Guarded:
    """A message in flight whose failure is PeerLost, naming the peer. It may be waited on more
    than once (a gloo receive waited twice would wait for a second message)."""

    def __init__(self, work: Any, what: str, peer: int | None) -> None:
        self.work, self.what, self.peer = work, what, peer
        self.done = False

    def wait(self) -> Any:
        if not self.done:
            with guarded(self.what, self.peer):
                self.work.wait()
            self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done or bool(self.work.is_completed())


class TorchTransport:
    """torch.distributed's batch_isend_irecv (gloo on CPU, NCCL on GPU), every tag 0; a failed
    message is PeerLost naming its peer. `ranks`: the global rank of each pipeline rank (its
    pipeline's ranks when the pipeline is one dimension of a mesh); the identity by default."""

    def __init__(self, ranks: Sequence[int] | None = None) -> None:
        self.ranks = list(ranks) if ranks is not None else None

    def batch(self, ops: Sequence[tuple[str, torch.Tensor, int]]) -> list[Work]:
        if self.ranks is not None:
            ops = [(kind, t, self.ranks[peer]) for kind, t, peer in ops]
        p2p = [dist.P2POp(dist.isend if kind == "send" else dist.irecv, t, peer) for kind, t, peer in ops]
        with guarded("posting messages", ops[0][2] if ops else None):
            works = dist.batch_isend_irecv(p2p)
        if len(works) != len(ops):  # NCCL coalesces the batch: its work stands for every op
            whole = _Guarded(_AllOf(works), "a batch of messages", ops[0][2])
            return [whole] * len(ops)
        return [_Guarded(w, f"a {kind}", peer)
                for w, (kind, _, peer) in zip(works, ops)]


class _AllOf:
    """Works waited on as one."""

    def __init__(self, works: Sequence[Any]) -> None:
        self.works = list(works)

    def wait(self) -> Any:
        for w in self.works:
            w.wait()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


def _layout(shape: Sequence[int], ref_shape: Sequence[int], ref_stride: Sequence[int]) -> tuple[int, ...] | None:
    """Dense strides for `shape` in the dim order of (ref_shape, ref_stride), innermost the smallest stride;
    None: contiguous. A value that is a slice of a larger tensor (the q of a fused qkv projection) is not
    dense, but kernels lay out what they make from it by its dim order (attention's output, and so whether
    a transpose and flatten after it is a view or a copy the next layer saves), so it keeps that order;
    a broadcast value (a stride of 0) goes contiguous."""
    if not ref_stride or len(ref_stride) != len(shape) or \
            any(st == 0 and sz > 1 for sz, st in zip(ref_shape, ref_stride)):
        return None
    order = sorted(range(len(shape)), key=lambda d: (ref_stride[d], -d))  # innermost first
    stride = [0] * len(shape)
    step = 1
    for d in order:
        stride[d] = step
        step *= max(1, shape[d])
    return tuple(stride)


def alloc_layout(shape: Sequence[int], dtype: torch.dtype, device: torch.device, *,
                 ref_shape: Sequence[int] = (), ref_stride: Sequence[int] = ()
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """A receive buffer laid out like the producer's value, and the 1-D view of its memory.

    Values keep their producer's dim order across the wire (a transposed activation stays
    transposed, a slice of a larger tensor keeps its order, densely), so graph ops such as `view` that
    depend on layout, and the layouts kernels choose, behave as unsplit.
    """
    stride = _layout(shape, ref_shape or shape, ref_stride)
    if stride is None:
        t = torch.empty(tuple(shape), dtype=dtype, device=device)
        return t, t.view(-1)
    t = torch.empty_strided(tuple(shape), stride, dtype=dtype, device=device)
    return t, torch.as_strided(t, (t.numel(),), (1,))


def to_layout(t: torch.Tensor, ref_shape: Sequence[int] = (), ref_stride: Sequence[int] = ()) -> torch.Tensor:
    """The 1-D memory to send for `t`, in the layout `alloc_layout` gives the receiver."""
    t = t.detach()
    stride = _layout(t.shape, ref_shape or t.shape, ref_stride)
    if stride is None:
        return t.contiguous().view(-1)
    if tuple(t.stride()) != stride:
        t = torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device).copy_(t)
    return torch.as_strided(t, (t.numel(),), (1,), t.storage_offset())
