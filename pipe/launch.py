"""Start-up under torchrun, mpirun or plain environment variables, and the end of a job: every
survivor of a lost rank exits within the timeout + 30 s under every launcher (finish)."""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import datetime
import gc
import importlib
import math
import os
import platform
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, NoReturn, Sequence

import torch
import torch.distributed as dist

from partition.errors import FxpipeError, first_line
from pipe.comm import _DONE_KEY, _FAILED, _KEPT, _LOST_KEY, _TIMEOUT_S, DEFAULT_TIMEOUT_S

__all__ = ["Context", "LaunchError", "TimeoutSettingError", "DEFAULT_TIMEOUT_S", "init", "context", "finish",
           "exit_process", "timeout_setting", "measure_allreduce", "measure_link", "keep_freed_memory"]

_MPI: list[Any] = []  # (mpi4py.MPI, whether finish finalizes it) once the rendezvous used MPI
_LINGER_S = 5.0    # how long finish waits at most for the ranks still naming a failure


class LaunchError(FxpipeError, RuntimeError):
    """The process environment does not describe a usable launch."""


class TimeoutSettingError(LaunchError, ValueError):
    """The communication timeout given is not a positive, finite number of seconds."""


@dataclass(frozen=True)
class Context:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    launcher: str  # "torchrun", "env" (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set by hand), "mpi" or "single"
    freed_kept: bool = False  # glibc keeps the memory this process frees (keep_freed_memory)


_CONTEXT: Context | None = None


def _int_env(*names: str) -> int | None:
    for n in names:
        v = os.environ.get(n)
        if v is not None and v != "":
            return int(v)
    return None


def _mpi_rendezvous(rank: int) -> tuple[str, int]:
    """Rank 0 starts the store host (_store_host) and MPI broadcasts its address and port to every
    rank. MPI stays initialized (a rank that exits without MPI_Finalize makes mpiexec end the job)
    and `finish`, not mpi4py's exit hook, finalizes it: after a failure it does not."""
    try:
        import mpi4py
    except ImportError as e:
        raise LaunchError("started by mpirun (MPI environment variables found) but mpi4py is not "
                          "installed; fix: pip install 'fxpipe[mpi]'") from e
    addr_port: tuple[str, int] | None = None
    if rank == 0:  # forked before MPI starts
        addr = os.environ.get("MASTER_ADDR") or socket.gethostbyname(socket.gethostname())
        addr_port = (addr, _store_host(addr))
    ours = "mpi4py.MPI" not in sys.modules  # else its importer set the exit hook already
    if ours:
        mpi4py.rc.finalize = False
    from mpi4py import MPI
    _MPI[:] = [MPI, ours]
    result: tuple[str, int] = MPI.COMM_WORLD.bcast(addr_port, root=0)
    return result


def _store_host(addr: str, port: int = 0, timeout_s: float = DEFAULT_TIMEOUT_S) -> int:
    """Under mpirun, or ranks started with plain environment variables (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT, no torchrun agent): fork a process to host the rendezvous store on `port` (0: any), as
    torchrun's agent hosts it, so that it answers while rank 0 is frozen (a stopped process's store
    blocks every rank that asks it); it ends once rank 0 has ended. Returns the store's port."""
    read, write = os.pipe()
    if os.fork() == 0:  # the host: no MPI, no exit handlers, no output
        code = 1
        with contextlib.suppress(BaseException):
            os.close(read)
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            parent = os.getppid()
            store = dist.TCPStore(addr, port, is_master=True, wait_for_workers=False,  # (found by review: an
                                  timeout=datetime.timedelta(seconds=timeout_s))  # address no host has: for ever)
            os.write(write, str(store.port).encode())
            os.close(write)
            while os.getppid() == parent:
                time.sleep(0.2)
            code = 0
        os._exit(code)
    os.close(write)
    with os.fdopen(read) as f:
        got = f.read()
    if not got.isdigit():
        raise LaunchError(f"rank 0 could not start the rendezvous store on {addr}" + (f":{port}" if port else "") +
                          "; set MASTER_ADDR to an address of this host the other ranks reach" +
                          (" and MASTER_PORT to a free port" if port else ""))
    return int(got)


