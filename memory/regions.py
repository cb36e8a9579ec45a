"""Checkpoint regions of a stage's fx graph: contiguous node runs cut where the fewest bytes cross.

A region is recomputed on its own in the backward (torch's non-reentrant checkpoint around a
sub-GraphModule), so a microbatch keeps only what enters the region, and the backward holds one
region's recomputation at a time instead of the whole stage's. Cuts go at the positions of the
topological order where the live values crossing are the fewest bytes (in a transformer: the
residual stream between half-blocks), ignoring crossings under 1/8 of the widest. Legend: N nodes
of a stage, p a cut position (before node p).
"""
from __future__ import annotations

import functools
import operator
from typing import Any, Callable, Sequence

import torch
import torch.fx
from torch.utils.checkpoint import checkpoint

from memory.budget import Region
from memory.recompute import ChainedHooks, KeptBuffers

__all__ = ["Checkpointed", "cut_regions", "checkpoint_regions"]


def cut_regions(order: Sequence[str], users: dict[str, list[str]], inputs: dict[str, list[str]],
                out_bytes: dict[str, int], fwd_ms: dict[str, float], owner: dict[str, str] | None = None,
                min_share: float = 0.05, writes: dict[str, list[str]] | None = None) -> list[Region]:
    """Regions of the stage whose nodes are `order` (topological). `inputs[n]` are the nodes n reads,
    `users[n]` those reading it (either may lie outside the stage); `owner[n]` is the node owning n's
    storage (a view's base; default n itself), whose `out_bytes` count once while any of its views is
    live. Cuts go where the crossing bytes are the least; runs under `min_share` of the stage's time
    join their neighbour. `writes[n]`: the values node n writes in place; no region writes one entering
    it (its recomputation would read the written value, and write it again), so no cut falls between a
    value and a write to it. O(N + E)."""
    n = len(order)
    if n < 2:
        return []
    owner = owner or {}
    pos = {name: i for i, name in enumerate(order)}
    barred = [False] * (n + 1)  # cut positions between a value and a write to it
    for m, written in (writes or {}).items():
        for x in written:
            if m in pos:
                for p in range(pos.get(x, -1) + 1, pos[m] + 1):
                    barred[p] = True
    live: dict[str, list[int]] = {}  # storage owner -> [made before position, read up to position]
    for i, name in enumerate(order):
        span = live.setdefault(owner.get(name, name), [i + 1, i])
        span[0] = min(span[0], i + 1)
        span[1] = max([span[1]] + [min(pos.get(u, n), n) for u in users.get(name, [])])
        for x in inputs.get(name, []):
            if x not in pos:  # a value from another stage: live from the start
                ext = live.setdefault(owner.get(x, x), [0, i])
                ext[0], ext[1] = 0, max(ext[1], i)
    delta = [0] * (n + 2)  # crossing(p) = bytes of storages made before p and read at p or later
    for o, (first, end) in live.items():
        if end >= first:
            delta[first] += out_bytes.get(o, 0)
            delta[end + 1] -= out_bytes.get(o, 0)
    crossing, run = [0] * (n + 1), 0
    for p in range(n + 1):
        run += delta[p]
        crossing[p] = run
    open_ = [p for p in range(1, n) if not barred[p]]
    widest = max([crossing[p] for p in open_], default=0)  # ignore the small values of a stage's first nodes
    least = min([c for c in (crossing[p] for p in open_) if c >= widest / 8], default=0)
    cuts = [0] + [p for p in open_ if crossing[p] <= least] + [n]
    total = sum(fwd_ms.get(x, 0.0) for x in order) or 1.0
    spans: list[list[int]] = []
    for a, b in zip(cuts, cuts[1:]):
        if spans and sum(fwd_ms.get(order[i], 0.0) for i in range(*spans[-1])) < min_share * total:
            spans[-1][1] = b
        else:
            spans.append([a, b])
    if len(spans) > 1 and sum(fwd_ms.get(order[i], 0.0) for i in range(*spans[-1])) < min_share * total:
        end = spans.pop()[1]
        spans[-1][1] = end
    out = []
    for a, b in spans:
        names = order[a:b]
        inside = set(names)
        entering = {x for m in names for x in inputs.get(m, []) if x not in inside and x in pos}
        owners = tuple(sorted({owner.get(x, x) for x in entering}))
        in_bytes = sum(out_bytes.get(x, 0) for x in owners)
        out.append(Region(tuple(names), sum(fwd_ms.get(m, 0.0) for m in names), in_bytes, owners))
    return out


