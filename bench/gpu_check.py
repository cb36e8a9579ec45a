"""python bench/gpu_check.py            (without a CUDA GPU it says so and exits 0; --dry-run: the same on CPU)

GPU check of memory/ with real CUDA memory and pinned-memory transfers, one script under 5 minutes.

Prints (1) pinned against pageable copy speed and how well side-stream copies overlap a matmul
loop; (2) interleaved-1f1b and zbv (two stages per rank; NCCL messages between the ranks when
there are two GPUs, hand-over in memory with one): loss and grads against the unpartitioned
model, and the CUDA-event timeline (device time) against the host's wall time of the step;
(3) per memory configuration, the ledger's peak against torch.cuda.max_memory_allocated;
(4) step times of plain, auto at half the plain peak, selective and full recompute; (5) a
checkpoint saved on the device resumed bitwise (dropout: the device's random state); (6) the
widest gpt that trains within a per-stage budget, plain against auto + offload of everything; (7) the
model's costs by FLOP count, by shape (cost="shaped") and timed op by op on the device; (8)
pp.clip_grad_norm_ and pp.eval().evaluate against torch's clipping and eval mode on the unpartitioned
model; (9) compile=True (inductor) against the model and against the same schedule uncompiled:
parity, the compilation's seconds, the step's speed-up; (10) measured costs of the whole graph against
the pipeline's (unit by unit for a model left on the CPU) and its steps' actions; (11) offloaded
activations and streamed states against the plain step, and in a profiled step how much of the copies' time a
kernel ran beside; (12) float16 with pp.make_grad_scaler against torch.amp.GradScaler on the model.
Uses min(2, GPUs) ranks (one process per GPU; --ranks to choose); with one GPU the single stage runs
GPipe so that several microbatches are in flight. Writes out/gpu_check/gpu_check.json after each part.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.memory_bench import _build, largest, timed, train_steps  # noqa: E402

__all__ = ["main"]

GPU: dict[str, Any] = {
    "timed": {"n_layer": 8, "d_model": 1024, "n_head": 16, "seq_len": 256, "vocab": 8192, "microbatch_size": 4,
              "tie": False},
    "scan": {"n_layer": 4, "n_head": 16, "seq_len": 64, "vocab": 8192, "microbatch_size": 2, "tie": False},
    "widths": [256, 512, 1024, 1536, 2048, 3072, 4096], "budget": 1 << 30, "scan_s": 40.0,
    "compiled": {"n_layer": 4, "d_model": 1024, "n_head": 16, "seq_len": 256, "vocab": 8192, "microbatch_size": 4,
                 "tie": False}, "compile": True}
DRY: dict[str, Any] = {
    "timed": {"n_layer": 2, "d_model": 64, "n_head": 4, "seq_len": 32, "vocab": 256, "microbatch_size": 2,
              "tie": False},
    "scan": {"n_layer": 2, "n_head": 4, "seq_len": 16, "vocab": 128, "microbatch_size": 2, "tie": False},
    "widths": [32, 64, 128], "budget": 4 << 20, "scan_s": 30.0,
    "compiled": {"n_layer": 2, "d_model": 32, "n_head": 2, "seq_len": 16, "vocab": 64, "microbatch_size": 2,
                 "tie": False}, "compile": {"backend": "aot_eager"}}


def copy_speeds(say: Callable[..., None]) -> dict[str, float]:
    """GB/s host->device and device->host, pinned and pageable; overlap of side-stream copies with compute."""
    dev = torch.device("cuda")
    n = 256 << 20
    out: dict[str, float] = {}
    for pinned in (True, False):
        h = torch.empty(n, dtype=torch.uint8, pin_memory=pinned)
        d = torch.empty(n, dtype=torch.uint8, device=dev)
        for name, dst, src in (("h2d", d, h), ("d2h", h, d)):
            dst.copy_(src, non_blocking=pinned)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(5):
                dst.copy_(src, non_blocking=pinned)
            torch.cuda.synchronize()
            out[f"{name}_{'pinned' if pinned else 'pageable'}_GBps"] = 5 * n / (time.perf_counter() - t0) / 1e9
    a = torch.randn(8192, 8192, device=dev)
    h = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    d = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    side = torch.cuda.Stream()

    def compute() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()
        return time.perf_counter() - t0
    alone = compute()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.cuda.stream(side):
        for _ in range(4):
            d.copy_(h, non_blocking=True)
    for _ in range(20):
        a @ a
    torch.cuda.synchronize()
    both = time.perf_counter() - t0
    side.synchronize()
    t0 = time.perf_counter()
    with torch.cuda.stream(side):
        for _ in range(4):
            d.copy_(h, non_blocking=True)
    side.synchronize()
    copies = time.perf_counter() - t0
    out.update(compute_s=alone, copies_s=copies, together_s=both,
               overlap=(alone + copies - both) / min(alone, copies) if min(alone, copies) > 0 else 0.0)
    for k, v in out.items():
        say(f"    {k:24s} {v:8.3f}")
    return out


def reference_step(w: Any, model: torch.nn.Module, args: tuple[Any, ...], target: torch.Tensor, M: int,
                   dev: torch.device, backward: bool = True) -> float:
    """The unpartitioned model's loss over the batch (mean of the microbatches' losses, as a pipeline's step),
    its grads accumulated in `model` (with `backward`)."""
    from pipe.runtime import split_microbatches
    loss = 0.0
    mbs = split_microbatches(tuple(a.to(dev) for a in args), M)
    for a, t in zip(mbs, split_microbatches(target.to(dev), M, "target")):
        with torch.set_grad_enabled(backward):
            part = w.loss_fn(model(*a), t) / M
        if backward:
            part.backward()
        loss += float(part.detach())
    return loss


def grad_error(pp: Any, model: torch.nn.Module) -> tuple[float, float]:
    """Over this rank's parameters, by name: the largest |grad - reference grad|, and that over the largest
    |reference grad| (0.0 when no grads)."""
    ref = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    pairs = [(p.grad, ref[n]) for n, p in pp.named_parameters() if p.grad is not None and n in ref]
    if not pairs:
        return 0.0, 0.0
    err = max(float((g - r).abs().max()) for g, r in pairs)
    scale = max(float(r.abs().max()) for _, r in pairs)
    return err, err / max(scale, 1e-30)


def schedules_check(base: dict[str, Any], M: int, say: Callable[..., None]) -> list[dict[str, Any]]:
    """interleaved-1f1b and zbv: parity with the unpartitioned model (loss, every grad by name),
    and the device timeline (CUDA events on CUDA) against the wall time of the step."""
    import partition
    import pipe
    from pipe.launch import context
    dev = context().device
    rows = []
    for schedule in ("interleaved-1f1b", "zbv"):
        w = partition.load("gpt", **base)
        ref = partition.load("gpt", **base)
        ref.model.to(dev)
        pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=M, schedule=schedule,
                           cost="flops")
        walls, spans = [], []
        for step in range(3):
            args, _, target = w.batch(w.microbatch_size * M, step)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = pp.step(*args, target=target)
            walls.append((time.perf_counter() - t0) * 1e3)
            tl = pp.gather_timeline()
            spans.append(tl.makespan if tl is not None else 0.0)
            ref_loss = reference_step(w, ref.model, args, target, M, dev)
            grad_err = grad_error(pp, ref.model)[0]
            for p in list(pp.parameters()) + list(ref.model.parameters()):
                p.grad = None
        row = {"schedule": schedule, "ranks": dist.get_world_size(), "loss_err": abs(loss - ref_loss),
               "grad_err": grad_err, "wall_ms": walls, "timeline_ms": spans, "bubble": tl.bubble if tl else None}
        rows.append(row)
        say(f"    {schedule:17s} |loss - ref| {row['loss_err']:.2e}, max |grad - ref| {grad_err:.2e}; step wall "
            f"{walls[-1]:.1f} ms, device timeline {spans[-1]:.1f} ms"
            + (f", bubble {tl.bubble:.3f}" if tl is not None else ""))
        del w, ref, pp
    return rows


def clip_eval_check(base: dict[str, Any], M: int, schedule: str, say: Callable[..., None]) -> dict[str, Any]:
    """pp.clip_grad_norm_ against torch.nn.utils.clip_grad_norm_ over the unpartitioned model (the norm, and
    every clipped grad by name), and pp.eval().evaluate and pp.forward with dropout against the model in eval
    mode, also with the parameters streamed from the host (offload="states"): on the device, through the job's
    backend (NCCL: no CPU tensor may reach a collective)."""
    import partition
    import pipe
    from pipe.launch import context
    dev = context().device
    w = partition.load("gpt", **base)
    ref = partition.load("gpt", **base)
    ref.model.to(dev)
    pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=M, schedule=schedule, cost="flops")
    args, _, target = w.batch(w.microbatch_size * M, 0)
    loss = pp.step(*args, target=target)
    ref_loss = reference_step(w, ref.model, args, target, M, dev)
    max_norm = 0.1
    norm = float(pp.clip_grad_norm_(max_norm))
    ref_norm = float(torch.nn.utils.clip_grad_norm_(list(ref.model.parameters()), max_norm))
    clipped_err = grad_error(pp, ref.model)
    del pp, w, ref
    d = partition.load("gpt", **{**base, "dropout": 0.1})
    dref = partition.load("gpt", **{**base, "dropout": 0.1})
    dref.model.to(dev).eval()
    pe = pipe.Pipeline(d.model, d.example_args, loss_fn=d.loss_fn, microbatches=M, schedule=schedule, cost="flops")
    args, _, target = d.batch(d.microbatch_size * M, 1)
    val = pe.eval().evaluate(*args, target=target)
    ref_val = reference_step(d, dref.model, args, target, M, dev, backward=False)
    out = pe.forward(*args)  # in eval mode too: the output on this rank's device, as the model's there
    with torch.no_grad():
        ref_out = dref.model(*(a.to(dev) for a in args))
    pe.train()
    del pe
    # the same with the parameters streamed in chunks from the host (offload="states"): fetched for the pass
    s = partition.load("gpt", **{**base, "dropout": 0.1})
    ps = pipe.Pipeline(s.model, s.example_args, loss_fn=s.loss_fn, microbatches=M, schedule=schedule, cost="flops",
                       offload="states")
    streamed_val = ps.eval().evaluate(*args, target=target)
    streamed_out = ps.forward(*args)
    row = {"streamed_eval_loss_err": abs(streamed_val - ref_val), "streamed_forward_device": str(streamed_out.device),
           "streamed_forward_err": float((streamed_out.to(dev) - ref_out).abs().max())}
    row.update({"step_loss_err": abs(float(loss) - ref_loss), "norm": norm, "ref_norm": ref_norm,
           "norm_rel_err": abs(norm - ref_norm) / max(ref_norm, 1e-30), "clipped_grad_err": clipped_err[0],
           "clipped_grad_rel_err": clipped_err[1], "eval_loss": val, "ref_eval_loss": ref_val,
           "eval_loss_err": abs(val - ref_val), "forward_device": str(out.device),
           "forward_err": float((out.to(dev) - ref_out).abs().max())})
    say(f"    clip_grad_norm_({max_norm}): total norm {norm:.6g} (torch on the whole model {ref_norm:.6g}, relative "
        f"error {row['norm_rel_err']:.1e}), clipped grads max error {clipped_err[0]:.2e} ({clipped_err[1]:.1e} of the "
        f"largest); eval-mode loss with dropout 0.1 {val:.6f} vs {ref_val:.6f} (|diff| {row['eval_loss_err']:.1e}); "
        f"pp.forward in eval mode on {out.device}, max |out - model's| {row['forward_err']:.1e}; with streamed "
        f"states: eval loss |diff| {row['streamed_eval_loss_err']:.1e}, forward on {streamed_out.device}, max |diff| "
        f"{row['streamed_forward_err']:.1e}")
    return row


def compile_check(base: dict[str, Any], M: int, schedules: tuple[str, ...], compile: Any, steps: int,
                  say: Callable[..., None]) -> list[dict[str, Any]]:
    """compile=`compile` (True: torch.compile's inductor, Triton kernels on CUDA) against the unpartitioned model (loss,
    grads by name) and against the same schedule uncompiled: the first step's seconds (the compilation) and
    the median step of each, timed alternately."""
    import statistics
    import partition
    import pipe
    from pipe.launch import context
    dev = context().device
    rows = []
    for schedule in schedules:
        ref = partition.load("gpt", **base)
        ref.model.to(dev)
        built: dict[bool, tuple[Any, Any]] = {}
        first: dict[bool, float] = {}
        for compiled in (False, True):
            w = partition.load("gpt", **base)
            pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=M, schedule=schedule,
                               cost="flops", compile=compile if compiled else False)
            built[compiled] = (w, pp)
        args, _, target = built[True][0].batch(built[True][0].microbatch_size * M, 0)
        losses: dict[bool, float] = {}
        errs: dict[bool, tuple[float, float]] = {}
        ref_loss = reference_step(built[True][0], ref.model, args, target, M, dev)
        for compiled, (w, pp) in built.items():
            t0 = time.perf_counter()
            losses[compiled] = float(pp.step(*args, target=target))
            _sync(dev)
            first[compiled] = time.perf_counter() - t0
            errs[compiled] = grad_error(pp, ref.model)
            for p in pp.parameters():
                p.grad = None
        times: dict[bool, list[float]] = {False: [], True: []}
        for i in range(steps):
            b, _, t = built[True][0].batch(built[True][0].microbatch_size * M, i + 1)
            for compiled in ((False, True) if i % 2 == 0 else (True, False)):
                pp = built[compiled][1]
                _sync(dev)
                t0 = time.perf_counter()
                pp.step(*b, target=t)
                _sync(dev)
                times[compiled].append(time.perf_counter() - t0)
                for p in pp.parameters():
                    p.grad = None
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        row = {"schedule": schedule, "ref_loss": ref_loss, "loss_err": {str(k): abs(v - ref_loss) for k, v in
                                                                        losses.items()},
               "grad_err": {str(k): v for k, v in errs.items()}, "first_step_s": {str(k): v for k, v in first.items()},
               "median_step_ms": {str(k): v for k, v in med.items()}, "speedup": med[False] / med[True],
               "notes": [n for n in built[True][1].plan.notes if "compile" in n]}
        rows.append(row)
        say(f"    {schedule:8s} compiled: |loss - ref| {abs(losses[True] - ref_loss):.1e} "
            f"(plain {abs(losses[False] - ref_loss):.1e}), "
            f"grads {errs[True][1]:.1e} of the largest (plain {errs[False][1]:.1e}); first step {first[True]:.1f} s "
            f"(plain {first[False]:.2f} s); median step {med[True]:.1f} ms against {med[False]:.1f} ms plain: "
            f"x{row['speedup']:.2f}")
        del built, ref
    return rows


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def costs_check(base: dict[str, Any], M: int, schedule: str, say: Callable[..., None]) -> dict[str, Any]:
    """A model's measured costs three ways on the device: the whole graph op by op (the model moved there
    first), the pipeline's plan (a model left on the CPU is measured unit by unit on the device,
    partition.measure), and the forward and backward actions of its steps (CUDA events), per microbatch."""
    import statistics
    import partition
    import pipe
    from partition.costs import node_costs
    from partition.trace import flatten_inputs, trace
    from pipe.launch import context
    dev = context().device
    w = partition.load("gpt", **base)
    model = w.model.to(dev)
    args = tuple(a.to(dev) for a in w.example_args)
    gm = trace(model, args, {})
    c = node_costs(gm, flatten_inputs(gm, args, {}), cost="measured")
    whole = (sum(x.fwd_ms for x in c.values()), sum(x.bwd_ms for x in c.values()))
    del w, model, gm, c
    w = partition.load("gpt", **base)
    pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=M, schedule=schedule,
                       cost="measured")
    plan = (sum(st.fwd_ms for st in pp.plan.stages), sum(st.bwd_ms for st in pp.plan.stages))
    b, _, target = w.batch(w.microbatch_size * M, 0)
    for _ in range(3):
        pp.step(*b, target=target)
    tl = pp.gather_timeline()
    acted: dict[str, float] = {}
    if tl is not None:
        for kind in ("F", "B"):
            per: dict[int, list[float]] = {}  # each stage's median over the microbatches, summed over the stages
            for e in tl.events:
                if e.action.kind == kind:
                    per.setdefault(e.action.stage, []).append(e.end - e.start)
            acted[kind] = sum(statistics.median(v) for v in per.values())
    row = {"whole_graph_ms": whole, "plan_ms": plan, "plan_method": pp.plan.cost_method, "actions_ms": acted}
    say(f"    fwd + bwd ms per microbatch: whole graph op by op {whole[0]:.2f} + {whole[1]:.2f}; the pipeline's "
        f"plan ({pp.plan.cost_method}) {plan[0]:.2f} + {plan[1]:.2f}; its steps' F + B actions "
        f"{acted.get('F', 0):.2f} + {acted.get('B', 0):.2f}")
    # one transformer block alone, as partition.measure times a unit: one call between two waits for the
    # device against calls back to back (partition.costs.back_to_back), per call
    from partition.costs import _clean_once, _clock
    block: torch.nn.Module = w.model.get_submodule("blocks.0").to(dev)
    x = torch.randn(w.microbatch_size, base["seq_len"], base["d_model"], device=dev, requires_grad=True)
    clock = _clock(block, [x])
    alone: dict[str, list[float]] = {}
    for calls in (1, 4, 16) * 4:  # alternately; the first round warms up
        fwd_ms, bwd_ms = _clean_once(block, [x], clock, calls)
        alone.setdefault(str(calls), []).append(fwd_ms + bwd_ms)
    per_call = {k: statistics.median(v[1:]) for k, v in alone.items()}
    row["block_alone_ms"] = per_call
    say("    one block alone, fwd + bwd ms per call: " + ", ".join(
        f"{k} back to back {v:.2f}" if k != "1" else f"one call {v:.2f}" for k, v in per_call.items()))
    return row


def ledger_vs_allocator(base: dict[str, Any], M: int, schedule: str, say: Callable[..., None]) -> list[dict[str, Any]]:
    """Each config alone on the device: the ledger's peak (this rank's stages) against the allocator's."""
    rows = []
    for recompute, offload in (("none", "none"), ("full", "none"), ("selective", "none"), ("none", "activations"),
                               ("none", "states"), ("auto", "all")):
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        try:
            w, pp = _build(base, M, schedule, recompute=recompute, offload=offload)
        except ValueError as e:
            say(f"    {recompute:9s} {offload:11s} refused: {str(e).splitlines()[0][:160]}")
            continue
        s_per_step = train_steps(w, pp, M, 3, warmup=1)  # (the first step allocates, pinned host memory too)
        report = pp.memory_report()
        ledger = sum(r["peak_total"] for r in report.values())
        cuda = max((r.get("cuda_peak_allocated", 0) for r in report.values()), default=0)
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, (ledger, cuda))
        row = {"recompute": recompute, "offload": offload, "ledger_peak": [p[0] for p in parts],
               "cuda_peak": [p[1] for p in parts], "s_per_step": s_per_step,
               "h2d_bytes": next(iter(report.values()))["h2d_bytes"]}
        rows.append(row)
        say(f"    {recompute:9s} {offload:11s} ledger {[f'{x / 2**20:.0f}' for x in row['ledger_peak']]} MiB, "
            f"allocator {[f'{x / 2**20:.0f}' for x in row['cuda_peak']]} MiB, {row['s_per_step']:.3f} s/step")
        del w, pp
    return rows


