"""pipe.scale (the ring all-reduce, buckets, a (pp, dp) layout's step) and its command, python -m bench scale."""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest

from pipe.lower import lower
from pipe.scale import MIB, Layout, LayoutCosts, bucket_cap, predict_layout, ring_allreduce_ms
from pipe.schedules import build, placement
from pipe.simulate import simulate_program


def costs(pp: int, *, f: float = 1.0, b: float = 2.0, w: float = 0.0, comm: float = 0.0,
          grad_bytes: float = 4 * MIB) -> LayoutCosts:
    return LayoutCosts(f_ms=[f] * pp, b_ms=[b] * pp, w_ms=[w] * pp, comm_ms=[comm] * (pp - 1),
                       grad_bytes=[grad_bytes] * pp)


def test_ring_allreduce_by_hand() -> None:
    # 2(n-1)/n x bytes / bw + 2(n-1) x latency
    assert ring_allreduce_ms(8e6, 4, 1e6, 0.01) == pytest.approx(2 * 3 / 4 * 8 + 2 * 3 * 0.01)  # 12.06
    assert ring_allreduce_ms(1e6, 2, 1e6) == pytest.approx(1.0)
    assert ring_allreduce_ms(3e6, 1024, 2.5e7, 0.005) == pytest.approx(2 * 1023 / 1024 * 3e6 / 2.5e7 + 2 * 1023 * 0.005)
    assert ring_allreduce_ms(8e6, 1, 1e6, 0.01) == 0.0  # one replica: nothing to reduce
    assert ring_allreduce_ms(0, 8, 1e6, 0.01) == 0.0


def test_bucket_cap_bounds() -> None:
    assert bucket_cap(0) == MIB  # 1 MiB floor
    assert bucket_cap(4 * MIB) == MIB
    assert bucket_cap(80 * MIB) == 10 * MIB  # an eighth
    assert bucket_cap(200 * MIB) == 25 * MIB
    assert bucket_cap(10_000 * MIB) == 25 * MIB  # DDP's 25 MiB ceiling
    assert bucket_cap(10_000 * MIB, cap=100 * MIB) == 100 * MIB  # an explicit cap wins
    assert bucket_cap(4 * MIB, cap=123) == 123


def test_one_replica_is_the_plain_lowered_program() -> None:
    for name, pp, v, M in (("1f1b", 4, 1, 8), ("zb-h1", 3, 1, 6), ("interleaved-1f1b", 2, 2, 4), ("zbv", 2, 2, 4)):
        c = costs(pp * v, w=0.5 if name.startswith("zb") else 0.0, comm=0.25)
        got = predict_layout(c, pp=pp, dp=1, schedule=name, microbatches=M, v=v, allreduce_bytes_per_ms=1.0)
        place = placement(name, pp * v, pp)
        plain = simulate_program(lower(build(name, pp, M, v), pp * v, M, place), pp * v, f_ms=c.f_ms, b_ms=c.b_ms,
                                 w_ms=c.w_ms, comm_ms=c.comm_ms, place=place)
        assert got.step_ms == pytest.approx(plain.makespan), name
        assert got.timeline.events == plain.events
        assert got.timeline.collectives == [] and got.allreduce_ms == got.exposed_ms == 0.0
        assert (got.ranks, got.bubble) == (pp, pytest.approx(plain.bubble))
        # the host's posts carry over from the costs into the layout's simulation
        posted = predict_layout(dataclasses.replace(c, post_ms=0.3), pp=pp, dp=1, schedule=name, microbatches=M,
                                v=v, allreduce_bytes_per_ms=1.0)
        slow = simulate_program(lower(build(name, pp, M, v), pp * v, M, place), pp * v, f_ms=c.f_ms, b_ms=c.b_ms,
                                w_ms=c.w_ms, comm_ms=c.comm_ms, place=place, post_ms=0.3)
        assert posted.step_ms == pytest.approx(slow.makespan) and slow.makespan > plain.makespan, name


