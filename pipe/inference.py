"""Inference and validation on a pipeline (pp.evaluate, pp.forward), in either mode: in the mode the stages
were not traced in, this rank's stages cut from a trace made in it (pipe.modes), their modules' flags set
to it while they run."""
from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from partition.plan import PlanError
from partition.reduction import keep_numerator, literal_numbers, loss_weighting, output_forms, weigh_terms
from partition.split import assemble_outputs, inference_stage, param_nodes_of
from partition.trace import flatten_inputs
from pipe import calls, comm, modes
from pipe.errors import ModeError, PipelineError, agree_everywhere
from pipe.step import StepState, check_layout, concat_outputs, failures, placed

if TYPE_CHECKING:
    from pipe.runtime import Pipeline

__all__ = ["evaluate", "flags", "forms", "forward", "loss_weights", "output_layout", "output_shapes",
           "stages_in_mode_of"]


def output_layout(pp: Pipeline) -> list[tuple[Any, bool]] | None:
    """Per leaf of the model's output, as pipe.step.concat_outputs takes it: the dim its batch is along,
    from a meta copy of the model run on the example microbatch and on twice its samples (the dim that
    doubles; None when no dim changes, or a value that is not a tensor is the same at both; ("pairs", shape
    on one, shape on two) when it grows more than twice, as logits [B, B] of in-batch negatives; "?"
    otherwise), and whether the graph computes it from the inputs. None when the model does not run on
    meta tensors (then dim 0 is taken by its size). Found once per mode."""
    if pp.training not in pp._layouts:
        fed, dims = _computed_from_inputs(pp._gm), _batch_dims(pp._model, *pp._example, pp.training)
        pp._layouts[pp.training] = list(zip(dims, fed)) if fed is not None and dims is not None and \
            len(fed) == len(dims) else None
    return pp._layouts[pp.training]


def forms(pp: Pipeline) -> list[tuple[str | None, int | None]] | None:
    """Per leaf of the model's output, how the batch's value is formed from the microbatches' where the layout
    alone does not say (partition.reduction.output_forms: one number's sum, mean, max or min; a sequence-first
    output flattened to tokens), from the plan's graph; found once."""
    if pp._forms is None:
        leaves, _ = _output_nodes(pp._gm)
        try:
            pp._forms = output_forms(pp._gm, leaves, flatten_inputs(pp._gm, *pp._example, pp._example_target),
                                     pp._literals)
        except Exception:  # noqa: BLE001 - unknown: one number averaged with a warning, dim 0 concatenated
            pp._forms = [(None, None)] * len(leaves)
    return pp._forms


def _output_nodes(gm: torch.fx.GraphModule) -> tuple[list[Any], list[bool]]:
    """Per leaf of the model's output in gm: its node (None: a constant, or a node a rewrite renamed), and
    whether it was a node."""
    from partition.loss import has_loss, model_outputs
    from partition.trace import flatten_outputs
    nodes = {n.name: n for n in gm.graph.nodes}
    if has_loss(gm):
        return ([nodes.get(x) if is_node else None for is_node, x in model_outputs(gm)[0]],
                [is_node for is_node, _ in model_outputs(gm)[0]])
    leaves = list(flatten_outputs(gm)[0])
    return leaves, [isinstance(x, torch.fx.Node) for x in leaves]


def loss_weights(pp: Pipeline, flats: list[list[Any]]) -> dict[int, list[float]]:
    """{the leaf of the model's output that is the loss the pipeline weighs (a model's own loss, `out.loss`):
    each microbatch's weight in the batch's} for forward(), as a step weighs it (partition.reduction: by
    counted targets, summed; a ratio by its divisor over the batch's, each at least the ratio's floor: exact
    unless a microbatch's divisor is 0 where its numerator is not); {} for any other output, or when the
    count needs the target forward() lacks."""
    w = pp.weighting
    leaves, _ = _output_nodes(pp._gm)
    names = [x.name if isinstance(x, torch.fx.Node) else None for x in leaves]
    leaf = next((names.index(n) for n in w.chain if n in names), None)  # (out.loss, not the loss_fn's cast of it)
    # a ratio's numerator, which the graph returns in its place (partition.reduction.keep_numerator), is the leaf
    # or what the leaf reads on the way (a model's own loss outside the graph; `2 * ratio` in the model)
    numerator = w.kind == "ratio" and (w.numerator in names or leaf is not None and w.ratio in w.chain
                                       and w.chain.index(names[leaf]) < w.chain.index(w.ratio))  # type: ignore
    if numerator and leaf is None:
        leaf = names.index(w.numerator)
    if leaf is None or w.kind == "mean":
        return {}
    if w.kind == "terms":  # the stage computing the leaf weighs its terms (_weighing): the sum is the batch's
        return {leaf: [1.0] * len(flats)}
    if w.kind == "sum":
        return {leaf: [1.0] * len(flats)}
    try:
        counts = [float(w.count(f if pp.plan.loss else [*f, None])) for f in flats]
    except Exception:  # noqa: BLE001 - a count that reads the target (forward() has none), or a tensor not here
        return {}
    total = sum(counts)
    if w.kind == "ratio" and w.floor is not None:  # each ratio = its numerator / max(its divisor, floor)
        counts, total = [max(c, w.floor) for c in counts], max(total, w.floor)
    if numerator:  # the sum of the numerators over the batch's divisor: exact, also where a divisor is 0
        return {leaf: [1.0 / total] * len(counts)} if total > 0 else {}
    return {leaf: [c / total for c in counts]} if total > 0 else {}