def copy_overlap(events: list[dict[str, Any]]) -> dict[str, float]:
    """From a profiler's Chrome trace events (torch.profiler: "kernel" and "gpu_memcpy" spans, in us): ms of
    compute kernels (their union over the streams), ms of host-to-device and device-to-host copies, and
    `hidden`, the share of the copies' time during which a kernel ran (1: behind the compute; 0: apart)."""
    import bisect
    union: list[list[float]] = []
    for a, b in sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel"):
        if union and a <= union[-1][1]:
            union[-1][1] = max(union[-1][1], b)
        else:
            union.append([a, b])
    starts = [a for a, _ in union]
    out = {"kernels_ms": sum(b - a for a, b in union) / 1e3, "h2d_ms": 0.0, "d2h_ms": 0.0}
    copied = hidden = 0.0
    for e in events:
        kind = "h2d_ms" if "HtoD" in e.get("name", "") else "d2h_ms" if "DtoH" in e.get("name", "") else None
        if e.get("cat") != "gpu_memcpy" or kind is None:
            continue
        a, b = e["ts"], e["ts"] + e["dur"]
        out[kind] += (b - a) / 1e3
        copied += b - a
        for x, y in union[max(bisect.bisect_right(starts, a) - 1, 0):bisect.bisect_left(starts, b)]:
            hidden += max(0.0, min(b, y) - max(a, x))
    out["hidden"] = hidden / copied if copied else 0.0
    return out


