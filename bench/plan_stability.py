"""python -m bench.plan_stability [--launches 6] [--busy]: how often fresh launches of one script plan
the same cuts with measured costs, for stable_within=0.1 (the default) and 0 (the fastest
measured split), in launches made alternately; --busy keeps one core spinning meanwhile (noise).

Each launch is 2 ranks under torchrun building the README's pipeline (`gpt`, measured costs, the
loss in the graph); rank 0 reports the parameters per stage. Prints one row per setting."""
from __future__ import annotations

from partition.args import whole
import argparse
import collections
import json
import multiprocessing
import sys
import tempfile
from pathlib import Path

__all__ = ["main"]


def worker(stable: float, out: str) -> None:
    import partition
    import partition.planner as planner
    import pipe
    ctx = pipe.init()
    real = planner.plan

    def plan(*args, **kwargs):  # type: ignore[no-untyped-def]
        return real(*args, **{**kwargs, "stable_within": stable})
    partition.plan = plan  # the pipeline plans through partition.plan
    w = partition.load("gpt")
    pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=8, example_target=w.example_target)
    if ctx.rank == 0:
        Path(out).write_text(json.dumps([len(st.params) for st in pp.plan.stages]))


def _spin() -> None:
    while True:
        pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.plan_stability", description=__doc__)
    p.add_argument("--launches", type=whole(1), default=6, help="launches per setting")
    p.add_argument("--busy", action="store_true", help="keep one core busy meanwhile")
    p.add_argument("--worker", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker is not None:
        worker(a.worker, a.out)
        return 0
    from bench.__main__ import launch
    spinner = multiprocessing.Process(target=_spin, daemon=True) if a.busy else None
    if spinner is not None:
        spinner.start()
    seen: dict[float, list[tuple[int, ...]]] = {0.1: [], 0.0: []}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(a.launches):
                for stable in seen:
                    out = Path(tmp) / f"{stable}-{i}.json"
                    if launch("bench.plan_stability", 2, ["--worker", str(stable), "--out", str(out)]) != 0:
                        return 1
                    seen[stable].append(tuple(json.loads(out.read_text())))
    finally:
        if spinner is not None:
            spinner.terminate()
    print(f"\n{a.launches} fresh 2-rank launches per setting, alternating{' (one core kept busy)' if a.busy else ''}:")
    print("| stable_within | plans (parameters per stage): launches |\n|---|---|")
    for stable, plans in seen.items():
        counts = ", ".join(f"{list(k)}: {n}" for k, n in collections.Counter(plans).most_common())
        print(f"| {stable:g} | {counts} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
