"""How a step's loss is formed from its microbatches' losses, so that it is the batch's.

A step computes the loss on each microbatch. A loss averaging the same number of elements in
every microbatch (a mean squared error, a cross entropy over every token) gives the batch's loss
as the mean of the microbatches' (microbatches are equal in size). A cross entropy or NLL loss
averages over the targets it does not ignore (`ignore_index`), weighed by class weights when it
has them: there the mean of the microbatches' losses weighs a microbatch with few counted targets
(a short sequence padded with -100, a prompt masked out) like a full one, and a microbatch whose
every target is ignored gives NaN. `weighting` finds such a loss at the end of the graph and the
targets it reads, computed from the graph's inputs alone; a step then weighs each microbatch's
loss by its count of targets over the batch's (pipe.step), which is the batch's loss exactly. A
loss with reduction="sum", or a .sum() over a tensor holding every sample's terms (its elements
double when the batch does), is the sum of the microbatches' losses. A ratio of two such sums, the
divisor computed from the inputs alone (a masked mean written by hand: (loss * mask).sum() /
mask.sum(), clamped below or not), is the batch's when every microbatch's numerator is divided by
the batch's divisor: the graph returns the numerator (`keep_numerator`) and a step scales it by
one over the batch's divisor. Any other loss: their mean, and the plan's notes say why.
"""
from __future__ import annotations

import dataclasses
import inspect
import math
import operator
import warnings
from dataclasses import dataclass, field
from difflib import SequenceMatcher
from typing import Any, Callable, Sequence

import torch
import torch.fx
import torch.nn.functional as F
import torch.utils._pytree as pytree

from partition.costs import attr_of
from partition.loss import TARGET
from partition.rewrite import loss_args

__all__ = ["TERMS", "Weighting", "batch_statistics", "keep_numerator", "literal_numbers", "loss_weighting",
           "output_forms", "pairing_read", "weigh_terms", "weighting"]

# element-wise losses: the batch's sum is the sum of the microbatches' sums
_SUMMED = {F.mse_loss: "mse_loss", F.l1_loss: "l1_loss", F.smooth_l1_loss: "smooth_l1_loss",
           F.huber_loss: "huber_loss", F.binary_cross_entropy: "binary_cross_entropy",
           F.binary_cross_entropy_with_logits: "binary_cross_entropy_with_logits"}
_SUMMED_MODULES = (torch.nn.MSELoss, torch.nn.L1Loss, torch.nn.SmoothL1Loss, torch.nn.HuberLoss, torch.nn.BCELoss,
                   torch.nn.BCEWithLogitsLoss)
_ATEN_ELEMENTWISE = {torch.ops.aten.mse_loss.default: "mse_loss", torch.ops.aten.l1_loss.default: "l1_loss",
                     torch.ops.aten.smooth_l1_loss.default: "smooth_l1_loss",
                     torch.ops.aten.huber_loss.default: "huber_loss",
                     torch.ops.aten.binary_cross_entropy.default: "binary_cross_entropy",
                     torch.ops.aten.binary_cross_entropy_with_logits.default: "binary_cross_entropy_with_logits"}
_PURE_OPS = ("placeholder", "call_function", "call_method", "get_attr")


@dataclass
class Weighting:
    """How the batch's loss is formed from the microbatches' losses.

    kind: "count" (each microbatch's loss weighs by `count` of its targets over the batch's),
    "sum" (their sum), "ratio" (the loss is a sum over a sum, `ratio` = `numerator` / a divisor
    that `count` gives per microbatch, at least `floor`: each microbatch's numerator over the batch's
    divisor) or "mean" (their mean). `describe` is the plan's note."""
    kind: str
    why: str
    loss: str = ""                                 # the loss's name, as the notes give it
    # the graph's inputs, then the tensors named by `attrs` -> (the loss's target, class weights)
    targets: torch.fx.GraphModule | None = None
    ignore_index: int = -100
    attrs: list[str] = field(default_factory=list)  # tensors the target's ops read, by path in `holder`
    weight_path: str | None = None                 # the class weights of a loss module, by path in `holder`
    written: list[int] = field(default_factory=list)  # inputs the target's ops write in place: copied first
    # where `attrs` and `weight_path` are read when counting: the module computing the loss now (the pipeline's
    # last stage, whose tensors a checkpoint or weights= loaded), else `origin`, the graph the weighting was found in
    holder: torch.nn.Module | None = None
    origin: torch.nn.Module | None = None
    # the graph's nodes giving the loss, from the output in: each passes on the next's value (a cast, a shared
    # scale); one of them a model's own loss (`out.loss`), an output forward() weighs alike
    chain: list[str] = field(default_factory=list)
    ratio: str = ""       # "ratio": the division node, the numerator the graph returns in its place, the node
    numerator: str = ""   # reading the division on the way to the output ("": the output), and the divisor's
    reader: str = ""      # lower bound (x.clamp(min=1)), if any
    floor: float | None = None
    # "mean" that is not the batch's: losses each pairing its own microbatch's samples only, terms weighed otherwise
    inexact: bool = False
    # "terms": a loss adding terms the batch forms each its own way (a cross entropy over counted targets plus a
    # mean auxiliary loss, as a mixture of experts' router adds): each term's weighting
    # and where the term is added: (the adding node, its argument, the term's name)
    parts: list[Weighting] = field(default_factory=list)
    at: list[tuple[str, int, str]] = field(default_factory=list)
    counted: tuple[Any, ...] = ()  # "count": what it counts (target, ignore_index, class weights), to compare terms
    elements: bool = False  # "count": of the target's elements (an element-wise loss over values a mask selects)

    def _tensor(self, path: str) -> Any:
        for root in (self.holder, self.origin):
            if root is not None:
                try:
                    return attr_of(root, path)
                except AttributeError:
                    continue
        raise AttributeError(f"the loss's {path} is in neither the last stage nor the graph")

    def count(self, values: Sequence[Any]) -> torch.Tensor:
        """The weight of one microbatch, from the values of the graph's inputs (float64, 0-dim, on
        the target's device): its targets other than ignore_index, each counted by its class
        weight when the loss has one. Probabilities as the target (soft labels): the loss
        averages over the rows, as many in every microbatch, so their number."""
        assert self.targets is not None
        values = [v.clone() if i in self.written and isinstance(v, torch.Tensor) else v for i, v in enumerate(values)]
        target, weight = self.targets(*values, *[self._tensor(p) for p in self.attrs])
        if self.kind == "ratio":  # the divisor's sum over this microbatch
            return target.to(torch.float64)
        if self.weight_path is not None:
            weight = self._tensor(self.weight_path)
        if target.is_floating_point() or self.elements:
            return torch.tensor(float(target.numel()), dtype=torch.float64, device=target.device)
        valid = target != self.ignore_index
        if weight is None:
            return valid.sum(dtype=torch.float64)
        w = weight.to(device=target.device, dtype=torch.float64)[torch.where(valid, target, 0)]
        return torch.where(valid, w, 0.0).sum()

    def describe(self, replicas: int = 1, dynamic: bool = False) -> str:
        """The plan's note (`dynamic`: the pipeline's microbatches may differ in size, dynamic_shapes=True)."""
        over = " over every replica's batch" if replicas > 1 else ""
        if self.kind == "count" and self.elements:
            return (f"loss: the batch's, each microbatch's {self.loss} weighs by its target's elements (the values "
                    f"a mask selects) over the batch's{over}")
        if self.kind == "count":
            weighed = " (by class weight)" if self.weight_path is not None or self._graph_weight() else ""
            what = (f"each microbatch's {self.loss} weighs by its targets other than ignore_index="
                    f"{self.ignore_index}{weighed} over the batch's{over}")
            return f"loss: the batch's, {what}"
        if self.kind == "sum":
            return f"loss: the batch's, the sum of the microbatches' ({self.loss}){over}"
        if self.kind == "ratio":
            floor = f", at least {self.floor:g}" if self.floor is not None else ""
            once = [n for (_, _, n), p in zip(self.at, self.parts) if p.kind == "mean"]
            added = f"; {', '.join(once)}, the same in every microbatch, added once" if once else ""
            return (f"loss: the batch's, {self.loss}: each microbatch's numerator over the batch's divisor{floor} "
                    f"(computed from the inputs){added}{over}")
        if self.kind == "terms":
            each = "; ".join(f"{n}{_named(n, p.loss)}: {_part_note(p)}" for (_, _, n), p in zip(self.at, self.parts))
            said = "NOT the batch's, " if self.inexact else ""
            return f"loss: {said}its terms each weighed in its microbatch as the batch forms it{over}: {each}"
        if self.inexact:
            return f"loss: NOT the batch's, the mean of the microbatches' losses: {self.why}"
        if dynamic:
            return (f"loss: the mean of the microbatches' losses, each weighed by its samples over the batch's{over} "
                    f"(the batch's when each averages over its samples alike): {self.why}")
        return (f"loss: the mean of the microbatches' losses (the batch's when each averages as many elements): "
                f"{self.why}")

    def _graph_weight(self) -> bool:
        assert self.targets is not None
        out = next(n for n in self.targets.graph.nodes if n.op == "output")
        return isinstance(out.args[0][1], torch.fx.Node)


_SAME = "the same in every microbatch"  # a "terms" part: a number, or a penalty of the weights alone


def _named(name: str, loss: str) -> str:
    """" (what the term is)" after the term's node name, when its loss says more than the name."""
    what = loss.removeprefix(f"{name}: ")
    return f" ({what})" if what and what != name else ""


