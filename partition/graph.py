"""The traced graph as a networkx DiGraph with costs, coarsened into a chain of cuttable blocks."""
from __future__ import annotations

from dataclasses import dataclass

import networkx as nx
import numpy as np
import torch.fx

from partition.costs import NodeCost, storage_owner
from partition.solve import Chain, PartitionError

__all__ = ["build_graph", "Blocks", "coarsen"]


def build_graph(gm: torch.fx.GraphModule, costs: dict[str, NodeCost]) -> nx.DiGraph:
    """Nodes: fx node names in program order, with `op`, `order` and the NodeCost as `cost`.

    Edges u -> v: v reads u's value; `bytes` is the size of that value. The graph attribute
    `output_leaves` lists the nodes whose values are the model's outputs.
    """
    from memory.recompute import is_random_node
    from partition.split import writes_in_place
    kinds = {n.name: n.op for n in gm.graph.nodes}
    writes = writes_in_place(gm)
    g = nx.DiGraph()
    for i, node in enumerate(gm.graph.nodes):
        # a random op drawn again on each stage, or a write to a model input or attribute done again, would not
        # be the model's: `once` nodes are placed on one stage like any other (their value sent on), never
        # replicated (a write to a value made from inputs alone, a mask's triu_, is replicated with it)
        once = node.op.startswith("call") and (
            is_random_node(gm, node) or any(kinds.get(x) in ("placeholder", "get_attr") for x in writes.get(
                node.name, ())))
        g.add_node(node.name, op=node.op, order=i, cost=costs.get(node.name), once=once,
                   writes=tuple(writes.get(node.name, ())))
    for node in gm.graph.nodes:
        for a in node.all_input_nodes:
            c = costs.get(a.name)
            g.add_edge(a.name, node.name, bytes=c.out_bytes if c else 0)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    g.graph["output"] = out.name
    return g


def _replicated(g: nx.DiGraph) -> set[str]:
    """Call nodes computed from model inputs and constants alone (positions, masks, sizes), other than
    random ops and in-place writes (`once`).

    Every stage that needs them recomputes them, so they never cross a boundary.
    """
    rep: set[str] = set()
    for name in sorted(g.nodes, key=lambda n: g.nodes[n]["order"]):
        attrs = g.nodes[name]
        if (attrs["op"] not in ("call_function", "call_method", "call_module") or attrs["cost"].params
                or attrs.get("once")):
            continue
        if g.out_degree(name) == 0 and not any(w in rep for w in attrs.get("writes", ())):
            continue  # nobody reads it: it runs once, for its effect (a write to a replicated value goes with it)
        if all(g.nodes[p]["op"] in ("placeholder", "get_attr") or p in rep for p in g.predecessors(name)):
            rep.add(name)
    return rep


def _activation_bytes(g: nx.DiGraph, members: list[list[str]], placed: set[str]) -> list[float]:
    """Bytes each block keeps for backward per microbatch, every storage counted once.

    A storage allocated on a stage (by a placed node) goes to the first block that saves
    it; one of a model input or a replicated node exists on every stage that computes or
    receives it, so every block that saves it counts it.
    """
    holder: set[str] = set()
    act = []
    for block in members:
        mine: dict[str, int] = {}
        for u in block:
            for sid, nb in g.nodes[u]["cost"].saved.items():
                if storage_owner(sid) in placed:
                    if sid in holder:
                        continue
                    holder.add(sid)
                mine[sid] = nb
        act.append(float(sum(mine.values())))
    return act


@dataclass
class Blocks:
    """The chain the solver cuts: block i holds fx nodes `members[i]`, in program order."""
    chain: Chain
    members: list[list[str]]
    replicated: set[str]
    param_names: list[str]  # parameter id -> canonical name


def coarsen(g: nx.DiGraph, param_bytes: dict[str, int], *, max_blocks: int = 2000) -> Blocks:
    """Group the call nodes into blocks that may be cut between, and cost each block.

    A cut is allowed only where every value crossing it is a single tensor (tuples stay
    with their getitems, sizes and other Python values stay where they are used); nodes
    that derive from model inputs only are replicated instead. When more than `max_blocks`
    blocks remain, neighbours merge evenly. A value crossing a boundary is counted once
    there, at every boundary it crosses.
    """
    rep = _replicated(g)
    out = g.graph["output"]
    nodes = [n for n in sorted(g.nodes, key=lambda n: g.nodes[n]["order"])
             if g.nodes[n]["op"] in ("call_function", "call_method", "call_module") and n not in rep]
    if not nodes:
        raise PartitionError("the traced graph has no operations to place on stages (it only passes inputs "
                             "or constants through); pipeline a model that computes something from its inputs")
    pos = {n: i for i, n in enumerate(nodes)}
    n = len(nodes)
    # last[i]: the last position that reads node i's value (n when the model outputs it)
    last = np.array([max([pos.get(s, n if s == out else -1) for s in g.successors(u)] + [i])
                     for i, u in enumerate(nodes)])
    blocked = np.zeros(n + 1, dtype=np.int64)  # boundaries a non-tensor value crosses
    live = np.zeros(n + 1, dtype=np.float64)  # bytes crossing the boundary before position i
    for i, u in enumerate(nodes):
        if last[i] > i:
            c: NodeCost = g.nodes[u]["cost"]
            target = live if c.is_tensor else blocked
            target[i + 1] += c.out_bytes if c.is_tensor else 1
            target[last[i] + 1 if last[i] < n else n] -= c.out_bytes if c.is_tensor else 1
    live, blocked = np.cumsum(live), np.cumsum(blocked)
    for i, u in enumerate(nodes):  # a node nobody reads runs for its effect (a buffer update):
        if i and g.out_degree(u) == 0:  # it stays with the node before it
            blocked[i] += 1
    cuts = [i for i in range(1, n) if blocked[i] == 0]
    if len(cuts) + 1 > max_blocks:
        step = (len(cuts) + 1) / max_blocks
        cuts = [cuts[int(k * step)] for k in range(1, max_blocks)]
    starts = [0] + cuts
    ends = cuts + [n]
    members = [nodes[a:b] for a, b in zip(starts, ends)]

    act = _activation_bytes(g, members, set(pos))
    pid: dict[str, int] = {}
    fwd, bwd, ref, params = [], [], [], []
    for block in members:
        costs: list[NodeCost] = [g.nodes[u]["cost"] for u in block]
        fwd.append(sum(c.fwd_ms for c in costs))
        bwd.append(sum(c.bwd_ms for c in costs))
        ref.append(sum(c.ref_ms for c in costs))
        params.append(tuple(sorted({pid.setdefault(p, len(pid)) for c in costs for p in c.params})))
    names = list(pid)
    chain = Chain(fwd_ms=np.array(fwd), bwd_ms=np.array(bwd), act_bytes=np.array(act, dtype=np.float64),
                  params=params, param_bytes={i: param_bytes[p] for i, p in enumerate(names)},
                  cut_bytes=np.array([0.0] + [float(live[i]) for i in cuts] + [0.0]),
                  names=[b[0] for b in members], ref_ms=np.array(ref) if any(ref) else None)
    return Blocks(chain=chain, members=members, replicated=rep, param_names=names)
