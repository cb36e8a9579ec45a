"""One step's messages on one rank: receives posted ahead, asynchronous sends, optional shapes first."""
from __future__ import annotations

from typing import Sequence

import torch

from partition.plan import Plan, PlanError, Value
from pipe import comm

__all__ = ["Exchange", "MAX_DIMS"]

MAX_DIMS = 8
ACT, GRAD, SHAPE = 0, 1, 2


class _Incoming:
    """A posted receive; with dynamic shapes, the shape message comes first and the data after it."""

    def __init__(self, ex: "Exchange", value: Value, src: int, tag: int, data_tag: int) -> None:
        self.value, self.src, self.data_tag, self.ex = value, src, data_tag, ex
        dtype = getattr(torch, value.dtype)
        if ex.dynamic:
            self.tensor = torch.empty(MAX_DIMS + 1, dtype=torch.int64)
            self.work = ex.transport.irecv(self.tensor, src, tag)
        else:
            self.tensor, wire = comm.alloc_layout(value.shape, dtype, ex.device, ref_stride=value.stride)
            self.work = ex.transport.irecv(wire, src, tag)

    def get(self) -> torch.Tensor:
        self.ex.peer = self.src
        self.work.wait()
        if not self.ex.dynamic:
            return self.tensor
        n = int(self.tensor[0])
        shape = [int(d) for d in self.tensor[1:1 + n]]
        t, wire = comm.alloc_layout(shape, getattr(torch, self.value.dtype), self.ex.device,
                                    ref_shape=self.value.shape, ref_stride=self.value.stride)
        self.ex.transport.irecv(wire, self.src, self.data_tag).wait()
        return t


class Exchange:
    """Messages between neighbouring stages; tags keep (boundary, kind, mb, value) apart.

    Activations cross boundary s from stage s-1 to stage s; their grads cross back. Receives
    are posted `window` microbatches ahead, so transfers overlap compute while buffers stay few;
    sends are kept only until they complete.
    Shapes come from the plan; with `dynamic=True` each activation is preceded by its shape.
    """

    def __init__(self, transport: comm.Transport, plan: Plan, world: int, microbatches: int,
                 local: Sequence[int], device: torch.device, dynamic: bool, window: int = 2,
                 grads: bool = True) -> None:
        self.transport, self.plan, self.world, self.M = transport, plan, world, microbatches
        self.local, self.device, self.dynamic = list(local), device, dynamic
        self.S = plan.n_stages
        self.window = max(1, window)  # receives posted ahead per stage and direction
        self.want_grads = grads  # False for inference: no grads come back
        self.V = max([len(st.recv) for st in plan.stages] + [1])
        self.acts: dict[tuple[int, int], list[_Incoming]] = {}
        self.grads: dict[tuple[int, int], list[tuple[torch.Tensor, comm.Work] | None]] = {}
        self.sends: list[tuple[torch.Tensor, comm.Work]] = []
        self.peer: int | None = None  # the rank last waited on, named when a wait fails

    def tag(self, boundary: int, kind: int, mb: int, i: int) -> int:
        return ((boundary * 3 + kind) * self.M + mb) * self.V + i

    def post(self) -> None:
        """Post the receives of the first `window` microbatches of every local stage."""
        for s in self.local:
            for mb in range(min(self.window, self.M)):
                self._post_acts(s, mb)
                self._post_grads(s, mb)

    def _post_acts(self, s: int, mb: int) -> None:
        if s > 0 and mb < self.M:
            src = (s - 1) % self.world
            self.acts[(s, mb)] = [
                _Incoming(self, v, src, self.tag(s, SHAPE if self.dynamic else ACT, mb, i),
                          self.tag(s, ACT, mb, i)) for i, v in enumerate(self.plan.stages[s].recv)]

    def _post_grads(self, s: int, mb: int) -> None:
        if s < self.S - 1 and not self.dynamic and mb < self.M and self.want_grads:
            dst = (s + 1) % self.world
            bufs: list[tuple[torch.Tensor, comm.Work] | None] = []
            for i, v in enumerate(self.plan.stages[s + 1].recv):
                if getattr(torch, v.dtype).is_floating_point:
                    t = torch.empty(v.shape, dtype=getattr(torch, v.dtype), device=self.device)
                    bufs.append((t, self.transport.irecv(t.view(-1), dst, self.tag(s + 1, GRAD, mb, i))))
                else:
                    bufs.append(None)
            self.grads[(s, mb)] = bufs

    def recv_activations(self, s: int, mb: int) -> list[torch.Tensor]:
        got = [x.get() for x in self.acts.pop((s, mb))]
        # keep `window` receives ahead (every schedule runs a stage's microbatches in order)
        self._post_acts(s, mb + self.window)
        return got

    def recv_grads(self, s: int, mb: int, outs: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        """Grads of stage s's outputs for microbatch mb, from stage s+1."""
        self.peer = (s + 1) % self.world
        if not self.dynamic:
            out: list[torch.Tensor | None] = []
            for item in self.grads.pop((s, mb)):
                if item is not None:
                    item[1].wait()
                out.append(None if item is None else item[0])
            self._post_grads(s, mb + self.window)
            return out
        src = (s + 1) % self.world
        got: list[torch.Tensor | None] = []
        for i, o in enumerate(outs):
            if not o.is_floating_point():
                got.append(None)
                continue
            t = torch.empty(o.shape, dtype=o.dtype, device=self.device)
            self.transport.irecv(t.view(-1), src, self.tag(s + 1, GRAD, mb, i)).wait()
            got.append(t)
        return got

    def send_activations(self, s: int, mb: int, outs: Sequence[torch.Tensor]) -> None:
        dst, values = (s + 1) % self.world, self.plan.stages[s + 1].recv
        for i, (o, v) in enumerate(zip(outs, values)):
            if self.dynamic:
                if o.dim() > MAX_DIMS:
                    raise PlanError(f"stage {s} sends {v.name} with {o.dim()} dims; dynamic shapes allow "
                                    f"at most {MAX_DIMS}")
                head = torch.zeros(MAX_DIMS + 1, dtype=torch.int64)
                head[0] = o.dim()
                head[1:1 + o.dim()] = torch.tensor(o.shape, dtype=torch.int64)
                self._isend(head, dst, self.tag(s + 1, SHAPE, mb, i))
            elif list(o.shape) != v.shape:
                raise PlanError(f"stage {s} produced {v.name} of shape {list(o.shape)} but the plan says "
                                f"{v.shape}; keep inputs at the planned shapes or pass dynamic_shapes=True")
            self._isend(comm.to_layout(o, v.shape, v.stride), dst, self.tag(s + 1, ACT, mb, i))

    def send_grads(self, s: int, mb: int, grads: Sequence[torch.Tensor | None]) -> None:
        """Grads of stage s's received inputs, back to stage s-1."""
        dst = (s - 1) % self.world
        for i, g in enumerate(grads):
            if g is not None:
                self._isend(g.detach().contiguous().view(-1), dst, self.tag(s, GRAD, mb, i))

    def _isend(self, t: torch.Tensor, dst: int, tag: int) -> None:
        self.peer = dst
        self.sends = [(x, w) for x, w in self.sends if not w.is_completed()]  # free what has gone
        self.sends.append((t, self.transport.isend(t, dst, tag)))

    def finish(self) -> None:
        for _, work in self.sends:
            work.wait()
        self.sends.clear()
