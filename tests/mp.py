"""Multi-process test harness: run a test body on N gloo ranks, or a launcher command, with a hard timeout."""
from __future__ import annotations

import contextlib
import importlib
import io
import multiprocessing
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Iterator

__all__ = ["RankExit", "RankFailure", "free_port", "run_ranks", "run_command", "Completed", "launch", "Launched",
           "ended"]

ROOT = Path(__file__).resolve().parent.parent


class RankFailure(AssertionError):
    """A rank failed or the group timed out; the message holds every rank's output."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _base_env(threads: int = 1) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONUNBUFFERED"] = "1"
    return env


# Ranks are forked from a server that has imported these once (multiprocessing's forkserver), not started
# afresh: importing torch, torch.export and fxpipe took 3-8 s of each rank's start, and the suite starts
# hundreds. FXPIPE_MP_START=spawn (or run_ranks(start="spawn")) starts each rank as a new interpreter instead
# (`python -m tests.mp`). What a forked rank cannot have of a fresh interpreter: a string hash seed of its own
# (every forked rank shares the server's, so ranks iterating a set of strings alike hide an order that differs
# between processes); launches that check such orders run spawned (tests/test_runtime.py's 4-rank NCCL-like
# parity on the GPT).
_PRELOAD = ["torch", "torch.distributed", "torch.fx", "torch.export", "torch.distributed.checkpoint", "transformers",
            "pipe", "partition", "memory", "bench", "tests.parity", "tests.nccl_like"]
_FORKS: Any = None


def _forks() -> Any:
    global _FORKS
    if _FORKS is None:
        _FORKS = multiprocessing.get_context("forkserver")
        _FORKS.set_forkserver_preload(_PRELOAD)
    return _FORKS


class _Forked:
    """A rank forked from the server, as much like a Popen as the harness uses: pid, poll(), wait(),
    returncode (negative: the signal that ended it)."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self._p = _forks().Process(target=_forked_child, args=(env, str(log)), daemon=False)
        self._p.start()
        self.pid = self._p.pid

    @property
    def returncode(self) -> int | None:
        return self._p.exitcode

    def poll(self) -> int | None:
        return self._p.exitcode

    def wait(self, timeout: float | None = None) -> int | None:
        self._p.join(timeout)
        if self._p.exitcode is None and timeout is not None:
            raise subprocess.TimeoutExpired("forked rank", timeout)
        return self._p.exitcode


