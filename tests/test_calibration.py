"""pipe.calibration: a machine's corrections recovered from measured steps, and the predictions they give.

The "measured" steps here are made by the simulator from known figures (the backward split into B
and W at known shares, a host gap before each action, an extra latency per message), with each
event's span starting after its gap, as the runtime times it; the fit must find those figures, and
the calibrated prediction of another schedule must equal its "measured" step."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pipe.calibration import Calibration, Observations, fit, observe
from pipe.predict import replayed_timeline, simulate_schedule
from pipe.simulate import Timeline

FWD = [3.0, 4.0, 2.5, 3.5]
BWD = [6.0, 8.0, 5.0, 7.0]
COMM = 0.2  # the plan's price of a message
TRUE = Calibration(b_share=0.8, w_share=0.55, gap_ms=0.4, message_ms=0.3)


def measured(name: str, v: int) -> Timeline:
    """One step of `name` on 2 ranks, M=8, as the runtime would time it under TRUE."""
    S = 2 * v
    fwd, bwd = FWD[:S], BWD[:S]
    has_w = name.startswith("zb") or name.endswith("-zb")
    f, b, w = TRUE.stage_costs(fwd, bwd, has_w)
    tl = simulate_schedule(name, 2, 8, f, b, w, [COMM + TRUE.message_ms] * (S - 1))
    return Timeline([dataclasses.replace(e, start=e.start + TRUE.gap_ms) for e in tl.events], tl.n_ranks)


def observed(name: str, v: int) -> Observations:
    tl = measured(name, v)
    return observe([tl, tl], [COMM] * (2 * v - 1), [s % 2 for s in range(2 * v)])


def test_the_fit_recovers_the_figures_behind_the_steps() -> None:
    obs = Observations()
    for name, v in (("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2), ("interleaved-zb", 2)):
        obs.extend(observed(name, v))
    got = fit(obs)
    assert got.b_share == pytest.approx(0.8)
    assert got.w_share == pytest.approx(0.55)
    assert got.gap_ms == pytest.approx(0.4)
    assert got.message_ms == pytest.approx(0.3)
    assert got.samples["stages_split_and_whole"] == 6 and got.samples["gaps"] > 0 and got.samples["messages"] > 0


def test_without_split_runs_the_shares_keep_their_defaults() -> None:
    got = fit(observed("1f1b", 1))
    assert (got.b_share, got.w_share) == (0.5, 0.5)
    assert got.gap_ms == pytest.approx(0.4)
    assert fit(Observations()) == Calibration(samples={"stages_split_and_whole": 0, "gaps": 0, "messages": 0},
                                              machine=fit(Observations()).machine)


def test_replaying_the_measured_actions_with_the_fit_gives_the_measured_step() -> None:
    from partition.plan import Plan, StagePlan
    for name, v in (("zb-h1", 1), ("interleaved-1f1b", 2), ("1f1b", 1)):
        S = 2 * v
        tl = measured(name, v)
        stages = [StagePlan(index=s, nodes=[], params=[], fwd_ms=FWD[s], bwd_ms=BWD[s], param_bytes=0,
                            activation_bytes=0, in_flight=1, peak_bytes=0.0, send_bytes=1 if s < S - 1 else 0,
                            recv_bytes=0, recv=[], shared=[]) for s in range(S)]
        plan = Plan(stages=stages, schedule=name, microbatches=8, stages_per_rank=v, cost="flops",
                    memory_budget=None, bottleneck_ms=0.0, imbalance=1.0, model="toy", fingerprint="", tracer="",
                    inputs=[], bytes_per_ms=1e9, latency_ms=COMM - 1e-9)
        action_ms = {(e.action.kind, e.action.stage): e.end - e.start for e in tl.events}
        span = max(e.end for e in tl.events) - 0.0  # the true step starts with the first gap
        assert replayed_timeline(plan, 2, action_ms, TRUE).makespan == pytest.approx(span)
        assert replayed_timeline(plan, 2, action_ms).makespan < span  # uncalibrated: no gaps, no extra latency


def test_a_calibration_file_round_trips_and_a_wrong_one_is_refused(tmp_path: Path) -> None:
    path = TRUE.save(tmp_path / "cal.json")
    assert Calibration.load(path) == TRUE
    (tmp_path / "bad.json").write_text('{"gap": 1}')
    with pytest.raises(ValueError, match="make it again with python -m bench calibrate"):
        Calibration.load(tmp_path / "bad.json")
    with pytest.raises(FileNotFoundError, match="python -m bench calibrate"):
        Calibration.load(tmp_path / "none.json")