def checkpoint_regions(gm: torch.fx.GraphModule, regions: Sequence[Sequence[str]],
                       wrap: Callable[[int, torch.fx.GraphModule], torch.nn.Module]) -> None:
    """Replace each region (contiguous call nodes, by name) by a call to `wrap(k, sub)`, where `sub`
    is a GraphModule of the region's nodes taking the values entering it and returning, as a tuple,
    those read after it (in place; the nodes keep their modules and parameters). Nodes the stage graph
    has between a region's first and last (cheap ones a stage recomputes, e.g. sizes) join it."""
    nodes = {x.name: x for x in gm.graph.nodes}
    planned = {x for names in regions for x in names}
    for k, names in enumerate(regions):
        found = [nodes[x] for x in names if x in nodes]
        if not found:
            continue
        calls = [x for x in gm.graph.nodes if x.op.startswith("call")]
        members = calls[calls.index(found[0]):calls.index(found[-1]) + 1]  # with nodes the plan does not list
        if any(m.name in planned and m.name not in names for m in members):
            raise ValueError(f"checkpoint region {k} ({names[0]} .. {names[-1]}) is not a contiguous run of the "
                             "stage graph's nodes")
        first = members[0]
        order = {x: i for i, x in enumerate(gm.graph.nodes)}
        for a in {a for m in members for a in m.all_input_nodes if a.meta.get("fxpipe_copy")}:
            # the stage's copy of a received value it writes in place (partition.split), read by no node before
            # the region: recomputed with it from the value, not read back as written
            if all(order[u] >= order[first] for u in a.users):
                members.insert(0, a)
        inside = set(members)
        entering: list[torch.fx.Node] = []
        for m in members:
            for a in m.all_input_nodes:
                if a not in inside and a not in entering:
                    entering.append(a)
        leaving = [m for m in members if any(u not in inside for u in m.users)]
        sub = torch.fx.Graph()
        env: dict[torch.fx.Node, Any] = {a: sub.placeholder(a.name) for a in entering}
        for m in members:
            env[m] = sub.node_copy(m, lambda a: env[a])
        sub.output(tuple(env[m] for m in leaving))
        name = f"_fxpipe_region{k}"
        gm.add_submodule(name, wrap(k, torch.fx.GraphModule(gm, sub)))
        with gm.graph.inserting_before(first):
            call = gm.graph.call_module(name, tuple(entering))
            outs = [gm.graph.call_function(operator.getitem, (call, i)) for i in range(len(leaving))]
        for m, o in zip(leaving, outs):
            m.replace_all_uses_with(o, delete_user_cb=lambda u: u not in inside)
        for m in reversed(members):
            gm.graph.erase_node(m)
    gm.graph.lint()
    gm.recompile()


class Checkpointed(torch.nn.Module):
    """One region under non-reentrant checkpoint. `entering(args)` is told what the checkpoint keeps
    (the region's inputs), `again()` that the backward starts recomputing it, `recomputed(t)` of every
    tensor the recomputation saves."""

    def __init__(self, inner: torch.nn.Module, *, entering: Callable[[tuple[Any, ...]], None],
                 again: Callable[[], None], recomputed: Callable[[torch.Tensor], None]) -> None:
        super().__init__()
        self.inner, self.entering, self.again, self.recomputed = inner, entering, again, recomputed
        self.buffers_kept = KeptBuffers(inner)

    def _run(self, calls: list[int], *args: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            return self.buffers_kept.first(lambda: self.inner(*args))
        self.again()
        with ChainedHooks(self.recomputed), self.buffers_kept.again():
            return self.inner(*args)

    def forward(self, *args: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.inner(*args)
        self.entering(args)
        return checkpoint(functools.partial(self._run, [0]), *args, use_reentrant=False)