def offload_check(base: dict[str, Any], M: int, schedule: str, say: Callable[..., None]) -> dict[str, Any]:
    """Offloaded activations, then streamed states: each step against the plain one (all after a warm-up
    step that allocates, pinned host memory too), the parameters each trained to against the plain ones'
    (activations: bitwise equal when every copy kept its order with the compute; states step on the host,
    so within rounding), and one step profiled: how long the copies take each way and how much of their
    time a compute kernel ran beside them (copy_overlap)."""
    from torch.profiler import ProfilerActivity, profile
    plain_w, plain = _build(base, M, schedule, recompute="none", offload="none")
    plain_s = train_steps(plain_w, plain, M, 3, warmup=1)
    trained = {n: p.detach().clone() for n, p in plain.named_parameters()}
    del plain_w, plain
    gc.collect()
    out: dict[str, Any] = {"plain_s": plain_s}
    for mode in ("activations", "states"):
        w, pp = _build(base, M, schedule, recompute="none", offload=mode)
        cuda = pp.ctx.device.type == "cuda"
        if cuda:  # reloads are allocated on a copy stream of their own: the allocator's pools are per stream
            torch.cuda.reset_peak_memory_stats(pp.ctx.device)
        offload_s = train_steps(w, pp, M, 3, warmup=1)
        peaks = {"allocated_peak_mib": torch.cuda.max_memory_allocated(pp.ctx.device) / 2**20,
                 "reserved_peak_mib": torch.cuda.max_memory_reserved(pp.ctx.device) / 2**20} if cuda else {}
        # the same steps from the same weights: a copy that raced the compute would show here
        diff = max(float((p.detach().to(trained[n].device) - trained[n]).abs().max()) for n, p in pp.named_parameters())
        b, _, target = w.batch(w.microbatch_size * M, 0)
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            pp.step(*b, target=target)
            _sync(pp.ctx.device)
        path = Path("out/gpu_check") / f"offload-{mode}-trace-rank{pp.ctx.rank}.json"
        prof.export_chrome_trace(str(path))
        row: dict[str, Any] = {"offload_s": offload_s, "param_max_diff": diff, **peaks,
                               **copy_overlap(json.loads(path.read_text())["traceEvents"])}
        say(f"    offloaded {mode} {offload_s:.3f} s/step against {plain_s:.3f} plain; in a profiled step "
            f"kernels {row['kernels_ms']:.1f} ms, copies {row['h2d_ms']:.1f} ms to the device and "
            f"{row['d2h_ms']:.1f} ms back, {row['hidden']:.0%} of the copies' time beside a kernel; after 4 steps "
            f"the parameters differ from the plain steps' by at most {diff:.2g}"
            + (f"; peak {peaks['allocated_peak_mib']:.0f} MiB allocated, {peaks['reserved_peak_mib']:.0f} reserved"
               if peaks else ""))
        out[mode] = row
        del w, pp
        gc.collect()
    return out


