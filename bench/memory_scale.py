"""Host memory of a pipeline's set-up and first step, per rank: today's path (every rank builds the
whole model) against a model built on the meta device, each rank materializing only its stages from
a .safetensors file (pipe.weights); the bundled GPT at several sizes on 2 and 4 ranks.

Each rank samples its resident set (/proc/self/statm, every 2 ms, and the kernel's peak,
getrusage's ru_maxrss) and reports its peak above a baseline in four phases. The baseline is taken
after a 1-layer GPT was planned, built and stepped, real and on the meta device, so that what a
process pays once whatever the model (torch's meta kernels: some 300 modules, ~31 MiB, imported at
the first meta op; fx, the kernels' first calls and caches, another ~20 MiB) is reported apart, in
the "one-time" column (`--cold`: the baseline right after start-up, with only the meta kernels loaded).
The phases: building the model, planning (trace, costs, solve), building its
stages (materializing them and loading their values), and the first step (AdamW's first step
included; its state is reported apart). Against it: the bytes of the rank's stages' parameters.
Each (size, ranks, mode) is its own launch, modes alternating:

  python -m bench memory-scale --sizes 16x512 --ranks 4 --modes eager,meta --rounds 2"""
from __future__ import annotations

from partition.args import whole
import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from partition.costs import COSTS

__all__ = ["main", "parser", "worker"]

PHASES = ("build", "plan", "stages", "first step")


def parser(add_help: bool = True) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench memory-scale", description=__doc__, add_help=add_help,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="8x256,16x512", help="GPT sizes as LAYERSxD_MODEL, comma-separated")
    p.add_argument("--ranks", default="2,4", help="pipeline ranks, comma-separated")
    p.add_argument("--modes", default="eager,meta", help="eager (every rank builds the model) and/or meta")
    p.add_argument("--rounds", type=whole(1), default=1, help="launches per (size, ranks, mode), alternating modes")
    p.add_argument("--cost", default="measured", choices=COSTS)
    p.add_argument("--microbatches", type=whole(1), default=8)
    p.add_argument("--seq-len", type=whole(1), default=64)
    p.add_argument("--vocab", type=whole(1), default=512)
    p.add_argument("--cold", action="store_true",
                   help="baseline right after start-up (default: after a 1-layer GPT was planned, built and "
                        "stepped both ways, so what a process pays once, whatever the model, is in the baseline "
                        "and reported apart)")
    p.add_argument("--out", default="out/bench-memory-scale")
    return p


class _Sampler:
    """This process's resident bytes, sampled in a thread; the peak of each phase."""

    def __init__(self) -> None:
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.phase = ""
        self.peak: dict[str, int] = {}
        self.seconds: dict[str, float] = {}  # wall time of each phase
        self._since = time.perf_counter()
        self.baseline = self.rss()
        self._stop = False
        self._kernel = self.maxrss()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    @staticmethod
    def maxrss() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def _note(self, value: int) -> None:
        if self.phase:
            self.peak[self.phase] = max(self.peak.get(self.phase, 0), value)

    def _run(self) -> None:
        while not self._stop:
            self._note(self.rss())
            time.sleep(0.002)

    def enter(self, phase: str) -> None:
        """End the current phase (a new kernel peak during it is its peak) and start `phase`."""
        kernel = self.maxrss()
        if kernel > self._kernel:
            self._note(kernel)
            self._kernel = kernel
        self._note(self.rss())
        now = time.perf_counter()
        if self.phase:
            self.seconds[self.phase] = self.seconds.get(self.phase, 0.0) + now - self._since
        self.phase, self._since = phase, now

    def stop(self) -> dict[str, int]:
        self.enter("")
        self._stop = True
        return {k: v - self.baseline for k, v in self.peak.items()}