def _client_store(addr: str, port: int, world: int, timeout_s: float) -> Any:
    """A client of the rendezvous store at addr:port, or a LaunchError within the timeout (+ 5 s). Found by
    review: where another program held MASTER_PORT, rank 0 named it, and a rank connecting to that program
    waited for its answer forever, past the timeout; the connection is made in a thread that is left behind."""
    import threading
    got: list[Any] = []

    def connect() -> None:
        try:
            got.append(dist.TCPStore(addr, port, world, is_master=False,
                                     timeout=datetime.timedelta(seconds=timeout_s)))
        except Exception as e:  # noqa: BLE001 - said below, as this rank's own error
            got.append(e)
    thread = threading.Thread(target=connect, name="fxpipe-store-connect", daemon=True)
    thread.start()
    thread.join(timeout_s + 5.0)
    if not got or isinstance(got[0], Exception):
        why = f" ({first_line(got[0])})" if got else ""
        raise LaunchError(f"could not reach the rendezvous store at {addr}:{port} within {timeout_s:g} s{why}: rank "
                          "0 did not start it there (it names why), or another program holds that port; set "
                          "MASTER_PORT to a free port on every rank")
    return got[0]


def _plain_env() -> bool:
    """Ranks started with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set by hand (or by a scheduler's
    script), not by torchrun, whose agent hosts the store (TORCHELASTIC_USE_AGENT_STORE)."""
    return (os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true" and bool(os.environ.get("MASTER_ADDR"))
            and (os.environ.get("MASTER_PORT") or "").isdigit())


def _detect() -> tuple[str, int, int, int]:
    """(launcher, rank, world_size, local_rank) from torchrun or MPI variables."""
    rank = _int_env("RANK")
    world = _int_env("WORLD_SIZE")
    if rank is not None and world is not None:
        return "torchrun", rank, world, _int_env("LOCAL_RANK") or 0
    rank = _int_env("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")
    world = _int_env("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")
    if rank is not None and world is not None:
        local = _int_env("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK")
        return "mpi", rank, world, local or 0
    return "single", 0, 1, 0


