"""python -m bench {schedules,calibrate,auto,vs-torch,partition,data-parallel,scale,memory-scale} MODEL ...: benchmark
schedules, fxpipe against torch.distributed.pipelining, partition quality, replicated pipelines' grad
all-reduce, the predicted step of (pp, dp) layouts at scale, and each rank's host memory when the model is
built whole or on the meta device; each prints a table and writes JSON (and pictures).

  python -m bench schedules gpt --ranks 2 --microbatches 4,8,16 --schedules gpipe,1f1b,interleaved-1f1b,zb-h1
  python -m bench calibrate gpt --out out/calibration.json
  python -m bench auto gpt --batch-size 32 --calibration out/calibration.json --cost flops
  python -m bench vs-torch gpt --ranks 2
  python -m bench partition gpt_wide_vocab --stages 2,4
  python -m bench data-parallel gpt --ranks 4 --data-parallel 2 --model-arg n_layer=8
  python -m bench scale gpt --layers-per-stage 8 --pp 8,16 --ranks 64,128,256,512,1024 --global-batch 4096
  python -m bench memory-scale --sizes 8x256,16x512 --ranks 2,4"""
from __future__ import annotations

from partition.args import wholes
import argparse
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

# partition.costs.COSTS, written out: this launcher does not load torch
COSTS = ("measured", "flops", "shaped")

__all__ = ["main", "launch"]

_LAUNCHED = {"schedules": "bench.schedules", "calibrate": "bench.calibrate", "auto": "bench.auto",
             "vs-torch": "bench.vs_torch", "data-parallel": "bench.data_parallel"}


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
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    return subprocess.call(cmd, env=env)