def _part_note(w: Weighting) -> str:
    """How a term of a "terms" loss is weighed, for the plan's note."""
    if w.kind == "ratio":
        floor = f", at least {w.floor:g}" if w.floor is not None else ""
        return f"each microbatch's numerator over the batch's divisor{floor}"
    if w.kind == "count":
        weighed = " (by class weight)" if w.weight_path is not None or w._graph_weight() else ""
        what = "its target's elements" if w.elements else f"its targets other than ignore_index={w.ignore_index}"
        return f"weighed by {what}{weighed} over the batch's"
    if w.kind == "sum":
        return "the sum of the microbatches'"
    if w.why == _SAME:
        return "the same in every microbatch, added once (1/M in each)"
    if w.inexact:
        return f"the mean of the microbatches', NOT the batch's: {w.why}"
    return ("the mean of the microbatches' (the batch's where each averages as many elements; a statistic of a "
            "microbatch's samples together, as a router's load-balancing loss, is each microbatch's own, as under "
            "gradient accumulation)")


def _elementwise(gm: torch.fx.GraphModule, node: torch.fx.Node) -> tuple[str, Any, str] | None:
    """(name, target, reduction) when `node` is an element-wise loss (mse_loss, l1_loss, ... as a function, an ATen
    op or a module; not under a legacy size_average/reduce), else None."""
    if node.op == "call_function" and node.target in _SUMMED:
        got: dict[str, Any] = dict(zip(inspect.signature(node.target).parameters, node.args))
        got.update(node.kwargs)
        if got.get("size_average") is not None or got.get("reduce") is not None:
            return None
        return _SUMMED[node.target], got.get("target"), got.get("reduction", "mean")
    if node.op == "call_function" and node.target in _ATEN_ELEMENTWISE:
        got = {a.name: x for a, x in zip(node.target._schema.arguments, node.args)}
        got.update(node.kwargs)
        return _ATEN_ELEMENTWISE[node.target], got.get("target"), ("none", "mean", "sum")[int(got.get("reduction", 1))]
    if node.op == "call_module" and len(node.args) == 2 and not node.kwargs:
        mod = gm.get_submodule(str(node.target))
        if type(mod) in _SUMMED_MODULES:
            return type(mod).__name__, node.args[1], str(getattr(mod, "reduction", "mean"))
    return None


def _summed(gm: torch.fx.GraphModule, node: torch.fx.Node) -> str | None:
    """The name of an element-wise loss with reduction='sum' that `node` is, or None."""
    found = _elementwise(gm, node)
    return found[0] if found is not None and found[2] == "sum" else None


_MUL = {operator.mul, torch.mul, torch.ops.aten.mul.Tensor, torch.ops.aten.mul.Scalar, "mul", "__mul__", "__rmul__"}
_DIV = {operator.truediv, torch.div, torch.true_divide, torch.ops.aten.div.Tensor, torch.ops.aten.div.Scalar, "div",
        "true_divide", "__truediv__"}


def _batch_constants(gm: torch.fx.GraphModule, example: Sequence[Any] | None, weights: bool = False
                     ) -> set[torch.fx.Node]:
    """Nodes every microbatch of a batch gives the same value: inputs that are not tensors or are 0-dim tensors
    (repeated, not split: num_items_in_batch), with `weights` the module's tensors too (parameters and buffers: an
    L2 penalty of the weights, which a loss may add but not be scaled by: a microbatch counting no target has a
    NaN loss, weighed 0, and the grad of a weight scaling it would be 0 x NaN; found by review of the change), and
    pure ops of them alone."""
    out: set[torch.fx.Node] = {n for n in gm.graph.nodes if n.op == "get_attr"} if weights else set()
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, n in enumerate(inputs):
        x = example[i] if example is not None and i < len(example) else n.meta.get("val")
        if x is not None and not _split(x) and n.name != TARGET:
            out.add(n)
    for n in gm.graph.nodes:
        if n.op in ("call_function", "call_method") and n.all_input_nodes and all(a in out for a in n.all_input_nodes) \
                and not _random(gm, n):
            out.add(n)
    return out


def _split(value: Any) -> bool:
    """Whether microbatches split `value` (pipe.calls.split_microbatches: a tensor of 1 dim or more, in any
    container), rather than each getting it whole."""
    return any(isinstance(x, torch.Tensor) and x.dim() > 0 for x in pytree.tree_leaves(value))


def _scaled(node: torch.fx.Node, constants: set[torch.fx.Node]) -> torch.fx.Node | None:
    """The loss `node` multiplies or divides by a value every microbatch shares (a number, num_items_in_batch):
    the microbatches' losses then form the batch's as that loss's do."""
    if node.op not in ("call_function", "call_method") or len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    shared = [not isinstance(x, torch.fx.Node) and isinstance(x, (int, float)) or x in constants for x in (a, b)]
    if node.target in _MUL:
        return a if shared[1] and isinstance(a, torch.fx.Node) else b if shared[0] and isinstance(b, torch.fx.Node) \
            else None
    if node.target in _DIV and shared[1] and isinstance(a, torch.fx.Node):
        return a
    return None


def weighting(gm: torch.fx.GraphModule, example: Sequence[Any] | None = None,
              twice: Callable[[], dict[str, tuple[int, ...]]] | None = None,
              literals: Callable[[], dict[str, Any]] | None = None) -> Weighting:
    """How the loss `gm` returns (a graph with the loss attached: partition.loss.attach_loss, or the
    model's own loss) forms the batch's from the microbatches'; `example`: the values of gm's inputs
    for one microbatch, the loss's target last when it is one (without them, a .sum() is not known
    to be over the samples, nor an input to be shared by every microbatch); `twice`: the model's outputs' shapes
    at twice the samples, by node name, where the graph fixes its sizes, and `literals` its nodes' numbers there
    (see _Sizes). See the module's doc."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    loss = out.args[0]
    if isinstance(loss, (tuple, list)) and len(loss) == 1:
        loss = loss[0]
    if not isinstance(loss, torch.fx.Node):
        return Weighting("mean", "the loss is not a value of the graph")
    found, chain, reader = _weigh(gm, loss, _batch_constants(gm, example), _Sizes(gm, example, twice, literals),
                                  _batch_constants(gm, example, weights=True))
    found.chain = chain
    if found.kind == "ratio":
        found.reader = reader
    return found


def _weigh(gm: torch.fx.GraphModule, loss: torch.fx.Node, constants: set[torch.fx.Node], sizes: _Sizes,
           shared: set[torch.fx.Node]) -> tuple[Weighting, list[str], str]:
    """weighting's answer for the loss node `loss`, the nodes from it in to the loss it weighs (each passes
    on the next's value) and the node reading that loss ("" for `loss` itself); `constants`: values every
    microbatch shares, `shared` with the weights' too (a loss they scale is a sum or a ratio as the loss it
    scales, not a count; a term of them alone is added alike to every microbatch's loss)."""
    chain, reader, by_weight = [loss.name], "", ""
    numbers: list[torch.fx.Node] = []  # scalings by a number: a size of the microbatch, where torch.export fixed it?
    # x * 0.5, a sum / num_items_in_batch, alpha * loss, loss.float(), the .sum() of one number
    while True:
        inner = _scaled(loss, shared)
        if inner is not None and _scaled(loss, constants) is None:
            by_weight = loss.name
        if inner is not None and any(_number(a) for a in loss.args):
            numbers.append(loss)
        inner = inner or _as_it_is(loss, sizes)
        if inner is None:
            break
        loss, reader = inner, loss.name
        chain.append(loss.name)
    found, chain, reader = _weighed(gm, loss, constants, sizes, shared, chain, reader)
    if numbers:  # (found by review: x.sum() / x.shape[0] under torch.export, a mean over the microbatch, was weighed
        found = _over_sizes(found, numbers, sizes)  # as a sum, M x the batch's, silently)
    if by_weight and found.kind == "count":  # (found by review of the change: a NaN grad, silently)
        found = Weighting("mean", f"the loss {found.loss} is scaled by a weight ({by_weight}): weighed by counts, a "
                                  "microbatch counting no target (its loss NaN, weighed 0) would give that weight the "
                                  "grad 0 x NaN, so the mean of the microbatches' losses, the batch's only where each "
                                  "counts as many targets", inexact=True)
    return found, chain, reader


def _weighed(gm: torch.fx.GraphModule, loss: torch.fx.Node, constants: set[torch.fx.Node], sizes: _Sizes,
             shared: set[torch.fx.Node], chain: list[str], reader: str) -> tuple[Weighting, list[str], str]:
    """_weigh's answer for `loss`, its scaling peeled."""
    if _adds(loss):
        return _terms(gm, loss, constants, sizes, shared), chain, reader
    pairs = sizes.paired(loss)
    if pairs is not None:
        one, two = sizes.of(pairs) or (0, 0)  # (known: its growth is what pairs)
        found = Weighting("mean", f"the loss pairs the samples of a microbatch ({pairs.name} has {one} "
                                  f"elements on one microbatch and {two} on two, not twice as many: "
                                  "in-batch negatives, a similarity of every two samples), and a pipeline computes "
                                  "each microbatch alone, so each pairs its own samples only (fewer microbatches "
                                  "pair more)", inexact=True)
    else:
        found = _found(gm, loss, sizes, shared)
    return found, chain, reader


_ADDS = {operator.add, operator.sub, torch.add, torch.sub, torch.ops.aten.add.Tensor, torch.ops.aten.sub.Tensor,
         "add", "sub", "__add__", "__radd__", "__sub__", "__rsub__"}


