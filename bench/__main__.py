"""python -m bench {schedules,vs-torch,partition} MODEL ...: benchmark schedules, fxpipe against
torch.distributed.pipelining, and partition quality; each prints a table and writes JSON and pictures.

  python -m bench schedules gpt --ranks 2 --microbatches 4,8,16 --schedules gpipe,1f1b,interleaved-1f1b,zb-h1
  python -m bench vs-torch gpt --ranks 2
  python -m bench partition gpt_wide_vocab --stages 2,4"""
from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
from pathlib import Path

__all__ = ["main", "launch"]


def launch(module: str, ranks: int, argv: list[str], launcher: str = "torchrun", threads: int = 1) -> int:
    """Run `python -m module argv` on `ranks` processes under torchrun or mpirun."""
    if launcher == "torchrun":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
               "--master-port", str(port), "-m", module, *argv]
    elif launcher == "mpirun":
        mpiexec = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
        if mpiexec is None:
            print("error: mpiexec not found; pip install 'fxpipe[mpi]'", file=sys.stderr)
            return 2
        cmd = [mpiexec, "-n", str(ranks), sys.executable, "-m", module, *argv]
    else:
        print(f"error: --launcher must be torchrun or mpirun, got {launcher!r}", file=sys.stderr)
        return 2
    print("$ " + " ".join(cmd), flush=True)
    import os
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    return subprocess.call(cmd, env=env)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("schedules", "vs-torch"):
        sp = sub.add_parser(name)
        sp.add_argument("--ranks", type=int, default=2)
        sp.add_argument("--launcher", default="torchrun", choices=["torchrun", "mpirun"])
        sp.add_argument("--threads", type=int, default=1)
    sp = sub.add_parser("partition")
    sp.add_argument("model")
    sp.add_argument("--stages", default="2,4")
    sp.add_argument("--cost", default="measured", choices=["measured", "flops"])
    sp.add_argument("--model-arg", action="append", default=[])
    sp.add_argument("--out", default="out/bench")
    args, rest = p.parse_known_args(argv)
    if args.cmd == "schedules":
        return launch("bench.schedules", args.ranks, rest, args.launcher, args.threads)
    if args.cmd == "vs-torch":
        if rest and not rest[0].startswith("-"):
            rest = ["--model", rest[0], *rest[1:]]
        return launch("bench.vs_torch", args.ranks, rest, args.launcher, args.threads)
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    from bench.quality import main as quality_main
    return quality_main(["--model", args.model, "--stages", args.stages, "--cost", args.cost, "--out", args.out]
                        + [x for kv in args.model_arg for x in ("--model-arg", kv)])


if __name__ == "__main__":
    sys.exit(main())
