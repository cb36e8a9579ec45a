"""Real text with no download: this Python's own standard library sources, as bytes (vocab 256)."""

from __future__ import annotations

import functools
import os
import sysconfig
from collections.abc import Iterator

import torch

__all__ = ["VAL_FRACTION", "VOCAB", "corpus", "stdlib_dir", "windows"]

VOCAB = 256  # one token per byte
VAL_FRACTION = 0.1  # the held-out tail of the corpus

# Directories skipped: installed packages (differ between machines), tests, caches.
_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)


def stdlib_dir() -> str:
    """The directory holding this interpreter's standard library sources."""
    return sysconfig.get_paths()["stdlib"]


@functools.lru_cache(maxsize=4)
def corpus(max_bytes: int = 4_000_000) -> torch.Tensor:
    """The first `max_bytes` bytes of the stdlib's .py files in sorted path order, (N,) uint8.

    Cached in-process; the same tensor is returned on every call, so do not modify it.
    """
    if max_bytes < 2:
        raise ValueError(f"corpus needs max_bytes >= 2 (max_bytes: {max_bytes})")
    root = stdlib_dir()
    chunks: list[bytes] = []
    total = 0
    for path in _source_files(root):
        with open(path, "rb") as f:
            chunk = f.read(max_bytes - total) + b"\n"
        chunks.append(chunk)
        total += len(chunk)
        if total >= max_bytes:
            break
    if not chunks:
        raise FileNotFoundError(
            f"no Python standard library sources (*.py) found under {root!r} "
            "(sysconfig.get_paths()['stdlib']); this interpreter ships without its .py "
            "sources, so use a full Python installation or a workload that does not need text"
        )
    data = b"".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)  # (N,)


def windows(
    data: torch.Tensor,
    batch_size: int,
    seq_len: int,
    step: int,
    *,
    split: str = "train",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of `data`, the same for the same `step`: inputs and next-byte targets.

    `split="train"` draws from the first 90% of `data`, `split="val"` from the rest.
    Returns `(x, y)`, both (B, T) int64, with `y[:, t] == x[:, t + 1]` inside a window.
    """
    part = _split(data, split)
    span = part.numel() - seq_len  # number of valid window starts
    if span < 1:
        raise ValueError(
            f"the {split!r} split has {part.numel()} bytes, too few for windows of "
            f"seq_len {seq_len} + 1; use a larger corpus(max_bytes=...) or a smaller seq_len"
        )
    gen = torch.Generator().manual_seed(2 * step + (split == "val"))
    starts = torch.randint(span, (batch_size,), generator=gen)  # (B,)
    offsets = starts[:, None] + torch.arange(seq_len + 1)  # (B, T + 1)
    tokens = part[offsets].long()  # (B, T + 1)
    return tokens[:, :-1], tokens[:, 1:]


def _split(data: torch.Tensor, split: str) -> torch.Tensor:
    n_train = int(data.numel() * (1 - VAL_FRACTION))
    if split == "train":
        return data[:n_train]
    if split == "val":
        return data[n_train:]
    raise ValueError(f"split must be 'train' or 'val' (split: {split!r})")


def _source_files(root: str) -> Iterator[str]:
    """The .py files under `root`, depth-first in sorted order, skipping `_SKIP_DIRS`."""
    for here, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
        yield from (os.path.join(here, name) for name in sorted(files) if name.endswith(".py"))