def scaler_check(base: dict[str, Any], M: int, schedule: str, say: Callable[..., None]) -> dict[str, Any]:
    """float16 autocast with pp.make_grad_scaler against torch.amp.GradScaler on the unpartitioned model,
    microbatch by microbatch: a first scale that overflows (skipped on both), then steps at the backed-off
    scale; the scales, losses and parameters after 4 steps, and the step's seconds against bfloat16 without a
    scaler."""
    import partition
    import pipe
    from pipe.launch import context
    dev = context().device
    w, ref = partition.load("gpt", **base), partition.load("gpt", **base)
    ref.model.to(dev)
    pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=M, schedule=schedule, cost="flops")
    kw: dict[str, Any] = dict(init_scale=2.0 ** 40, backoff_factor=2.0 ** -24)
    scaler, ref_scaler = pp.make_grad_scaler(**kw), torch.amp.GradScaler(dev.type, **kw)
    opt = torch.optim.Adam(list(pp.parameters()), lr=1e-4)
    ref_opt = torch.optim.Adam(ref.model.parameters(), lr=1e-4)
    rows, seconds = [], []
    for step in range(4):
        args, _, target = w.batch(w.microbatch_size * M, step)
        _sync(dev)
        t0 = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.float16):
            loss = pp.step(*args, target=target)
        scaler.step(opt)
        scaler.update()
        _sync(dev)
        seconds.append(time.perf_counter() - t0)
        with torch.autocast(dev.type, dtype=torch.float16):
            want = 0.0
            for a, t in zip(args[0].to(dev).chunk(M), target.to(dev).chunk(M)):
                part = w.loss_fn(ref.model(a), t) / M
                ref_scaler.scale(part).backward()
                want += float(part.detach())
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        for o in (opt, ref_opt):
            o.zero_grad(set_to_none=True)
        rows.append({"loss": loss, "ref_loss": want, "scale": scaler.get_scale(), "ref_scale": ref_scaler.get_scale()})
    refs = dict(ref.model.named_parameters())
    err = max(float((p.detach() - refs[n].detach()).abs().max()) for n, p in pp.named_parameters())
    bf16 = []
    for step in range(4):
        args, _, target = w.batch(w.microbatch_size * M, step)
        _sync(dev)
        t0 = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            pp.step(*args, target=target)
        _sync(dev)
        bf16.append(time.perf_counter() - t0)
        opt.zero_grad(set_to_none=True)
    out = {"steps": rows, "param_err": err, "fp16_scaled_s": sorted(seconds[1:])[1], "bf16_s": sorted(bf16[1:])[1]}
    say(f"    float16 + make_grad_scaler: scales {[r['scale'] for r in rows]} (torch.amp on the model: "
        f"{[r['ref_scale'] for r in rows]}), losses {[round(r['loss'], 5) for r in rows]} vs "
        f"{[round(r['ref_loss'], 5) for r in rows]}, max |param - model's| {err:.2e}; step "
        f"{out['fp16_scaled_s']:.3f} s against bfloat16 unscaled {out['bf16_s']:.3f} s")
    return out


