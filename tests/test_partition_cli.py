"""Tests for python -m partition: the table, the plan file, --json, and errors without tracebacks."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import partition
from partition.__main__ import main

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """`python -m partition ARGS` run from `cwd`, in this process (a fresh interpreter took 3-8 s to import torch
    for each): its exit code and what it printed, as subprocess.run gives them."""
    import contextlib
    import io
    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    os.chdir(cwd)
    sys.path.insert(0, str(cwd))  # (python -m puts the working folder first: path/file.py:factory resolves there)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(args))
    finally:
        os.chdir(here)
        sys.path.remove(str(cwd))
    return subprocess.CompletedProcess(["python", "-m", "partition", *args], code, out.getvalue(), err.getvalue())


def test_plans_a_bundled_workload_and_writes_the_plan(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    r = run("mlp", "--stages", "3", "--cost", "flops", "--model-arg", "depth=4", "--model-arg", "width=32",
            "--schedule", "gpipe", "--microbatches", "6", "--memory-budget", "1GiB", "--out", str(out))
    assert r.returncode == 0, r.stderr
    rows = [ln for ln in r.stdout.splitlines() if ln.strip()[:1].isdigit()]
    assert len(rows) == 3 and "bottleneck" in r.stdout and f"plan written to {out}" in r.stdout
    plan = partition.Plan.load(out)
    assert (plan.n_stages, plan.schedule, plan.microbatches, plan.memory_budget) == (3, "gpipe", 6, 2**30)
    assert [sp.in_flight for sp in plan.stages] == [6, 6, 6]
    w = partition.load("mlp", depth=4, width=32)  # the plan file serves another process's model
    assert plan.loss and len(partition.split(w.model, plan, w.example_args, loss_fn=w.loss_fn)) == 3
    outside = main(["mlp", "--stages", "3", "--cost", "flops", "--model-arg", "depth=4", "--model-arg", "width=32",
                    "--loss-outside", "--out", str(out)])
    assert outside == 0 and not partition.Plan.load(out).loss


def test_json_output_is_the_plan(tmp_path: Path) -> None:
    factory = tmp_path / "my_models.py"
    factory.write_text(textwrap.dedent("""
        import torch
        from partition.workload import Workload

        def two_layers(width: int = 8) -> Workload:
            model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, 2))
            x = torch.randn(4, width)
            return Workload(name="two", model=model, example_args=(x,), loss_fn=torch.nn.functional.mse_loss,
                            make_batch=lambda b, s: ((torch.randn(b, width),), torch.zeros(b, 2)),
                            microbatch_size=4)
    """))
    out = tmp_path / "p.json"
    r = run("my_models.py:two_layers", "--stages", "2", "--cost", "flops", "--json", "--out", str(out),
            cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    printed = partition.Plan.from_dict(json.loads(r.stdout))
    assert printed == partition.Plan.load(out)
    assert printed.model == "Sequential" and printed.n_stages == 2


def test_an_error_exits_2_with_one_paragraph_and_no_traceback() -> None:
    r = run("mlp", "--stages", "500", "--cost", "flops", "--model-arg", "depth=2")
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "use at most" in r.stderr and "Traceback" not in r.stderr and r.stdout == ""
    progress = [line for line in r.stderr.splitlines() if line.startswith("[plan] ")]
    assert progress[0].startswith("[plan] tracing") and any("costing" in line for line in progress)
    error = [line for line in r.stderr.splitlines() if not line.startswith("[plan] ")]
    assert len(error) == 1 and error[0].startswith("python -m partition: error:")


@pytest.mark.parametrize("args, needle", [
    (["nosuch", "--stages", "2"], "is not a bundled name"),
    (["no_module_here:f", "--stages", "2"], "importing module 'no_module_here' failed"),
    (["mlp", "--stages", "2", "--cost", "flops", "--memory-budget", "1KiB", "--model-arg", "depth=2"],
     "the least budget any split fits"),
    (["mlp", "--stages", "0"], "argument --stages: must be a whole number >= 1, got '0'"),
    (["mlp", "--stages", "2", "--microbatches", "0"], "argument --microbatches: must be a whole number >= 1"),
    (["mlp", "--stages", "2", "--stages-per-rank", "0"], "argument --stages-per-rank: must be a whole number >= 1"),
    (["mlp", "--schedule", "auto", "--ranks", "2", "--batch-size", "0"], "argument --batch-size: must be a whole"),
    (["mlp", "--stages", "2", "--memory-budget", "lots"], "is not a size"),
    (["mlp", "--stages", "2", "--memory-budget", "0"], "must be positive"),
    (["mlp", "--stages", "2", "--model-arg", "depth"], "key=value"),
    (["mlp", "--stages", "2", "--model-arg", "colour=red"], "unexpected keyword argument"),
    (["mlp"], "--stages N is required"),
    (["mlp", "--schedule", "auto"], "pass --ranks R"),
    (["mlp", "--schedule", "auto", "--ranks", "2", "--stages", "4"], "but --stages fixes one"),
    (["mlp", "--schedule", "auto", "--ranks", "2", "--batch-size", "1"], "batch_size=1"),
    (["mlp", "--schedule", "auto", "--ranks", "2", "--calibration", "/no/such.json"], "python -m bench calibrate"),
])
def test_usage_errors_print_one_paragraph_and_return_2(args: list[str], needle: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main(args) == 2
    err = "\n".join(line for line in capsys.readouterr().err.splitlines() if not line.startswith("[plan] "))
    assert needle in err and err.startswith("python -m partition: error:")
    assert err.strip().count("\n") == 0


def test_interleaved_plans_count_the_schedules_microbatches_in_flight(capsys: pytest.CaptureFixture[str]) -> None:
    from pipe.schedules import in_flight_limit
    assert main(["gpt", "--stages", "4", "--schedule", "interleaved-1f1b", "--microbatches", "4", "--cost", "flops",
                 "--model-arg", "n_layer=4", "--model-arg", "d_model=32", "--model-arg", "seq_len=16",
                 "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["schedule"] == "interleaved-1f1b" and got["stages_per_rank"] == 2
    assert [s["in_flight"] for s in got["stages"]] == [in_flight_limit("interleaved-1f1b", 4, 4, s, 2)
                                                      for s in range(4)]
    assert main(["gpt", "--stages", "3", "--schedule", "interleaved-1f1b"]) == 2
    assert "not a multiple of --stages-per-rank 2" in capsys.readouterr().err


def test_bench_help_lists_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    for sub, words in (("schedules", ["--loss-outside", "--schedules", "interleaved-1f1b", "--microbatches", "model",
                                      "--ranks"]),
                       ("vs-torch", ["--rounds", "--model-arg", "--ranks", "model"])):
        from bench.__main__ import main as bench_main
        with pytest.raises(SystemExit) as e:  # (in this process: a fresh interpreter took seconds to import torch)
            bench_main([sub, "--help"])
        printed = capsys.readouterr().out
        assert e.value.code == 0, printed
        for word in words:
            assert word in printed, (sub, word, printed)


@pytest.mark.parametrize("argv,words", [
    (["schedules", "mlp", "--microbatches", "0"], "argument --microbatches: must be comma-separated whole numbers"),
    (["schedules", "mlp", "--ranks", "0"], "argument --ranks: must be a whole number >= 1, got '0'"),
    (["auto", "mlp", "--batch-size", "0"], "argument --batch-size: must be a whole number >= 1, got '0'"),
    (["partition", "mlp", "--stages", "0"], "argument --stages: must be comma-separated whole numbers >= 1"),
    (["schedules", "mlp", "--microbatches", "3", "--schedules", "interleaved-1f1b"],
     "nothing to measure: interleaved-1f1b M=3 needs M divisible by 2"),
    (["vs-torch", "gpt", "--rounds", "x"], "argument --rounds: must be a whole number >= 1, got 'x'"),
    # found in review: each launched its ranks first (~30 s), then a traceback on every rank
    (["schedules", "mlp", "--schedules", "1f1b,nosuch"], "--schedules names nosuch, which fxpipe does not have"),
    (["schedules", "mlp", "--calibration", "/nonexistent.json"], "--calibration /nonexistent.json: no calibration at"),
    (["schedules", "mlp", "--ranks", "3", "--data-parallel", "2"], "--ranks 3 is not a multiple of --data-parallel 2"),
    # found by review of the bench commands (session 36): each failed on every rank after the launch, as
    # tracebacks (an --out under a file only after the whole run, its measurements lost)
    (["schedules", "nosuch.module:factory"], "workload 'nosuch.module:factory': importing module 'nosuch.module'"),
    (["vs-torch", "nosuch"], "workload 'nosuch' is not a bundled name"),
    (["auto", "mlp", "--schedules", "1f1b,foo"], "--schedules names foo, which fxpipe does not have"),
    (["vs-torch", "gpt", "--torch-schedules", "foo"], "--torch-schedules names foo; torch's are gpipe"),
    (["data-parallel", "mlp", "--ranks", "3", "--data-parallel", "2"], "--ranks 3 is not a multiple of --data-parall"),
    (["calibrate", "gpt", "--microbatches", "abc"], "python -m bench calibrate: error: argument --microbatches"),
    (["schedules", "mlp", "--out", "@file/sub"], "--out @file/sub cannot be a folder: @file is a file"),
    (["calibrate", "mlp", "--out", "@file/cal.json"], "--out @file cannot be a folder: @file is a file"),
    (["calibrate", "mlp", "--out", "@dir"], "--out @dir is a folder; give a file's path"),
    (["schedules", "mlp", "--calibrate", "@dir"], "--calibrate @dir is a folder; give a file's path"),
    (["schedules", "mlp", "--calibrate", "@file/cal.json"], "--calibrate @file cannot be a folder: @file is a file"),
    (["auto", "mlp", "--calibration", "@flops"], "costed by 'flops' and these are costed by 'measured'"),
    (["schedules", "mlp", "--calibration", "@partial"], "this calibration is damaged: it lacks f, b, b_split, w")])
def test_bench_refuses_a_bad_count_before_launching(argv: list[str], words: str, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Found by review: `bench schedules --microbatches 0` launched two ranks and ended in their tracebacks,
    `--ranks 0` in torchrun's bare AssertionError, `bench auto --batch-size 0` ran 70 s on another batch, and
    `bench partition --stages 0` ended in a traceback, and a grid every schedule skipped measured nothing and exited 0:
    each is now argparse's usage error, before anything runs."""
    from bench.__main__ import main as bench_main
    from pipe.calibration import Calibration
    files = {"@file": tmp_path / "file", "@dir": tmp_path, "@flops": tmp_path / "flops.json",
             "@partial": tmp_path / "partial.json"}
    files["@file"].write_text("")
    Calibration(cost="flops").save(files["@flops"])
    files["@partial"].write_text('{"version": %d}' % Calibration().version)

    def placed(x: str) -> str:
        for k, v in files.items():
            x = x.replace(k, str(v))
        return x
    with pytest.raises(SystemExit) as e:
        bench_main([placed(x) for x in argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and placed(words) in err, err[-2000:]


def test_bench_takes_the_zeros_its_options_mean() -> None:
    """--warmup 0 (no warm-up) and bench auto's --finalists 0 (no final round, as its help says) stay accepted
    (found by review: --finalists was refused once counts were checked)."""
    from bench import auto, schedules
    assert auto.parser().parse_args(["gpt", "--finalists", "0", "--warmup", "0"]).finalists == 0
    assert schedules.parser().parse_args(["gpt", "--warmup", "0"]).warmup == 0


def test_auto_ranks_every_candidate_and_keeps_the_fastest_plan(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    tiny = ["--model-arg", "n_layer=4", "--model-arg", "d_model=32", "--model-arg", "seq_len=16"]
    assert main(["gpt", "--schedule", "auto", "--ranks", "2", "--batch-size", "8", "--cost", "flops", *tiny,
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    chosen = next(ln.split() for ln in text.splitlines() if ln.endswith("chosen"))
    plan = partition.Plan.load(out)
    assert (plan.schedule, plan.microbatches, plan.stages_per_rank) == (chosen[1], int(chosen[2]), int(chosen[3]))
    assert plan.n_stages == 2 * plan.stages_per_rank and plan.inputs[0].shape[0] == 8 // plan.microbatches
    assert any(n.startswith(f"schedule='auto' chose {chosen[1]} M={chosen[2]}") for n in plan.notes)
    refused = [ln.split() for ln in text.splitlines() if ln.startswith("-")]
    assert ["-", "dualpipev", "2", "2"] == refused[0][:4] and "needs at least two microbatches per rank" in text
    assert main(["gpt", "--schedule", "auto", "--ranks", "2", "--batch-size", "8", "--cost", "flops", *tiny,
                 "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    times = [c["step_ms"] for c in got["candidates"] if not c["refused"]]
    assert times == sorted(times) and len(got["candidates"]) == 27  # 9 schedules x M in 2, 4, 8


def test_auto_under_a_budget_weighs_recomputation_as_the_pipeline_does(capsys: pytest.CaptureFixture[str]) -> None:
    tiny = ["--model-arg", "n_layer=4", "--model-arg", "d_model=32", "--model-arg", "seq_len=16"]
    assert main(["gpt", "--schedule", "auto", "--ranks", "2", "--batch-size", "8", "--cost", "flops", *tiny,
                 "--memory-budget", "700KiB", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    run = [c for c in got["candidates"] if not c["refused"]]
    # each candidate with and without recomputation, each with its stages' memory plans within the budget
    assert {c["recompute"] for c in got["candidates"]} == {"none", "auto"}
    assert all(c["memory"] and c["peak_bytes"] <= 700 * 1024 for c in run)
    assert any(c["recompute"] == "auto" and any(x != "none" for x in c["memory"].split("|")) for c in run)
    best = run[0]
    assert any(n.startswith(f"schedule='auto' chose {best['schedule']} M={best['microbatches']}")
               and f"memory plan per stage: {best['memory']}" in n for n in got["plan"]["notes"])
    assert [s["memory"] for s in got["plan"]["stages"]] == best["memory"].split("|")
    assert main(["gpt", "--schedule", "auto", "--ranks", "2", "--batch-size", "8", "--cost", "flops", *tiny,
                 "--memory-budget", "700KiB", "--recompute", "none", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)  # asked not to: no recomputation weighed
    assert {c["recompute"] for c in plain["candidates"]} == {""}
    # one plan (no auto): with --recompute auto its stages get their memory plans within the budget
    assert main(["gpt", "--stages", "2", "--cost", "flops", *tiny, "--memory-budget", "1100KiB", "--recompute", "auto",
                 "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert all(s["memory"] and s["memory_peak"] <= 1100 * 1024 for s in one["stages"])
    assert main(["gpt", "--stages", "2", "--cost", "flops", *tiny, "--memory-budget", "700KiB", "--recompute",
                 "auto"]) == 2
    err = capsys.readouterr().err
    assert "memory/ cannot fit it" in err and "Fix: give memory_budget >=" in err


def test_a_file_to_write_that_cannot_be_is_refused_first(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Found by review: `python -m partition --out` naming a folder (or a path in a missing one) failed after
    planning with a bare traceback and left a .tmp file; so did `python -m pipe.checkpoint export/plan --to`.
    Refused before anything runs, naming the path."""
    from pipe.checkpoint import main as checkpoint_main
    (tmp_path / "adir").mkdir()
    for argv, run in ((["gpt", "--stages", "2", "--out", str(tmp_path / "adir")], main),
                      (["export", str(tmp_path), "--to", str(tmp_path / "adir")], checkpoint_main),
                      (["plan", str(tmp_path), "--to", str(tmp_path / "nope" / "plan.json")], checkpoint_main)):
        try:
            code = run(argv)  # (python -m partition's main returns its usage error's exit code)
        except SystemExit as e:
            code = e.code
        assert code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert ("is a folder; give the path of a file" in err if "adir" in argv[-1] else
                f"{tmp_path / 'nope'}, does not exist; give a path in an existing folder" in err), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir"]


def test_a_budget_with_several_stages_per_rank_is_noted_per_stage(capsys: pytest.CaptureFixture[str]) -> None:
    """Found by review: pipe.Pipeline's plan noted that the budget is per stage with two stages per rank, the
    command line's did not."""
    assert main(["gpt", "--model-arg", "n_layer=4", "--stages", "4", "--schedule", "interleaved-1f1b",
                 "--stages-per-rank", "2", "--microbatches", "4", "--cost", "flops", "--memory-budget", "1GiB",
                 "--json"]) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert any(n.startswith("memory_budget is per stage, and each rank holds 2 stages") for n in notes), notes


def test_options_only_auto_reads_and_schedules_the_pipeline_refuses_are_refused(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Found by review: --ranks, --batch-size and --calibration (a file never opened) were ignored without
    --schedule auto, and 1f1b with --stages-per-rank 2 was planned, a plan pipe.run then refused."""
    from partition.__main__ import main
    assert main(["gpt", "--stages", "2", "--cost", "flops", "--ranks", "4", "--calibration", "/nonexistent.json"]) == 2
    err = capsys.readouterr().err
    assert "--ranks and --calibration are read only with --schedule auto, and --schedule 1f1b plans --stages 2 as " \
           "given" in err, err
    assert main(["gpt", "--stages", "4", "--schedule", "1f1b", "--stages-per-rank", "2", "--cost", "flops"]) == 2
    err = capsys.readouterr().err
    assert "1f1b runs one stage per rank (got stages_per_rank=2)" in err, err