def _folder_error(flag: str, path: Path) -> str | None:
    """Why `path` cannot be made a folder this process writes into, or None."""
    blocked = next((q for q in (path, *path.parents) if q.exists() and not q.is_dir()), None)
    if blocked is not None:
        return f"{flag} {path} cannot be a folder: {blocked} is a file; give another {flag}"
    existing = next(q for q in (path, *path.parents) if q.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{flag} {path}: {existing} is not writable; give another {flag}"
    return None


def _file_error(flag: str, path: Path) -> str | None:
    """Why `path` cannot be a file this process writes, or None."""
    if path.is_dir():
        return f"{flag} {path} is a folder; give a file's path"
    return _folder_error(flag, path.parent)


def check_launch(cmd: str, p: argparse.ArgumentParser, argv: list[str]) -> None:
    """A launched command's arguments, before it starts --ranks processes (found by review: an unknown model,
    schedule or calibration, a calibration of plans costed otherwise, ranks the replicas do not divide, and an
    --out that cannot be written each failed on every rank after the launch, as tracebacks, the last only after
    the whole run, its measurements lost): an error naming the flag, its value and the fix, through `p`."""
    from partition.workload import WorkloadError, factory_of, parse_overrides
    args = p.parse_args(argv)
    try:
        factory_of(args.model)
    except WorkloadError as e:
        p.error(str(e))
    if cmd == "calibrate":  # the fit's file, and the run's folder beside it
        why = _file_error("--out", Path(args.out)) or _folder_error("--out", Path(f"{args.out}.run"))
    else:
        why = _folder_error("--out", Path(args.out))
        if not why and getattr(args, "calibrate", None):  # (bench schedules: the fit is written before the tables)
            why = _file_error("--calibrate", Path(args.calibrate))
    if why:
        p.error(why)
    if getattr(args, "calibration", None) and (cmd != "vs-torch" or args.auto):  # (vs-torch: auto's alone)
        from pipe.calibration import Calibration
        try:
            Calibration.load(args.calibration).check_cost(args.cost)
        except (OSError, ValueError, KeyError, TypeError) as e:
            p.error(f"--calibration {args.calibration}: {e}")
    if cmd == "data-parallel" and args.ranks % args.data_parallel:
        p.error(f"--ranks {args.ranks} is not a multiple of --data-parallel {args.data_parallel}: each replica is a "
                f"pipeline of --ranks / --data-parallel ranks; use e.g. --ranks {2 * args.data_parallel}")
    if cmd == "auto" and args.schedules:
        from pipe.schedules import SCHEDULES
        unknown = [n for n in args.schedules.split(",") if n not in SCHEDULES]
        if unknown:
            p.error(f"--schedules names {', '.join(unknown)}, which fxpipe does not have; pick from "
                    f"{', '.join(SCHEDULES)}")
    if cmd == "vs-torch":
        from bench.vs_torch import DEFAULTS, TORCH_SCHEDULES, uneven_batch
        unknown = [n for n in args.torch_schedules.split(",") if n not in (*TORCH_SCHEDULES, "all")]
        if unknown:
            p.error(f"--torch-schedules names {', '.join(unknown)}; torch's are {', '.join(TORCH_SCHEDULES)} (or all)")
        if args.model == "gpt":  # (its microbatch size known without building it; another model's, on the ranks)
            try:
                size = {**DEFAULTS, **parse_overrides(args.model_arg)}["microbatch_size"]
            except WorkloadError as e:
                p.error(str(e))
            why = uneven_batch(args.microbatches, size, args.ranks) if isinstance(size, int) and size > 0 else None
            if why:
                p.error(why)


def main(argv: list[str] | None = None) -> int:
    from bench import auto, calibrate, data_parallel, memory_scale, scale, schedules, vs_torch
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("schedules", parents=[schedules.parser(add_help=False)], help="schedules side by side")
    sub.add_parser("calibrate", parents=[calibrate.parser(add_help=False)],
                   formatter_class=argparse.RawDescriptionHelpFormatter, description=calibrate.__doc__,
                   help="fit the simulator's corrections on this machine, once")
    sub.add_parser("auto", parents=[auto.parser(add_help=False)], formatter_class=argparse.RawDescriptionHelpFormatter,
                   description=auto.__doc__, help="schedule='auto' against every candidate of its grid, measured")
    sub.add_parser("vs-torch", parents=[vs_torch.parser(add_help=False)],
                   help="fxpipe against torch.distributed.pipelining")
    raw = argparse.RawDescriptionHelpFormatter
    sub.add_parser("data-parallel", parents=[data_parallel.parser(add_help=False)], formatter_class=raw,
                   description=data_parallel.__doc__,
                   help="replicated pipelines: the grad all-reduce's exposure, measured and predicted")
    sub.add_parser("scale", parents=[scale.parser(add_help=False)], formatter_class=raw, description=scale.__doc__,
                   help="predicted step of (pp, dp) layouts from a plan's costs (one process)")
    sub.add_parser("memory-scale", parents=[memory_scale.parser(add_help=False)], formatter_class=raw,
                   description=memory_scale.__doc__,
                   help="each rank's peak host memory: the model built whole, or on the meta device")
    sp = sub.add_parser("partition", help="partition quality against the usual baselines")
    sp.add_argument("model")
    sp.add_argument("--stages", default="2,4", type=wholes(1))
    sp.add_argument("--cost", default="measured", choices=COSTS)
    sp.add_argument("--model-arg", action="append", default=[])
    sp.add_argument("--out", default="out/bench")
    argv = sys.argv[1:] if argv is None else list(argv)
    args, rest = p.parse_known_args(argv)
    if args.cmd == "schedules":  # what only its own parser checks (a grid with nothing to run), before launching
        schedules.check_grid(argv[argv.index(args.cmd) + 1:])
    if args.cmd in _LAUNCHED:  # parsed above to check and for --help; the ranks parse again
        check_launch(args.cmd, sub.choices[args.cmd], argv[argv.index(args.cmd) + 1:])
        return launch(_LAUNCHED[args.cmd], args.ranks, argv[argv.index(args.cmd) + 1:], args.launcher, args.threads)
    if args.cmd == "scale":  # one process: parsed again by bench.scale
        return scale.main(argv[argv.index(args.cmd) + 1:])
    if args.cmd == "memory-scale":  # launches its own runs, one per size, rank count and mode
        return memory_scale.main(argv[argv.index(args.cmd) + 1:])
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    from bench.quality import main as quality_main
    return quality_main(["--model", args.model, "--stages", args.stages, "--cost", args.cost, "--out", args.out]
                        + [x for kv in args.model_arg for x in ("--model-arg", kv)])


if __name__ == "__main__":
    sys.exit(main())
