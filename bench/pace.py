"""The machine's pace: a fixed piece of work that every rank runs at once, timed in each round of a
benchmark beside its pipelines.

This 2-core machine's speed moves with nothing else of ours running: the bundled `gpt`'s forward and
backward on 32 samples, alone in one process, measured 165-251 ms a step over ten launches minutes apart,
and from 197 to 251 ms within one launch. A
calibration fitted during a fast minute predicts every step of a slow one short by the same factor.
`bench calibrate` records the pace beside its fit (`Calibration.pace_ms`) and `bench schedules` measures
it again in every round of its own, so that its predictions run at the pace of the steps they are
compared with (`Calibration.at_pace`): what is left of the difference is the simulator's.
"""
from __future__ import annotations

import statistics
from typing import Any

import torch

__all__ = ["Pace", "SAMPLES", "REPEATS"]

SAMPLES = 4  # one microbatch of the bundled gpt's (its defaults: 4 layers, d=128, 64 tokens)
REPEATS = 2  # forward and backward, twice a round


class Pace:
    """The bundled `gpt` at its defaults (seed 0), its forward and backward on one fixed microbatch, run by
    every rank at once: `measure()` times a round (the slowest rank's), `ms` is the median so far."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        import partition
        with torch.random.fork_rng(devices=[]):  # the factory seeds torch's generator: leave the caller's as it was
            w = partition.load("gpt")
        self.device = torch.device(device)
        self.model = w.model.to(self.device)
        args, kwargs, target = w.batch(SAMPLES, 0)
        self.args = [x.to(self.device) if isinstance(x, torch.Tensor) else x for x in args]
        self.kwargs = kwargs
        self.target = target.to(self.device)
        self.loss_fn = w.loss_fn
        self.times: list[float] = []  # seconds per round

    def _work(self) -> None:
        for _ in range(REPEATS):
            self.loss_fn(self.model(*self.args, **self.kwargs), self.target).backward()
        self.model.zero_grad(set_to_none=True)

    def measure(self) -> float:
        """One round, every rank starting together; the slowest rank's seconds (kept in `times`)."""
        from bench.schedules import slowest_rank_s
        self.times.append(slowest_rank_s(self._work, self.device))
        return self.times[-1]

    @property
    def ms(self) -> float | None:
        """The median round so far (ms); None before any."""
        return statistics.median(self.times) * 1e3 if self.times else None

    def describe(self, calibration: Any = None) -> str:
        """This run's pace against `calibration`'s (a pipe.calibration.Calibration), in words."""
        if self.ms is None:
            return "pace: not measured"
        theirs = getattr(calibration, "pace_ms", None)
        return (f"pace: {self.ms:.1f} ms a round (gpt forward and backward, {SAMPLES} samples x {REPEATS}, every "
                f"rank at once, median of {len(self.times)})"
                + ("" if not theirs else f"; the calibration's {theirs:.1f} ms: its predictions x "
                   f"{self.ms / theirs:.3f}"))
