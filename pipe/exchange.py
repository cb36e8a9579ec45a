"""One step's messages on one rank, moved where the lowered program says (pipe.lower).

A compute action leaves what it sends in an outbox and takes what it receives from an inbox;
a batch of the program moves them: its sends and receives go out together (one
batch_isend_irecv, tag 0: matched per pair in issue order, as NCCL does). Neighbouring stages
on one rank hand over in memory. With dynamic shapes each activation's shape and dtype travel
first as a device tensor: a batch then moves every header, waits for the incoming ones, and moves
the data (gradients need none: they have the shapes and dtypes of the outputs this rank sent).
So does a step that learns the dtypes under an autocast the plan was not traced in (`learn`);
later steps under it receive into buffers of the dtypes learned (`dtypes`).
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

__all__ = ["Exchange", "MAX_DIMS", "DTYPES"]

MAX_DIMS = 8
# the dtypes a header can name (its last entry: the index here)
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128, torch.float8_e4m3fn,
          torch.float8_e5m2)
Key = tuple[str, int, int]  # ("F" activations | "B" grads, stage that reads them, mb)


class Exchange:
    """This rank's messages of one step. Stage s reads the activations of boundary s (recv of
    plan.stages[s]) and the grads of its outputs (the recv of stage s+1, floating ones only)."""

    def __init__(self, transport: comm.Transport, plan: Plan, place: Sequence[int], rank: int,
                 device: torch.device, dynamic: bool, dtypes: dict[tuple[int, int], torch.dtype] | None = None,
                 learn: bool = False) -> None:
        self.transport, self.plan, self.place, self.rank = transport, plan, list(place), rank
        self.device, self.dynamic = device, dynamic
        self.dtypes = dtypes or {}  # (stage, i) -> the dtype of stage's i-th received value, where not the plan's
        self.headers = dynamic or learn  # shapes and dtypes travel ahead of the data
        self.learned: dict[tuple[int, int], torch.dtype] = {}  # what the headers said or sent, (stage, i) -> dtype
        self.sent_dtypes: dict[tuple[int, int], list[torch.dtype]] = {}  # (stage, mb) -> sent dtypes
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
    def dtype(self, s: int, i: int) -> torch.dtype:
        """The dtype stage s receives its i-th value in: the plan's, unless learned otherwise."""
        return self.dtypes.get((s, i)) or getattr(torch, self.plan.stages[s].recv[i].dtype)

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
        if self.headers:
            odd = [o.dtype for o in outs if o.dtype not in DTYPES]
            if odd:
                raise PlanError(f"stage {s} sends a value of dtype {odd[0]}, which fxpipe's message headers cannot "
                                f"name (they name {', '.join(str(d) for d in DTYPES)}); cast it inside the model")
            self.learned.update(((s + 1, i), o.dtype) for i, o in enumerate(outs))  # what the sender expects next
        elif self.place[s + 1] != self.rank:  # received into buffers of the dtypes expected
            for i, (o, v) in enumerate(zip(outs, values)):
                if o.dtype != self.dtype(s + 1, i):
                    raise PlanError(f"stage {s} produced {v.name} as {o.dtype} but stage {s + 1} expects "
                                    f"{self.dtype(s + 1, i)} (the plan's dtype, or the one learned under this "
                                    "autocast); a value's dtype may change only with the autocast state (learned "
                                    "at its first step), so keep the model's dtypes fixed between steps")
        self.shapes[(s, mb)] = [list(o.shape) for o in outs]
        self.sent_dtypes[(s, mb)] = [o.dtype for o in outs]
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
        shapes = self._exchange_headers(batch) if self.headers else {}
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
                    shape, dtype = shapes[(a.stage, a.mb)][i] if self.headers else (v.shape, self.dtype(a.stage, i))
                    buf, wire = comm.alloc_layout(shape, dtype, self.device, ref_shape=v.shape, ref_stride=v.stride)
                    bufs.append((buf, len(ops)))
                    ops.append(("recv", wire, peer))
                posted.append((("F", a.stage, a.mb), bufs))
            else:  # RECV_B: the grads of what this rank sent, in its shapes and dtypes
                bufs = []
                for shape, dtype in zip(self.shapes[(a.stage, a.mb)], self.sent_dtypes[(a.stage, a.mb)]):
                    if dtype.is_floating_point:
                        buf = torch.empty(shape, dtype=dtype, device=self.device)
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

    def _exchange_headers(self, batch: Batch) -> dict[tuple[int, int], list[tuple[list[int], torch.dtype]]]:
        """Every activation's shape and dtype, as device tensors, sent and received for the batch first (its
        own group), and the incoming ones read."""
        ops: list[tuple[str, torch.Tensor, int]] = []
        wanted: list[tuple[tuple[int, int], int]] = []  # (stage, mb) and the op index of its head
        for a in batch:
            peer = peer_of(a, self.place)
            if a.kind == "SEND_F":
                for shape, dtype in zip(self.shapes[(a.stage, a.mb)], self.sent_dtypes[(a.stage, a.mb)]):
                    head = torch.zeros(MAX_DIMS + 2, dtype=torch.int64)
                    head[0] = len(shape)
                    head[1:1 + len(shape)] = torch.tensor(shape, dtype=torch.int64)
                    head[-1] = DTYPES.index(dtype)
                    ops.append(("send", head.to(self.device), peer))
            elif a.kind == "RECV_F":
                for _ in self.plan.stages[a.stage].recv:
                    wanted.append(((a.stage, a.mb), len(ops)))
                    ops.append(("recv", torch.empty(MAX_DIMS + 2, dtype=torch.int64, device=self.device), peer))
        works = self._post(ops)
        self.sends += [(x, w) for (kind, x, _), w in zip(ops, works) if kind == "send"]
        for _, i in wanted:
            works[i].wait()
        got: dict[tuple[int, int], list[tuple[list[int], torch.dtype]]] = {}
        for key, i in wanted:
            h = [int(d) for d in ops[i][1].tolist()]  # (MAX_DIMS + 2,): rank, the sizes, the dtype
            mine = got.setdefault(key, [])
            self.learned[(key[0], len(mine))] = DTYPES[h[-1]]
            mine.append((h[1:1 + h[0]], DTYPES[h[-1]]))
        return got

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
