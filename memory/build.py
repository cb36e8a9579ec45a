"""Build the memory manager of a pipeline from plain data: the plan's stages and per-node costs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.fx
import torch.utils._pytree as pytree

from memory.budget import COPY_BYTES_PER_MS, Chunking, NodeInfo, StageChoice, StageInfo, check_options, choose
from memory.buffers import comm_peaks
from memory.chunks import chunk_sizes, node_units, pack
from memory.manager import PlannedMemory
from memory.recompute import bases, is_matmul_node, remat_candidates, savers, saves_input_only
from memory.regions import cut_regions
from memory.timeline import Point, stage_actions, stage_points
from partition.costs import storage_owner
from partition.split import writes_in_place

__all__ = ["NodeCost", "stage_infos", "plan_choices", "build"]


@dataclass(frozen=True)
class NodeCost:
    """Per fx node, per microbatch: forward time, output bytes, bytes of temporaries it saves for
    backward, and the (canonical) names of the parameters it reads."""
    fwd_ms: float
    out_bytes: int
    temp_bytes: int = 0
    params: tuple[str, ...] = ()
    saved: tuple[tuple[str, int], ...] = ()  # storages it saves for backward (partition.costs ids), in order
    storage: str = ""      # the storage id its output lives in (partition.costs: measured; a view's is its base's)


def _chunkings(groups: list[tuple[str, ...]], sizes: dict[str, tuple[int, int]]) -> tuple[Chunking, ...]:
    """The chunk sizes a stage whose nodes read `groups` of parameters may stream them in (each with its
    chunk bytes, chunk count and the most chunks one node needs at once), packed as memory.store packs."""
    names, units = node_units([tuple(p for p in g if p in sizes) for g in groups])
    if not names:
        return ()
    numels = [sizes[n][0] for n in names]
    itemsize = max(sizes[n][1] for n in names)
    out = []
    for elems in chunk_sizes(numels, units):
        layout = pack(list(zip(names, numels)), elems, units=units)
        where = {s.name: s.chunk for s in layout.slots}
        need = max([len({where[p] for p in g if p in where}) for g in groups] + [1])
        fwd = tuple(g for g in (tuple(sorted({where[p] for p in grp if p in where})) for grp in groups) if g)
        out.append(Chunking(elems, elems * itemsize, layout.n_chunks, need, fwd))
    return tuple(out)


def _node_info(gm: torch.fx.GraphModule, node: torch.fx.Node, cost: NodeCost, stage: set[str],
               candidates: set[str], time_scale: float, saved_by: tuple[str, ...], reads: tuple[str, ...]
               ) -> NodeInfo:
    """A node as the planner sees it. Recomputing on unpack is planned only for nodes whose users are
    all on the stage (a stage output stays alive anyway), and it is counted as freeing the output only
    for ops known to save their input rather than their output, read by a matmul (which saves it)."""
    users = list(node.users)
    remat = node.name in candidates and all(u.name in stage for u in users)
    frees = remat and saves_input_only(gm, node) and any(is_matmul_node(gm, u) for u in users)
    return NodeInfo(node.name, cost.fwd_ms * time_scale, out_bytes=cost.out_bytes,
                    remat_bytes=cost.out_bytes if frees else 0, remat=remat, params=bool(cost.params),
                    temp_bytes=cost.temp_bytes, saved_by=saved_by, saved=cost.saved, reads=reads)


def stage_infos(*, stages: Sequence[dict[str, Any]], costs: dict[str, NodeCost], gm: torch.fx.GraphModule,
                param_sizes: dict[str, tuple[int, int]], microbatches: int, comm: Sequence[int],
                time_scale: float = 1.0, copy_bytes_per_ms: float = COPY_BYTES_PER_MS, regions: bool = True,
                points: Mapping[int, tuple[Point, ...]] | None = None, output_bytes: int = 0,
                actions: Mapping[int, tuple[str, ...]] | None = None, place: Sequence[int] | None = None,
                fused_points: Mapping[int, tuple[Point, ...]] | None = None) -> list[StageInfo]:
    """StageInfo per stage (from the plan's stage dicts and the costs).

    The plan's activation bytes leave out the model inputs that ops save (token ids, targets: the
    runtime holds the step's batch anyway, and the ledger does not count it); 2% on top keeps the
    prediction an upper bound of what the ledger measures. `time_scale` turns the costs'
    forward ms into this device's, to weigh recomputing against copying at `copy_bytes_per_ms`.
    `regions`: cut each stage in checkpoint regions (not under zero-bubble schedules, whose split
    backward cannot run through a checkpoint twice). `points`: each stage's memory.timeline points
    (else the planner assumes every microbatch in flight at once, with the buffers' peak), `actions` the
    kinds of its compute actions (memory.timeline.stage_actions: where streamed chunks are, at each).
    `output_bytes`: the graph's outputs per microbatch (the plan's), what the loss saves when no
    per-node costs are given (no memory feature asked for: the prediction comes from the plan).
    `place`: each stage's rank; a parameter an earlier stage on the same rank reads (a tied weight) is
    that stage's (the memory manager holds it once per rank, with the first local stage reading it).
    `fused_points`: under zero bubble, each stage's points with its backward a BW (where a plan that
    recomputes is walked: memory.fused_backward)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    out = next(n for n in gm.graph.nodes if n.op == "output")
    loss = sum(costs[x.name].out_bytes for x in pytree.tree_leaves(out.args[0])
               if isinstance(x, torch.fx.Node) and x.name in costs) if costs else output_bytes
    candidates = set(remat_candidates(gm))
    saved_by = savers(gm)
    # the node owning each node's output storage: as measured (an aten.reshape may or may not view), else by op
    owner = {n.name: b.name for n, b in bases(gm).items() if b is not None}
    owner.update({n: storage_owner(c.storage) for n, c in costs.items()
                  if c.storage and storage_owner(c.storage) in nodes})
    users = {n.name: [u.name for u in n.users] for n in gm.graph.nodes}
    reads = {n.name: [a.name for a in n.all_input_nodes] for n in gm.graph.nodes}
    writes = writes_in_place(gm)
    infos = []
    last = len(stages) - 1
    before: dict[int, set[str]] = {}  # rank -> parameters its earlier stages read
    rank_of = list(place) if place is not None else list(range(len(stages)))
    for s, st in enumerate(stages):
        rank = rank_of[s]
        earlier = set(before.get(rank, set()))
        before.setdefault(rank, set()).update(st.get("params", ()))
        # a later stage of this rank using this one's chunks moves them too: its state is then bounded
        lent = any(set(st.get("params", ())) & set(stages[t].get("params", ()))
                   for t in range(s + 1, len(stages)) if rank_of[t] == rank)
        names = [n for n in st["nodes"] if n in costs]
        here = set(names)
        infos_nodes = tuple(_node_info(gm, nodes[n], costs[n], here, candidates, time_scale,
                                       tuple(x for x in saved_by.get(n, (n,)) if x in names),
                                       tuple(dict.fromkeys(b for b in (owner.get(a, "") for a in reads[n])
                                                           if b in here and costs[b].out_bytes > 0)))
                            if n in nodes
                            else NodeInfo(n, costs[n].fwd_ms * time_scale, costs[n].out_bytes,
                                          temp_bytes=costs[n].temp_bytes, saved_by=(n,)) for n in names)
        exact = all(n in costs and n in nodes for n in st["nodes"])  # no node rewritten (sliced) by the plan
        cuts = cut_regions(names, users, reads, {n: c.out_bytes for n, c in costs.items()},
                           {n: costs[n].fwd_ms * time_scale for n in names}, owner,
                           writes=writes) if regions and exact else []
        infos.append(StageInfo(index=s, nodes=infos_nodes,
                               act_bytes=int(1.02 * st["activation_bytes"]),
                               loss_bytes=int(1.02 * loss) if s == last else 0,
                               in_flight=int(st["in_flight"]),
                               param_bytes=int(st["param_bytes"]) - sum(
                                   param_sizes[p][0] * param_sizes[p][1] for p in st.get("params", ())
                                   if p in earlier and p in param_sizes),
                               comm_bytes=int(comm[s]),
                               chunkings=_chunkings([tuple(p for p in costs[n].params if p not in earlier)
                                                     for n in names], param_sizes),
                               microbatches=microbatches, copy_bytes_per_ms=copy_bytes_per_ms,
                               regions=tuple(cuts),
                               points=(points or {}).get(s, ()),
                               fused_points=(fused_points or {}).get(s, ()),
                               actions=() if lent else (actions or {}).get(s, ())))
    return infos