def _computed_from_inputs(gm: torch.fx.GraphModule) -> list[bool] | None:
    """Per leaf of the model's output in gm: whether an input of the model's (not the loss's target) is among
    the values it is computed from."""
    from partition.loss import TARGET
    leaves, named = _output_nodes(gm)
    out = []
    for leaf, is_node in zip(leaves, named):
        if not isinstance(leaf, torch.fx.Node):
            out.append(is_node)  # a node renamed by a rewrite: taken as computed from the inputs
            continue
        seen, todo, fed = set(), [leaf], False
        while todo and not fed:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            fed = n.op == "placeholder" and n.name != TARGET
            todo.extend(n.all_input_nodes)
        out.append(fed)
    return out


def output_shapes(model: torch.nn.Module, args: Any, kwargs: Any, gm: torch.fx.GraphModule
                  ) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """The shape of each tensor the model outputs on the example and at twice its samples (a meta copy run on
    them), by the name of its node in gm (partition.reduction: where the graph fixes its sizes, the loss's own ops
    run on the outputs so shaped, and a loss reading one that pairs the samples is said not to be the batch's);
    {} when the model does not run on meta tensors."""
    shapes = _leaf_shapes(model, args, kwargs, model.training)
    leaves, _ = _output_nodes(gm)
    if shapes is None or len(shapes[1]) != len(leaves):
        return {}
    return {n.name: (tuple(one), tuple(two)) for n, one, two in zip(leaves, *shapes)
            if isinstance(n, torch.fx.Node) and one[:1] != ("value",) and two[:1] != ("value",)}


def literals_at_twice(model: torch.nn.Module, args: Any, kwargs: Any, gm: torch.fx.GraphModule) -> dict[str, Any]:
    """For a graph torch.export traced (`gm`), which fixes the sizes it computes with as numbers: each node's op and
    numbers (partition.reduction.literal_numbers) in a trace of a meta copy of the model at twice the example's
    samples, by node name (a number that differs is a size of the batch: x.sum() / x.shape[0]); {} for another
    graph, or where that trace fails."""
    if gm.meta.get("fxpipe_tracer") != "torch.export.export":
        return {}
    from partition.meta import meta_copy
    from partition.trace import export_graph
    try:
        copy = meta_copy(model).train(model.training)
        a, kw = pytree.tree_map(lambda x: torch.cat([x.to("meta")] * 2) if isinstance(x, torch.Tensor) and x.dim()
                                else x, (tuple(args), dict(kwargs)))
        with torch.device("meta"):
            two = export_graph(copy, a, kw)
    except Exception:  # noqa: BLE001 - a model that needs values: its sizes stay unknown
        return {}
    return {n.name: literal_numbers(n) for n in two.graph.nodes if n.op == "call_function"}


def _leaf_shapes(model: torch.nn.Module, args: Any, kwargs: Any, training: bool) -> list[list[Any]] | None:
    """The shape of each leaf of the model's output (("value", it) for one that is not a tensor) on the example
    microbatch and on twice its samples, from a meta copy of the model; None when it does not run on meta."""
    from partition.meta import meta_copy
    shapes = []
    try:
        copy = meta_copy(model).train(training)
        for k in (1, 2):
            a, kw = pytree.tree_map(lambda x: torch.cat([x.to("meta")] * k) if isinstance(x, torch.Tensor) and x.dim()
                                    else x, (tuple(args), dict(kwargs)))
            with torch.no_grad(), torch.device("meta"):  # (a tensor made without a device: on meta too)
                out = copy(*a, **kw)
            shapes.append([tuple(x.shape) if isinstance(x, torch.Tensor) else ("value", x)
                           for x in pytree.tree_leaves(out)])
    except Exception:  # noqa: BLE001 - a model that needs values (an .item(), a data-dependent shape)
        return None
    return shapes


