"""Microbatches in flight per stage for the schedules with a closed form (torch-free, so that both
partition's planner and pipe.schedules read the one table)."""
from __future__ import annotations

__all__ = ["CLOSED_FORMS", "closed_form"]

CLOSED_FORMS = ("1f1b", "1f1b-overlap", "zb-h1", "gpipe")


def closed_form(schedule: str, n_stages: int, microbatches: int) -> list[int] | None:
    """Microbatches whose activations stage s holds at once: 1F1B min(M, S - s), 1f1b-overlap one more
    on every stage but the last, ZB-H1 min(M, S) (a microbatch stays until its deferred W), GPipe M;
    None for a schedule without a closed form (its figures come from the built schedule)."""
    S, M = n_stages, microbatches
    if schedule == "1f1b":
        return [min(M, S - s) for s in range(S)]
    if schedule == "1f1b-overlap":
        return [min(M, S - s + (s < S - 1)) for s in range(S)]
    if schedule == "zb-h1":
        return [min(M, S)] * S
    if schedule == "gpipe":
        return [M] * S
    return None
