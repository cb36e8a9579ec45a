"""One step on one rank: the interpreter of a lowered program (pipe.lower), running each action's
forward, backward or weight-grad computation on this rank's stages, its messages through the exchange and
its memory actions through the memory manager, and timing each action on the device."""
from __future__ import annotations

import contextlib
import warnings
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor

from partition.errors import first_line
from partition.planner import check_scalar_loss
from partition.reduction import TERMS
from partition.trace import unflatten_outputs
from memory.recompute import autocast_as
from pipe.backward import Saved, backward_full, backward_input, backward_weight
from pipe import comm
from pipe.errors import NonFiniteLoss, PipelineError
from pipe.exchange import Exchange
from pipe.schedules import Action
from pipe.simulate import Event
from pipe.timing import clock_for

if TYPE_CHECKING:
    from pipe.runtime import Pipeline

__all__ = ["StepState", "concat_outputs", "failures", "non_finite", "placed", "sum_tied_grads", "tied_trained"]


def placed(tree: Any, device: torch.device) -> Any:
    """`tree` with its tensors on `device`."""
    return pytree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, tree)


def _alike(column: tuple[Any, ...]) -> bool:
    """Whether every microbatch gave the same leaf."""
    x = column[0]
    if isinstance(x, torch.Tensor):
        return all(isinstance(c, torch.Tensor) and c.shape == x.shape and torch.equal(c, x) for c in column)
    return all(c == x for c in column)