def _batch_dims(model: torch.nn.Module, args: Any, kwargs: Any, training: bool) -> list[Any] | None:
    """The batch dim of each leaf of the model's output (see output_layout), or None."""
    shapes = _leaf_shapes(model, args, kwargs, training)
    if shapes is None or len(shapes[0]) != len(shapes[1]):
        return None
    dims: list[Any] = []
    for one, two in zip(*shapes):
        if one[:1] == ("value",) or two[:1] == ("value",):  # not a tensor: the batch's when the same at both sizes
            dims.append(None if one == two else "?")
            continue
        if len(one) != len(two):
            dims.append("?")
            continue
        changed = [d for d, (a, b) in enumerate(zip(one, two)) if a != b]
        grows = math.prod(two) / max(1, math.prod(one))
        dims.append(None if not changed else changed[0] if len(changed) == 1 and two[changed[0]] == 2 *
                    one[changed[0]] else ("pairs", one, two) if grows > 2 else "?")
    return dims


def stages_in_mode_of(pp: Pipeline, inference: bool) -> tuple[dict[int, Any] | None, dict[int, Any] | None]:
    """In the mode the stages were traced in: (None, None). Else this rank's stages cut from a trace
    in the current mode, (each stage as step calls it, each as forward calls it when the loss is in the
    graph: without it); built once, a failure raised on every rank."""
    if pp.training == pp._traced_mode:
        return None, None
    if "stages" not in pp._other_mode:
        error = None
        try:
            # under FSDP a meta copy made before sharding; on a GPU, where the stages' parameters were moved
            # off the model's device, a meta copy; matched to the plan's own trace (found: a meta copy's trace in
            # the plan's mode has copies the model's lacks, torch.export numbering its nodes otherwise)
            model = pp._other_mode.get("model")
            model = modes.traceable(pp._model, *pp._example) if model is None else model
            gm = modes.traced_in_mode(model, *pp._example, pp.training, leaf_modules=pp.leaf_modules,
                                      loss_fn=pp.loss_fn, loss=pp.plan.loss, device=pp.ctx.device)
            if pp.weighting.kind == "ratio":  # its numerator returned, as in the plan's mode
                found = loss_weighting(gm, pp.loss_fn, pp.plan.loss,
                                       flatten_inputs(gm, *pp._example, pp._example_target), pp._example_target)
                if found.kind != "ratio":
                    raise ValueError(f"its loss is no longer a ratio of sums ({found.describe()})")
                keep_numerator(gm, found)
            names: dict[str, str] = {}
            pp._other_mode["stages"] = _streamed(pp, _weighing(pp, modes.stages_in_mode(
                gm, pp._plan_graph, pp._gm, pp.plan, pp._trained, names), names, strict=True))
            pp._other_mode["gm"], pp._other_mode["names"] = gm, names
        except Exception as e:  # noqa: BLE001 - whatever the trace or the cut raises: on every rank, not one
            error = (f"{type(e).__name__}: in {'training' if pp.training else 'eval'} mode the model traces "
                     f"otherwise than the plan's graph ({e}); build a Pipeline from the model in that mode")
        agree_everywhere(error, ModeError, pp.pp_group, when=f"cutting the stages in {_mode(pp)} mode")
    if inference and pp.plan.loss and "inference" not in pp._other_mode:
        error, gm, names = None, pp._other_mode["gm"], pp._other_mode["names"]
        if any(names.get(n.name, n.name) != n.name for n in gm.graph.nodes):  # (torch.export numbers its nodes:
            gm = modes.renamed(gm, names)  # without dropout, others) inference_stage cuts by the plan's names
        try:
            pp._other_mode["inference"] = _streamed(pp, _weighing(pp, {s: inference_stage(gm, pp.plan, s,
                                                                                          pp._trained[s])
                                                                       for s in pp.local}))
        except Exception as e:  # noqa: BLE001 - a value the cut misses (found by review: a KeyError on one
            # rank, the other waiting for it until the timeout)
            error = (f"forward() in {'training' if pp.training else 'eval'} mode, the loss in the graph: the "
                     f"stages without the loss cannot be cut from the mode's graph ({type(e).__name__}: {e}); "
                     "evaluate() works, and so does forward() on a Pipeline built with trace_loss=False (the loss "
                     "outside the graph: its stages are the model's own in either mode)")
        agree_everywhere(error, ModeError, pp.pp_group, when=f"cutting the stages without the loss in {_mode(pp)} "
                         "mode")
    return pp._other_mode["stages"], pp._other_mode.get("inference") if inference else None