def plan_choices(*, recompute: str, offload: str, budget: float | None, stages: Sequence[dict[str, Any]],
                 costs: dict[str, NodeCost], gm: torch.fx.GraphModule, param_sizes: dict[str, tuple[int, int]],
                 programs: Mapping[int, Sequence[Any]], place: Sequence[int], microbatches: int,
                 optim_factor: float = 2.0, time_scale: float = 1.0, copy_bytes_per_ms: float = COPY_BYTES_PER_MS,
                 output_bytes: int = 0, most: tuple[str, str] = ("auto", "all")) -> list[StageChoice]:
    """Every stage's memory plan (memory.budget.choose) from plain data: the plan's stage dicts, the
    per-node costs, every rank's lowered program and the stages' ranks. What build plans with, and
    what schedule='auto' weighs each candidate's recompute and offload with (pipe.auto)."""
    recv = [int(st["recv_bytes"]) for st in stages]
    send = [int(st["send_bytes"]) for st in stages]
    zero_bubble = any(getattr(a, "kind", None) == "W" for prog in programs.values() for a in prog)
    infos = stage_infos(stages=stages, costs=costs, gm=gm, param_sizes=param_sizes,
                        microbatches=microbatches, comm=comm_peaks(programs, place, recv, send, zero_bubble),
                        time_scale=time_scale, copy_bytes_per_ms=copy_bytes_per_ms,
                        regions=not zero_bubble, points=stage_points(programs, place, recv, send, zero_bubble),
                        actions=stage_actions(programs), place=place, output_bytes=output_bytes,
                        fused_points={s: stage_points(programs, place, recv, send, True, fused=(s,))[s]
                                      for s in range(len(stages))} if zero_bubble else None)
    return choose(infos, recompute=recompute, offload=offload, budget=budget, optim_factor=optim_factor, most=most)