def _per_sample(nodes: list[torch.fx.Node], sizes: _Sizes) -> str:
    """How the numbers `nodes` scale a value by (_Sizes.sized): "constant" (all of them), "per sample" (one of
    them over the count of the samples, the others constants: a sum so scaled is a mean), "other" (any other
    change at twice the samples), or "unknown" (a number fxpipe cannot tell: no trace at twice the samples)."""
    kinds = []
    for n in nodes:
        kind = sizes.sized(n)
        divides = n.target in _DIV and _number(n.args[1]) and not _number(n.args[0])
        kinds.append("constant" if kind == "constant" else "per sample"
                     if (kind, divides) in (("samples", True), ("per sample", False)) else
                     "unknown" if kind == "unknown" else "other")
    varying = [k for k in kinds if k != "constant"]
    return "constant" if not varying else "per sample" if varying == ["per sample"] else \
        "unknown" if "unknown" in varying else "other"


def _may_count(numbers: list[torch.fx.Node], sizes: _Sizes) -> bool:
    """Whether a number among the arguments of `numbers` could be a size of the microbatch that torch.export fixed
    in the graph: it or one over it, times or over 2, 3 or 4 (n / 2 folded into one number), is a
    product of dims of one of the graph's inputs or values that takes a dim that may grow with the samples (a graph
    input's dim 0 times some of its other dims: the samples, their tokens), as an intermediate value's number of
    elements does; or its square is (sqrt(n)), or it plus or minus one (n - 1). A loss's coefficient (0.001 or 0.1,
    a mixture of experts' router term) or a count of experts mostly is none, and then no trace at twice the samples
    is made to tell (whole numbers up to 8 made 0.1 one over 5 x 2 samples)."""
    if sizes.gm.meta.get("fxpipe_tracer") != "torch.export.export":
        return False
    inputs = [tuple(t.shape) for t in sizes.example or () if isinstance(t, torch.Tensor) and t.dim() > 0]
    grow = {s[0] * math.prod(s[1:][i] for i in subset) for s in inputs for subset in _subsets(len(s) - 1)}
    shapes = set(inputs) | {tuple(n.meta["val"].shape) for n in sizes.gm.graph.nodes
                            if isinstance(n.meta.get("val"), torch.Tensor)
                            and all(isinstance(d, int) for d in n.meta["val"].shape)}
    counts = set(grow)
    for shape in shapes:
        for subset in _subsets(len(shape)):
            if any(shape[i] in grow for i in subset):
                counts.add(math.prod(shape[i] for i in subset))
    values = [abs(v) for n in numbers for v in literal_numbers(n)[1] if v]
    forms = [x for v in values for base in (v, 1 / v) for x in [base, base * 2, base * 3, base * 4, base / 2,
                                                                 base / 3, base / 4, base * base, base + 1, base - 1]]
    return any(x >= 1 and abs(x - round(x)) <= 1e-6 * x and round(x) in counts for x in forms)


def _subsets(n: int) -> list[tuple[int, ...]]:
    """The subsets of range(n) (of its first 8: a value of more dims is rare), the empty one first."""
    n = min(n, 8)
    return [tuple(i for i in range(n) if mask >> i & 1) for mask in range(1 << n)]


def _constant(numbers: list[torch.fx.Node], sizes: _Sizes) -> bool:
    """Whether the numbers among the arguments of `numbers` scale a mean by a constant: none could be a size of the
    microbatch (_may_count), or each is the same in a trace at twice the samples."""
    return not numbers or not _may_count(numbers, sizes) or _per_sample(numbers, sizes) == "constant"


def _over_sizes(found: Weighting, numbers: list[torch.fx.Node], sizes: _Sizes) -> Weighting:
    """`found`, the weighting of a loss `numbers` scale: where torch.export fixed the microbatch's size as a number,
    a sum over it is a mean, and one fxpipe cannot tell from a constant makes the loss the microbatches' mean,
    said not to be the batch's; a mean scaled by a number that may be such a size and is not the same at twice the
    samples (z.mean() * x.shape[0], a sum written so) is said not to be the batch's, as under torch.fx
    (_by_a_size)."""
    if found.kind == "mean":  # (found by review: averaged with the note that it is the batch's where each
        # microbatch averages as many elements, 1/M of the sum z.mean() * n writes, silently in effect)
        if found.inexact or _constant(numbers, sizes):
            return found
        return Weighting("mean", f"{', '.join(n.name for n in numbers)} scales {found.loss or 'the loss, a mean,'} "
                                 "by a number torch.export fixed in the graph that is a size of the microbatch (it is "
                                 "not the same in a trace at twice the samples) or that fxpipe cannot tell from one: "
                                 "the mean of the microbatches' losses; write the loss as a sum or a mean over the "
                                 "samples, or make the model traceable by torch.fx", inexact=True)
    # (found by review: a count or a ratio scaled by a number fxpipe could not tell, sqrt(n) among them, was taken for
    # one scaled by a constant: the batch's, silently; a sum asks for the trace whatever its number, as a mistake
    # there is M x the loss)
    how = _per_sample(numbers, sizes)
    if how == "constant" or how == "unknown" and found.kind != "sum" and not _may_count(numbers, sizes):
        return found
    names = ", ".join(n.name for n in numbers)
    if how == "per sample" and found.kind == "sum":
        return Weighting("mean", f"{names} scales {found.loss} by one over the microbatch's count of samples, a number "
                                 "torch.export fixed in the graph (it doubles in a trace at twice the samples): a sum "
                                 "over the microbatch over its size, a mean")
    if how == "per sample":
        return Weighting("mean", f"{names} scales {found.loss or found.kind} by one over the microbatch's count of "
                                 "samples, a number torch.export fixed in the graph: the mean of the microbatches' "
                                 "losses", inexact=True)
    return Weighting("mean", f"{names} scales {found.loss} by a number that torch.export fixed in the graph and "
                             "fxpipe cannot tell from a constant (a size of the microbatch, sqrt(n) or n - 1, or a "
                             "trace at twice the samples failed or took other ops): the mean of the microbatches' "
                             "losses; write the scaling with the model's values (x.mean(), a tensor of the count) or "
                             "make the model traceable by torch.fx", inexact=True)


_SIZED = ("{} is computed from the weights alone with a number torch.export fixed in the graph that is not the same "
          "at twice the samples, or that fxpipe cannot tell from a constant (a penalty over the microbatch's size): "
          "not the same in every microbatch of another size")


def _fixed(node: torch.fx.Node, sizes: _Sizes, shared: set[torch.fx.Node]) -> bool:
    """Whether `node`, a value every microbatch shares (computed from the weights and numbers alone), is the same
    whatever the microbatch's size: where torch.export traced the graph, every number it is computed with stays at
    twice the samples (found by review: w.pow(2).sum() / x.shape[0] under torch.export was added once, as a
    constant, silently)."""
    if sizes.gm.meta.get("fxpipe_tracer") != "torch.export.export":
        return True
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in seen or n not in shared:
            continue
        seen.add(n)
        if n.op == "call_function" and literal_numbers(n)[1] and sizes.sized(n) != "constant":
            return False
        todo.extend(n.all_input_nodes)
    return True


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _adds(node: torch.fx.Node) -> bool:
    """Whether `node` adds or subtracts two values (no alpha=) of which one at least is a node."""
    return (node.op in ("call_function", "call_method") and node.target in _ADDS and len(node.args) == 2
            and not node.kwargs and any(isinstance(a, torch.fx.Node) for a in node.args))


def _terms(gm: torch.fx.GraphModule, node: torch.fx.Node, constants: set[torch.fx.Node], sizes: _Sizes,
           shared: set[torch.fx.Node]) -> Weighting:
    """The weighting of a loss that adds terms (a cross entropy plus an auxiliary loss): each term's, when they
    agree (every term a sum, or a count of the same targets; a number every microbatch shares added to a count
    or a mean); the mean of the microbatches' losses where a term is not the batch's anyway (pairs its samples)
    or every term is a mean; else "terms": each term weighed its own way where the graph adds it (weigh_terms)."""
    terms: list[tuple[str, Weighting | None]] = []
    for a in node.args:
        if isinstance(a, torch.fx.Node) and a in shared and not _fixed(a, sizes, shared):
            terms.append((a.name, Weighting("mean", _SIZED.format(a.name), inexact=True)))
            continue
        if not isinstance(a, torch.fx.Node) or a in shared:
            terms.append((a.name if isinstance(a, torch.fx.Node) else repr(a), None))
            continue
        w, _, reader = _weigh(gm, a, constants, sizes, shared)
        if w.kind == "ratio":  # (weigh_terms reads its numerator there)
            w.reader = reader
        terms.append((a.name, w))
    kinds = {w.kind for _, w in terms if w is not None}
    named = [(n, w) for n, w in terms if w is not None]  # (not a shared number)
    loss = " + ".join(f"{n} ({w.loss or w.kind})" if w is not None else f"{n} (the same in every microbatch)"
                      for n, w in terms)
    if kinds == {"sum"} and len(named) == len(terms):
        return Weighting("sum", "", loss=loss)
    if kinds == {"count"} and len({w.counted for _, w in named}) == 1 and named[0][1].counted:
        return dataclasses.replace(named[0][1], loss=loss)
    inexact = next((w for _, w in named if w.inexact), None)
    if kinds == {"mean"} and inexact is not None:
        return Weighting("mean", inexact.why, inexact=True)
    if kinds == {"mean"}:
        return Weighting("mean", "the loss adds terms each formed as a mean: "
                                 + "; ".join(f"{n}: {w.why}" for n, w in named))
    nested = next((n for n, w in named if w.kind == "ratio" and w.parts), None)
    if nested is not None:  # (found by review: its penalty was added M times, silently)
        return Weighting("mean", f"the loss adds terms the batch forms each its own way ({loss}), one of them a ratio "
                                 f"({nested}) whose numerator adds a penalty of the weights to its sums, which fxpipe "
                                 "weighs apart only where the ratio is the whole loss: the mean of the microbatches' "
                                 "losses", inexact=True)
    parts: list[Weighting] = []  # each term weighed its own way where it is added (weigh_terms)
    at: list[tuple[str, int, str]] = []
    for i, (n, part) in enumerate(terms):
        if part is not None and part.kind == "terms":
            parts += part.parts
            at += part.at
            continue
        parts.append(part if part is not None else Weighting("mean", _SAME))
        at.append((node.name, i, n))
    # a term not the batch's (a sum over a number fxpipe cannot tell, a pairing loss) is weighed as the mean of the
    # microbatches', the others still each their own way (found by review: the whole loss averaged, a cross entropy
    # then NaN on a microbatch counting no target)
    return Weighting("terms", "", loss=loss, parts=parts, at=at, inexact=any(p.inexact for p in parts))


