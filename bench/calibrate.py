"""Calibrate the simulator on this machine, once: python -m bench calibrate [MODEL] --out FILE.
Runs a bundled model (default gpt) under 1f1b, zb-h1 (one stage per rank) and interleaved-1f1b,
interleaved-zb (two) at microbatches of 1, 4 and 16 samples on 2 ranks, alternating step by step,
on plans costed by FLOP count (--cost); fits each kind of action's measured duration on its planned
cost and its stage's node count, the host's gap between actions, its time posting each batch of
messages and the messages' extra latency (pipe.calibration), and writes the fit with the machine's
pace while it ran (bench.pace: a fixed forward and backward timed on every rank at once in each round);
`bench schedules --calibration FILE` predicts with it at its own run's pace, `bench auto` and
pipe.Pipeline(calibration=FILE) as it is."""
from __future__ import annotations

from partition.args import whole, wholes
import argparse
import sys

# partition.costs.COSTS, written out: this launcher does not load torch
COSTS = ("measured", "flops", "shaped")

__all__ = ["main", "parser"]

SCHEDULES = "1f1b,zb-h1,interleaved-1f1b,interleaved-zb"


def parser(add_help: bool = True) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench calibrate", description=__doc__, add_help=add_help,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default="gpt", help="bundled name, package.module:factory or file.py:factory")
    p.add_argument("--model-arg", action="append", default=[], metavar="K=V", help="factory keyword, repeatable")
    p.add_argument("--microbatches", default="8", type=wholes(1), help="comma-separated microbatch counts")
    p.add_argument("--microbatch-sizes", default="1,4,16", metavar="B1,B2,...", type=wholes(1),
                   help="samples per microbatch, each size running every schedule: sizes that differ let the fit "
                        "tell an op's fixed cost from its FLOPs; cover the sizes predicted (schedule='auto' at "
                        "batch 32 on 2 ranks weighs 1 to 16)")
    p.add_argument("--steps", type=whole(1), default=6, help="timed steps per pipeline")
    p.add_argument("--warmup", type=whole(0), default=2)
    p.add_argument("--cost", default="flops", choices=COSTS,
                   help="how the plans are costed: the calibration applies to plans costed alike (flops: costs that do "
                        "not move with the machine's drift; shaped: and products priced by their shapes)")
    p.add_argument("--ranks", type=whole(1), default=2)
    p.add_argument("--launcher", default="torchrun", choices=["torchrun", "mpirun"])
    p.add_argument("--threads", type=whole(1), default=1)
    p.add_argument("--out", default="out/calibration.json", help="where the calibration is written")
    return p


def main(argv: list[str] | None = None) -> int:
    from bench import schedules
    args = parser().parse_args(argv)
    extra = [x for kv in args.model_arg for x in ("--model-arg", kv)]
    return schedules.main([args.model, *extra, "--schedules", SCHEDULES, "--microbatches", args.microbatches,
                           "--microbatch-sizes", args.microbatch_sizes,
                           "--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", str(args.threads),
                           "--cost", args.cost,
                           "--calibrate", args.out, "--out", f"{args.out}.run"])


if __name__ == "__main__":
    sys.exit(main())