def checkpoint_check(base: dict[str, Any], M: int, say: Callable[..., None]) -> dict[str, Any]:
    """Save on the device and resume into a fresh pipeline of the same plan: with dropout, the next
    step's loss is bitwise the uninterrupted one's only if the device's random state came back too,
    and every parameter and buffer (the stages' own tensors on the device) equals."""
    import partition
    import pipe
    base = {**base, "dropout": 0.1}
    w = partition.load("gpt", **base)
    pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=M, cost="flops")
    opt = torch.optim.AdamW(list(pp.parameters()), lr=1e-3)

    def step(p: Any, o: Any, i: int) -> float:
        args, _, target = w.batch(w.microbatch_size * M, i)
        loss = p.step(*args, target=target)
        o.step()
        o.zero_grad(set_to_none=True)
        return float(loss)
    step(pp, opt, 0)
    path = Path("out/gpu_check/ckpt")
    pp.save(path, optimizer=opt)
    straight = step(pp, opt, 1)
    w2 = partition.load("gpt", **{**base, "seed": 1})
    p2 = pipe.Pipeline(w2.model, w2.example_args, loss_fn=w2.loss_fn, microbatches=M, cost="flops", plan=path)
    o2 = torch.optim.AdamW(list(p2.parameters()), lr=1e-3)
    p2.load(path, optimizer=o2)
    resumed = step(p2, o2, 1)
    held = {**dict(pp.named_parameters()), **pp.local_buffers()}
    same = all(torch.equal(t, held[n]) for n, t in {**dict(p2.named_parameters()), **p2.local_buffers()}.items())
    row = {"bitwise_loss": resumed == straight, "state_equal": same, "device": str(next(pp.parameters()).device)}
    say(f"    resumed loss {'bitwise equal' if row['bitwise_loss'] else f'{resumed} != {straight}'}, "
        f"parameters and buffers {'equal' if same else 'DIFFER'} on {row['device']}")
    return row