def worker(argv: list[str]) -> int:
    """One launch: build, plan, build the stages and take a first step; each rank writes its figures."""
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=whole(1))
    p.add_argument("--d-model", type=whole(1))
    p.add_argument("--mode")
    p.add_argument("--cost")
    p.add_argument("--microbatches", type=whole(1))
    p.add_argument("--seq-len", type=whole(1))
    p.add_argument("--vocab", type=whole(1))
    p.add_argument("--weights")
    p.add_argument("--result")
    p.add_argument("--warm", action="store_true")
    a = p.parse_args(argv)
    import torch
    torch.set_num_threads(1)
    import pipe
    from bench.models import GPT, GPTConfig, _lm_loss, _random_tokens
    ctx = pipe.init()
    page = os.sysconf("SC_PAGE_SIZE")
    cold = int(open("/proc/self/statm").read().split()[1]) * page
    if a.warm:  # what a process pays once whatever the model: a 1-layer GPT planned, built and stepped both ways,
        # the meta one read from a .safetensors file as the measured meta runs are (found by review: built from its
        # init, it left the reading's one-time cost, ~30 MiB and 1.4 s, to the measured run)
        from safetensors.torch import save_file
        tiny = GPTConfig(n_layer=1, d_model=64, n_head=1, seq_len=a.seq_len, vocab=a.vocab)
        ex, tg = _random_tokens(4, 0, vocab=a.vocab, seq_len=a.seq_len)
        source = f"{a.result}.warm.safetensors"  # (in the launcher's folder: every rank reads rank 0's file)
        for meta in (False, True):
            torch.manual_seed(0)  # every rank the same values (pipe.Pipeline compares them)
            with torch.device("meta" if meta else "cpu"):
                m = GPT(tiny)
            if not meta and ctx.rank == 0:
                save_file({k: v.detach().clone().contiguous() for k, v in m.state_dict().items()}, source)
            if meta:
                torch.distributed.barrier()
            warm = pipe.Pipeline(m, ex, loss_fn=_lm_loss, microbatches=ctx.world_size, cost=a.cost,
                                 example_target=tg, weights=source if meta else None)
            warm.step(*_random_tokens(4 * ctx.world_size, 1, vocab=a.vocab, seq_len=a.seq_len)[0],
                      target=_random_tokens(4 * ctx.world_size, 1, vocab=a.vocab, seq_len=a.seq_len)[1])
            del warm, m
        from partition.measure import release_memory
        release_memory()
    else:
        torch.empty(1, device="meta") + 1  # torch's meta kernels: ~300 modules loaded at the first meta op
    torch.distributed.barrier()
    sampler = _Sampler()
    one_time = sampler.baseline - cold
    start = time.perf_counter()
    sampler.enter("build")
    cfg = GPTConfig(n_layer=a.layers, d_model=a.d_model, n_head=max(1, a.d_model // 64), seq_len=a.seq_len,
                    vocab=a.vocab)
    torch.manual_seed(0)
    if a.mode == "meta":
        with torch.device("meta"):
            model = GPT(cfg)
    else:
        model = GPT(cfg)
    sampler.enter("plan")

    def progress(msg: str) -> None:
        if msg.startswith("building this rank's stages"):
            sampler.enter("stages")
    example, target = _random_tokens(4, 0, vocab=a.vocab, seq_len=a.seq_len)
    pp = pipe.Pipeline(model, example, loss_fn=_lm_loss, microbatches=a.microbatches, cost=a.cost,
                       example_target=target, weights=a.weights if a.mode == "meta" else None, progress=progress)
    sampler.enter("first step")
    opt = torch.optim.AdamW(pp.parameters(), lr=1e-4)
    args, tgt = _random_tokens(4 * a.microbatches, 1, vocab=a.vocab, seq_len=a.seq_len)
    loss = pp.step(*args, target=tgt)
    opt.step()
    opt.zero_grad(set_to_none=True)
    first_step_s = time.perf_counter() - start
    peaks = sampler.stop()
    params = sum(p.numel() * p.element_size() for p in pp.parameters())
    state = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0)
    model_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    report = pp.memory_report()
    row = {"rank": ctx.rank, "mode": a.mode, "layers": a.layers, "d_model": a.d_model, "ranks": ctx.world_size,
           "baseline": sampler.baseline, "peaks": peaks, "stage_param_bytes": params, "optimizer_state_bytes": state,
           "model_param_bytes": model_bytes, "time_to_first_step_s": first_step_s, "loss": loss, "one_time": one_time,
           "phase_seconds": sampler.seconds, "params_host": sum(r.get("params_host", 0) for r in report.values()),
           "params_device": sum(r.get("params_device", 0) for r in report.values())}
    Path(f"{a.result}.{ctx.rank}.json").write_text(json.dumps(row))
    torch.distributed.barrier()
    from pipe.launch import finish
    finish()
    return 0