def _weighing(pp: Pipeline, stages: dict[int, Any], names: dict[str, str] | None = None, strict: bool = False
              ) -> dict[int, Any]:
    """`stages` (stage -> (module, ...)), the last stage, where this rank holds it, weighing the loss's terms
    as the training stage does (partition.reduction.weigh_terms; `names`: its nodes -> the plan's). `strict`:
    a stage computing the loss (another mode's training stage) that does not add the terms where the plan's
    graph does is refused (ValueError); a stage without the loss (forward()) that does not is left as it is."""
    last = pp.S - 1
    if pp.weighting.parts and last in stages and not weigh_terms(stages[last][0], pp.weighting, names) \
            and strict:
        raise ValueError(f"its loss does not add the terms {', '.join(n for _, _, n in pp.weighting.at)} where the "
                         "plan's graph adds them")
    return stages


def _mode(pp: Pipeline) -> str:
    return "training" if pp.training else "eval"


def _streamed(pp: Pipeline, stages: dict[int, Any]) -> dict[int, Any]:
    """`stages`: forward-only modules of this rank's stages (with what they are called with), each made to
    fetch the chunks of the parameters it reads where they stream (offload='states'); returned."""
    for s, (gm, *_) in stages.items():
        pp.memory.stream_forward_only(s, gm, param_nodes_of(gm, [n.name for n in gm.graph.nodes]))
    return stages


def flags(pp: Pipeline, other: bool) -> contextlib.AbstractContextManager[None]:
    """In the other mode than the trace's: every module of this rank's stages in the pipeline's mode for
    the call (their own flags restored after); in the trace's mode the flags stay as the user set them."""
    return modes.in_mode([pp._trained[s] for s in pp.local], pp.training) if other \
        else contextlib.nullcontext()


def evaluate(pp: Pipeline, batch_args: tuple[Any, ...], batch_kwargs: dict[str, Any], target: Any) -> float:
    """Pipeline.evaluate: the training stages' forwards under no_grad over the forward-only program, in the
    pipeline's mode, the loss where step() computes it, then the mean loss on every rank."""
    mbs, targets = calls.agreed_call(pp, (batch_args, batch_kwargs), target, "evaluate")
    stages, _ = stages_in_mode_of(pp, inference=False)
    flats = pp._flats(mbs, targets)
    pp._weigh_by_target(flats[0], targets[0])
    run = StepState(pp, flats, targets, calls.exchange(pp), inference=True, evaluating=True, stages=stages)
    with _plain(pp), torch.no_grad(), failures(pp, run, "evaluation"), flags(pp, stages is not None):
        if stages is not None and pp.sharded is not None:  # gathered as the stages' own forward would
            _gather(pp, stages)
        run.forwards(pp.inference_program)
        if pp.sharded is not None:  # no backward frees the parameters the forwards gathered
            pp.sharded.reshard()
        loss = pp._mean_loss(run)
        calls.learned(pp, run.ex)  # (the loss's broadcast: the last collective of every rank)
    return float(loss.item())


def _gather(pp: Pipeline, stages: dict[int, Any]) -> None:
    """dp_shard="full": gather this rank's stages' parameters, as a training stage's own forward would, for
    `stages` (stage -> (module, ...)), modules cut from the training stage that call it for nothing: where they read
    a parameter as an attribute (get_attr: torch.export's graphs), theirs is the sharded one they were cut with,
    and FSDP swaps the gathered one in on the training stage alone (found by review: forward() and eval-mode
    evaluate() raised "mixed torch.Tensor and DTensor" on every model torch.export traced). Each is pointed at the
    training stage's parameter, gathered."""
    for s in pp.local:
        root = pp._trained[s]
        root.unshard()  # type: ignore[operator]
        gm = stages[s][0] if s in stages else root
        for n in gm.graph.nodes if gm is not root else ():
            if n.op != "get_attr":
                continue
            *path, field = n.target.split(".")
            owner, there = gm.get_submodule(".".join(path)), root.get_submodule(".".join(path))
            if field in owner._parameters and field in there._parameters:
                owner._parameters[field] = there._parameters[field]