def test_the_step_never_shrinks_as_dp_grows() -> None:
    for name, v in (("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2)):
        c = costs(4 * v, w=1.0 if name == "zb-h1" else 0.0, comm=0.1, grad_bytes=300 * MIB)
        steps = [predict_layout(c, pp=4, dp=dp, schedule=name, microbatches=8, v=v, allreduce_bytes_per_ms=2.5e7,
                                allreduce_latency_ms=0.005).step_ms for dp in (1, 2, 4, 8, 64, 1024)]
        assert steps == sorted(steps), (name, steps)
        assert steps[-1] > steps[0]


def test_a_tiny_all_reduce_hides_and_a_slow_one_is_exposed() -> None:
    c = costs(4, grad_bytes=MIB)

    def exposed_at(bytes_per_ms: float) -> Layout:
        return predict_layout(c, pp=4, dp=8, schedule="1f1b", microbatches=8, allreduce_bytes_per_ms=bytes_per_ms)

    fast = exposed_at(1e12)
    # only the last bucket, launched as the last backward ends, can run past it: ~1e-6 ms here
    assert fast.exposed_ms == pytest.approx(0.0, abs=1e-5) and fast.allreduce_ms > 0
    exposed = [exposed_at(bw).exposed_ms for bw in (1e6, 1e5, 1e4)]
    assert 0 < exposed[0] < exposed[1] < exposed[2]


def test_two_ranks_by_hand() -> None:
    """1F1B, pp=2, dp=2, M=2, F=1, B=2, free messages. Compute: rank 0 0F0 [0,1] 0F1 [1,2] 0B0 [4,6]
    0B1 [7,9]; rank 1 1F0 [1,2] 1B0 [2,4] 1F1 [4,5] 1B1 [5,7]. One bucket per stage (grads under 1 MiB),
    the ring of 2 moves 2(2-1)/2 = 1 x the bytes at 1e5 B/ms: stage 0 1 ms after 0B1 [9,10], stage 1
    4 ms after 1B1 [7,11]. The step ends at 11, 2 ms after the last compute (9); rank 1's own collective
    runs 4 ms past its last compute, hidden in part behind rank 0's 0B1."""
    c = LayoutCosts(f_ms=[1, 1], b_ms=[2, 2], w_ms=[0, 0], comm_ms=[0], grad_bytes=[1e5, 4e5])
    got = predict_layout(c, pp=2, dp=2, schedule="1f1b", microbatches=2, allreduce_bytes_per_ms=1e5)
    tl = got.timeline
    assert {str(e.action): (e.start, e.end) for e in tl.events} == {
        "0F0": (0, 1), "0F1": (1, 2), "0B0": (4, 6), "0B1": (7, 9),
        "1F0": (1, 2), "1B0": (2, 4), "1F1": (4, 5), "1B1": (5, 7)}
    assert [(e.rank, str(e.action), e.start, e.end) for e in tl.collectives] == [
        (1, "1REDUCE_GRAD0", 7, 11), (0, "0REDUCE_GRAD0", 9, 10)]
    assert (got.step_ms, got.exposed_ms, got.rank_exposed_ms, got.allreduce_ms) == (11, 2, 4, 4)
    assert got.bubble == pytest.approx((11 - 6) * 2 / (2 * 11))
    # with 5 us of latency per ring step: 2(n-1) = 2 steps per bucket
    slower = predict_layout(c, pp=2, dp=2, schedule="1f1b", microbatches=2, allreduce_bytes_per_ms=1e5,
                            allreduce_latency_ms=0.005)
    assert slower.step_ms == pytest.approx(11.01)


def test_the_table_of_64_to_1024_ranks_is_quick() -> None:
    t0 = time.perf_counter()
    rows = []
    for pp in (4, 8, 16):
        for ranks in (64, 128, 256, 512, 1024):
            dp, M = ranks // pp, 4096 // (ranks // pp * 4)  # 4096 sequences, 4 a microbatch
            got = predict_layout(costs(pp, comm=0.05, grad_bytes=120 * MIB), pp=pp, dp=dp, schedule="1f1b",
                                 microbatches=M, allreduce_bytes_per_ms=2.5e7, allreduce_latency_ms=0.005)
            rows.append((ranks, pp, M, got.step_ms))
    assert len(rows) == 15 and min(M for _, _, M, _ in rows) == 4
    assert time.perf_counter() - t0 < 20
    # at fixed pp, more replicas share the batch: fewer microbatches each, a shorter step
    for pp in (4, 8, 16):
        steps = [s for _, p, _, s in rows if p == pp]
        assert steps == sorted(steps, reverse=True)


def test_cost_lengths_must_match_the_stages() -> None:
    c = LayoutCosts(f_ms=[1.0] * 3, b_ms=[1.0] * 4, w_ms=[0.0] * 4, comm_ms=[0.0] * 3, grad_bytes=[1.0] * 4)
    with pytest.raises(ValueError, match=r"f_ms has 3 values but pp=4 x v=1 = 4 stages need 4"):
        predict_layout(c, pp=4, dp=2, schedule="1f1b", microbatches=4, allreduce_bytes_per_ms=1.0)
    with pytest.raises(ValueError, match=r"comm_ms has 4 values but pp=2 x v=2 = 4 stages need 3"):
        bad = LayoutCosts(f_ms=[1.0] * 4, b_ms=[1.0] * 4, w_ms=[0.0] * 4, comm_ms=[0.0] * 3 + [1.0],
                          grad_bytes=[1.0] * 4)
        predict_layout(bad, pp=2, v=2, dp=2, schedule="interleaved-1f1b", microbatches=4,
                       allreduce_bytes_per_ms=1.0)


def test_candidates_skip_what_does_not_divide() -> None:
    from bench.scale import Candidate, candidates, gbps_to_bytes_per_ms
    kept, skipped = candidates([4, 8], ranks=[32, 48, 1024], global_batch=1024, microbatch_size=4)
    assert kept == [Candidate(4, 8, 32), Candidate(8, 4, 64)]
    assert [s.split(":")[0] for s in skipped] == ["ranks=48 pp=4 dp=12", "ranks=1024 pp=4 dp=256",
                                                  "ranks=48 pp=8 dp=6", "ranks=1024 pp=8 dp=128"]
    assert "not a multiple of dp x microbatch size = 12 x 4 = 48" in skipped[0]
    assert "M=1 microbatches per replica < pp=4" in skipped[1]
    kept, skipped = candidates([4], dps=[2, 3], global_batch=64, microbatch_size=4)
    assert kept == [Candidate(4, 2, 8)] and len(skipped) == 1
    kept, skipped = candidates([16], ranks=[24], global_batch=64, microbatch_size=4)
    assert kept == [] and skipped == ["ranks=24 pp=16: 24 ranks are not a multiple of pp=16"]
    assert gbps_to_bytes_per_ms(200) == 2.5e7


def test_bench_scale_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """python -m bench scale on a tiny gpt with FLOP-counted costs (no processes): every pp planned once,
    a row per layout that divides, the others said."""
    from bench.__main__ import main
    argv = ["scale", "gpt", "--cost", "flops", "--model-arg", "d_model=32", "--model-arg", "vocab=64",
            "--model-arg", "seq_len=16", "--layers-per-stage", "1", "--pp", "2,4", "--ranks", "4,6,8",
            "--global-batch", "32", "--out", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    head = lines.index("| ranks | pp | dp | M | step ms | bubble | all-reduce ms | exposed ms | tokens/s |")
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[head + 2:] if line.startswith("| ")]
    assert [r[:4] for r in rows] == [["4", "2", "2", "4"], ["4", "4", "1", "8"], ["8", "2", "4", "2"],
                                     ["8", "4", "2", "4"]]
    assert rows[1][6:8] == ["0.00", "0.00"]  # dp=1: no all-reduce
    assert "skipped ranks=6 pp=2 dp=3: global batch 32 is not a multiple of dp x microbatch size" in out
    assert "skipped ranks=6 pp=4: 6 ranks are not a multiple of pp=4" in out
    result = json.loads((tmp_path / "scale.json").read_text())
    assert sorted(result["plans"]) == ["2", "4"] and result["plans"]["4"]["model_args"]["n_layer"] == 4
    for row, r in zip(result["layouts"], rows):
        assert f"{row['step_ms']:.2f}" == r[4]
        assert row["tokens_per_s"] == pytest.approx(32 * 16 / (row["step_ms"] / 1e3))
    assert (tmp_path / "scale.md").read_text().startswith("`python -m bench scale gpt --cost flops")
    # a saved plan gives the same table without planning; pp comes from it
    again = tmp_path / "again"
    assert main(["scale", "gpt", "--plan", str(tmp_path / "plan-pp4.json"), "--model-arg", "seq_len=16",
                 "--ranks", "4,6,8", "--global-batch", "32", "--out", str(again)]) == 0
    assert "pp=4: gpt (plan " in capsys.readouterr().out
    replay = json.loads((again / "scale.json").read_text())["layouts"]
    assert replay == [row for row in result["layouts"] if row["pp"] == 4]


def test_bench_scale_refuses_n_layer_twice(capsys: pytest.CaptureFixture[str]) -> None:
    from bench.scale import main
    assert main(["gpt", "--model-arg", "n_layer=2", "--layers-per-stage", "1", "--pp", "2"]) == 2
    assert "give one of them" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["gpt", "--pp", "2,x"])
    with pytest.raises(SystemExit):
        main(["gpt", "--bucket-mb", "0"])
