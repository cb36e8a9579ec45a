"""Reliability: every bad input a clear error on every rank, lost ranks, checkpoints, NaN, soak."""
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from tests.mp import run_ranks

BAD = "tests/bad_models.py"
GPT = ["--model-arg", "n_layer=2", "--model-arg", "d_model=32", "--model-arg", "n_head=2",
       "--model-arg", "seq_len=16", "--model-arg", "vocab=64"]


def cli_body(rank: int, world: int, *, argv: list[str]) -> None:
    import sys
    from pipe.run import main
    sys.exit(main(argv + ["--cost", "flops", "--steps", "3", "--out", os.environ["FXPIPE_OUT"]]))


def _plan_for(tmp: Path, model: list[str], stages: int) -> str:
    import partition
    from partition.workload import parse_overrides
    w = partition.load(model[0], **parse_overrides(model[1:]))
    p = partition.plan(w.model, w.example_args, stages, cost="flops")
    return str(p.save(tmp / f"plan{stages}.json"))


CASES = {
    # name: (argv, words every rank's message must hold)
    "unresolvable MODEL": (["nosuch.module:factory"], ["nosuch.module:factory", "package.module:factory"]),
    "untraceable model": ([f"{BAD}:untraceable"], ["cannot trace", "symbolic_trace", "export", "Fix"]),
    "more stages than the graph gives": ([f"{BAD}:one_block", "--loss-outside"], ["2 stages", "at most 1"]),
    "batch not divisible": (["gpt", *GPT, "--batch-size", "7", "--microbatches", "2"],
                            ["7 samples", "not divisible into 2 microbatches"]),
    "infeasible memory budget": (["gpt", *GPT, "--memory-budget", "1KiB"],
                                 ["least budget", "Fix: give memory_budget >="]),
    "missing loss function": ([f"{BAD}:no_loss"], ["loss_fn must be a callable"]),
    "wrong input shape at run time": ([f"{BAD}:wrong_shape"], ["shape", "[", "plan"]),
    "plan for another model": (["mlp", "--plan", "@mlp-other"], ["fingerprint", "re-create"]),
    "plan for another stage count": (["gpt", *GPT, "--plan", "@gpt3"], ["3 stages", "world size 2"]),
    "NaN loss": ([f"{BAD}:nan_data"], ["nan", "step 1", "stage 0", "skip_nonfinite"]),
    "world size vs stages per rank": (["gpt", *GPT, "--schedule", "interleaved-1f1b", "--stages-per-rank", "2",
                                       "--microbatches", "3"], ["divisible", "M=3"]),
    "interleaved with one stage per rank": (["gpt", *GPT, "--schedule", "interleaved-1f1b", "--stages-per-rank", "1"],
                                            ["stages_per_rank=1", "stages_per_rank=2"]),
    # a wrong dtype and a missing input take this path too; tests/test_exact.py checks their messages
    "extra input": ([f"{BAD}:extra_input"], ["not planned for: kwargs['attention_mask']", "dropped", "re-plan"]),
    "non-scalar loss": ([f"{BAD}:non_scalar_loss"], ["must return a scalar", "shape [64]", ".mean()"]),
}
# errors raised while a step runs, on one rank: that rank names its own error (with its stage and
# microbatch), every other rank names that rank and the error; nobody reports a lost peer
RELAYED = {
    # name: (argv, ranks, the failing rank, words every rank's message must hold)
    "index out of range in the model": ([f"{BAD}:index_out_of_range"], 2, 0,
                                        ["IndexError", "index out of range", "rank 0, stage 0, microbatch 0"]),
    # rank 2 waits on rank 1, which waits on rank 0: the error travels, and every rank names rank 0
    "index out of range, 3 ranks": ([f"{BAD}:index_out_of_range"], 3, 0,
                                    ["IndexError", "rank 0, stage 0, microbatch 0"]),
    "forgotten target": ([f"{BAD}:forgotten_target"], 2, 1, ["target=None", "target=y", "rank 1, stage 1"]),
    "non-scalar loss outside the graph": ([f"{BAD}:non_scalar_loss", "--loss-outside"], 2, 1,
                                          ["must return a scalar", "rank 1, stage 1"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_fails_on_every_rank(case: str, tmp_path: Path) -> None:
    argv, words = CASES[case]
    argv = list(argv)
    if "@mlp-other" in argv:
        argv[argv.index("@mlp-other")] = _plan_for(tmp_path, ["mlp", "depth=3"], 2)
    if "@gpt3" in argv:
        argv[argv.index("@gpt3")] = _plan_for(tmp_path, ["gpt", *GPT[1::2]], 3)
    start = time.monotonic()
    exits = run_ranks("tests.test_reliability:cli_body", 2, timeout=30, raw=True, argv=argv,
                      env={"FXPIPE_OUT": str(tmp_path / "out")})
    assert time.monotonic() - start < 30
    for r, ex in enumerate(exits):
        assert ex.code not in (0, None), f"rank {r} exited {ex.code}:\n{ex.output[-3000:]}"
        err = [line for line in ex.output.splitlines() if line.startswith("error (rank")]
        assert err, f"rank {r} printed no error line:\n{ex.output[-3000:]}"
        for word in words:
            assert word in err[-1], f"rank {r}: {word!r} not in {err[-1]!r}"
        assert "Traceback" not in ex.output, ex.output[-3000:]


@pytest.mark.parametrize("case", list(RELAYED))
def test_an_error_in_a_step_is_its_ranks_own_and_named_on_every_rank(case: str, tmp_path: Path) -> None:
    argv, world, failing, words = RELAYED[case]
    start = time.monotonic()
    exits = run_ranks("tests.test_reliability:cli_body", world, timeout=30, raw=True, argv=list(argv),
                      env={"FXPIPE_OUT": str(tmp_path / "out")})
    assert len(exits) == world
    assert time.monotonic() - start < 30
    for r, ex in enumerate(exits):
        assert ex.code == 2, f"rank {r} exited {ex.code}:\n{ex.output[-3000:]}"
        err = [line for line in ex.output.splitlines() if line.startswith("error (rank")][-1]
        for word in words:
            assert word in err, f"rank {r}: {word!r} not in {err!r}"
        assert "lost" not in err and "PeerLost" not in ex.output, err
        if r != failing:
            assert f"because rank {failing}" in err, err


def kill_body(rank: int, world: int, freeze: bool = False) -> None:
    """The last rank dies (SIGKILL) or freezes (for longer than the timeout) in step 2."""
    import partition
    import pipe
    pipe.init(timeout_s=4.0 if freeze else 300.0)
    w = partition.load("gpt", n_layer=2, d_model=32, n_head=2, seq_len=16, vocab=64)
    pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=4, cost="flops")
    stage = pp.stages[pp.local[0]]
    calls = [0]
    forward = stage.forward

    def dying_forward(*args):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if rank == world - 1 and calls[0] == 6:  # step 2, second microbatch
            if freeze:
                time.sleep(11)  # the survivors time out (4 s) and name it before it ends
                os._exit(3)
            os.kill(os.getpid(), signal.SIGKILL)
        return forward(*args)
    stage.forward = dying_forward  # type: ignore[method-assign]
    for step in range(4):
        args, target = w.make_batch(16, step)
        pp.step(*args, target=target)


@pytest.mark.parametrize("world,freeze", [(2, False), (3, False), (3, True)], ids=["2-killed", "3-killed", "3-frozen"])
def test_lost_rank_ends_the_others_and_every_survivor_names_it(world: int, freeze: bool) -> None:
    """Rank world-1 dies or freezes; its neighbour's wait fails, and ranks further away, whose waits
    fail on a live neighbour, follow the reports (pipe.comm.follow_lost) to name the same rank."""
    start = time.monotonic()
    exits = run_ranks("tests.test_reliability:kill_body", world, timeout=60, raw=True, freeze=freeze)
    assert time.monotonic() - start < 45
    assert exits[-1].code in ((3, None) if freeze else (-signal.SIGKILL,))
    for r, ex in enumerate(exits[:-1]):
        assert ex.code not in (0, None), ex.output[-2000:]
        lines = [line for line in ex.output.splitlines() if "PeerLost: rank" in line]
        assert lines and f"rank {r} lost rank {world - 1} during step 1" in lines[-1], ex.output[-3000:]
        if r < world - 2:  # it waited on a live rank: the message says through whom
            assert f"through rank {r + 1}" in lines[-1], lines[-1]


def skip_body(rank: int, world: int) -> list[float]:
    import partition
    import pipe
    pipe.init()
    w = partition.load(f"{BAD}:nan_data")
    pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=2, cost="flops",
                       skip_nonfinite=True)
    opt = torch.optim.AdamW(list(pp.parameters()), lr=1e-2)
    losses = []
    for step in range(3):
        args, target = w.make_batch(w.microbatch_size * 2, step)
        before = [p.detach().clone() for p in pp.parameters()]
        losses.append(pp.step(*args, target=target))
        if step == 1:
            assert all(p.grad is None for p in pp.parameters())
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == 1:  # the skipped step changed nothing
            assert all(torch.equal(a, p) for a, p in zip(before, pp.parameters()))
    return losses


def test_skip_nonfinite_drops_the_step() -> None:
    losses = run_ranks("tests.test_reliability:skip_body", 2, timeout=60)[0]
    assert losses[1] != losses[1] and losses[0] == losses[0] and losses[2] == losses[2]


def soak_body(rank: int, world: int, *, steps: int) -> list[int]:
    import resource
    import partition
    import pipe
    pipe.init()
    w = partition.load("gpt", n_layer=2, d_model=32, n_head=2, seq_len=16, vocab=64)
    pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=4, cost="flops")
    opt = torch.optim.AdamW(list(pp.parameters()), lr=1e-3)
    rss = []
    for step in range(steps):
        args, target = w.make_batch(16, step)
        pp.step(*args, target=target)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 49:
            rss.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)  # KiB
    return rss


@pytest.mark.slow
def test_soak_500_steps_no_growth() -> None:
    for rss in run_ranks("tests.test_reliability:soak_body", 2, timeout=240, steps=500):
        # the peak resident size after warm-up may not grow by more than 2% over 450 steps
        assert rss[-1] <= rss[0] * 1.02, rss
