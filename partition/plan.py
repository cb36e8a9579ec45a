"""The partition result (Plan): what lives on each stage, predicted times and memory; JSON and a table."""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch.fx

from partition.errors import FxpipeError
from partition.flights import CLOSED_FORMS, closed_form

__all__ = ["Plan", "StagePlan", "Value", "PlanError", "parse_bytes", "human_bytes", "fingerprint",
           "in_flight"]

FORMAT = 1


class PlanError(FxpipeError, ValueError):
    """A plan that does not fit the model or the request it is used for."""


@dataclass
class Value:
    """A tensor that crosses into a stage: the fx node that makes it, its shape and dtype per microbatch."""
    name: str
    shape: list[int]
    dtype: str
    stride: list[int] = field(default_factory=list)  # the producer's layout; [] = contiguous

    @property
    def nbytes(self) -> int:
        import torch
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


@dataclass
class StagePlan:
    index: int
    nodes: list[str]                 # fx call nodes computed on this stage, in order
    params: list[str]                # canonical (first) names of the parameters it holds
    fwd_ms: float
    bwd_ms: float
    param_bytes: int
    activation_bytes: int            # saved for backward, per microbatch
    in_flight: int                   # microbatches the schedule keeps alive on this stage
    peak_bytes: float                # predicted: states + in-flight activations + buffers
    send_bytes: int                  # forward activations sent per microbatch (grads come back)
    recv_bytes: int
    recv: list[Value] = field(default_factory=list)
    shared: list[str] = field(default_factory=list)  # params another stage also holds (tied)
    memory: str = ""                 # memory plan (recompute / offload) chosen by memory/, if any
    memory_peak: float = 0.0         # its predicted peak bytes
    memory_ms: float = 0.0           # what it costs per microbatch (recompute, copies), in the costs' units
    memory_nodes: int = 0            # fx nodes it runs again per microbatch (recompute)
    # under a zero-bubble schedule, W's part of bwd_ms per microbatch (None: not priced, half) and how many
    # nodes it differentiates: the nn.Linear weight grads (pipe.backward), or every parameter node's
    w_ms: float | None = None
    w_nodes: int = 0


@dataclass
class Plan:
    stages: list[StagePlan]
    schedule: str
    microbatches: int
    stages_per_rank: int
    cost: str                        # "measured" or "flops"
    memory_budget: float | None
    bottleneck_ms: float
    imbalance: float                 # slowest stage / mean stage
    model: str                       # class name
    fingerprint: str                 # graph and parameter shapes; guards against another model
    tracer: str
    inputs: list[Value | None]       # the flat example (args, kwargs) leaves (None: not a tensor)
    input_spec: str = ""             # their pytree structure (torch.utils._pytree.treespec_dumps)
    input_constants: dict[str, Any] = field(default_factory=dict)  # flat index -> a non-tensor leaf (JSON)
    rewrites: list[list[Any]] = field(default_factory=list)  # [node, parts(, "vocab")]: see partition.rewrite
    loss: bool = False               # loss_fn is in the graph: the last stage returns it; inputs[-1] is the target
    loss_note: str = ""              # why the loss is outside the graph, or how its target was inferred
    output_bytes: int = 0            # the graph's outputs per microbatch (a loss outside the graph saves them)
    notes: list[str] = field(default_factory=list)  # faster paths not taken, and why
    leaf_modules: list[str] = field(default_factory=list)  # module types traced whole ("pkg.mod.Class")
    state_factor: float = 4.0
    cost_device: str = ""            # where measured costs were taken ("" for FLOP counts)
    cost_method: str = ""            # how: the whole graph op by op, block by block, or a FLOP count
    bytes_per_ms: float = 1e6
    latency_ms: float = 0.05
    format: int = FORMAT

    @property
    def n_stages(self) -> int:
        return len(self.stages)

    def example_target(self) -> Any:
        """Zeros shaped as the target of one microbatch the plan recorded (its loss in the graph), else None."""
        import torch
        v = self.inputs[-1] if self.loss and self.inputs else None
        return None if v is None else torch.zeros(v.shape, dtype=getattr(torch, v.dtype))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        d = dict(d)
        if d.get("format") != FORMAT:
            raise PlanError(f"plan format {d.get('format')!r} is not {FORMAT}; re-create the plan "
                            "with this version of fxpipe (python -m partition ...)")
        try:
            stages = []
            for s in d.pop("stages"):
                s = dict(s)
                s["recv"] = [Value(**v) for v in s["recv"]]
                stages.append(StagePlan(**s))
            d["inputs"] = [None if v is None else Value(**v) for v in d["inputs"]]
            return cls(stages=stages, **d)
        except (TypeError, KeyError, AttributeError) as e:
            raise PlanError(f"the plan's fields do not match this version of fxpipe ({type(e).__name__}: {e}); "
                            "re-create the plan with partition.plan(...) or python -m partition") from e

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1))
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise PlanError(f"cannot read plan file {str(path)!r}: {e}; give the path of a file written by "
                            "Plan.save or python -m partition ... --out plan.json") from e
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise PlanError(f"plan file {str(path)!r} is not JSON ({e}); give a file written by Plan.save or "
                            "python -m partition ... --out plan.json") from e
        if not isinstance(data, dict) or "stages" not in data:
            raise PlanError(f"plan file {str(path)!r} is JSON but not a plan (no 'stages'); give a file "
                            "written by Plan.save or python -m partition ... --out plan.json")
        return cls.from_dict(data)

    def table(self, measured: dict[int, float] | None = None) -> str:
        """One row per stage: nodes, parameters, predicted times, memory and traffic; `measured`: the
        peak bytes each stage's memory ledger measured, shown beside the predicted peak."""
        head = ["stage", "nodes", "params", "fwd ms", "bwd ms", "act/mb", "in flight", "peak",
                "budget", "send/mb"]
        rows = [[str(s.index), str(len(s.nodes)), human_bytes(s.param_bytes), f"{s.fwd_ms:.2f}",
                 f"{s.bwd_ms:.2f}", human_bytes(s.activation_bytes), str(s.in_flight),
                 human_bytes(s.memory_peak if s.memory else s.peak_bytes),
                 "-" if self.memory_budget is None else human_bytes(self.memory_budget),
                 human_bytes(s.send_bytes)] for s in self.stages]
        if measured is not None:
            head.insert(8, "measured")
            for r, s in zip(rows, self.stages):
                r.insert(8, human_bytes(measured[s.index]) if s.index in measured else "-")
        if any(s.memory for s in self.stages):  # the memory plan: policy per stage, its peak in "peak"
            head.insert(7, "memory")
            for r, s in zip(rows, self.stages):
                r.insert(7, s.memory or "-")
        widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
        fmt = "  ".join("{:>%d}" % w for w in widths)
        on = f" on {self.cost_device}" if self.cost_device else ""
        how = f" ({self.cost_method}{on})" if self.cost_method else ""
        lines = [f"{self.model}: {self.n_stages} stages, schedule {self.schedule}, "
                 f"{self.microbatches} microbatches, cost {self.cost}{how}, traced by {self.tracer}",
                 fmt.format(*head)] + [fmt.format(*r) for r in rows]
        lines.append(f"bottleneck {self.bottleneck_ms:.2f} ms per microbatch (fwd+bwd+comm), "
                     f"imbalance {self.imbalance:.3f} (slowest / mean)")
        if self.loss:
            lines.append(f"loss: computed in the last stage ({self.n_stages - 1}), traced into the graph"
                         + (f"; {self.loss_note}" if self.loss_note else ""))
        else:
            lines.append(f"loss: computed after the last stage ({self.n_stages - 1}) by loss_fn, outside the graph"
                         + (f" ({self.loss_note})" if self.loss_note else ""))
        lines += [f"note: {n}" for n in self.notes]
        for r in self.rewrites:
            parts = r[1] if isinstance(r[1], int) else len(r[1]) - 1
            where = [s.index for s in self.stages if any(n.startswith(f"{r[0]}_vocab") or n.startswith(f"{r[0]}_rows")
                                                         for n in s.nodes)]
            kind = "vocabulary slices with its cross entropy" if list(r[2:]) == ["vocab"] else "row slices"
            lines.append(f"{r[0]} cut into {parts} {kind} (bounds {r[1]}) on stages {where}")
        shared = sorted({p for s in self.stages for p in s.shared})
        if shared:
            lines.append("tied parameters held by several stages (grads summed): " + ", ".join(shared))
        return "\n".join(lines)