def _plain(pp: Pipeline) -> Any:
    """Outside torch.inference_mode() for a sharded pipeline (dp_shard="full"): the parameters its first
    gather allocates would be inference tensors, which no later step could write."""
    return torch.inference_mode(False) if pp.sharded is not None else contextlib.nullcontext()


def forward(pp: Pipeline, batch_args: tuple[Any, ...], batch_kwargs: dict[str, Any]) -> Any:
    """Pipeline.forward: the stages without the loss (when the plan has it in its graph) over the
    forward-only program, then the model's output gathered to every rank and placed on its device."""
    mbs, _ = calls.agreed_call(pp, (batch_args, batch_kwargs), None, "forward", training=False)
    if pp.plan.loss and not pp._inference:  # stages without the loss, returning the model's outputs
        error = None
        try:
            pp._inference = _streamed(pp, _weighing(pp, {s: inference_stage(pp._gm, pp.plan, s, pp._trained[s])
                                                         for s in pp.local}))
        except PlanError as e:
            error = f"PipelineError: forward() on this pipeline: {e}"
        except Exception as e:  # noqa: BLE001 - raised on every rank, not on one while the others wait
            error = f"PipelineError: forward() on this pipeline: the stages without the loss: {type(e).__name__}: {e}"
        agree_everywhere(error, group=pp.pp_group, when="cutting the stages without the loss for forward()")
    stages, inference = stages_in_mode_of(pp, inference=True)  # (None, None) in the mode of the trace
    layout = output_layout(pp)
    check_layout(layout)  # (the same on every rank: a meta run's)
    flats = pp._flats(mbs, [None] * pp.M)
    last = pp.place[pp.S - 1]
    # a model's own loss, weighed as a step weighs it: by the last stage's rank, which holds the loss's tensors
    weights = loss_weights(pp, flats) if pp.rank == last else {}
    sizes = [next((x.shape[0] for x in pytree.tree_leaves(mb) if isinstance(x, torch.Tensor) and x.dim()), 0)
             for mb in mbs]  # each microbatch's: the outputs that hold the batch have it along dim 0
    exchange = calls.exchange(pp)
    run = StepState(pp, flats, [None] * pp.M, exchange, inference=True, stages=stages,
                    inference_stages=inference)
    shape = forms(pp)
    with _plain(pp), torch.no_grad(), failures(pp, run, "inference"), flags(pp, stages is not None):
        if pp.sharded is not None and (pp._inference or stages):  # gathered as the stages' forward would
            _gather(pp, inference or pp._inference or stages or {})
        run.forwards(pp.inference_program)
        if pp.sharded is not None:  # inference has no backward to free the gathered parameters
            pp.sharded.reshard()
        if pp._inference:  # each rank holds the outputs its stages computed: every rank gathers them
            parts: list[Any] = [(run.outputs, weights)]
            if pp.world > 1:
                parts = [None] * pp.world
                with comm.guarded("the gather of the output"):
                    dist.all_gather_object(parts, (run.outputs, weights), group=pp.pp_group)
            outputs = [assemble_outputs(pp._gm, {k: v for p, _ in parts for k, v in (p[mb] or {}).items()})
                       for mb in range(pp.M)]
            box: list[Any] = [_formed_or_refused(outputs, sizes, layout, parts[last][1], shape)]
        else:
            box = [_formed_or_refused(run.outputs, sizes, layout, weights, shape) if pp.rank == last else None]
            if pp.world > 1:  # (pickled: through the host, where a device tensor would name the sender's device)
                box = [placed(box[0], torch.device("cpu"))]
                with comm.guarded("the broadcast of the output", last):
                    dist.broadcast_object_list(box, src=pp._global[last], group=pp.pp_group)
        calls.learned(pp, exchange)
    if isinstance(box[0], _Refused):  # every rank, after the step's messages are all in: the pipeline stays usable
        raise PipelineError(box[0].message)
    return placed(box[0], pp.ctx.device)


class _Refused:
    """forward()'s refusal of an output (pipe.step.concat_outputs), sent to every rank as its result."""
    def __init__(self, message: str) -> None:
        self.message = message


def _formed_or_refused(outputs: list[Any], sizes: list[int], layout: Any, weights: dict[int, list[float]],
                       shape: Any) -> Any:
    try:
        return concat_outputs(outputs, sizes, layout, weights, shape)
    except PipelineError as e:  # (raised by every rank after the output's broadcast, not inside the run)
        return _Refused(str(e))
