"""The byte ledger: what each stage holds on its compute device, by kind, current and peak per step."""
from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["KINDS", "Ledger"]

# params: parameters on the device; grads: their gradients; optimizer: optimizer state on the
# device; activations: tensors saved for backward (and selective-checkpoint caches) held on the
# device; recompute: tensors recomputed for the backward running now; comm: message buffers.
KINDS = ("params", "grads", "optimizer", "activations", "recompute", "comm")


class Ledger:
    """Bytes per stage and kind. `peak_*` are the largest values since `step_begin`; `peak_total`
    is the largest sum at any one moment (not the sum of the kinds' peaks).

    On CUDA, `report` adds the rank's `cuda_peak_allocated` (torch.cuda.max_memory_allocated
    since the step began) to every local stage, to check the ledger against the allocator.
    """

    def __init__(self, stages: Sequence[int], device: torch.device) -> None:
        self.stages = list(stages)
        self.device = device
        self.now = {s: dict.fromkeys(KINDS, 0) for s in self.stages}
        self.peak = {s: dict.fromkeys(KINDS, 0) for s in self.stages}
        self.total_peak = dict.fromkeys(self.stages, 0)
        self.at_peak = {s: dict.fromkeys(KINDS, 0) for s in self.stages}  # by kind when peak_total was reached
        self.extra: dict[int, dict[str, float]] = {s: {} for s in self.stages}

    def add(self, stage: int, kind: str, delta: int) -> None:
        now = self.now[stage]
        now[kind] += int(delta)
        assert now[kind] >= 0, f"ledger went negative: stage {stage} {kind} {now[kind]}"
        if now[kind] > self.peak[stage][kind]:
            self.peak[stage][kind] = now[kind]
        total = sum(now.values())
        if total > self.total_peak[stage]:
            self.total_peak[stage] = total
            self.at_peak[stage] = dict(now)

    def set(self, stage: int, kind: str, value: int) -> None:
        self.add(stage, kind, int(value) - self.now[stage][kind])

    def total(self, stage: int) -> int:
        return sum(self.now[stage].values())

    def step_begin(self) -> None:
        for s in self.stages:
            self.peak[s] = dict(self.now[s])
            self.total_peak[s] = self.total(s)
            self.at_peak[s] = dict(self.now[s])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def report(self) -> dict[int, dict[str, int]]:
        out: dict[int, dict[str, int]] = {}
        cuda = None
        if self.device.type == "cuda":
            cuda = int(torch.cuda.max_memory_allocated(self.device))
        for s in self.stages:
            row = {k: v for k, v in self.now[s].items()}
            row.update({f"peak_{k}": v for k, v in self.peak[s].items()})
            row["total"] = self.total(s)
            row["peak_total"] = self.total_peak[s]
            row.update({f"at_peak_{k}": v for k, v in self.at_peak[s].items()})
            row.update({k: int(v) for k, v in self.extra[s].items()})
            if cuda is not None:
                row["cuda_peak_allocated"] = cuda
            out[s] = row
        return out