def _structure(value: Any) -> Any:
    """What `value` (a node, or an argument holding nodes) computes, by op, not by name: two terms counting
    `t.flatten()` each count the same targets. Inputs by position, tensors of the module by path."""
    if isinstance(value, torch.fx.Node):
        if value.op == "placeholder":
            return ("input", value.name)
        return (value.op, str(value.target), _structure(value.args), _structure(value.kwargs))
    if isinstance(value, (tuple, list)):
        return tuple(_structure(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _structure(v)) for k, v in value.items()))
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value))
    return repr(value)


def pairing_read(gm: torch.fx.GraphModule, w: Weighting, shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]
                 ) -> Weighting:
    """`w`, or a "mean" said not to be the batch's when the loss gm returns is computed from a model output that
    pairs the samples of a microbatch (`shapes`: the outputs' shapes on one microbatch and on two, by node name;
    logits [B, B] of in-batch negatives grow 4x). Found by review: CLIP's own loss, computed inside the model where
    the graph's sizes are fixed, was said to be the batch's (1.214 for the batch's 2.875)."""
    if w.inexact:
        return w
    pairs = {n: (one, two) for n, (one, two) in shapes.items()
             if one and len(one) == len(two) and math.prod(one) > 0 and math.prod(two) > 2 * math.prod(one)}
    out = next(n for n in gm.graph.nodes if n.op == "output")
    loss = out.args[0][0] if isinstance(out.args[0], (tuple, list)) else out.args[0]
    if not pairs or not isinstance(loss, torch.fx.Node):
        return w
    seen, todo = set(), [loss]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    hit = next((n for n in gm.graph.nodes if n in seen and n.name in pairs), None)
    if hit is None:
        return w
    one, two = pairs[hit.name]
    return Weighting("mean", f"the loss is computed from {hit.name}, which pairs the samples of a microbatch (shape "
                             f"{list(one)} on one, {list(two)} on two: more than twice the elements, in-batch "
                             "negatives), and a pipeline computes each microbatch alone, so each pairs its own samples "
                             "only (fewer microbatches pair more)", inexact=True, chain=w.chain)


_MAXES = {torch.max, torch.amax, torch.ops.aten.max.default, torch.ops.aten.amax.default, "max", "amax"}
_MINS = {torch.min, torch.amin, torch.ops.aten.min.default, torch.ops.aten.amin.default, "min", "amin"}
_RESHAPES = {"view", "reshape", "flatten", "contiguous", torch.reshape, torch.flatten, torch.ops.aten.view.default,
             torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.clone.default}


def output_forms(gm: torch.fx.GraphModule, leaves: Sequence[torch.fx.Node | None], example: Sequence[Any] | None,
                 literals: Callable[[], dict[str, Any]] | None = None) -> list[tuple[str | None, int | None]]:
    """How the batch's value of each of `leaves` (the model's outputs in gm) is formed from the microbatches',
    for forward(): (for a value of one element: "sum", "mean" (of every element of a tensor holding each
    sample's, as many in each), "max", "min", or None when unknown; for a tensor whose dim 0 merges its batch
    dim with dims before it (a sequence-first [T, B, V] output flattened to tokens, `.view(-1, V)`: its rows
    run over the positions, each over the samples): the product of those dims before, else None). From a run
    of a meta copy of gm on one microbatch and on two (example: gm's inputs for one microbatch)."""
    sizes, constants = _Sizes(gm, example, literals=literals), _batch_constants(gm, example)
    return [(None, None) if n is None else (_one_value(gm, n, constants, sizes), _within(n, sizes)) for n in leaves]


def _one_value(gm: torch.fx.GraphModule, node: torch.fx.Node, constants: set[torch.fx.Node], sizes: _Sizes
               ) -> str | None:
    """How a value of one element forms the batch's (see output_forms)."""
    scaled, numbers = False, []
    while True:
        inner = _scaled(node, constants)
        if inner is not None and any(_number(a) for a in node.args):
            numbers.append(node)
        if inner is None and node.op in ("call_function", "call_method") and node.target in _CASTS \
                and node.args and isinstance(node.args[0], torch.fx.Node):
            inner = node.args[0]
        if inner is None:
            break
        scaled, node = scaled or node.target not in _CASTS, inner
    if sizes.of(node) != (1, 1):
        return None
    by_size = _by_a_size(gm, node, sizes, constants)  # (x.sum() / x.shape[0] under torch.fx: a mean)
    if by_size is not None:
        return None if by_size.inexact else "mean"
    if _additive(gm, node, sizes) is not None:  # (x.sum() / x.shape[0] under torch.export: a mean)
        return {"constant": "sum", "per sample": "mean"}.get(_per_sample(numbers, sizes)) if numbers else "sum"
    arg = node.args[0] if node.op in ("call_function", "call_method") and len(node.args) == 1 and not node.kwargs \
        else None  # over every element: no dim
    if isinstance(arg, torch.fx.Node) and sizes._carries(arg) and sizes.mixed(arg) is False:
        if node.target in _MEANS:
            return "mean" if _constant(numbers, sizes) else None  # (z.mean() * x.shape[0] under torch.export)
        if not scaled and node.target in _MAXES:  # (scaled by a negative number, a max would be a min)
            return "max"
        if not scaled and node.target in _MINS:
            return "min"
    found = _elementwise(gm, node)
    if found is not None and found[2] == "mean" and isinstance(node.args[0], torch.fx.Node) \
            and sizes._carries(node.args[0]) and sizes.mixed(node) is False:
        return "mean" if _constant(numbers, sizes) else None
    return None


def _within(node: torch.fx.Node, sizes: _Sizes) -> int | None:
    """For a tensor whose dim 0 doubles with the batch: the product of the dims before the batch that its dim 0
    merges with it, reached back through reshapes (view, flatten) from a tensor with the batch along a later dim;
    None when its dim 0 is the batch's alone (or unknown)."""
    got = sizes.shapes(node)
    if got is None or not got[0] or got[1][0] != 2 * got[0][0]:
        return None
    rows = got[0][0]
    while node.op in ("call_function", "call_method") and node.target in _RESHAPES and node.args \
            and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
        got = sizes.shapes(node)
        if got is None or len(got[0]) != len(got[1]):
            return None
        changed = [d for d, (a, b) in enumerate(zip(*got)) if a != b]
        if len(changed) != 1 or got[1][changed[0]] != 2 * got[0][changed[0]]:
            return None
        d = changed[0]
        if d == 0:
            return None
        lead = math.prod(got[0][:d])
        if rows % (lead * got[0][d]) == 0 and any(math.prod(got[0][:j + 1]) == rows for j in range(d, len(got[0]))):
            return lead
    return None


_aten = torch.ops.aten
_BATCH_NORMS = {F.batch_norm, torch.batch_norm, _aten.batch_norm.default, _aten._native_batch_norm_legit.default,
                _aten._native_batch_norm_legit_functional.default, _aten._native_batch_norm_legit.no_stats,
                _aten.native_batch_norm.default, _aten._native_batch_norm_legit_no_training.default}


def batch_statistics(gm: torch.fx.GraphModule) -> list[str]:
    """The batch norms of `gm` normalizing by the statistics of the samples they are given (training mode): a
    pipeline gives them one microbatch's, where the model over the batch uses the batch's."""
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_module":
            m = gm.get_submodule(str(n.target))
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and (m.training or m.running_mean is None):
                out.append(str(n.target))
        elif n.op == "call_function" and n.target in _BATCH_NORMS \
                and n.target is not _aten._native_batch_norm_legit_no_training.default:
            if n.kwargs.get("training", next((a for a in n.args if isinstance(a, bool)), False)):  # (its first bool)
                out.append(n.name)
    return out


def keep_numerator(gm: torch.fx.GraphModule, w: Weighting) -> None:
    """For a "ratio" weighting found in `gm`: the graph's loss reads the numerator where it read the
    ratio (in place; the ratio stays, a model's own output forward() may return). A step then scales
    each microbatch's numerator by one over the batch's divisor, the batch's loss exactly, also where a
    microbatch's divisor is 0 (its ratio NaN, and the grads through it)."""
    if w.kind != "ratio":
        return
    nodes = {n.name: n for n in gm.graph.nodes}
    reader = nodes[w.reader] if w.reader else next(n for n in gm.graph.nodes if n.op == "output")
    reader.replace_input_with(nodes[w.ratio], nodes[w.numerator])
    gm.recompile()