def _mib(x: float) -> str:
    return f"{x / 2**20:.1f}"


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from bench.__main__ import launch
    sizes = [tuple(int(x) for x in s.split("x")) for s in args.sizes.split(",")]
    ranks = [int(r) for r in args.ranks.split(",")]
    modes = args.modes.split(",")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="fxpipe-memscale-") as tmp:
        for layers, d in sizes:
            weights = Path(tmp) / f"gpt-{layers}x{d}.safetensors"
            if "meta" in modes:  # the state dict the meta runs load (written once, not measured)
                import torch
                from safetensors.torch import save_file
                from bench.models import GPT, GPTConfig
                torch.manual_seed(0)
                m = GPT(GPTConfig(n_layer=layers, d_model=d, n_head=max(1, d // 64), seq_len=args.seq_len,
                                  vocab=args.vocab))
                save_file({k: v.detach().clone().contiguous() for k, v in m.state_dict().items()}, str(weights))
                del m
            for n in ranks:
                for r in range(args.rounds):
                    for mode in modes:
                        result = Path(tmp) / f"r{layers}x{d}-{n}-{mode}-{r}"
                        code = launch("bench.memory_scale", n, [
                            "--worker", "--layers", str(layers), "--d-model", str(d), "--mode", mode,
                            "--cost", args.cost, "--microbatches", str(args.microbatches), "--seq-len",
                            str(args.seq_len), "--vocab", str(args.vocab), "--weights", str(weights),
                            "--result", str(result)] + ([] if args.cold else ["--warm"]))
                        if code:
                            return code
                        rows += [json.loads(Path(f"{result}.{k}.json").read_text()) | {"round": r}
                                 for k in range(n)]
    head = ["size", "ranks", "mode", "rank", "one-time MiB", "stage params MiB", "build", "plan", "stages",
            "first step", "set-up peak / params", "Adam state MiB", "first step s", "s: build/plan/stages/step"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        pk = row["peaks"]
        setup = max(pk.get(ph, 0) for ph in PHASES[:3])
        lines.append("| " + " | ".join([
            f"{row['layers']}x{row['d_model']}", str(row["ranks"]), row["mode"], str(row["rank"]),
            _mib(row["one_time"]), _mib(row["stage_param_bytes"]), *(_mib(pk.get(ph, 0)) for ph in PHASES),
            f"{setup / row['stage_param_bytes']:.2f}", _mib(row["optimizer_state_bytes"]),
            f"{row['time_to_first_step_s']:.1f}",
            "/".join(f"{row.get('phase_seconds', {}).get(ph, 0.0):.1f}" for ph in PHASES)]) + " |")
    print("peak resident MiB above each rank's baseline, by phase (median-free: every launch listed)")
    print("\n".join(lines))
    for (layers, d) in sizes:
        for n in ranks:
            t = {mode: statistics.median(max(r["time_to_first_step_s"] for r in rows if r["mode"] == mode and
                                             r["ranks"] == n and r["layers"] == layers and r["round"] == k)
                                         for k in range(args.rounds)) for mode in modes}
            print(f"{layers}x{d} on {n} ranks: time to the first step (slowest rank, median of {args.rounds}): "
                  + ", ".join(f"{m} {v:.1f} s" for m, v in t.items()))
    (out / "memory-scale.json").write_text(json.dumps(rows, indent=1))
    (out / "memory-scale.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / 'memory-scale.json'}")
    return 0


if __name__ == "__main__":
    if "--worker" in sys.argv:
        sys.argv.remove("--worker")
        sys.exit(worker(sys.argv[1:]))
    sys.exit(main())
