"""python -m pipe.run under torchrun and mpiexec: plan, per-step lines, trace, PNG and bubble summary."""
import json
import sys
from pathlib import Path

import pytest

from tests.mp import free_port, run_command

BIN = Path(sys.executable).parent
TINY = ["gpt", "--model-arg", "n_layer=2", "--model-arg", "d_model=32", "--model-arg", "n_head=2",
        "--model-arg", "seq_len=16", "--model-arg", "vocab=64", "--steps", "4", "--microbatches", "4",
        "--cost", "flops"]


@pytest.mark.parametrize("launcher", ["torchrun", "mpiexec"])
def test_run_command(launcher: str, tmp_path: Path) -> None:
    if launcher == "torchrun":
        cmd = [str(BIN / "torchrun"), "--nproc-per-node", "2", "--master-port", str(free_port()), "-m", "pipe.run"]
    else:
        cmd = [str(BIN / "mpiexec"), "-n", "2", sys.executable, "-m", "pipe.run"]
    out = run_command(cmd + TINY + ["--out", str(tmp_path)], timeout=120).output
    assert "bottleneck" in out and "stage" in out  # the plan table
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(steps) == 4 and all("tok/s" in s and "loss" in s for s in steps)
    assert "bubble: measured" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["launcher"] == ("torchrun" if launcher == "torchrun" else "mpi")
    assert 0 <= summary["measured_bubble"] < 1 and 0 <= summary["predicted_bubble"] < 1
    trace = json.loads((tmp_path / "trace.json").read_text())
    names = {e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"}
    assert {"0F0", "1F0", "0B3", "1B3"} <= names
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