def literal_numbers(node: torch.fx.Node) -> tuple[str, tuple[float, ...]]:
    """(`node`'s op, the numbers among its arguments), to compare with a trace at other sizes (_Sizes.sized)."""
    return str(node.target), tuple(x for x in pytree.tree_leaves((node.args, node.kwargs))
                                   if isinstance(x, (int, float)) and not isinstance(x, bool))


TERMS = "fxpipe_term_weights"  # the input weigh_terms adds: each term's weight in the batch's loss


def weigh_terms(gm: torch.fx.GraphModule, w: Weighting, names: dict[str, str] | None = None) -> bool:
    """For a "terms" weighting (or a "ratio" whose numerator adds a penalty of the weights to its sums: the
    numerator's terms): `gm` (a stage) takes one more input, last, TERMS: one microbatch's weight of each
    term in the batch's loss (pipe.step), and adds each term as where(weight > 0, term, 0) * weight (a microbatch
    counting no target has a NaN cross entropy, weighed 0, whose grads stay 0); a ratio term as its numerator
    times its weight (one over the batch's divisor: a ratio over no sample is NaN, its grads too, where its
    numerator is 0). The scalings and casts between
    the adding nodes and the loss are linear, so the loss is the weighed sum of its terms. `names`: gm's node
    -> the node of the weighting's graph it stands for (a trace in another mode). True when done; False, gm
    unchanged, when gm does not hold every adding node (the terms are added on another stage)."""
    if not w.parts:
        return False
    by = {(names or {}).get(n.name, n.name): n for n in gm.graph.nodes if n.op != "placeholder"}  # (a value
    adds = [by.get(name) for name, _, _ in w.at]  # received from another stage bears the name of its node there)
    ratios = [(p, add) for p, add in zip(w.parts, adds) if p.kind == "ratio"]
    if any(a is None for a in adds) or any(p.ratio not in by or p.numerator not in by or p.reader and p.reader not in by
                                           for p, _ in ratios):
        return False
    for p, add in ratios:  # a ratio term adds its numerator, weighed by one over the batch's divisor (keep_numerator)
        assert add is not None
        (by[p.reader] if p.reader else add).replace_input_with(by[p.ratio], by[p.numerator])
    g = gm.graph
    inputs = [n for n in g.nodes if n.op == "placeholder"]
    with g.inserting_after(inputs[-1]) if inputs else g.inserting_before(next(iter(g.nodes))):
        weights = g.placeholder(TERMS, default_value=None)  # (after any input with a default)
    for k, (add, (_, i, _), part) in enumerate(zip(adds, w.at, w.parts)):
        assert add is not None
        term = add.args[i]
        with g.inserting_before(add):
            weight = g.call_function(operator.getitem, (weights, k))
            if isinstance(term, torch.fx.Node) and part.kind != "ratio":  # (a numerator over no sample is 0)
                term = g.call_function(torch.where, (g.call_function(operator.gt, (weight, 0)), term, 0.0))
            weighed = g.call_function(operator.mul, (term, weight))
        add.update_arg(i, weighed)
    gm.meta[TERMS] = True  # (what a caller asks: does it take the weights)
    gm.recompile()
    return True