_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12,
          "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def per_stage_note(stages_per_rank: int) -> str:
    """The note a plan with a memory budget and several stages per rank carries (pipe.Pipeline's and python -m
    partition's alike)."""
    v = stages_per_rank
    return (f"memory_budget is per stage, and each rank holds {v} stages: a rank may hold up to {v}x it at once (for "
            f"a device's memory, give that memory / {v})")


def parse_bytes(x: float | int | str | None) -> float | None:
    """8GiB, 512MB, 1.5e9 or a number of bytes; None stays None. Zero or below is an error."""
    if x is None:
        return None
    if isinstance(x, (int, float)):
        value = float(x)
    else:
        m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([A-Za-z]*)\s*", x)
        number = None
        if m:
            try:
                number = float(m.group(1))
            except ValueError:  # "1e", "1.2.3": the pattern's characters, not a number
                pass
        if number is None or m is None or m.group(2).lower() not in _UNITS:
            raise PlanError(f"memory budget {x!r} is not a size; write e.g. 8GiB, 512MiB, 2GB or a "
                            "number of bytes")
        value = number * _UNITS[m.group(2).lower()]
    if not value > 0 or value == float("inf"):
        raise PlanError(f"memory budget must be positive and finite, got {x!r}; give the bytes each "
                        "stage may use, e.g. 8GiB, or no budget at all")
    return value


def human_bytes(x: float, digits: int = 1) -> str:
    """Bytes in binary units, e.g. 1.5 MiB (`digits` after the point; whole bytes below 1 KiB)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(x) < 1024:
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.{digits}f} {unit}"
        x /= 1024
    return f"{x:.{digits}f} TiB"


def fingerprint(gm: torch.fx.GraphModule) -> str:
    """Hash of the graph's operations and the parameters' names and shapes."""
    h = hashlib.sha256()
    for node in gm.graph.nodes:
        t = node.target
        target = t if isinstance(t, str) else f"{getattr(t, '__module__', '')}.{getattr(t, '__qualname__', t)}"
        h.update(f"{node.op}|{node.name}|{target}\n".encode())
    for name, p in gm.named_parameters():
        h.update(f"{name}|{tuple(p.shape)}|{p.dtype}\n".encode())
    return h.hexdigest()[:16]


def in_flight(schedule: str, n_stages: int, microbatches: int) -> list[int]:
    """Microbatches whose activations stage s holds at once, for the schedules with a closed form
    (partition.flights). Interleaved schedules depend on the placement; pipe passes their figures,
    from the built schedule, explicitly.
    """
    got = closed_form(schedule, n_stages, microbatches)
    if got is None:
        raise PlanError(f"no in-flight rule for schedule {schedule!r} in partition; known: {', '.join(CLOSED_FORMS)}; "
                        "pass in_flight=[...] (one count per stage) for other schedules")
    return got
