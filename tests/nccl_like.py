"""A transport with NCCL's semantics for CPU tests: no tags (every message tag 0, so gloo matches
the i-th send from a to b with the i-th receive b posts for a), and per pair one batch at a time:
a batch with peer p is posted only when every earlier operation with p has completed (NCCL runs
the operations of a pair in issue order on one stream). A program that would hang or mismatch
under NCCL hangs (the test's timeout) or fails here, where plain gloo would match by tag."""
from __future__ import annotations

from typing import Any, Sequence

import torch

from pipe.comm import TorchTransport, Work

__all__ = ["NcclLike"]


class NcclLike:
    def __init__(self) -> None:
        self.inner = TorchTransport()
        self.open: dict[int, list[Work]] = {}  # peer -> operations posted and not yet waited here

    def batch(self, ops: Sequence[tuple[str, torch.Tensor, int]]) -> list[Any]:
        for peer in dict.fromkeys(p for _, _, p in ops):
            for work in self.open.pop(peer, []):
                work.wait()
        works = self.inner.batch(ops)
        for (_, _, peer), work in zip(ops, works):
            self.open.setdefault(peer, []).append(work)
        return works