class _Sizes:
    """gm's values on one microbatch and on two (a meta copy of gm run on the example, then on it twice
    along dim 0, as microbatches are split), found at the first question: a tensor's number of elements, a
    number's or a size's value. From them, `of` and `mixed`."""
    def __init__(self, gm: torch.fx.GraphModule, example: Sequence[Any] | None,
                 twice: Callable[[], dict[str, tuple[int, ...]]] | None = None,
                 literals: Callable[[], dict[str, Any]] | None = None) -> None:
        self.gm, self.example, self.twice, self.literals = gm, example, twice, literals
        self._literals: dict[str, Any] | None = None
        self.values: dict[str, list[Any]] | None = None
        self.why = ""  # why the run gave nothing
        self._mixed: dict[torch.fx.Node, bool] = {}
        self._paired: dict[torch.fx.Node, torch.fx.Node | None] | None = None

    def sized(self, node: torch.fx.Node) -> str:
        """What the number among `node`'s arguments is, where torch.export traced the graph and fixed the sizes it
        computes with as numbers (x.sum() / x.shape[0] divides by one), from a trace at twice the samples
        (`literals`: literal_numbers of its nodes, by name, in program order; the two graphs' ops aligned in order,
        as their names shift where one has ops the other lacks: an expand at other sizes, a branch on a size):
        "constant" (the same there; also in a graph keeping sizes as values), "samples" (doubled: a count of the
        samples, or of their tokens), "per sample" (halved: one over such a count), "other" (changed otherwise:
        sqrt(n), n - 1, two of them), or "unknown" (no such trace: it failed; or no op there aligned with it)."""
        if self.gm.meta.get("fxpipe_tracer") != "torch.export.export":
            return "constant"
        if self._literals is None:
            two = list((self.literals() if self.literals is not None else {}).values())
            mine = [n for n in self.gm.graph.nodes if n.op == "call_function"]
            self._literals = {}
            ops = SequenceMatcher(a=[str(n.target) for n in mine], b=[t for t, _ in two], autojunk=False)
            for tag, i1, i2, j1, j2 in ops.get_opcodes():
                if tag == "equal":
                    self._literals.update((n.name, there) for n, there in zip(mine[i1:i2], two[j1:j2]))
        there = self._literals.get(node.name)
        if there is None:
            return "unknown"
        one = literal_numbers(node)[1]
        changed = [(a, b) for a, b in zip(one, there[1]) if a != b]
        if len(one) != len(there[1]) or len(changed) > 1:
            return "other"
        if not changed:
            return "constant"
        a, b = changed[0]
        return "samples" if b == 2 * a else "per sample" if 2 * b == a else "other"

    def of(self, node: torch.fx.Node) -> tuple[int, int] | None:
        """The number of elements of the tensor `node` gives, on one microbatch and on two; None unknown."""
        got = self._values(node)
        return (got[0][1], got[1][1]) if got is not None and got[0][0] == "tensor" else None

    def shapes(self, node: torch.fx.Node) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """The shape of the tensor `node` gives, on one microbatch and on two; None unknown (also where only the
        loss's own ops ran)."""
        got = self._values(node)
        return (got[0][2], got[1][2]) if got is not None and got[0][0] == "tensor" and len(got[0]) > 2 else None

    def _values(self, node: torch.fx.Node) -> list[Any] | None:
        if self.values is None:
            self.values = self._run()
        got = self.values.get(node.name)
        return got if got is not None and len(got) == 2 else None

    def _carries(self, node: torch.fx.Node) -> bool:
        n = self.of(node)
        return n is not None and n[0] > 0 and n[1] == 2 * n[0]

    def paired(self, node: torch.fx.Node) -> torch.fx.Node | None:
        """The first value `node` is computed from, among the model's outputs and the loss's own ops, whose elements
        grow more than twice at twice the samples (logits [B, B] of in-batch negatives pair every two), or None
        (also when unknown). Inside the model such a value may pair nothing (a block-diagonal mask of packed
        sequences, [B T, B T]): the values the loss reads decide."""
        if self._paired is None:
            self._paired = {}
            inside = _model_part(self.gm)
            for n in self.gm.graph.nodes:
                k = self.of(n)
                own = n if k is not None and k[0] > 0 and k[1] > 2 * k[0] and n not in inside else None
                self._paired[n] = own or next((p for a in n.all_input_nodes if (p := self._paired[a]) is not None),
                                              None)
        return self._paired.get(node)

    def _along_the_batch(self, node: torch.fx.Node) -> bool:
        """Whether `node` combines its input's values along the batch's dim (the one that doubles): a cumsum, a
        softmax, a sort over the samples; an op of _ALONG whose dim is not known counts as one."""
        if node.op not in ("call_function", "call_method") or node.target not in _ALONG or not node.args \
                or not isinstance(node.args[0], torch.fx.Node):
            return False
        got = self.shapes(node.args[0])
        if got is None or len(got[0]) != len(got[1]):
            return False
        batch = [d for d, (a, b) in enumerate(zip(*got)) if a != b]
        if not batch:
            return False
        at, default = _ALONG[node.target]
        name = "dims" if node.target in (torch.flip, "flip", _aten_ops.flip.default, torch.roll, "roll",
                                         _aten_ops.roll.default) else "dim"
        dim = node.args[at] if len(node.args) > at else node.kwargs.get(name, default)
        dims: list[Any] = list(dim) if isinstance(dim, (tuple, list)) else [dim]
        if any(not isinstance(d, int) for d in dims):  # (not known, or none: roll over the flattened tensor)
            return True
        rank = len(got[0])
        return any(int(d) % rank in batch for d in dims if rank)

    def _changes(self, node: torch.fx.Node) -> bool:
        got = self._values(node)
        return got is not None and got[0][0] == "value" and got[0] != got[1]

    def mixed(self, node: torch.fx.Node) -> bool | None:
        """Whether a sample's values in `node` may depend on other samples of its microbatch (None: unknown):
        it is computed from a tensor made of the batch that is not one per sample (a .sum(), a .mean(0), a
        mask's count), or from the batch's size as a value (x / x.shape[0], not x.view(x.shape[0], -1))."""
        if self._values(node) is None and node.op != "placeholder":
            return None
        if not self._mixed:
            made: dict[torch.fx.Node, bool] = {}  # computed from values the batch makes (per sample, its size)
            for n in self.gm.graph.nodes:  # (in program order: inputs first)
                ins = n.all_input_nodes
                got = self._values(n)
                if got is not None and got[0][0] == "value":  # a number, a size: made of the batch if it changes
                    made[n] = self._changes(n)
                elif got is None and n.target is getattr:  # x.device, x.dtype: no value of the batch's
                    made[n] = False
                else:
                    made[n] = any(made[a] or self._carries(a) for a in ins)
                if n.op == "placeholder" or any(self._mixed[a] for a in ins) or self.of(n) is None:
                    self._mixed[n] = n.op != "placeholder" and any(self._mixed[a] for a in ins)
                    continue
                reduced = [a for a in ins if self.of(a) is not None and not self._carries(a) and made[a]]
                counted = [a for a in ins if self._changes(a)] if n.target not in _SHAPES else []
                self._mixed[n] = bool(reduced or counted) or self._along_the_batch(n)
        return self._mixed[node]

    def _run(self) -> dict[str, list[Any]]:
        from partition.meta import meta_copy
        if self.example is None or len(self.example) != sum(n.op == "placeholder" for n in self.gm.graph.nodes):
            self.why = "no example of its inputs was given"
            return {}
        if self.example[-1] is None and any(n.op == "placeholder" and n.name == TARGET and n.users
                                            for n in self.gm.graph.nodes):
            self.why = "no example target was given (example_target= gives one)"
            return {}
        values: dict[str, list[Any]] = {}

        class Recorder(torch.fx.Interpreter):
            def run_node(self, n: torch.fx.Node) -> Any:
                value = super().run_node(n)
                if isinstance(value, torch.Tensor):
                    values.setdefault(n.name, []).append(("tensor", value.numel(), tuple(value.shape)))
                elif isinstance(value, (int, float, torch.Size)) or isinstance(value, tuple) and all(
                        isinstance(v, (int, float)) for v in value):
                    values.setdefault(n.name, []).append(("value", tuple(value) if isinstance(value, tuple)
                                                          else value))
                return value
        try:
            with warnings.catch_warnings():  # (copying the graph's recorded tree specs warns of their deprecated kind)
                warnings.simplefilter("ignore", FutureWarning)
                copy = meta_copy(self.gm)
            for k in (1, 2):
                example = pytree.tree_map(lambda x: (torch.cat([x.to("meta")] * k) if x.dim() else x.to("meta"))
                                          if isinstance(x, torch.Tensor) else x, list(self.example))
                with torch.no_grad(), torch.device("meta"):  # (a tensor made without a device: on meta too)
                    Recorder(copy).run(*example)
        except Exception as e:  # noqa: BLE001 - a graph that needs values (.item(), a data-dependent shape) or fixed sizes
            self.why = f"the graph does not run on the meta device at twice the example's samples ({type(e).__name__})"
            values.clear()
            try:
                self._loss_part(Recorder)
            except Exception:  # noqa: BLE001 - the loss's own ops need values too
                values.clear()
                return {}
            self.why = ""
        return values

    def _loss_part(self, recorder: type[torch.fx.Interpreter]) -> None:
        """Record the loss's own ops alone, on one microbatch and two, where the whole graph does not run (torch.export
        fixes the model's sizes in its graph; Hugging Face's mask helpers copy to the CPU): the model's outputs the
        loss reads are taken as the graph recorded their shapes (export's `val`), doubled along dim 0 when they are
        computed from inputs the microbatches split and dim 0 is the example's microbatch size (one per sample)."""
        from partition.loss import has_loss
        if not has_loss(self.gm) or self.example is None:
            raise ValueError("no loss in the graph")
        out = next(n for n in self.gm.graph.nodes if n.op == "output")
        loss = out.args[0][0] if isinstance(out.args[0], (tuple, list)) else out.args[0]
        model = _model_part(self.gm) | _model_outputs(self.gm)
        inputs = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        fed = {p for p, x in zip(inputs, self.example) if _split(x)}  # made from inputs the microbatches split
        for n in self.gm.graph.nodes:
            if n.op != "placeholder" and any(a in fed for a in n.all_input_nodes):
                fed.add(n)
        needed, todo = set(), [loss]  # the loss's own ops
        while todo:
            n = todo.pop()
            if n not in needed and n not in model and n.op != "placeholder":
                needed.add(n)
                todo += n.all_input_nodes
        part = [n for n in self.gm.graph.nodes if n in needed]
        bounds = list(dict.fromkeys(a for n in part for a in n.all_input_nodes if a not in needed))
        size = next(x.shape[0] for x in pytree.tree_leaves(list(self.example)) if _split(x))
        g = torch.fx.Graph()
        env = {b: g.placeholder(b.name) for b in bounds}
        for n in part:
            env[n] = g.node_copy(n, lambda a: env[a])
        g.output(env[loss])
        sub = torch.fx.GraphModule(self.gm, g)
        # the model's outputs as a run of the model at twice the samples shapes them: logits [B, B] of in-batch
        # negatives grow on both dims (found by review: doubled along dim 0 alone, CLIP's loss was taken for the
        # batch's)
        shaped = self.twice() if self.twice is not None else {}
        for k in (1, 2):
            given = []
            for b in bounds:
                if b.op == "placeholder":
                    x = self.example[inputs.index(b)]
                else:
                    v = b.meta.get("val")
                    if not isinstance(v, torch.Tensor):
                        raise ValueError(f"no recorded shape for {b.name}")
                    x = torch.empty(v.shape, dtype=v.dtype, device="meta")
                # (an output of parameters alone, K centres, is no sample's, whatever its dim 0: found by review)
                doubled = isinstance(x, torch.Tensor) and x.dim() > 0 and b in fed and (
                    b.op == "placeholder" or x.shape[0] == size)
                if k == 2 and b.name in shaped and isinstance(x, torch.Tensor):
                    given.append(torch.empty(shaped[b.name], dtype=x.dtype, device="meta"))
                    continue
                given.append(torch.cat([x.to("meta")] * k) if doubled else x.to("meta")
                             if isinstance(x, torch.Tensor) else x)
            with torch.no_grad(), torch.device("meta"):  # (recorded by the nodes' own names)
                recorder(sub).run(*given)