def build(*, recompute: str, offload: str, budget: float | None, stages: Sequence[dict[str, Any]],
          costs: dict[str, NodeCost], gm: torch.fx.GraphModule, modules: dict[int, torch.fx.GraphModule],
          param_nodes: dict[int, dict[str, list[str]]], param_sizes: dict[str, tuple[int, int]],
          actions: Sequence[tuple[int, str, int]], programs: Mapping[int, Sequence[Any]], place: Sequence[int],
          microbatches: int, device: torch.device,
          optim_factor: float = 2.0, time_scale: float = 1.0,
          copy_bytes_per_ms: float = COPY_BYTES_PER_MS, output_bytes: int = 0, most: tuple[str, str] = ("auto", "all")
          ) -> tuple[PlannedMemory, list[StageChoice]]:
    """Plan every stage (the same on every rank: only the plan and the costs go in), then the
    manager for this rank's `modules`. BudgetError when the budget cannot be met. `programs`: every
    rank's lowered program (pipe.lower), `place`: each stage's rank; the communication buffers a
    stage holds are planned from them (memory.buffers)."""
    check_options(recompute, offload)
    tied = sorted({p for st in stages for p in st.get("shared", [])})
    if offload in ("states", "all") and device.type == "cuda" and tied:
        raise ValueError(f"offload={offload!r} keeps gradients on the host at the end of a step, where NCCL "
                         f"cannot sum the grads of weights tied across stages ({', '.join(tied[:3])}); untie "
                         "them, or use offload='activations'")
    recv = [int(st["recv_bytes"]) for st in stages]
    send = [int(st["send_bytes"]) for st in stages]
    choices = plan_choices(recompute=recompute, offload=offload, budget=budget, stages=stages, costs=costs, gm=gm,
                           param_sizes=param_sizes, programs=programs, place=place, microbatches=microbatches,
                           optim_factor=optim_factor, time_scale=time_scale, copy_bytes_per_ms=copy_bytes_per_ms,
                           output_bytes=output_bytes, most=most)
    mm = PlannedMemory(choices=choices, modules=modules, param_nodes=param_nodes, actions=actions,
                       recv_bytes=recv, send_bytes=send, device=device,
                       budget=budget, chunk_elems={c.stage: c.chunk_elems for c in choices if c.chunk_elems},
                       place=place, optim_factor=optim_factor)
    return mm, choices