def shaped_check(base: dict[str, Any], say: Callable[..., None]) -> dict[str, Any]:
    """The timed model's costs on the device three ways (partition.costs): by FLOP count, with products priced by
    their measured shapes (cost="shaped"), and timed op by op; the linear layers' device ms per priced ms tells
    how far a FLOP count is from the device's speed and what pricing the shapes takes of that."""
    import partition
    from partition.costs import node_costs
    from partition.trace import flatten_inputs, trace
    dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    w = partition.load("gpt", **base)
    model = w.model.to(dev)
    args = tuple(a.to(dev) if isinstance(a, torch.Tensor) else a for a in w.example_args)
    gm = trace(model, args, w.example_kwargs)
    flat = flatten_inputs(gm, args, w.example_kwargs or {})
    linear = {n.name for n in gm.graph.nodes
              if n.op == "call_module" and isinstance(gm.get_submodule(str(n.target)), torch.nn.Linear)}
    out: dict[str, Any] = {}
    for cost in ("flops", "shaped", "measured"):
        c = node_costs(gm, flat, cost=cost)
        out[cost] = {"fwd_ms": sum(x.fwd_ms for x in c.values()), "bwd_ms": sum(x.bwd_ms for x in c.values()),
                     "linear_ms": sum(c[n].fwd_ms + c[n].bwd_ms for n in linear)}
    out["linear_measured_per_priced"] = {k: out["measured"]["linear_ms"] / max(out[k]["linear_ms"], 1e-12)
                                         for k in ("flops", "shaped")}
    say(f"    costs of the model on {dev} (fwd + bwd ms): " + ", ".join(
        f"{k} {v['fwd_ms']:.2f} + {v['bwd_ms']:.2f}" for k, v in out.items() if isinstance(v, dict) and "fwd_ms" in v)
        + "; linear layers measured per priced ms: " + ", ".join(
        f"by {k} {v:.3f}" for k, v in out["linear_measured_per_priced"].items()))
    return out


