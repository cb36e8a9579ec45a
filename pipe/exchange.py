"""One step's messages on one rank, moved where the lowered program says (pipe.lower).

A compute action leaves what it sends in an outbox and takes what it receives from an inbox;
a batch of the program moves them: its sends and receives go out together (one
batch_isend_irecv, tag 0: matched per pair in issue order, as NCCL does). Neighbouring stages
on one rank hand over in memory. With dynamic shapes each activation's shape travels first
as a device tensor: a batch then moves every shape, waits for the incoming ones, and moves
the data (gradients need none: they have the shapes of the outputs this rank sent).
Sends stay alive until complete: activations until their grads come back (which the peer
computes from them, so they arrived); grads until a receive from the same peer posted in a
later batch is waited on (a pair's batches complete in issue order, as on NCCL); shapes until
the step ends.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from partition.plan import Plan, PlanError
from pipe import comm
from pipe.lower import Batch, peer_of

__all__ = ["Exchange", "MAX_DIMS"]

MAX_DIMS = 8
Key = tuple[str, int, int]  # ("F" activations | "B" grads, stage that reads them, mb)


class Exchange:
    """This rank's messages of one step. Stage s reads the activations of boundary s (recv of
    plan.stages[s]) and the grads of its outputs (the recv of stage s+1, floating ones only)."""

    def __init__(self, transport: comm.Transport, plan: Plan, place: Sequence[int], rank: int,
                 device: torch.device, dynamic: bool) -> None:
        self.transport, self.plan, self.place, self.rank = transport, plan, list(place), rank
        self.device, self.dynamic = device, dynamic
        self.outbox: dict[tuple[str, int, int], list[torch.Tensor]] = {}  # (SEND kind, stage, mb)
        self.inbox: dict[Key, list[tuple[torch.Tensor, Any]]] = {}       # tensor, its receive (None: here)
        self.shapes: dict[tuple[int, int], list[list[int]]] = {}         # (stage, mb) -> sent shapes
        self.sends: list[tuple[torch.Tensor, comm.Work]] = []           # alive until complete
        self.sent_outputs: dict[tuple[int, int], list[tuple[torch.Tensor, comm.Work]]] = {}  # (stage, mb)
        self.sent_grads: dict[int, list[tuple[int, torch.Tensor, comm.Work]]] = {}  # peer -> (batch, ...)
        self.batches = 0
        self.posted_in: dict[Key, int] = {}  # a receive -> the batch that posted it
        self.peer: int | None = None  # the rank last waited on, named when a wait fails

    # ----- what compute actions leave and take -----
    def send_activations(self, s: int, mb: int, outs: Sequence[torch.Tensor]) -> None:
        values = self.plan.stages[s + 1].recv
        if not self.dynamic:
            for o, v in zip(outs, values):
                if list(o.shape) != v.shape:
                    raise PlanError(f"stage {s} produced {v.name} of shape {list(o.shape)} but the plan says "
                                    f"{v.shape}; keep inputs at the planned shapes or pass dynamic_shapes=True")
        elif any(o.dim() > MAX_DIMS for o in outs):
            raise PlanError(f"stage {s} sends a value with more than {MAX_DIMS} dims; dynamic shapes allow at most "
                            f"{MAX_DIMS}")
        self.shapes[(s, mb)] = [list(o.shape) for o in outs]
        if self.place[s + 1] == self.rank:
            self.inbox[("F", s + 1, mb)] = [(o.detach().clone(), None) for o in outs]
        else:
            self.outbox[("SEND_F", s, mb)] = [comm.to_layout(o, v.shape, v.stride) for o, v in zip(outs, values)]

    def send_grads(self, s: int, mb: int, grads: Sequence[torch.Tensor | None]) -> None:
        """Grads of stage s's received inputs, back to stage s-1 (floating inputs only)."""
        kept = [g.detach() for g in grads if g is not None]
        if self.place[s - 1] == self.rank:
            self.inbox[("B", s - 1, mb)] = [(g.clone(), None) for g in kept]
        else:
            self.outbox[("SEND_B", s, mb)] = [g.contiguous().view(-1) for g in kept]

    def recv_activations(self, s: int, mb: int) -> list[torch.Tensor]:
        return self._take(("F", s, mb), self.place[s - 1])

    def recv_grads(self, s: int, mb: int, outs: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        """Grads of stage s's outputs for microbatch mb (None for the non-floating ones)."""
        got = iter(self._take(("B", s, mb), self.place[s + 1]))
        for _, work in self.sent_outputs.pop((s, mb), []):  # the grads came back: the outputs arrived
            work.wait()
        return [next(got) if o.is_floating_point() else None for o in outs]

    def _take(self, key: Key, src: int) -> list[torch.Tensor]:
        if key not in self.inbox:
            raise AssertionError(f"no message {key} in the program before it is read")
        self.peer = src
        out = []
        for t, work in self.inbox.pop(key):
            if work is not None:
                work.wait()
            out.append(t)
        j = self.posted_in.pop(key, None)
        if j is not None and self.sent_grads.get(src):  # a pair's batches complete in issue order
            done = [x for x in self.sent_grads[src] if x[0] < j]
            self.sent_grads[src] = [x for x in self.sent_grads[src] if x[0] >= j]
            for _, _, work in done:
                work.wait()
        return out

    # ----- what a batch of the program moves -----
    def issue(self, batch: Batch) -> None:
        """Post the batch's sends and receives as one group (shapes first, with dynamic shapes)."""
        shapes = self._exchange_shapes(batch) if self.dynamic else {}
        ops: list[tuple[str, torch.Tensor, int]] = []
        posted: list[tuple[Key, list[tuple[torch.Tensor, int]]]] = []  # buffers and their op index
        outputs: dict[int, tuple[int, int]] = {}  # op index of an activation sent -> (stage, mb)
        n = self.batches
        self.batches += 1
        for a in batch:
            peer = peer_of(a, self.place)
            if a.kind in ("SEND_F", "SEND_B"):
                if a.kind == "SEND_F":
                    outputs.update((len(ops) + i, (a.stage, a.mb))
                                   for i in range(len(self.outbox[(a.kind, a.stage, a.mb)])))
                ops += [("send", x, peer) for x in self.outbox.pop((a.kind, a.stage, a.mb))]
            elif a.kind == "RECV_F":
                bufs = []
                for i, v in enumerate(self.plan.stages[a.stage].recv):
                    shape = shapes[(a.stage, a.mb)][i] if self.dynamic else v.shape
                    buf, wire = comm.alloc_layout(shape, getattr(torch, v.dtype), self.device,
                                                  ref_shape=v.shape, ref_stride=v.stride)
                    bufs.append((buf, len(ops)))
                    ops.append(("recv", wire, peer))
                posted.append((("F", a.stage, a.mb), bufs))
            else:  # RECV_B: the grads of what this rank sent, in its shapes
                bufs = []
                for shape, v in zip(self.shapes[(a.stage, a.mb)], self.plan.stages[a.stage + 1].recv):
                    if getattr(torch, v.dtype).is_floating_point:
                        buf = torch.empty(shape, dtype=getattr(torch, v.dtype), device=self.device)
                        bufs.append((buf, len(ops)))
                        ops.append(("recv", buf.view(-1), peer))
                posted.append((("B", a.stage, a.mb), bufs))
        works = self._post(ops)
        for i, ((kind, x, peer), w) in enumerate(zip(ops, works)):
            if i in outputs:  # alive until the grads of (stage, mb) come back (recv_grads)
                self.sent_outputs.setdefault(outputs[i], []).append((x, w))
            elif kind == "send":  # grads: until a later batch's receive from that peer is waited on
                self.sent_grads.setdefault(peer, []).append((n, x, w))
        for key, bufs in posted:
            self.inbox[key] = [(buf, works[i]) for buf, i in bufs]
            self.posted_in[key] = n

    def _exchange_shapes(self, batch: Batch) -> dict[tuple[int, int], list[list[int]]]:
        """Dynamic shapes: every activation's shape, as device tensors, sent and received for the
        batch first (its own group), and the incoming ones read."""
        ops: list[tuple[str, torch.Tensor, int]] = []
        wanted: list[tuple[tuple[int, int], int]] = []  # (stage, mb) and the op index of its head
        for a in batch:
            peer = peer_of(a, self.place)
            if a.kind == "SEND_F":
                for shape in self.shapes[(a.stage, a.mb)]:
                    head = torch.zeros(MAX_DIMS + 1, dtype=torch.int64)
                    head[0] = len(shape)
                    head[1:1 + len(shape)] = torch.tensor(shape, dtype=torch.int64)
                    ops.append(("send", head.to(self.device), peer))
            elif a.kind == "RECV_F":
                for _ in self.plan.stages[a.stage].recv:
                    wanted.append(((a.stage, a.mb), len(ops)))
                    ops.append(("recv", torch.empty(MAX_DIMS + 1, dtype=torch.int64, device=self.device), peer))
        works = self._post(ops)
        self.sends += [(x, w) for (kind, x, _), w in zip(ops, works) if kind == "send"]
        for _, i in wanted:
            works[i].wait()
        shapes: dict[tuple[int, int], list[list[int]]] = {}
        for key, i in wanted:
            dims = [int(d) for d in ops[i][1].tolist()]  # (MAX_DIMS + 1,): rank, then the sizes
            shapes.setdefault(key, []).append(dims[1:1 + dims[0]])
        return shapes

    def _post(self, ops: list[tuple[str, torch.Tensor, int]]) -> list[comm.Work]:
        if not ops:
            return []
        self.peer = ops[0][2]
        return self.transport.batch(ops)

    def finish(self) -> None:
        for _, work in self.sends + [x for held in self.sent_outputs.values() for x in held]:
            work.wait()
        for _, _, work in [x for held in self.sent_grads.values() for x in held]:
            work.wait()
        self.sends.clear()
        self.sent_outputs.clear()
        self.sent_grads.clear()
        self.posted_in.clear()
        self.batches = 0
