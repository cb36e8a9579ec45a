"""The main job (scripts/demo): python -m bench.demo [--steps 150] — partition the bundled GPT on its own
and train it on real text (the Python standard library's sources) over 2 processes with 1F1B."""
from __future__ import annotations

from partition.args import whole
import argparse
import socket
import subprocess
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.demo", description=__doc__)
    p.add_argument("--steps", type=whole(1), default=150)
    p.add_argument("--ranks", type=whole(1), default=2)
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--out", default="out/demo")
    args = p.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.ranks),
           "--master-port", str(port), "-m", "pipe.run", "gpt_text", "--schedule", args.schedule,
           "--microbatches", "8", "--steps", str(args.steps), "--cost", "measured", "--out", args.out, "--overwrite"]
    print("$ " + " ".join(cmd), flush=True)
    return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main())