def _model_outputs(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The nodes of the model's outputs in a graph its loss was attached to (empty without one)."""
    from partition.loss import has_loss, model_outputs
    if not has_loss(gm):
        return set()
    names = {n.name: n for n in gm.graph.nodes}
    return {names[x] for is_node, x in model_outputs(gm)[0] if is_node and x in names}


def _model_part(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The nodes the model's outputs are computed from, the outputs left out (empty without a loss attached)."""
    outs = _model_outputs(gm)
    inside: set[torch.fx.Node] = set()
    todo = [a for n in outs for a in n.all_input_nodes]
    while todo:
        n = todo.pop()
        if n not in inside:
            inside.add(n)
            todo += n.all_input_nodes
    return inside - outs


# ops reading numbers as sizes (x.view(x.shape[0], -1)): the batch's size in them is not a value of a sample
_SHAPES = {"view", "reshape", "expand", "repeat", "new_zeros", "new_ones", "new_full", "new_empty", "unflatten",
           "split", "chunk", "flatten", "permute", "transpose", "unsqueeze", "squeeze", "size", "narrow",
           torch.reshape, torch.zeros, torch.ones, torch.full, torch.empty, torch.split, torch.chunk,
           torch.flatten, torch.unflatten, torch.narrow, operator.getitem, getattr}
# (not arange: its values are the numbers it reads, a sample's position when it counts the batch: found by review)

_aten_ops = torch.ops.aten
# ops combining the values along a dim (position of the dim argument, its default): along the batch's, they mix the
# samples while keeping the shape (found by review: a .cumsum(0) or .softmax(0) taken for per-sample terms)
_ALONG: dict[Any, tuple[int, Any]] = {
    **{op: (1, None) for op in (torch.cumsum, torch.cumprod, torch.logcumsumexp, torch.cummax, torch.cummin,
                                "cumsum", "cumprod", "logcumsumexp", "cummax", "cummin", _aten_ops.cumsum.default,
                                _aten_ops.cumprod.default, torch.softmax, torch.log_softmax, F.softmax, F.log_softmax,
                                "softmax", "log_softmax", _aten_ops._softmax.default, _aten_ops._log_softmax.default,
                                _aten_ops.softmax.int, _aten_ops.log_softmax.int, torch.flip, "flip",
                                _aten_ops.flip.default)},
    **{op: (1, -1) for op in (torch.sort, torch.argsort, "sort", "argsort", _aten_ops.sort.default)},
    **{op: (2, -1) for op in (torch.topk, "topk", _aten_ops.topk.default)},
    **{op: (2, None) for op in (torch.roll, "roll", _aten_ops.roll.default)},
}


_NEGS = {operator.neg, torch.neg, torch.ops.aten.neg.default, "neg", "__neg__"}
_SUMS = {torch.sum, torch.ops.aten.sum.default, torch.ops.aten.sum.dim_IntList, "sum"}
_MEANS = {torch.mean, torch.ops.aten.mean.default, torch.ops.aten.mean.dim, "mean"}
_CASTS = {torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default, "float", "double", "to",
          "type_as"}
_CLAMPS = {torch.clamp, torch.clamp_min, torch.ops.aten.clamp.default, torch.ops.aten.clamp_min.default, "clamp",
           "clamp_min", "clip"}


def _as_it_is(node: torch.fx.Node, sizes: _Sizes) -> torch.fx.Node | None:
    """The value `node` gives as it is, or scaled by a number every microbatch shares: a dtype cast's, or the .sum()
    or .mean() into one number of a tensor as large in every microbatch (one number; the per-feature sums over the
    samples of `x.sum(0).mean()`); else None."""
    if node.op not in ("call_function", "call_method") or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return None
    if node.target in _CASTS or node.target in _NEGS:  # (a negated loss forms the batch's as the loss does; found
        return node.args[0]  # by review: -(...).sum() outside the graph was averaged)
    inner = sizes.of(node.args[0])
    if node.target in _SUMS | _MEANS and inner is not None and inner[0] == inner[1] > 0 and sizes.of(node) == (1, 1):
        return node.args[0]
    return None


def _sums_the_batch(node: torch.fx.Node, sizes: _Sizes, one: bool = True) -> bool:
    """Whether `node` sums a tensor holding every sample's terms over the samples: the summed tensor's elements
    double with the batch, the sum stays one number (`one`), or as many numbers (a sum over dim 0 alone)."""
    if node.op not in ("call_function", "call_method") or node.target not in _SUMS or not node.args \
            or not isinstance(node.args[0], torch.fx.Node):
        return False
    n = sizes.of(node)
    return n is not None and (n == (1, 1) or not one and n[0] == n[1] > 0) and sizes._carries(node.args[0]) \
        and sizes.mixed(node.args[0]) is False


def _additive(gm: torch.fx.GraphModule, node: torch.fx.Node, sizes: _Sizes,
              shared: set[torch.fx.Node] | frozenset[torch.fx.Node] = frozenset()) -> str | None:
    """What `node` is when it is the sum of its microbatches' values (a loss with reduction='sum', a
    .sum() over the samples, such a sum times or over a number or a value in `shared`, which every
    microbatch has alike: a learned weight), else None."""
    terms = [a for a in node.args if isinstance(a, torch.fx.Node)]
    if _adds(node) and len(terms) == len(node.args):  # a sum of sums: (ce_a + ce_b) / mask.sum()
        parts = [_additive(gm, a, sizes, shared) for a in terms]
        sign = " - " if "sub" in str(getattr(node.target, "__name__", node.target)) else " + "
        return sign.join(f"{a.name}: {p}" for a, p in zip(terms, parts)) if all(parts) else None
    numbers = [a for a in node.args if _number(a)]
    if node.op in ("call_function", "call_method") and len(terms) == 1 and len(numbers) == 1 and not node.kwargs \
            and (node.target in _MUL or node.target in _DIV and node.args[0] is terms[0]):  # 0.5 * a sum: a sum
        summed = _additive(gm, terms[0], sizes, shared)
        return summed if summed is None or _per_sample([node], sizes) == "constant" else None  # (over a size: none)
    if node.op in ("call_function", "call_method") and len(terms) == 2 == len(node.args) and not node.kwargs \
            and (node.target in _MUL or node.target in _DIV and node.args[1] in shared):
        # a sum times a learned weight: the microbatches' sums times the one weight add to the batch's (a sum over
        # no sample is 0, so its weight's grad is finite, where a counted mean's would be 0 x NaN)
        inner = [a for a in terms if a not in shared]
        if len(inner) == 1:
            return _additive(gm, inner[0], sizes, shared)
    name = _summed(gm, node)
    for kind in ("cross_entropy", "nll_loss"):
        args = loss_args(gm, node, kind) if name is None else None
        if args is not None:
            plain = args.get("size_average") is None and args.get("reduce") is None
            name = kind if plain and args.get("reduction", "mean") == "sum" else None
            break
    if name is not None:  # (a loss whose inputs mix the samples is no sum of theirs; unknown: taken as one)
        return f"{name}, reduction='sum'" if sizes.mixed(node) is not True else None
    return "a .sum() over the samples" if _sums_the_batch(node, sizes, one=False) else None


def _divisor(node: torch.fx.Node) -> tuple[torch.fx.Node, float | None] | None:
    """(The sum under the dtype casts and the one lower bound of a divisor, the bound or None), else None."""
    floor = None
    while node.op in ("call_function", "call_method"):
        if node.target in _CASTS and node.args and isinstance(node.args[0], torch.fx.Node):
            node = node.args[0]
            continue
        if node.target in _CLAMPS and floor is None and node.args and isinstance(node.args[0], torch.fx.Node):
            low = node.args[1] if len(node.args) > 1 else node.kwargs.get("min")
            high = node.args[2] if len(node.args) > 2 else node.kwargs.get("max")
            if isinstance(low, (int, float)) and not isinstance(low, bool) and high is None:
                floor, node = float(low), node.args[0]
                continue
            return None
        break
    return node, floor


def _ratio(gm: torch.fx.GraphModule, loss: torch.fx.Node, sizes: _Sizes, shared: set[torch.fx.Node]
           ) -> Weighting | None:
    """A "ratio" weighting for `loss` = a sum over the samples / a sum over the samples computed from the
    inputs alone (dtype casts and a lower bound on the way); a "mean" one saying why when the divisor
    needs more than the inputs; None when `loss` is no such ratio."""
    if loss.op not in ("call_function", "call_method") or loss.target not in _DIV or len(loss.args) != 2 \
            or loss.kwargs:
        return None
    numerator, divisor = loss.args
    if not isinstance(numerator, torch.fx.Node) or not isinstance(divisor, torch.fx.Node):
        return None
    found = _divisor(divisor)
    if found is None or not _sums_the_batch(found[0], sizes):
        return None
    what = _additive(gm, numerator, sizes, shared)
    parts: list[Weighting] = []
    at: list[tuple[str, int, str]] = []
    if what is None:  # a sum plus a penalty of the weights ((ce_a + ce_b + 0.01 * w.pow(2).sum()) / mask.sum()):
        what = _with_shared(gm, numerator, sizes, shared, parts, at)  # the penalty added once (weigh_terms)
    if what is None:  # (found by review: said to be the batch's where the microbatches average alike)
        return Weighting("mean", f"it divides {numerator.name}, which is not a sum over the samples fxpipe can split "
                                 f"(a term every microbatch shares, a mean), by {found[0].name}, a "
                                 "sum over the batch: the mean of the microbatches' ratios is the batch's only where "
                                 "their divisors are equal", inexact=True)
    sub, attrs, written, why = _inputs_only(gm, [found[0], None], loss)
    if sub is None:
        return Weighting("mean", f"it is {what} over a sum whose {why.replace('target', 'value', 1)}")
    return Weighting("ratio", "", loss=f"{numerator.name} ({what}) / {found[0].name}", targets=sub, attrs=attrs,
                     written=written, origin=gm, ratio=loss.name, numerator=numerator.name, floor=found[1],
                     parts=parts, at=at)


def _with_shared(gm: torch.fx.GraphModule, node: torch.fx.Node, sizes: _Sizes, shared: set[torch.fx.Node],
                 parts: list[Weighting], at: list[tuple[str, int, str]]) -> str | None:
    """What a ratio's numerator `node` is when it adds sums over the samples and values every microbatch shares
    (a penalty of the weights, a number), at least one a sum, else None; `parts` and `at` receive each term's
    weighting ("sum", or "mean" for a shared one: weighed to count once in the batch) and where it is added."""
    if not _adds(node):
        return None
    said = []
    for i, a in enumerate(node.args):
        name = a.name if isinstance(a, torch.fx.Node) else repr(a)
        if isinstance(a, torch.fx.Node) and a in shared and not _fixed(a, sizes, shared):
            return None  # (a penalty over the microbatch's size, torch.export's number: not added once)
        if not isinstance(a, torch.fx.Node) or a in shared:
            parts.append(Weighting("mean", _SAME))
            at.append((node.name, i, name))
            said.append(f"{name}: {_SAME}")
            continue
        what = _additive(gm, a, sizes, shared)
        if what is not None:
            parts.append(Weighting("sum", "", loss=what))
            at.append((node.name, i, name))
            said.append(f"{name}: {what}")
        elif _with_shared(gm, a, sizes, shared, parts, at) is None:
            return None
        else:
            said.append(f"{name}: terms")
    return " + ".join(said) if any(p.kind == "sum" for p in parts) else None


def _by_a_size(gm: torch.fx.GraphModule, loss: torch.fx.Node, sizes: _Sizes, shared: set[torch.fx.Node]
               ) -> Weighting | None:
    """Where the graph keeps sizes as values (torch.fx): a loss multiplying or dividing by one that changes with the
    microbatch's samples, as a "mean" weighting: a sum over the samples over their count (x.sum() / x.shape[0]) is a
    mean, any other such scaling (z.mean() * x.shape[0], a sum written so; x.sum() / n ** 2) makes the loss the
    microbatches' mean, said not to be the batch's (found by review: it was averaged with a note saying it is the
    batch's where each averages as many elements: 21.30 where the batch's is 85.19); None for any other loss."""
    if loss.op not in ("call_function", "call_method") or len(loss.args) != 2 or loss.kwargs \
            or not (loss.target in _MUL or loss.target in _DIV):
        return None
    values = [sizes._values(a) if isinstance(a, torch.fx.Node) else None for a in loss.args]
    changing = [i for i, v in enumerate(values) if v is not None and v[0][0] == "value" and v[0] != v[1]]
    if len(changing) != 1:
        return None
    i = changing[0]
    one, two = values[i][0][1], values[i][1][1]  # type: ignore[index]
    size, other = loss.args[i], loss.args[1 - i]
    assert isinstance(size, torch.fx.Node)
    if loss.target in _DIV and i == 1 and isinstance(one, (int, float)) and two == 2 * one \
            and isinstance(other, torch.fx.Node) and _additive(gm, other, sizes, shared) is not None:
        return Weighting("mean", f"it divides {other.name}, a sum over the samples, by {size.name}, their count: a "
                                 "mean")
    return Weighting("mean", f"the loss {loss.name} scales by {size.name}, a size of the microbatch ({one} "
                             f"here, {two} at twice the samples): the mean of the microbatches' losses; write it as a "
                             "sum or a mean over the samples", inexact=True)


def _found(gm: torch.fx.GraphModule, loss: torch.fx.Node, sizes: _Sizes, shared: set[torch.fx.Node]) -> Weighting:
    """weighting's answer for the loss node `loss` (its scaling by shared values peeled)."""
    name = _additive(gm, loss, sizes, shared)
    if name is not None:
        return Weighting("sum", "", loss=name if "reduction" in name else f"{loss.name}: {name}")
    ratio = _ratio(gm, loss, sizes, shared)
    if ratio is not None:
        return ratio
    mean = _elementwise(gm, loss)
    if mean is not None and mean[2] == "mean" and isinstance(mean[1], torch.fx.Node) and sizes.of(loss) is None \
            and sizes.why.startswith(
            "the graph does not run on the meta device"):  # a count the values decide (t[~isnan(t)]): weighed by it
        sub, attrs, written, why = _inputs_only(gm, [mean[1], None], loss)
        if sub is not None:
            return Weighting("count", "", loss=mean[0], targets=sub, attrs=attrs, written=written, origin=gm,
                             elements=True, counted=(_structure(mean[1]), "elements"))
    args, name = loss_args(gm, loss, "cross_entropy"), "cross_entropy"
    if args is None:
        args, name = loss_args(gm, loss, "nll_loss"), "nll_loss"
    if args is None:
        if len(loss.args) == 1 and not loss.kwargs and loss.target in _SUMS:
            summed = loss.args[0]
            why = sizes.why or ("its terms are computed from values of the whole microbatch (a sum over it, its "
                                "size), not each from its own sample" if isinstance(summed, torch.fx.Node) and
                                sizes._carries(summed) else "the summed elements did not double")
            return Weighting("mean", (
                "the loss is a .sum() fxpipe cannot tell is over the samples (a run of the graph on the meta device "
                f"at two batch sizes: {why}): the step's loss and grads are 1/M of the batch's sum"))
        scaled = _by_a_size(gm, loss, sizes, shared)
        if scaled is not None:
            return scaled
        return Weighting("mean", f"the loss is {_what(loss)}, not a cross entropy or NLL loss fxpipe can weigh by "
                                 "its targets")
    reduction = args.get("reduction", "mean")
    if args.get("size_average") is not None or args.get("reduce") is not None or reduction not in ("mean", "sum"):
        return Weighting("mean", f"its {name} has a legacy reduction (size_average/reduce) or reduction={reduction!r}")
    ignore = args.get("ignore_index", -100)
    target, weight = args.get("target"), args.get("weight")
    if not isinstance(ignore, int) or not isinstance(target, torch.fx.Node):
        return Weighting("mean", f"its {name}'s ignore_index or target is not a value fxpipe can follow")
    weight_path = f"{loss.target}.weight" if loss.op == "call_module" and isinstance(weight, torch.Tensor) else None
    sub, attrs, written, why = _inputs_only(gm, [target, weight if isinstance(weight, torch.fx.Node) else None], loss)
    if sub is None:
        return Weighting("mean", f"its {name}'s {why}")
    return Weighting("count", "", loss=name, targets=sub, ignore_index=ignore, attrs=attrs, weight_path=weight_path,
                     written=written, origin=gm,
                     counted=(_structure(target), ignore, weight_path, _structure(weight)))


def loss_weighting(gm: torch.fx.GraphModule, loss_fn: Any, in_graph: bool,
                   example: Sequence[Any] | None = None, target: Any = None,
                   twice: Callable[[], dict[str, tuple[int, ...]]] | None = None,
                   literals: Callable[[], dict[str, Any]] | None = None) -> Weighting:
    """`weighting` of the loss a pipeline computes: gm's own when the loss is in the graph, else
    loss_fn's traced onto a copy of gm (whose last input is then the target: a step counts a
    microbatch from its inputs followed by its target). `example`: one microbatch's values of gm's
    inputs (the target last when the loss is in the graph), `target`: its target otherwise. Call it
    before rewrites change the loss. A ratio (see the module's doc) is weighed only in the graph,
    where the graph can return its numerator."""
    import copy
    from partition.loss import attach_loss
    if in_graph:
        return weighting(gm, example, twice, literals)
    if loss_fn is None:
        return Weighting("mean", "no loss_fn")
    view = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
    view.meta.update(gm.meta)
    if hasattr(gm, "_out_spec"):
        view._out_spec = gm._out_spec
    why = attach_loss(view, loss_fn)
    if why:
        return Weighting("mean", f"the loss stays outside the graph and its kind is unknown: {why}")
    found = weighting(view, None if example is None else [*example, target], twice, literals)
    if found.kind == "terms" and not all(name in {n.name for n in gm.graph.nodes} for name, _, _ in found.at):
        return Weighting("mean", f"the loss adds terms the batch forms each its own way ({found.loss}), which fxpipe "
                                 "weighs apart only where the graph adds them (a model's own loss, or a loss_fn traced "
                                 "into the last stage: leave trace_loss on, and give example_target= where fxpipe "
                                 "cannot infer the target): the mean of the microbatches' losses, the batch's only "
                                 "where every microbatch counts as many targets",
                         inexact=True)
    if found.kind == "ratio":  # weighed where the model computes the ratio (its own loss): gm returns the numerator
        nodes = {n.name: n for n in gm.graph.nodes}
        out = next(n for n in gm.graph.nodes if n.op == "output")
        ours = found.ratio in nodes and found.numerator in nodes
        if ours and found.reader not in nodes and nodes[found.ratio] in out.all_input_nodes:
            found.reader = ""  # (the loss_fn's node reading it, or the view's output: gm's output then)
        elif not ours or found.reader not in nodes:
            return Weighting("mean", f"the loss is {found.loss}, which fxpipe weighs only where the graph computes "
                                     "it, whose numerator a stage can return, and the mean of the microbatches' ratios "
                                     "is the batch's only where their divisors are equal (a plan with the loss in its "
                                     "last stage: give example_target=)", inexact=True)
    return found


def _what(node: torch.fx.Node) -> str:
    target = node.target
    return f"{node.op} {getattr(target, '__name__', None) or str(target)}"


def _inputs_only(gm: torch.fx.GraphModule, wanted: list[torch.fx.Node | None], before: torch.fx.Node
                 ) -> tuple[torch.fx.GraphModule | None, list[str], list[int], str]:
    """(A graph module taking gm's inputs, then the tensors it reads by get_attr, and returning `wanted` (None
    stays None), made of the nodes they need and the ops before `before` that write those in place; the paths
    of those tensors; the positions of the inputs those ops write; "") or (None, [], [], why) when one needs more
    than the inputs: a module, a parameter, a random op (a node of the model itself)."""
    from partition.split import writes_in_place
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    by_name = {n.name: n for n in gm.graph.nodes}
    writers = {by_name[u]: [by_name[b] for b in bases] for u, bases in writes_in_place(gm).items()}
    need: set[torch.fx.Node] = set()
    todo = [n for n in wanted if n is not None]
    while todo:
        while todo:
            n = todo.pop()
            if n in need:
                continue
            if n.op not in _PURE_OPS:
                return None, [], [], f"target is computed by {_what(n)}, not from the inputs alone"
            if n.op == "get_attr":
                value = attr_of(gm, str(n.target))
                if isinstance(value, torch.nn.Parameter) or isinstance(value, torch.Tensor) and value.requires_grad:
                    return None, [], [], f"target is computed from the parameter {n.target}"
            elif n.op != "placeholder" and _random(gm, n):
                return None, [], [], f"target is computed by a random op ({_what(n)})"
            need.add(n)
            todo.extend(n.all_input_nodes)
        # an op writing a value the target is made of (t.masked_fill_(t == 0, -100) whose result goes unused)
        todo = [u for u, bases in writers.items() if u not in need and order[u] < order[before]
                and any(b in need for b in bases)]
    g = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    attrs = [n for n in gm.graph.nodes if n in need and n.op == "get_attr"]
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for n in inputs:
        env[n] = g.node_copy(n, lambda x: env[x])
    for i, n in enumerate(attrs):  # read where the loss is computed now, not as they were here
        env[n] = g.placeholder(f"fxpipe_attr_{i}", default_value=None)  # (after inputs with defaults)
    for n in gm.graph.nodes:
        if n in need and n not in env:
            env[n] = g.node_copy(n, lambda x: env[x])
    g.output(tuple(env[n] if n is not None else None for n in wanted))
    written = sorted({inputs.index(b) for u, bases in writers.items() if u in need for b in bases if b in inputs})
    return torch.fx.GraphModule(gm, g), [str(n.target) for n in attrs], written, ""



def _random(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    from memory.recompute import is_random_node  # (memory imports partition)
    return is_random_node(gm, node)