def timeout_setting(value: object, source: str = "timeout_s") -> float:
    """`value` (a number, or its text from the command line or the environment) as the
    communication timeout in seconds; `source` names where it came from, for the error."""
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        seconds = math.nan
    if isinstance(value, bool) or not (math.isfinite(seconds) and seconds > 0):
        raise TimeoutSettingError(f"{source} must be a positive, finite number of seconds, got {value!r}; "
                                  f"give e.g. 60, or leave it unset for the default {DEFAULT_TIMEOUT_S:g} s")
    return seconds


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep the memory this process frees instead of handing it back to the
    kernel; process-wide, and for the rest of the process. True when glibc took the settings (False
    without glibc: other C libraries, macOS, Windows).

    torch's CPU tensors come from malloc. By default glibc serves a block above its mmap threshold
    (128 KiB, raised up to 32 MiB as such blocks are freed) with a fresh mapping and unmaps it when
    freed, and trims a free top of the heap above twice that: the next microbatch's activations are
    then page-faulted in again, which measured up to 20% of a pipeline step on CPU (README). This sets
    M_MMAP_THRESHOLD to 1 GiB and M_TRIM_THRESHOLD to 2 GiB: the resident set stays at the step's
    peak between steps, as CUDA's caching allocator keeps device memory.
    """
    if platform.libc_ver()[0] != "glibc":  # another C library may take one setting and refuse the other
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        # mallopt takes a C int: 2^31 - 1 is the largest trim threshold it can set (2^62 became 0, a trim
        # at every free)
        return bool(libc.mallopt(m_mmap_threshold, 1 << 30)) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1))
    except (OSError, AttributeError):
        return False


def init(*, backend: str | None = None, timeout_s: float | None = None, keep_freed: bool | None = None) -> Context:
    """Start torch.distributed from the launcher's environment; idempotent.

    torchrun: RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT. mpirun/mpiexec (MPICH, Open MPI,
    MVAPICH): rank and size from the MPI variables, rendezvous through mpi4py. Neither:
    one process. Backend: NCCL when CUDA is available, else gloo. `timeout_s` bounds every
    wait on another rank, so a lost rank ends the others with an error instead of a hang
    (default: $FXPIPE_TIMEOUT, else 300 s). Every survivor of a lost rank exits within the
    timeout + 30 s, under every launcher (see finish). `keep_freed`: on CPU, glibc keeps the memory
    the process frees (keep_freed_memory; default: $FXPIPE_KEEP_FREED, 0 or 1, else 1); the plan's
    notes say whether it did.
    """
    global _CONTEXT
    if _CONTEXT is not None:
        return _CONTEXT
    env_timeout = os.environ.get("FXPIPE_TIMEOUT", "")
    if timeout_s is not None:
        timeout_s = timeout_setting(timeout_s)
    elif env_timeout.strip():
        timeout_s = timeout_setting(env_timeout, "FXPIPE_TIMEOUT")
    else:
        timeout_s = DEFAULT_TIMEOUT_S
    if keep_freed is None:
        env_keep = os.environ.get("FXPIPE_KEEP_FREED", "1").strip()
        if env_keep not in ("0", "1"):
            raise LaunchError(f"FXPIPE_KEEP_FREED must be 0 or 1, got {env_keep!r}: 1 (the default) keeps the "
                              "memory a CPU process frees in it, 0 leaves glibc's malloc as it is")
        keep_freed = env_keep == "1"
    launcher, rank, world, local_rank = _detect()
    cuda = torch.cuda.is_available()
    backend = backend or ("nccl" if cuda else "gloo")
    if backend not in ("gloo", "nccl", "mpi"):
        raise LaunchError(f"backend must be 'gloo', 'nccl' or 'mpi', got {backend!r}")
    device = torch.device("cuda", local_rank % max(1, torch.cuda.device_count())) if (
        cuda and backend == "nccl") else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    _TIMEOUT_S[0] = timeout_s
    # torch._dynamo, imported once a process group exists (the first op under a TorchDispatchMode imports
    # it, as FLOP counting does), takes references to that group that destroy_process_group does not
    # drop: gloo's threads then outlive it and abort the process at exit ("terminate called without an
    # active exception"). Imported before, it holds none.
    importlib.import_module("torch._dynamo")
    # NCCL's communicator bound to this rank's device at once (else every barrier guesses it from the rank)
    bound: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
    from pipe.calls import still_running
    still_running("pipe.init()")  # (a group torn down after a failure is not started again in this process)
    if not dist.is_initialized():
        if launcher == "torchrun" and _plain_env():  # no agent: rank 0's own store would freeze with it
            addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
            if rank == 0:
                _store_host(addr, port, timeout_s)
            store = _client_store(addr, port, world, timeout_s)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout, **bound)
            launcher = "env"
        elif launcher == "torchrun":
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout, **bound)
        elif launcher == "mpi":
            addr, port = _mpi_rendezvous(rank)
            store = dist.TCPStore(addr, port, world, is_master=False, timeout=timeout)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout, **bound)
        else:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", 0))
                port = int(s.getsockname()[1])
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                    world_size=1, timeout=timeout, **bound)
    atexit.register(finish)
    kept = keep_freed and device.type == "cpu" and keep_freed_memory()
    _CONTEXT = Context(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank,
                       device=device, backend=backend, launcher=launcher, freed_kept=kept)
    return _CONTEXT


def finish() -> None:
    """End this rank's part in the job; init registers it to run at exit, and a command line may
    call it before exiting (exit_process). Normally: destroy the process group, finalize MPI. After a failure
    (this rank's own, another's, a lost rank): wait while a rank still names it, 5 s at most (a
    launcher ends every rank once one exits non-zero), and leave MPI unfinalized: MPI_Finalize
    waits for every rank, a frozen one too, while a rank that exits without it makes mpiexec end
    the job. Where mpi4py was imported before init (its exit hook finalizes), abort the job."""
    if _FAILED[0]:
        _linger()
        if _MPI:  # said, so that mpiexec's report of the ranks it then kills is not read as their own failure
            print(f"fxpipe: rank {_CONTEXT.rank if _CONTEXT else '?'} saw the job fail and leaves without "
                  "MPI_Finalize: mpiexec ends the job's other ranks", file=sys.stderr, flush=True)
        if _MPI and not _MPI[1]:
            sys.stdout.flush()
            sys.stderr.flush()
            _MPI[0].COMM_WORLD.Abort(1)
        return
    if dist.is_initialized():  # left to C++ destructors, gloo's threads abort a finished process
        dist.destroy_process_group()
    _KEPT.clear()  # the store too: its threads are joined now, not in the interpreter's teardown
    gc.collect()
    if _MPI and _MPI[1] and not _MPI[0].Is_finalized():
        _MPI[0].Finalize()


def exit_process(code: int) -> NoReturn:
    """End this process with `code` right after `finish`, without C++ static destructors (gloo's
    threads have aborted finished processes in them: "terminate called without an active
    exception"). Under mpirun, after a clean finish, through C's exit instead: MPICH ends its link
    to the process manager in a C exit handler, not in MPI_Finalize, and os._exit skips it; mpiexec
    then takes the closed link for a crash and kills (SIGKILL) every rank still running, so a rank
    slower to leave than the others ended killed after a successful run."""
    finish()
    sys.stdout.flush()
    sys.stderr.flush()
    if _MPI and _MPI[1] and not _FAILED[0] and _MPI[0].Is_finalized():
        ctypes.CDLL(None).exit(code)
    os._exit(code)


def _linger() -> None:
    """Mark this rank as leaving, then wait (_LINGER_S at most) while a rank that began naming the
    failure (it reported what it could not reach) has not left yet."""
    store = _KEPT[-1] if _KEPT else None
    if store is None or _CONTEXT is None:
        return
    me, world = _CONTEXT.rank, _CONTEXT.world_size
    deadline = time.monotonic() + _LINGER_S
    with contextlib.suppress(Exception):  # the store may be gone with rank 0
        store.set(f"{_DONE_KEY}{me}", "1")
        while time.monotonic() < deadline:
            if not any(store.check([f"{_LOST_KEY}{r}"]) and not store.check([f"{_DONE_KEY}{r}"])
                       for r in range(world) if r != me):
                return
            time.sleep(0.05)


def link_fit(sizes: Sequence[int], ms: Sequence[float]) -> tuple[float, float]:
    """(bytes per ms, latency ms) through two (bytes, ms) points; when the smaller message took no
    less time (noise), the larger one's time counts whole as bandwidth, with the smaller's as latency
    bound: a finite, pessimistic link, never a free one."""
    slope = (ms[1] - ms[0]) / (sizes[1] - sizes[0])  # ms per byte
    if slope <= 0:
        slope = max(ms[1], 1e-9) / sizes[1]
    return 1.0 / slope, max(ms[0] - sizes[0] * slope, 0.0)


def measure_link(device: torch.device, sizes: Sequence[int] = (1 << 14, 1 << 22), repeats: int = 5,
                 peer: int = 1) -> tuple[float, float] | None:
    """(bytes per ms, latency ms) of the link between ranks 0 and `peer` (global ranks: rank 0's
    pipeline neighbour), from ping-pongs of two sizes (the fastest of `repeats` each: noise only
    adds time); a collective call, returning the figures on every rank, None with one rank. The
    partitioner's communication cost is latency + bytes / bandwidth. When noise still leaves the
    small message no faster than the large one, the large one's time counts whole as bandwidth (a
    finite, pessimistic figure, never a free link)."""
    if not dist.is_initialized() or dist.get_world_size() < 2 or peer == 0:
        return None
    rank = dist.get_rank()
    ms: list[float] = []
    for n in sizes:
        buf = torch.zeros(n // 4, device=device)
        times = []
        for _ in range(repeats + 1):  # the first round opens the connection
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, peer)
                dist.recv(buf, peer)
            elif rank == peer:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            times.append((time.perf_counter() - t0) / 2 * 1e3)
        ms.append(min(times[1:]))
    fit = torch.tensor([0.0, 0.0])
    if rank == 0:
        fit = torch.tensor(link_fit(sizes, ms), dtype=torch.float64)
    fit = fit.to(torch.float64).to(device)
    dist.broadcast(fit, src=0)
    return float(fit[0]), float(fit[1])


def measure_allreduce(device: torch.device, group: Any, sizes: Sequence[int] = (1 << 16, 1 << 23),
                      repeats: int = 5) -> tuple[float, float]:
    """(bytes per ms, latency ms) of an all-reduce over `group`, fitted to the ring formula
    2(n-1)/n x bytes / bandwidth + 2(n-1) x latency (pipe.scale.ring_allreduce_ms) from the median
    of `repeats` all-reduces of two sizes; every rank of the job calls it (each its own group, all
    at once, as the replicas' grads are reduced); the figures of global rank 0's group, everywhere."""
    n = dist.get_world_size(group)
    ms: list[float] = []
    for size in sizes:
        buf = torch.zeros(size // 4, device=device)
        times = []
        for _ in range(repeats + 1):  # the first round opens the connections
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            dist.all_reduce(buf, group=group)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append((time.perf_counter() - t0) * 1e3)
        ms.append(statistics.median(times[1:]))
    steps = 2 * (n - 1)
    slope = max((ms[1] - ms[0]) / (sizes[1] - sizes[0]), 1e-12)  # ms per byte of the buffer
    fit = torch.tensor([steps / n / slope, max(ms[0] - sizes[0] * slope, 0.0) / steps], dtype=torch.float64)
    fit = fit.to(device)
    dist.broadcast(fit, src=0)
    return float(fit[0]), float(fit[1])


def context() -> Context:
    """The context `init()` made; calls `init()` when it has not run yet."""
    return _CONTEXT or init()
