# .venv/bin/python -m bench.quality --model gpt_wide_vocab,unet --stages 2,4 --accuracy gpt --out out/bench
"""Partition quality: fxpipe's plan against three baselines, every stage measured; cost-model accuracy."""
from __future__ import annotations

from partition.args import whole, wholes
import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.fx

import partition
from partition.meta import meta_copy
from partition.costs import COSTS, preserve_state
from partition.plan import in_flight
from partition.measure import calibrate as calibrate_stages
from partition.planner import Analysis, calibrate_plan, plan_from_bounds, split_heavy_ops
from partition.solve import CostModel, balance_by_param_count, balance_by_time, even_split, evaluate, solve
from partition.split import split_graph, stage_io
from partition.workload import Workload, parse_overrides
from pipe.launch import keep_freed_memory

__all__ = ["quality", "layer_spans", "baselines", "measure_stages", "markdown", "plot", "main"]

METHODS = ("fxpipe", "even layers", "param count", "layer time")


def _module_paths(node: torch.fx.Node) -> list[str]:
    paths = [str(path) for path, _ in (node.meta.get("nn_module_stack") or {}).values()]
    if node.op == "call_module":
        paths.append(str(node.target))
    return paths


def layer_spans(a: Analysis, prefixes: Sequence[str]) -> list[tuple[int, int]]:
    """[first, last + 1) blocks holding each layer's nodes, found by the nodes' module paths."""
    nodes = {n.name: n for n in a.gm.graph.nodes}
    spans = []
    for p in prefixes:
        hits = [b for b, block in enumerate(a.blocks.members)
                if any(path == p or path.startswith(p + ".") for u in block for path in _module_paths(nodes[u]))]
        if not hits:
            raise ValueError(f"layer {p!r} owns no block of the traced graph; check Workload.layer_prefixes")
        spans.append((min(hits), max(hits) + 1))
    starts = [s for s, _ in spans]
    if starts != sorted(set(starts)):
        raise ValueError(f"layers {list(prefixes)} do not start in program order at distinct blocks ({starts})")
    return spans


def _units(spans: list[tuple[int, int]], n: int) -> list[int]:
    """Start blocks of torchgpipe-style layers: what precedes the first layer, each layer, what follows."""
    starts = ([0] if spans[0][0] > 0 else []) + [s for s, _ in spans]
    end = spans[-1][1]
    return starts + ([end] if end < n else [])


def baselines(a: Analysis, n_stages: int, prefixes: Sequence[str], cm: CostModel) -> dict[str, tuple[int, ...]]:
    """Block bounds of fxpipe's solver and of the three baselines, each as its source describes it."""
    ch = a.chain
    n = ch.n
    spans = layer_spans(a, prefixes)
    units = _units(spans, n)
    unit_ms = [float((ch.fwd_ms[lo:hi] + ch.bwd_ms[lo:hi]).sum()) for lo, hi in zip(units, units[1:] + [n])]
    by_time = balance_by_time(unit_ms, n_stages)
    block_bytes = [float(sum(ch.param_bytes[p] for p in ps)) for ps in ch.params]
    return {
        "fxpipe": solve(ch, n_stages, cm).bounds,
        # what users write for torch.distributed.pipelining: a split point before every k-th layer
        "even layers": even_split([s for s, _ in spans], n_stages, n_blocks=n),
        # DeepSpeed partition_method="parameters": balance the parameter count of the blocks
        "param count": balance_by_param_count(block_bytes, n_stages),
        # torchgpipe balance_by_time over measured per-layer times; layer bounds mapped to blocks
        "layer time": tuple([0] + [units[u] if u < len(units) else n for u in by_time[1:-1]] + [n]),
    }


def _stage_inputs(stages: Sequence[torch.fx.GraphModule], flat: list[Any]) -> list[list[Any]]:
    """Each stage's call arguments for the example microbatch; received values as fresh leaves."""
    env: dict[str, Any] = {}
    out = []
    for st in stages:
        io = stage_io(st)
        recv = [env[r].detach().clone().requires_grad_(env[r].is_floating_point()) for r in io.recv]
        args = recv + [flat[i] for i in io.inputs]
        out.append(args)
        with torch.no_grad():
            result = st(*args)
        if not io.last:
            env.update(zip(io.send, result))
    return out