def worker(dry: bool, parts: list[str] | None = None) -> int:
    import pipe
    ctx = pipe.init()
    say: Callable[..., None] = (lambda *a, **k: print(*a, **k, flush=True)) if ctx.rank == 0 else (lambda *a, **k: None)
    cfg: dict[str, Any] = DRY if dry else GPU
    world = ctx.world_size
    schedule, M = ("1f1b", 8) if world > 1 else ("gpipe", 8)
    result: dict[str, Any] = {"command": " ".join(sys.argv), "device": str(ctx.device), "ranks": world,
                              "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
                              "torch": torch.__version__, "machine": platform.platform()}
    t_all = time.perf_counter()
    steps: list[tuple[str, Callable[[], Any]]] = [
        ("copies", lambda: copy_speeds(say) if (ctx.rank == 0 and not dry) else {}),
        ("schedules", lambda: schedules_check(cfg["timed"], 4, say)),
        ("checkpoint", lambda: checkpoint_check(cfg["timed"], 4, say)),
        ("ledger", lambda: ledger_vs_allocator(cfg["timed"], M, schedule, say)),
        ("time", lambda: timed(3, M, say, base=cfg["timed"], schedule=schedule, v=1)),
        ("scan_plain", lambda: largest(cfg["budget"], {}, 4, say, base=cfg["scan"], widths=cfg["widths"],
                                       schedule=schedule, seconds=cfg["scan_s"] / 2)),
        ("scan_memory", lambda: largest(cfg["budget"], {"recompute": "auto", "offload": "all"}, 4, say,
                                        base=cfg["scan"], widths=cfg["widths"], schedule=schedule,
                                        seconds=cfg["scan_s"])),
        ("shaped", lambda: shaped_check(cfg["timed"], say) if ctx.rank == 0 else {}),
        ("clip_eval", lambda: clip_eval_check(cfg["timed"], 4, schedule, say)),
        ("costs", lambda: costs_check(cfg["timed"], M, schedule, say)),
        ("offload", lambda: offload_check(cfg["timed"], M, schedule, say)),
        ("scaler", lambda: scaler_check(cfg["timed"], 4, schedule, say)),
        ("compile", lambda: compile_check(cfg["compiled"], 4, ("1f1b", "zb-h1") if world > 1 else ("gpipe", "zbv"),
                                          cfg["compile"], 4, say)),
    ]
    unknown = sorted(set(parts or []) - {name for name, _ in steps})
    if unknown:
        raise SystemExit(f"gpu_check: no part {unknown}; the parts: {', '.join(name for name, _ in steps)}")
    for name, fn in steps:
        if parts is not None and name not in parts:
            continue
        say(f"[{time.perf_counter() - t_all:6.1f} s] {name}")
        try:
            result[name] = fn()
        except Exception as e:  # report and go on: one failing part must not hide the others
            result[name] = {"error": f"{type(e).__name__}: {e}"[:400]}
            say(f"    failed: {result[name]['error']}")
            if world > 1:
                raise  # a rank may be stuck in a collective: stop the whole check
        dist.barrier()
        if ctx.rank == 0:  # what was measured so far survives a check stopped at its time limit
            write(result)
    if "scan_plain" in result and "scan_memory" in result:
        a, b = result["scan_plain"].get("params", 0), result["scan_memory"].get("params", 0)
        say(f"largest within {cfg['budget'] / 2**20:.0f} MiB per stage: plain {a / 1e6:.1f} M params, "
            f"auto + offload all {b / 1e6:.1f} M: x{b / max(a, 1):.2f}")
    say(f"done in {time.perf_counter() - t_all:.0f} s")
    if ctx.rank == 0:
        say(f"wrote {write(result)}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


def write(result: dict[str, Any]) -> Path:
    out = Path("out/gpu_check")
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1, default=str))
    return out / "gpu_check.json"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/gpu_check.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="run on CPU with small sizes (checks the script)")
    p.add_argument("--ranks", type=int, default=None, help="processes (default: min(2, GPUs); 2 with --dry-run)")
    p.add_argument("--parts", default=None, metavar="A,B",
                   help="run only these parts (names as printed: copies, schedules, checkpoint, ledger, time, "
                        "scan_plain, scan_memory, shaped, clip_eval, costs, offload, scaler, compile)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args.dry_run, args.parts.split(",") if args.parts else None)
    if not torch.cuda.is_available() and not args.dry_run:
        print("gpu_check: skipped: no CUDA GPU on this machine (torch.cuda.is_available() is False); run it on a "
              "GPU machine, or pass --dry-run to exercise the script on CPU")
        return 0
    import subprocess
    import socket
    ranks = args.ranks or (min(2, torch.cuda.device_count()) if torch.cuda.is_available() else 2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port", str(port),
           str(Path(__file__).resolve()), "--worker"] + (["--dry-run"] if args.dry_run else []) + (
               ["--parts", args.parts] if args.parts else [])
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1" if args.dry_run else "8"))
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent.parent), env.get("PYTHONPATH", "")])
    print("$ " + " ".join(cmd), flush=True)
    return subprocess.call(cmd, env=env)


if __name__ == "__main__":
    sys.exit(main())