def _forked_child(env: dict[str, str], log: str) -> None:
    """A forked rank: a session of its own (the harness kills its group), its output to `log`, unbuffered,
    the rank's environment, then the body as `python -m tests.mp` would run it."""
    os.setsid()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = io.TextIOWrapper(open(1, "wb", buffering=0, closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(open(2, "wb", buffering=0, closefd=False), write_through=True)
    os.environ.clear()
    os.environ.update(env)
    # what the interpreter reads at its start: the module path (env= may add to it), the fault handler
    sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    if env.get("PYTHONFAULTHANDLER"):
        import faulthandler
        faulthandler.enable()
    code = 1
    try:
        _child()  # (returns only by an exception: a body's result ends the process with os._exit(0))
    except SystemExit as e:  # as the interpreter exits on it
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - as the interpreter reports an uncaught one
        import traceback
        traceback.print_exc()
    # then as the interpreter ends (found by review of the change: skipped here): it waits for the threads that
    # are not daemons, then runs the exit handlers (pipe.launch.finish after a failure among them)
    import atexit
    import threading
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _kill(procs: list[Any]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        p.wait()


def _wait_all(procs: list[Any], timeout: float) -> bool:
    """Wait for every process; return False on timeout (the processes are then killed)."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline:
            _kill(procs)
            return False
        time.sleep(0.02)
    return True


def _report(what: str, logs: list[Path], codes: list[int | None]) -> str:
    parts = [what]
    for r, (log, code) in enumerate(zip(logs, codes)):
        text = log.read_text(errors="replace") if log.exists() else ""
        parts.append(f"----- rank {r} (exit {code}) -----\n{text[-6000:]}")
    return "\n".join(parts)


@dataclass
class RankExit:
    code: int | None      # None: killed by the harness at the timeout
    output: str


def run_ranks(target: str, world_size: int, *, timeout: float = 120.0, threads: int = 1,
              env: dict[str, str] | None = None, raw: bool = False, start: str | None = None,
              **kwargs: Any) -> list[Any]:
    """Run `module:function(rank, world_size, **kwargs)` on `world_size` processes.

    Each process gets the torchrun variables (RANK, WORLD_SIZE, MASTER_ADDR/PORT,
    LOCAL_RANK), so `pipe.init()` starts gloo exactly as under torchrun (`start`: "forkserver" or "spawn", see
    _PRELOAD; default $FXPIPE_MP_START, else "forkserver"). Returns the
    functions' return values by rank (with raw=True: each rank's RankExit, failures included,
    so tests can check exit codes and messages). Raises RankFailure with all ranks' output when a
    rank fails or the group runs past `timeout` seconds (then every rank is killed).
    """
    from torch.distributed import TCPStore
    port = free_port()
    # the store lives in this process, as torchrun's agent hosts it: a rank that fails and exits
    # takes no store with it, so the others can still read what it published
    store = TCPStore("127.0.0.1", port, world_size, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory(prefix="fxpipe-mp-") as tmp:
        tmpdir = Path(tmp)
        (tmpdir / "kwargs.pkl").write_bytes(pickle.dumps(kwargs))
        procs: list[Any] = []
        logs: list[Path] = []
        fork = (start or os.environ.get("FXPIPE_MP_START", "forkserver")) != "spawn"
        for rank in range(world_size):
            e = _base_env(threads)
            e.update(env or {})
            e.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                     LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True",
                     FXPIPE_MP_TARGET=target, FXPIPE_MP_DIR=tmp)
            log = tmpdir / f"rank{rank}.log"
            logs.append(log)
            if fork:
                procs.append(_Forked(e, log))
                continue
            with open(log, "wb") as out:
                procs.append(subprocess.Popen([sys.executable, "-m", "tests.mp"], env=e, cwd=ROOT,
                                              stdout=out, stderr=subprocess.STDOUT,
                                              start_new_session=True))
        finished = _wait_all(procs, timeout)
        del store
        if raw:
            return [RankExit(p.returncode if finished else None, log.read_text(errors="replace"))
                    for p, log in zip(procs, logs)]
        if not finished:
            raise RankFailure(_report(f"{target} on {world_size} ranks timed out after {timeout:.0f} s",
                                      logs, [p.returncode for p in procs]))
        codes = [p.returncode for p in procs]
        if any(codes):
            raise RankFailure(_report(f"{target} failed on {world_size} ranks", logs, list(codes)))
        return [pickle.loads((tmpdir / f"result{r}.pkl").read_bytes()) for r in range(world_size)]


@dataclass
class Completed:
    returncode: int
    output: str


def run_command(cmd: list[str], *, timeout: float = 120.0, threads: int = 1,
                env: dict[str, str] | None = None, check: bool = True, cwd: Path = ROOT) -> Completed:
    """Run a launcher command (torchrun, mpiexec, python -m ...) from `cwd` (the repo root) with a timeout.

    The whole process group is killed on timeout, so no rank outlives the test.
    """
    e = _base_env(threads)
    e.update(env or {})
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(cmd, env=e, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        finished = _wait_all([proc], timeout)
        out.seek(0)
        text = out.read().decode(errors="replace")
    if not finished:
        raise RankFailure(f"{' '.join(cmd)} timed out after {timeout:.0f} s\n{text[-8000:]}")
    if check and proc.returncode != 0:
        raise RankFailure(f"{' '.join(cmd)} exited {proc.returncode}\n{text[-8000:]}")
    return Completed(proc.returncode, text)


class Launched:
    """A launcher command running under `launch`: its process, its output so far, and `strays`, the
    pids outside its process group (torchrun starts each worker in a session of its own) to kill
    when the test ends."""

    def __init__(self, proc: subprocess.Popen[bytes], out: IO[bytes]) -> None:
        self.proc, self._out = proc, out
        self.strays: list[int] = []

    def output(self) -> str:
        self._out.seek(0)
        return self._out.read().decode(errors="replace")

    def wait(self, timeout: float) -> int | None:
        """The exit status, or None when it still runs after `timeout` seconds."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None


@contextlib.contextmanager
def launch(cmd: list[str], *, threads: int = 1, env: dict[str, str] | None = None,
           cwd: Path = ROOT) -> Iterator[Launched]:
    """Start a launcher command for a test to watch while it runs; on leaving, its process group and
    its strays are killed, so no rank (a stopped one included) outlives the test."""
    e = _base_env(threads)
    e.update(env or {})
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(cmd, env=e, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        job = Launched(proc, out)
        try:
            yield job
        finally:
            for pid in job.strays:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            _kill([proc])


def ended(pid: int) -> bool:
    """Whether process `pid` has ended (gone, or a zombie its parent has not reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def _child() -> None:
    target = os.environ["FXPIPE_MP_TARGET"]
    tmpdir = Path(os.environ["FXPIPE_MP_DIR"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    mod_name, fn_name = target.split(":")
    fn = getattr(importlib.import_module(mod_name), fn_name)
    kwargs = pickle.loads((tmpdir / "kwargs.pkl").read_bytes())
    import torch
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    result = fn(rank, world, **kwargs)
    (tmpdir / f"result{rank}.pkl").write_bytes(pickle.dumps(result))
    try:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.barrier()  # no rank tears its connections down while another still uses them
            dist.destroy_process_group()
    except Exception:  # teardown must not mask the result
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    # skip C++ static destructors: gloo's worker threads have aborted the process at exit
    # ("terminate called without an active exception") after the body had returned
    os._exit(0)


if __name__ == "__main__":
    _child()