def _batched(dims: list[int], sizes: list[int]) -> bool:
    """Whether each microbatch's dim 0 is the same multiple of its size (the batch, or the batch folded with
    other dims: logits flattened to tokens)."""
    return bool(sizes) and all(s > 0 for s in sizes) and dims[0] % sizes[0] == 0 and dims[0] >= sizes[0] and \
        all(d == dims[0] // sizes[0] * s for d, s in zip(dims, sizes))


def check_layout(layout: list[tuple[Any, bool]] | None) -> None:
    """Refuse outputs no batch value can be formed of before forward() runs: one pairing the samples."""
    for i, (d, _) in enumerate(layout or []):
        if isinstance(d, tuple):  # ("pairs", shape on one microbatch, on two)
            raise PipelineError(f"the model's output leaf {i} pairs the samples of a microbatch (shape {list(d[1])} "
                                f"on one, {list(d[2])} on two: more than twice the elements, as a similarity of "
                                "every two samples), and a pipeline computes each microbatch alone, so forward() "
                                "cannot form the batch's value; return per-sample values (embeddings) and pair "
                                "them outside the model")


def concat_outputs(outputs: list[Any], sizes: list[int] | None = None,
                   layout: list[tuple[Any, bool]] | None = None, weights: dict[int, list[float]] | None = None,
                   forms: list[tuple[str | None, int | None]] | None = None) -> Any:
    """Microbatch outputs as one batch. `layout` (pipe.inference.output_layout), per leaf: the dim its batch
    is along (an int; None: its shape does not change with the batch; "?": not known) and whether it is
    computed from the inputs; `forms` (partition.reduction.output_forms), per leaf: how a value of one element
    forms the batch's ("sum", "mean", "max", "min"; None: unknown), and for dim 0 the product of the dims before
    the batch that it merges with it (a sequence-first output flattened to tokens: rows over positions, each
    over the samples), else None. A leaf with a batch dim is concatenated along it (the merged one sample by
    sample within each position), also when every microbatch gave the same (repeated prompts); one of unknown
    layout along dim 0 when its dim 0 is each microbatch's size (`sizes`) or the same multiple of it (without
    sizes, every tensor of a dim or more); a 0-dim one weighed by `weights` (leaf -> each microbatch's weight:
    the model's own loss, as a step weighs it), else formed as its form says (a mean weighed by the
    microbatches' sizes); a 0-dim floating one of unknown form that differs between microbatches is their
    mean, with a RuntimeWarning that it is not known to be the batch's; any other leaf is kept when every
    microbatch gave the same, unless the inputs give it and it is a 0-dim tensor or a value the batch's size
    changes (a count of the batch's tokens would come out a microbatch's); refused otherwise: no batch value
    can be formed from theirs."""
    check_layout(layout)
    flat = [pytree.tree_flatten(o) for o in outputs]
    spec = flat[0][1]
    leaves = []
    for i, column in enumerate(zip(*[f[0] for f in flat])):
        x = column[0]
        tensor = isinstance(x, torch.Tensor)
        same = _alike(column)
        d, fed = layout[i] if layout is not None and i < len(layout) else ("?", True)
        form, within = forms[i] if forms is not None and i < len(forms) else (None, None)
        dims = [c.shape[0] for c in column] if tensor and x.dim() else []
        if tensor and d == 0 and within:  # [lead x b, ...] each: joined sample by sample within each of lead
            rest = x.shape[1:]
            leaves.append(torch.cat([c.reshape(within, -1, *rest) for c in column], 1).reshape(-1, *rest))
        elif tensor and isinstance(d, int) and x.dim() > d:
            leaves.append(torch.cat(column, d))
        elif d == "?" and dims and (sizes is None or dims == list(sizes) or _batched(dims, sizes) and not same):
            if sizes is not None and dims != list(sizes):  # (a multiple of the size, alike in every microbatch: a
                warnings.warn(  # parameter; found by review: a bincount [64] came back [256], silently)
                    f"forward(): the model's output leaf {i} has {dims[0]} rows in a microbatch of {sizes[0]} samples, "
                    "a multiple of them, and is joined along dim 0 as tokens flattened with the batch would be; "
                    "fxpipe could not run the model on meta tensors to tell its layout, so if this output is not "
                    "per sample (a histogram, a table), form it outside the model", RuntimeWarning, stacklevel=2)
            leaves.append(torch.cat(column, 0))
        elif tensor and not x.dim() and (x.is_floating_point() or x.is_complex()) and i in (weights or {}):
            w = torch.tensor((weights or {})[i], dtype=torch.float64, device=x.device)
            leaves.append((torch.where(w > 0, torch.stack(column).double(), 0.0) * w).sum().to(x.dtype))
        elif tensor and not x.dim() and form is not None:
            leaves.append(_formed(torch.stack(column), form, sizes).to(x.dtype))
        elif tensor and not x.dim() and (x.is_floating_point() or x.is_complex()):
            if not same and fed:
                warnings.warn(f"forward(): the model's output leaf {i} (one number, computed from the inputs) is the "
                              "mean of the microbatches' values, which fxpipe cannot tell is the batch's: a sum, a "
                              "mean or a max over the samples is formed exactly, this one may be a statistic of the "
                              "whole batch (a std, a MoE's load-balancing loss); form it outside the model from "
                              "forward()'s per-sample outputs", RuntimeWarning, stacklevel=2)
            leaves.append(torch.stack(column).mean())
        elif same and not (layout is not None and fed and (d == "?" or tensor and not x.dim())):
            leaves.append(x)  # (not a count of the batch: a 0-dim tensor or a value the batch's size changes)
        else:
            what = f"a {x.dtype} tensor of shape {list(x.shape)}" if tensor else f"a {type(x).__name__}"
            why = ("computed from the inputs without a batch dimension (a count or a flag of the batch)" if same
                   else "without the batch along its dim 0 that differs between microbatches")
            raise PipelineError(f"the model's output leaf {i} is {what} {why}, so forward() cannot form the whole "
                                "batch's value from theirs (tensors with the batch along a dim are concatenated, "
                                "one number summed, averaged or maxed where the graph shows which); return it with "
                                "a batch dimension, or compute it outside the model")
    return pytree.tree_unflatten(leaves, spec)


def _formed(values: torch.Tensor, form: str, sizes: list[int] | None) -> torch.Tensor:
    """The batch's value from the microbatches' (`values`, one each) by `form` (see concat_outputs)."""
    if form == "sum":
        return values.sum() if not values.is_floating_point() else values.double().sum()
    if form == "max":
        return values.max()
    if form == "min":
        return values.min()
    w = torch.tensor(sizes if sizes and len(sizes) == len(values) and all(n > 0 for n in sizes)
                     else [1] * len(values), dtype=torch.float64, device=values.device)
    return (values.double() * w).sum() / w.sum()


def check_loss_reads(pp: Pipeline, loss: torch.Tensor, through: list[Any]) -> None:
    """loss_fn, run by the last stage's rank, must reach the tensors that require grad only through the
    stage's outputs (`through`, and its inputs): a parameter it reads otherwise (a closure's regulariser,
    `ce + 0.01 * w.pow(2).sum()`) gets its grad only where this rank trains that very tensor, and where
    B and W are not split apart (zero bubble's B computes the grads of named tensors only). PipelineError
    naming them otherwise: the grads would go to a copy no optimizer steps, or be lost."""
    if loss.grad_fn is None:
        return
    mine = [t for t in through if isinstance(t, torch.Tensor)]
    stop, ids = {t.grad_fn for t in mine if t.grad_fn is not None}, {id(t) for t in mine}
    seen: set[Any] = set()
    todo: list[Any] = [loss.grad_fn]
    found: list[torch.Tensor] = []
    while todo:  # the loss's own ops, down to the stage's outputs
        fn = todo.pop()
        if fn is None or fn in seen or fn in stop:
            continue
        seen.add(fn)
        var = getattr(fn, "variable", None)  # AccumulateGrad: a leaf tensor
        if var is not None:
            if id(var) not in ids:
                found.append(var)
            continue
        todo.extend(f for f, _ in fn.next_functions)
    held = {id(p) for t in pp.local for p in pp.stages[t].parameters()}
    wrong = [v for v in found if pp.split_w or id(v) not in held]
    if wrong:
        names = {id(p): n for n, p in pp._model.named_parameters()}
        what = ", ".join(names.get(id(v), f"a tensor of shape {list(v.shape)}") for v in wrong)
        why = ("this schedule's B computes the grads of the stage's own tensors only (zero bubble)" if pp.split_w
               else f"rank {pp.rank} does not train {'them' if len(wrong) > 1 else 'it'} (its stages are "
                    f"{sorted(pp.local)})")
        raise PipelineError(
            f"loss_fn reads {what}, which require{'s' if len(wrong) == 1 else ''} grad, other than through the "
            f"model's output (a parameter reached through a closure, as in `ce + 0.01 * w.pow(2).sum()`): {why}, so "
            "its grads would be lost; compute the term inside the model's forward and return it with the output, or "
            "use the optimizer's weight_decay")


class StepState:
    """The state of one step on one rank: microbatch inputs, messages, saved activations."""

    def __init__(self, pp: Pipeline, flats: list[list[Any]], targets: list[Any], exchange: Exchange,
                 inference: bool = False, evaluating: bool = False, stages: dict[int, Any] | None = None,
                 inference_stages: dict[int, Any] | None = None) -> None:
        self.pp, self.flats, self.targets, self.ex = pp, flats, targets, exchange
        self.inference = inference and not evaluating  # the model's outputs
        self.evaluating = evaluating  # the loss, without grads: the training stages' forwards, nothing kept
        # in the mode the stages were not traced in: this rank's stages (module, model inputs) cut from a trace
        # in the pipeline's mode, and (the loss in the graph) those without the loss, for the model's outputs
        self.stages = stages
        self.inference_stages = inference_stages if inference_stages is not None else pp._inference
        # inference: the last stage's output per mb; with the loss in the graph, {model output leaf: value}
        # per mb of what this rank's stages computed
        self.outputs: list[Any] = [None] * len(flats)
        self.saved: dict[tuple[int, int], Saved] = {}
        self.finite: list[tuple[int, torch.Tensor]] = []  # (stage, all outputs finite), read only on NaN
        self.loss_sum: torch.Tensor | float = 0.0
        self.scales: list[float | torch.Tensor] | None = None  # each microbatch's weight in the batch's loss
        self.term_weights: torch.Tensor | None = None  # a loss of terms: [microbatch, term] weights (_scales)
        self.clock = clock_for(pp.ctx.device)  # device time: CUDA events on CUDA, read after the step
        self.clock.begin()
        self.reducer = pp.reducer
        # actions that compute nothing: memory (RELOAD) and data-parallel (REDUCE_GRAD, arming the reducer)
        self.side_handlers: dict[str, Callable[[int, int], None]] = {"RELOAD": pp.memory.reload}
        if self.reducer is not None:
            self.side_handlers["REDUCE_GRAD"] = self.reducer.arm
        self.current: Action | None = None  # the action running, named when it fails

    def execute(self, program: list[Any]) -> None:
        """Run this rank's lowered program: compute actions through the handlers (and the memory
        manager around them), memory actions through theirs, batches of messages through the exchange."""
        mem = self.pp.memory
        for x in program:
            if not isinstance(x, Action):
                start = self.clock.mark()
                self.ex.issue(x)
                self.clock.span(Action(x[0].stage, "POST", x[0].mb), start, self.clock.mark())
                mem.posted(x)
                continue
            if x.kind in self.side_handlers:
                self.side_handlers[x.kind](x.stage, x.mb)
                continue
            self.current = x
            mem.before(x)
            if self.reducer is not None:
                self.reducer.before(x)
            if x.kind == "F":
                _HANDLERS[x.kind](self, x)
            else:  # a backward runs outside the user's autocast, as torch's AMP runs it (an op the forward ran in
                with autocast_as(()):  # float32 in an autocast(enabled=False) region keeps a float32 backward)
                    _HANDLERS[x.kind](self, x)
            mem.after(x)
            if self.reducer is not None:
                self.reducer.after(x)
        self.current = None
        self.ex.finish()

    def forwards(self, program: list[Any]) -> None:
        """Run a forward-only program (pipe.lower.forward_only): its forwards, and its batches of messages."""
        mem = self.pp.memory
        with mem.forward_only(program, {s: self._forward_module(s) for s in self.pp.local}):
            for x in program:
                if isinstance(x, Action):
                    self.current = x
                    mem.before_forward_only(x)
                    self.forward(x)
                else:
                    self.ex.issue(x)
            self.current = None
            self.ex.finish()

    def _forward_module(self, s: int) -> Any:
        """The module forward() runs for stage s other than its training one (None: that one)."""
        if self.inference and self.inference_stages:
            return self.inference_stages[s][0]
        return self.stages[s][0] if self.stages is not None else None

    def _record(self, a: Action, start: object) -> None:
        self.clock.span(a, start, self.clock.mark())

    def events(self) -> tuple[list[Event], list[Event], list[Event]]:
        """This step's timed compute actions, grad collectives and batch posts (ms); on CUDA this waits
        for the device once."""
        every = [Event(self.pp.rank, a, start, end) for a, start, end in self.clock.resolve()]
        return ([e for e in every if e.action.kind not in ("REDUCE_GRAD", "POST")],
                [e for e in every if e.action.kind == "REDUCE_GRAD"],
                [e for e in every if e.action.kind == "POST"])

    def forward(self, a: Action) -> None:
        pp, s, mb = self.pp, a.stage, a.mb
        io = pp.io[s]
        leaves = [t.requires_grad_(True) if t.is_floating_point() else t
                  for t in (self.ex.recv_activations(s, mb) if s > 0 else [])]
        start = self.clock.mark()
        if self.inference and self.inference_stages:  # a plan with the loss in the graph: the stage without it
            module, inputs, extras = self.inference_stages[s]
            outs = list(module(*leaves, *[self.flats[mb][i] for i in inputs], *self._weights_for(module, mb)))
            sent = len(outs) - len(extras)
            if not io.last:
                self.ex.send_activations(s, mb, outs[:sent])
            if extras:
                mine = self.outputs[mb] = self.outputs[mb] or {}
                mine.update({i: x.cpu() if isinstance(x, torch.Tensor) and pp.world > 1 else x  # (gathered as objects)
                             for i, x in zip(extras, outs[sent:])})
            return
        model_inputs = [self.flats[mb][i] for i in io.inputs]
        if io.last and pp.weighting.parts:  # the last stage weighs the loss's terms (weigh_on)
            model_inputs.append(self._term_weights()[mb])
        args = leaves + model_inputs
        if self.stages is not None:  # the other mode's stage, without grads: no memory or W split to manage
            module, inputs = self.stages[s]
            outs, param_outs, ins = module(*leaves, *[self.flats[mb][i] for i in inputs],
                                           *self._weights_for(module, mb)), (), []
        else:
            with pp.memory.forward(s, mb, model_inputs):
                if pp.split_w:
                    outs, param_outs, *ins = pp._call[s](*args)  # ins: the linear layers' inputs (direct W)
                else:
                    outs, param_outs, ins = pp._call[s](*args), (), []
        outs = list(outs)
        if self.inference:
            if io.last:
                self.outputs[mb] = unflatten_outputs(outs, io.out_spec)
            else:
                self.ex.send_activations(s, mb, outs)
            return
        if io.last:
            if pp.plan.loss:  # the stage computed it
                loss = outs[0]
            else:
                with pp.memory.forward(s, mb, [self.targets[mb]]):  # the loss's saved tensors count (and offload)
                    loss = self._loss(unflatten_outputs(outs, io.out_spec), self.targets[mb])
                if not self.evaluating and not pp._loss_reads_checked:
                    check_loss_reads(pp, loss, [*outs, *leaves])
                    pp._loss_reads_checked = True
            scale = weight = self._scales()[mb]
            if isinstance(scale, torch.Tensor):  # counted: a microbatch without targets (loss NaN) weighs 0
                loss = torch.where(scale > 0, loss, 0.0)
                weight = scale.to(torch.promote_types(loss.dtype, torch.float32))
            self.loss_sum = self.loss_sum + loss.detach().double() * scale  # stays on device: no sync
            roots = [loss * weight if pp.grad_scaler is None else pp.grad_scaler.scale(loss * weight)]
        else:
            self.ex.send_activations(s, mb, outs)
            roots = outs
            self.finite += [(s, torch.isfinite(o).all()) for o in outs if o.is_floating_point()]
        if self.evaluating:  # no backward follows
            return
        self.saved[(s, mb)] = Saved(roots=roots, leaves=[x if x.is_floating_point() else None for x in leaves],
                                    param_outs=list(param_outs), param_ins=list(ins[0]) if ins else [],
                                    param_versions=list(ins[1]) if ins else [])
        self._record(a, start)

    def _weights_for(self, module: Any, mb: int) -> list[torch.Tensor]:
        """[microbatch mb's weights of the loss's terms] for a stage of another mode or without the loss that
        weighs them (partition.reduction.weigh_terms), else []."""
        return [self._term_weights()[mb]] if getattr(module, "meta", {}).get(TERMS) else []

    def _term_weights(self) -> torch.Tensor:
        """A loss adding terms each formed its own way ("terms"): [microbatch, term] weights in the batch's loss,
        float32 on the device, as _scales weighs a whole loss of the term's kind (its counts over the batch's; times
        the replicas); forward()'s are its replica's own. A ratio's numerator adding a penalty of the weights to its
        sums: 1 for a sum, 1/(M x replicas) for the penalty."""
        if self.term_weights is None:
            pp, w = self.pp, self.pp.weighting
            counted = [k for k, p in enumerate(w.parts) if p.kind in ("count", "ratio")]
            counts, totals = self._counts([w.parts[k] for k in counted], pp.dynamic and w.kind == "terms",
                                          "counts of the loss's terms")
            dp = 1 if self.inference else pp.dp
            columns = []
            for k, p in enumerate(w.parts):
                if w.kind == "ratio":  # its numerator's terms (the step scales it by one over the batch's divisor):
                    once = 1.0 if p.kind == "sum" else 1.0 / (pp.M * dp)  # a penalty added once over the replicas
                    columns.append(torch.full((pp.M,), once, dtype=torch.float64, device=pp.ctx.device))
                elif p.kind in ("count", "ratio"):  # a ratio's numerator (weigh_terms) over the batch's divisor
                    columns.append(self._weighed(p, counts[counted.index(k)], totals[counted.index(k)], dp))
                elif p.kind == "sum" or not pp.dynamic:
                    weight = float(dp) if p.kind == "sum" else 1.0 / pp.M
                    columns.append(torch.full((pp.M,), weight, dtype=torch.float64, device=pp.ctx.device))
                else:  # a mean with dynamic shapes: the microbatch's samples over the batch's
                    columns.append(counts[-1] * (dp / totals[-1]))
            self.term_weights = torch.stack(columns, 1).float()
        return self.term_weights

    def _scales(self) -> list[float | torch.Tensor]:
        """Each microbatch's weight in the batch's loss (partition.reduction): its count of targets over
        the batch's (every replica's: one all-reduce of the count, made before this rank's first loss),
        one over the batch's divisor for a ratio's numerator, 1 for a summed loss, else 1/M, or with
        dynamic shapes its samples over the batch's (every replica's: microbatches and replicas may differ
        in size); times the replicas, whose grads and losses are averaged."""
        if self.scales is None:
            pp, w = self.pp, self.pp.weighting
            if w.kind == "terms":  # the last stage weighs each term (_term_weights): the loss is the batch's
                self.scales = [1.0] * pp.M
            elif w.kind == "sum" or w.kind == "mean" and not pp.dynamic:
                self.scales = [float(pp.dp) if w.kind == "sum" else 1.0 / pp.M] * pp.M
            elif w.kind == "mean":  # microbatches, and replicas' batches, may differ in size
                counts, totals = self._counts([], True, "samples")
                self.scales = list(counts[0] * (pp.dp / totals[0]))
            else:
                counts, totals = self._counts([w], False, "count of targets")
                self.scales = list(self._weighed(w, counts[0], totals[0], pp.dp))
        return self.scales

    def _counts(self, parts: list[Any], samples: bool, what: str) -> tuple[list[torch.Tensor], torch.Tensor]:
        """[each microbatch's count of what each of `parts` (partition.reduction.Weighting, of kind count or ratio)
        counts], then of its samples where `samples` (float64, on the device); and their totals over the batch:
        every replica's in one all-reduce (of the batch's `what`), this replica's alone in forward()."""
        pp = self.pp
        values = self.flats if pp.plan.loss else [f + [t] for f, t in zip(self.flats, self.targets)]
        counts = [torch.stack([p.count(v) for v in values]).to(pp.ctx.device) for p in parts]
        if samples:
            counts.append(torch.tensor([float(_samples(f)) for f in self.flats], dtype=torch.float64,
                                       device=pp.ctx.device))
        totals = torch.stack([c.sum() for c in counts]) if counts else torch.zeros(0, dtype=torch.float64)
        if counts and pp.dp_group is not None and not self.inference:
            with comm.guarded(f"the data-parallel all-reduce of the batch's {what}"):
                dist.all_reduce(totals, group=pp.dp_group)
        return counts, totals

    def _weighed(self, w: Any, counts: torch.Tensor, total: torch.Tensor, dp: int) -> torch.Tensor:
        """Each microbatch's weight of a loss (or term) `w` of kind count (its count over the batch's `total`) or
        ratio (one over the batch's divisor, at least its floor), times the replicas `dp` averaging."""
        if w.kind == "ratio":
            return (dp / (total if w.floor is None else total.clamp(min=w.floor))).expand(self.pp.M)
        return counts * (dp / total)

    def _loss(self, output: Any, target: Any) -> torch.Tensor:
        """loss_fn on the model's output; a loss that is not one number, or fails for want of a
        target, is refused with the fix."""
        try:
            loss = self.pp.loss_fn(output, target)
        except Exception as e:  # the user's loss raised
            if target is None:
                raise PipelineError(f"loss_fn(output, target) failed with target=None ({type(e).__name__}: "
                                    f"{first_line(e)}); pass the batch's target: "
                                    "pp.step(*inputs, target=y)") from e
            raise
        check_scalar_loss(loss, "in the step", PipelineError)
        return loss

    def backward(self, a: Action) -> None:
        pp, s, mb = self.pp, a.stage, a.mb
        saved = self.saved[(s, mb)]
        grads: list[torch.Tensor | None] = self.ex.recv_grads(s, mb, saved.roots) if s < pp.S - 1 else [None]
        start = self.clock.mark()
        if a.kind == "B" and pp.split_w:  # input grads; W computes the weight grads
            w_nodes, in_b = pp._zb_params(s)
            leaf_grads = backward_input(saved, grads, in_b, w_nodes)
            kept = any(t is not None for ts in saved.param_grads for t, _ in ts)
            if kept and pp.memory.plain(s) and s not in pp._zb_kept:  # (an offloading stage keeps it by design)
                pp._zb_kept.add(s)  # said once per stage, as a fallback must be
                pp.plan.notes.append(
                    f"zero bubble: stage {s}'s W takes an autograd call per node, not matrix products, from step "
                    f"{pp.steps_done + 1}: a linear layer's input, output and weight differ in dtype or shape (under "
                    "autocast the output is of the low precision), or a later op wrote its output or input in place "
                    "(an inplace activation), so B keeps the graph for W")
        else:  # B without W, or BW (a stage recomputing under zero-bubble): the whole backward
            leaf_grads = backward_full(saved, grads)
            saved.param_outs.clear()
            del self.saved[(s, mb)]
        if s > 0:
            self.ex.send_grads(s, mb, leaf_grads)
        self._record(a, start)

    def weight(self, a: Action) -> None:
        start = self.clock.mark()
        saved = self.saved.pop((a.stage, a.mb))
        backward_weight(saved, self.pp._zb_params(a.stage)[0], None if self.reducer is None else self.reducer.ready,
                        callable_nodes=self.pp._zb_callable[a.stage])
        self._record(a, start)


@contextlib.contextmanager
def failures(pp: Pipeline, run: StepState, when: str) -> Iterator[None]:
    """Classify what fails inside a step or pass: this rank's own error is re-raised as itself (noted with
    the rank, stage and microbatch) after telling every rank; failed communication is RemoteError when
    another rank failed first, else PeerLost."""
    try:
        yield
    except comm.PeerLost as e:
        if pp.reducer is not None:  # no hook of the step left on the parameters
            pp.reducer.fail()
        waited = e.peer if e.peer is not None else (
            None if run.ex.peer is None else pp._global[run.ex.peer])  # global ranks
        me = pp.ctx.rank
        if waited is not None:
            comm.report_lost(waited)  # first, so the ranks waiting on this one follow the chain
        first = comm.first_failure()
        if first is not None:
            raise comm.RemoteError(f"rank {me} stopped in {when} because {first}") from None
        if waited is None:
            raise comm.PeerLost(f"rank {me} lost another rank during {when} ({first_line(e)}); that "
                                "process died or stopped answering within the timeout; see its output") from e
        lost, chain = comm.follow_lost(waited, e.early, me)
        via = "" if lost == waited else (f", which rank {me} waited on through " +
                                         " -> ".join(f"rank {r}" for r in chain[:-1]))
        raise comm.PeerLost(f"rank {me} lost rank {lost} during {when}{via} ({first_line(e)}); that "
                            "process died or stopped answering within the timeout; see its output",
                            lost) from e
    except (Exception, KeyboardInterrupt) as e:  # this rank's own error (the model's, the loss's, a stage's) or an
        if pp.reducer is not None:  # interrupt (found by review: Ctrl-C left the others waiting out the timeout,
            pp.reducer.fail()  # and ranks interrupted at once went on with messages unmatched, some hanging)
        a = run.current
        where = f"rank {pp.ctx.rank}" + (f", stage {a.stage}, microbatch {a.mb} ({a.kind})" if a else "")
        e.add_note(f"fxpipe: raised on {where} of {when}")
        what = "was interrupted" if isinstance(e, KeyboardInterrupt) else "failed"
        comm.fail_everywhere(f"{where} {what} in {when} with {type(e).__name__}: {first_line(e, 300)}")
        raise


# compute actions by kind; the class's functions, not bound methods held by each StepState (a reference cycle
# that kept a finished step, its pipeline and the pipeline's process groups alive until the next collection)
_HANDLERS: dict[str, Callable[[StepState, Action], None]] = {
    "F": StepState.forward, "B": StepState.backward, "W": StepState.weight, "BW": StepState.backward}


def _samples(flat: list[Any]) -> int:
    """A microbatch's samples: dim 0 of its first input tensor that has one (with dynamic shapes every input
    tensor carries the batch there)."""
    return next((x.shape[0] for x in flat if isinstance(x, torch.Tensor) and x.dim()), 1)


def tied_trained(pp: Pipeline) -> dict[str, int]:
    """Before a step sends anything: how many of the ranks holding each tied parameter train it (one small
    all-reduce over the pipeline's ranks, on every rank alike); one frozen on some holders only is refused on
    every rank, before anything runs (found by review: refused after the step, its grads accumulated and the
    process group torn down). {} without tied parameters."""
    names = pp._tied_names
    if not names:
        return {}
    mine = dict(pp.named_parameters())
    counts = torch.tensor([[n in mine, n in mine and mine[n].requires_grad] for n in names], dtype=torch.int64,
                          device=pp.ctx.device)
    with comm.guarded("the all-reduce of which tied parameters are trained"):
        dist.all_reduce(counts, group=pp.pp_group)
    got = {n: (int(h), int(t)) for n, (h, t) in zip(names, counts.tolist())}
    some = [n for n, (h, t) in got.items() if 0 < t < h]
    if some:
        raise PipelineError(f"the tied parameters {', '.join(some)} are frozen (requires_grad=False) on some of the "
                            "ranks holding them and trained on others, which would train them apart; freeze or "
                            "unfreeze them on every rank (through pp.named_parameters() on each)")
    return {n: t for n, (_, t) in got.items()}


def sum_tied_grads(pp: Pipeline, held: dict[int, torch.Tensor], trained: dict[str, int]) -> None:
    """Sum each tied parameter's grad over the ranks that hold it; `held`: what grads held before the step
    (accumulated over steps), so that only this step's part is summed; `trained`: how many holders train each
    (tied_trained, before the step). One frozen on every holder keeps no grad, as on the model (a zero grad would
    have the optimizer step it: weight decay, momentum)."""
    name_of = {id(p): n for n, p in pp.named_parameters()}
    with comm.guarded("the all-reduce of tied parameters' grads"):
        for group, params in pp._tied_groups:
            for p in params:
                if trained.get(name_of[id(p)], 0) == 0:  # frozen on every holder
                    continue
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                g = p.grad  # dp_shard="full": every holder keeps the same shard of it
                if id(p) in held:
                    g.sub_(held[id(p)])
                dist.all_reduce(g.to_local() if isinstance(g, DTensor) else g, group=group)
                if id(p) in held:
                    g.add_(held[id(p)])


def grads_not_finite(pp: Pipeline) -> bool:
    """Whether a grad on any rank of the job holds an inf or a NaN (skip_nonfinite, a finite loss: an overflow in a
    backward, which stepped would make the parameters NaN, and every later step's loss, which skip_nonfinite would
    then drop for good). Collective over the pipeline's ranks and its replicas'."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for p in pp.parameters():
        if p.grad is not None:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            if g.layout == torch.sparse_coo:  # (the fused test takes dense tensors: a sparse grad's values)
                g = g._values()
            elif g.layout != torch.strided:
                g = g.values()
            by_device.setdefault(g.device, []).append(g)
    found = torch.zeros(1, device=pp.ctx.device)
    for device, held in by_device.items():  # (inv_scale 1: the grads unchanged; an exact test, no norm to overflow)
        here = torch.zeros(1, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(held, here, torch.ones(1, device=device))
        found += here.to(found.device)
    with comm.guarded("the check that every grad is finite"):
        if pp.world > 1:
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=pp.pp_group)  # (None: the job's default group)
        if pp.dp_group is not None:
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=pp.dp_group)
    return bool(found.item())


def drop_grads(pp: Pipeline, value: float, accumulated: bool) -> None:
    """skip_nonfinite, a finite loss `value` whose grads are not finite (grads_not_finite): every grad cleared, with
    a warning."""
    for p in pp.parameters():
        p.grad = None
    warnings.warn(f"step {pp.steps_done} (counted from 1): the loss is {value:.6g}, but a grad is not finite (inf or "
                  "NaN: an overflow in a backward), so skip_nonfinite dropped the step and cleared every grad"
                  + (", including those earlier step() calls accumulated since the last zero_grad" if accumulated
                     else ""), RuntimeWarning, stacklevel=3)


def non_finite(pp: Pipeline, value: float, run: StepState, accumulated: bool = False) -> None:
    """Name the first stage whose outputs were not finite; stop, or skip the step if asked: every grad is
    cleared, with a warning when earlier step() calls had accumulated grads (`accumulated`), lost with it."""
    mine = min([s for s, ok in run.finite if not bool(ok)] + [pp.S - 1])
    firsts: list[Any] = [None] * pp.world
    if pp.world > 1:
        dist.all_gather_object(firsts, mine, group=pp.pp_group)
    else:
        firsts = [mine]
    stage = min(firsts)
    if pp.skip_nonfinite:
        for p in pp.parameters():
            p.grad = None
        if accumulated:
            warnings.warn(f"step {pp.steps_done}: the loss is {value}, so skip_nonfinite cleared every grad, "
                          "including those earlier step() calls accumulated since the last zero_grad (no step can "
                          "be taken out of a sum that holds a NaN or inf)", RuntimeWarning, stacklevel=3)
        return
    raise NonFiniteLoss(f"the loss is {value} at step {pp.steps_done} (counted from 1); it first appeared on stage "
                        f"{stage} (rank {pp._global[pp.place[stage]]}); the step's grads are left as computed (not "
                        "finite): call optimizer.zero_grad() before the next step if you go on; lower the learning "
                        "rate, check the data, or pass skip_nonfinite=True to drop such steps (their grads are "
                        "cleared)")
