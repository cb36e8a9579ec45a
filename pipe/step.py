"""One step on one rank: the interpreter of a lowered program (pipe.lower), running each action's
forward, backward or weight-grad computation on this rank's stages, its messages through the exchange and
its memory actions through the memory manager, and timing each action on the device."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.utils._pytree as pytree

from partition.errors import first_line
from partition.planner import check_scalar_loss
from partition.trace import unflatten_outputs
from pipe.backward import Saved, backward_full, backward_input, backward_weight
from pipe.errors import PipelineError
from pipe.exchange import Exchange
from pipe.schedules import Action
from pipe.simulate import Event
from pipe.timing import clock_for

if TYPE_CHECKING:
    from pipe.runtime import Pipeline

__all__ = ["StepState", "concat_outputs", "placed"]


def placed(tree: Any, device: torch.device) -> Any:
    """`tree` with its tensors on `device`."""
    return pytree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, tree)


def concat_outputs(outputs: list[Any]) -> Any:
    """Microbatch outputs as one batch: tensors concatenated along dim 0, 0-dim tensors averaged."""
    flat = [pytree.tree_flatten(o) for o in outputs]
    spec = flat[0][1]
    leaves = []
    for column in zip(*[f[0] for f in flat]):
        x = column[0]
        if isinstance(x, torch.Tensor):
            leaves.append(torch.cat(column, 0) if x.dim() else torch.stack(column).mean())
        else:
            leaves.append(x)
    return pytree.tree_unflatten(leaves, spec)


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
        self.clock = clock_for(pp.ctx.device)  # device time: CUDA events on CUDA, read after the step
        self.clock.begin()
        self.handlers = {"F": self.forward, "B": self.backward, "W": self.weight, "BW": self.backward}
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
            self.handlers[x.kind](x)
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
            outs = list(module(*leaves, *[self.flats[mb][i] for i in inputs]))
            sent = len(outs) - len(extras)
            if not io.last:
                self.ex.send_activations(s, mb, outs[:sent])
            if extras:
                mine = self.outputs[mb] = self.outputs[mb] or {}
                mine.update({i: x.cpu() if isinstance(x, torch.Tensor) and pp.world > 1 else x  # (gathered as objects)
                             for i, x in zip(extras, outs[sent:])})
            return
        model_inputs = [self.flats[mb][i] for i in io.inputs]
        args = leaves + model_inputs
        if self.stages is not None:  # the other mode's stage, without grads: no memory or W split to manage
            module, inputs = self.stages[s]
            outs, param_outs, ins = module(*leaves, *[self.flats[mb][i] for i in inputs]), (), []
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
            self.loss_sum = self.loss_sum + loss.detach().double() / pp.M  # stays on device: no sync
            roots = [loss / pp.M]
        else:
            self.ex.send_activations(s, mb, outs)
            roots = outs
            self.finite += [(s, torch.isfinite(o).all()) for o in outs if o.is_floating_point()]
        if self.evaluating:  # no backward follows
            return
        self.saved[(s, mb)] = Saved(roots=roots, leaves=[x if x.is_floating_point() else None for x in leaves],
                                    param_outs=list(param_outs), param_ins=list(ins[0]) if ins else [])
        self._record(a, start)

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
                    "autocast the output is of the low precision), so B keeps the graph for W")
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
        backward_weight(saved, self.pp._zb_params(a.stage)[0], None if self.reducer is None else self.reducer.ready)
        self._record(a, start)