def _fwd_bwd(stage: torch.nn.Module, args: list[Any]) -> Callable[[], tuple[float, float]]:
    def once() -> tuple[float, float]:
        t0 = time.perf_counter()
        out = stage(*args)
        t1 = time.perf_counter()
        outs = [t for t in out if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]
        if outs:
            torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
        return (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3
    return once


def measure_stages(runs: dict[Any, Callable[[], tuple[float, float]]], repeats: int, warmup: int = 2,
                   burst: int = 4) -> dict[Any, tuple[float, float]]:
    """Median (fwd ms, bwd ms) of each run over `repeats` timed calls.

    Rounds go over all runs so drifting load hits every method alike; within a round a run
    is called `burst` times in a row and its first call only warms the caches, as a rank
    running its one stage microbatch after microbatch would have them.
    """
    times: dict[Any, list[tuple[float, float]]] = {k: [] for k in runs}
    rounds = warmup + -(-repeats // (burst - 1))
    for r in range(rounds):
        for k, once in runs.items():
            got = [once() for _ in range(burst)][1:]
            if r >= warmup:
                times[k].extend(got)
    return {k: (statistics.median(f for f, _ in v), statistics.median(b for _, b in v)) for k, v in times.items()}


def quality(model_spec: str | Workload, stages: list[int], *, cost: str = "measured", repeats: int = 20,
            methods: Sequence[str] = METHODS, meta: bool = False, rounds: int = 1, calibrate: bool = False,
            **model_args: Any) -> list[dict[str, Any]]:
    """One row per (stage count, method): predicted and measured fwd+bwd ms of every stage.

    The model is costed once (`cost`); every method's bounds become a Plan and stage modules
    (plan_from_bounds + split_graph), and each stage's forward and backward on one microbatch
    is timed on one thread, median of `repeats`, with glibc told to keep freed memory. `meta`: the
    plans are made for a copy of the model on the meta device (costs measured block by block with
    random weights, partition.measure) and their stages timed with the model's own weights.

    `rounds` > 1 alternates costing and timing: each later round costs the model afresh, predicts the
    first round's cuts from those costs, and times the stages again; predicted and measured are the
    medians over the rounds, so a change in the machine's load between the costing and the timing
    (which no cost model predicts) moves both alike. `calibrate`: fxpipe's plan as partition.plan's
    with calibrate=True (costs measured block by block, its stages then timed whole).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    keep_freed_memory()  # a repeated run then measures the work, not the allocator's state
    try:
        return _quality(model_spec, stages, cost=cost, repeats=repeats, methods=methods, meta=meta, rounds=rounds,
                        calibrate=calibrate, **model_args)
    finally:
        torch.set_num_threads(threads)


def _saved_times(a: Analysis) -> tuple[str, dict[str, tuple[float, float]]]:
    return a.cost_method, {u: (c.fwd_ms, c.bwd_ms) for u, c in a.costs.items()}


def _restore_times(a: Analysis, kept: tuple[str, dict[str, tuple[float, float]]]) -> None:
    """The analysis's node times and cost method as `kept` (before a calibration for one plan's stages)."""
    a.cost_method, times = kept
    if any((c.fwd_ms, c.bwd_ms) != times[u] for u, c in a.costs.items()):
        for u, c in a.costs.items():
            c.fwd_ms, c.bwd_ms = times[u]
        a.recost()


def _quality(model_spec: str | Workload, stages: list[int], *, cost: str, repeats: int, methods: Sequence[str],
             meta: bool = False, rounds: int = 1, calibrate: bool = False,
             **model_args: Any) -> list[dict[str, Any]]:
    w = partition.load(model_spec, **model_args) if isinstance(model_spec, str) else model_spec
    if not w.layer_prefixes:
        raise ValueError(f"workload {w.name!r} names no layer_prefixes; the layer baselines need them")
    # the loss is in the graph (partition.loss), so every method's last stage computes it, as in training
    model = meta_copy(w.model) if meta else w.model

    def analysis() -> Analysis:
        return Analysis(model, w.example_args, w.example_kwargs, cost=cost, repeats=max(5, repeats // 2),
                        loss_fn=w.loss_fn, example_target=w.example_target, device="cpu")
    a = analysis()
    real = a if not meta else Analysis(w.model, w.example_args, w.example_kwargs, cost="flops",
                                       loss_fn=w.loss_fn, example_target=w.example_target)
    rows: list[dict[str, Any]] = []
    runs: dict[tuple[int, int], Callable[[], tuple[float, float]]] = {}
    predicted: list[list[list[tuple[float, float]]]] = []  # row -> round -> stage -> (fwd, bwd)
    measured: list[dict[tuple[int, int], tuple[float, float]]] = []  # round -> (row, stage) -> (fwd, bwd)
    with preserve_state(w.model):
        for S in stages:
            cm = CostModel(in_flight=tuple(in_flight("1f1b", S, S)))
            for method, bounds in baselines(a, S, w.layer_prefixes, cm).items():
                if method not in methods:
                    continue
                aa = a
                kept = _saved_times(a)
                if method == "fxpipe":  # as partition.plan does: slice an op slower than a fair stage, and
                    aa, sol = split_heavy_ops(a, evaluate(a.chain, bounds, cm), S, cm)
                    if aa.blockwise and calibrate:  # as plan(calibrate=True): the stages timed whole, re-solved
                        aa, sol = calibrate_plan(aa, sol, S, cm)
                    bounds = sol.bounds
                p = plan_from_bounds(aa, bounds, cm, schedule="1f1b", microbatches=S, stages_per_rank=1,
                                     memory_budget=None)
                how = aa.cost_method
                _restore_times(a, kept)  # the other methods and stage counts start from the costs measured
                timed = aa if not meta else real.with_rewrites(aa.rewrites) if aa.rewrites else real
                mods = split_graph(timed.gm, p)  # a meta plan cuts the real model's graph: the same graph
                for st, args in zip(mods, _stage_inputs(mods, timed.flat)):
                    runs[(len(rows), stage_io(st).index)] = _fwd_bwd(st, args)
                predicted.append([[(sp.fwd_ms, sp.bwd_ms) for sp in p.stages]])
                rows.append(dict(model=w.name, stages=S, method=method, bounds=list(bounds), rewrites=p.rewrites,
                                 predicted_bottleneck=p.bottleneck_ms, cost_method=how))
        measured.append(measure_stages(runs, repeats))
        for _ in range(1, rounds):  # costed afresh, then timed: the same cuts
            again = analysis()
            for i, row in enumerate(rows):
                ar = again.with_rewrites(row["rewrites"]) if row["rewrites"] else again
                kept = _saved_times(ar)
                if row["method"] == "fxpipe" and ar.blockwise and calibrate:  # as its plan was: stages timed whole
                    calibrate_stages(ar.gm, ar.costs, ar.blocks.members, row["bounds"], ar.example_flat,
                                     ar.target_device)
                    ar.recost()
                cm = CostModel(in_flight=tuple(in_flight("1f1b", row["stages"], row["stages"])))
                p = plan_from_bounds(ar, row["bounds"], cm, schedule="1f1b", microbatches=row["stages"],
                                     stages_per_rank=1, memory_budget=None)
                predicted[i].append([(sp.fwd_ms, sp.bwd_ms) for sp in p.stages])
                _restore_times(ar, kept)
            measured.append(measure_stages(runs, repeats))
    for i, row in enumerate(rows):
        S = row["stages"]
        pred = [(statistics.median(r[s][0] for r in predicted[i]), statistics.median(r[s][1] for r in predicted[i]))
                for s in range(S)]
        meas = [(statistics.median(m[(i, s)][0] for m in measured), statistics.median(m[(i, s)][1] for m in measured))
                for s in range(S)]
        row["predicted_fwd"] = [f for f, _ in pred]
        row["predicted_bwd"] = [b for _, b in pred]
        row["predicted"] = [f + b for f, b in pred]
        row["measured"] = [f + b for f, b in meas]
        row["measured_fwd"] = [f for f, _ in meas]
        row["measured_bwd"] = [b for _, b in meas]
        # each round's prediction against the timing right after it: the machine's speed drifts by up to 2x
        # over a minute here, so a costing is compared with the timing nearest it, not with the rounds' median
        row["ratio"] = [statistics.median(sum(predicted[i][k][s]) / sum(m[(i, s)]) for k, m in enumerate(measured))
                        for s in range(S)]
        row["rounds"] = rounds
    return rows


def print_quality(rows: list[dict[str, Any]]) -> None:
    print(f"{'model':<15} {'S':>2} {'method':<12} {'pred slowest':>12} {'meas slowest':>12}  "
          "per-stage measured ms (= : same cuts as fxpipe)")
    ours = {(r["model"], r["stages"]): r["bounds"] for r in rows if r["method"] == "fxpipe"}
    for r in rows:
        per = " ".join(f"{x:7.2f}" for x in r["measured"])
        same = " =" if r["method"] != "fxpipe" and ours.get((r["model"], r["stages"])) == r["bounds"] else ""
        print(f"{r['model']:<15} {r['stages']:>2} {r['method']:<12} {max(r['predicted']):>12.2f} "
              f"{max(r['measured']):>12.2f}  {per}{same}")
    for model in dict.fromkeys(r["model"] for r in rows):
        for S in dict.fromkeys(r["stages"] for r in rows if r["model"] == model):
            group = {r["method"]: max(r["measured"]) for r in rows if r["model"] == model and r["stages"] == S}
            if "fxpipe" in group:
                best_other = min((v, k) for k, v in group.items() if k != "fxpipe")
                print(f"{model} S={S}: fxpipe slowest stage {group['fxpipe']:.2f} ms vs best baseline "
                      f"{best_other[1]} {best_other[0]:.2f} ms ({group['fxpipe'] / best_other[0]:.2f}x)")


def print_accuracy(rows: list[dict[str, Any]]) -> None:
    print(f"{'model':<15} {'S':>2} {'stage':>5} {'pred ms':>8} {'meas ms':>8} {'pred/meas':>9}")
    worst = 0.0
    for r in rows:
        for s, (p, m, q) in enumerate(zip(r["predicted"], r["measured"], r["ratio"])):
            worst = max(worst, abs(q - 1))
            print(f"{r['model']:<15} {r['stages']:>2} {s:>5} {p:>8.2f} {m:>8.2f} {q:>9.3f}")
    print(f"largest per-stage error: {100 * worst:.1f}%")


def markdown(rows: list[dict[str, Any]]) -> str:
    """The quality rows as a Markdown table (slowest stage predicted and measured, per-stage measured)."""
    lines = ["| model | S | method | predicted slowest (ms) | measured slowest (ms) | per-stage measured (ms) |",
             "|---|---:|---|---:|---:|---|"]
    for r in rows:
        per = ", ".join(f"{x:.2f}" for x in r["measured"])
        lines.append(f"| {r['model']} | {r['stages']} | {r['method']} | {max(r['predicted']):.2f} "
                     f"| {max(r['measured']):.2f} | {per} |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> bool:
    """Per-stage measured fwd+bwd ms, one panel per (model, S), one bar group per method."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    groups = list(dict.fromkeys((r["model"], r["stages"]) for r in rows))
    fig, axes = plt.subplots(1, len(groups), figsize=(4.5 * len(groups), 3.5), squeeze=False)
    for ax, (model, S) in zip(axes[0], groups):
        mine = [r for r in rows if (r["model"], r["stages"]) == (model, S)]
        width = 0.8 / S
        for s in range(S):
            ax.bar([i + s * width for i in range(len(mine))], [r["measured"][s] for r in mine], width,
                   label=f"stage {s}")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(mine))], [r["method"] for r in mine], fontsize=8)
        ax.set_title(f"{model}, {S} stages")
        ax.set_ylabel("measured fwd+bwd ms")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.quality", description=__doc__)
    ap.add_argument("--model", default="gpt_wide_vocab,unet", help="comma-separated workload specs")
    ap.add_argument("--stages", default="2,4", type=wholes(1), help="comma-separated stage counts")
    ap.add_argument("--accuracy", default="", help="more workloads for the cost-model accuracy table "
                    "(fxpipe's plan only); --model's own fxpipe rows are always in it")
    ap.add_argument("--cost", choices=COSTS, default="measured")
    ap.add_argument("--repeats", type=whole(1), default=20)
    ap.add_argument("--calibrate", action="store_true", help="with --meta: fxpipe's plan's stages timed whole and "
                    "its costs scaled to them, as partition.plan(calibrate=True)")
    ap.add_argument("--rounds", type=whole(1), default=1, help="alternate costing and timing this many times; "
                    "predicted and measured are medians over the rounds, pred/meas the median of each round's ratio "
                    "(see quality())")
    ap.add_argument("--meta", action="store_true", help="plan a copy of each model on the meta device (costs "
                    "measured block by block, partition.measure) and time its stages with the model's weights")
    ap.add_argument("--model-arg", action="append", default=[], metavar="K=V",
                    help="keyword argument for every model factory (repeatable)")
    ap.add_argument("--out", default=None, help="folder for partition.json, partition.md and partition.png")
    args = ap.parse_args(argv)
    stages = [int(s) for s in args.stages.split(",")]
    overrides = parse_overrides(args.model_arg)
    rows = [r for m in args.model.split(",") if m
            for r in quality(m, stages, cost=args.cost, repeats=args.repeats, meta=args.meta, rounds=args.rounds,
                              calibrate=args.calibrate, **overrides)]
    print_quality(rows)
    acc = [r for r in rows if r["method"] == "fxpipe"]
    acc += [r for m in args.accuracy.split(",") if m
            for r in quality(m, stages, cost=args.cost, repeats=args.repeats, methods=("fxpipe",), meta=args.meta,
                             rounds=args.rounds, calibrate=args.calibrate, **overrides)]
    print()
    print_accuracy(acc)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        result = {"command": " ".join(["python -m bench.quality", *(argv if argv is not None else sys.argv[1:])]),
                  "cost": args.cost, "repeats": args.repeats, "rounds": args.rounds, "model_args": overrides,
                  "threads": 1,
                  "torch": torch.__version__, "machine": platform.platform(), "cpus": os.cpu_count(),
                  "quality": rows, "accuracy": acc}
        (out / "partition.json").write_text(json.dumps(result, indent=1))
        (out / "partition.md").write_text(markdown(rows) + "\n")
        plot(rows, out / "partition.png")
        print(f"wrote {out / 'partition.json'}, partition.md and partition.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
