"""The loss as part of the traced graph: the last stage returns it, so the partitioner sees it.

With the loss in the graph a rewrite can spread a wide LM head and its cross entropy over
several stages (partition.rewrite.vocab_parallel) without any stage ever holding the whole
logits. The target becomes the graph's last input, fed to whichever stages read it.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx
import torch.utils._pytree as pytree

from partition.errors import first_line

__all__ = ["TARGET", "attach_loss", "has_loss", "infer_target", "model_outputs"]

TARGET = "fxpipe_target"  # the placeholder attach_loss adds
_SUBMODULE = "fxpipe_loss"  # where a loss that is an nn.Module (or holds one) lives in the graph module


class _Loss(torch.nn.Module):
    def __init__(self, fn: Callable[[Any, Any], torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, output: Any, target: Any) -> torch.Tensor:
        return self.fn(output, target)


class _LossTracer(torch.fx.Tracer):
    """Traces `loss_fn(output, target)` with `output` rebuilt in the model's own structure (tuple,
    dict, dataclass, ModelOutput, ...) from one placeholder per tensor the model returns, so
    `out[0]`, `out["logits"]` and `out.logits` read what they read on the model's output."""

    def __init__(self, leaves: list[Any], spec: pytree.TreeSpec) -> None:
        super().__init__()
        self._leaves, self._spec = leaves, spec
        self._held: set[int] = set()

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        """A module the loss holds stays one call; one it reaches otherwise (a criterion in a closure:
        `lambda o, t: criterion(o, t)`), which the graph could not name, is traced through into its ops."""
        return id(m) in self._held and super().is_leaf_module(m, module_qualified_name)

    def path_of_module(self, mod: torch.nn.Module) -> str:
        if id(mod) in self._held:
            return super().path_of_module(mod)
        return f"<{type(mod).__name__}, traced through>"  # never a call_module target: is_leaf_module says no

    def create_args_for_root(self, root_fn: Callable[..., Any], is_module: bool, concrete_args: Any = None
                             ) -> tuple[Callable[..., Any], list[Any]]:
        values = [self.create_proxy("placeholder", f"output_{i}", (), {}) if isinstance(x, torch.fx.Node) else x
                  for i, x in enumerate(self._leaves)]
        target = self.create_proxy("placeholder", "target", (), {})
        output = pytree.tree_unflatten(values, self._spec)

        self._held = {id(m) for m in self.root.modules()}

        def loss_of(root: torch.nn.Module) -> Any:
            return root_fn(root, output, target)
        return loss_of, [self.root]


def infer_target(loss_fn: Callable[[Any, Any], torch.Tensor], output: Any) -> tuple[torch.Tensor | None, str]:
    """A target for one microbatch that `loss_fn(output, target)` accepts, when none was given, and
    how it was found (or why none was).

    From the model's first floating-point output `p` (logits, a prediction) it tries, in order:
    class indices over the last dim (int64 of p.shape[:-1]: a language model's or a classifier's
    cross entropy), class indices over dim 1 (p.shape without dim 1: a segmentation's), and a
    tensor like p (a regression, soft labels). A guess loss_fn takes returns one finite
    floating-point number without a warning (a broadcast it warns about is a wrong guess). The
    first it also takes at twice the samples (the output's tensors and the guess repeated along
    dim 0) is kept: a guess taken by a broadcast that happens to fit the example's sizes (an
    int64[4] subtracted from a [4, 4] output) fails there. Else the first taken at all. Zeros, on
    the CPU. The loss's graph does not depend on the target's shape, so a real target of another
    shape or dtype still gets the loss loss_fn computes (pipe.Pipeline checks what would not: a
    value computed from the target sent between stages).
    """
    p = next((x for x in pytree.tree_leaves(output) if isinstance(x, torch.Tensor) and x.is_floating_point()
              and x.dim() >= 1), None)
    if p is None:
        return None, "the model returns no floating-point tensor to infer a target from"
    shapes = [(list(p.shape[:-1]), torch.int64), (list(p.shape[:1] + p.shape[2:]), torch.int64),
              (list(p.shape), p.dtype)]
    twice = pytree.tree_map(lambda x: torch.cat([x, x]) if isinstance(x, torch.Tensor) and x.dim() else x, output)
    tried: list[str] = []
    taken: tuple[torch.Tensor, str] | None = None
    for shape, dtype in shapes:
        label = f"{str(dtype).removeprefix('torch.')}{shape}"
        if label in tried:
            continue
        tried.append(label)
        target = torch.zeros(shape, dtype=dtype)
        if not _takes(loss_fn, output, target.to(p.device)):
            continue
        if taken is None:
            taken = target, label
        if target.dim() and _takes(loss_fn, twice, torch.cat([target] * 2).to(p.device)):
            taken = target, label
            break
    if taken is not None:
        return taken[0], (f"its target inferred as {taken[1]} from loss_fn and the model's output "
                          "(example_target= sets it)")
    return None, f"no example_target given, and loss_fn takes none of {', '.join(tried)} inferred from the output"


def _takes(loss_fn: Callable[[Any, Any], torch.Tensor], output: Any, target: torch.Tensor) -> bool:
    """Whether loss_fn(output, target) returns one finite floating-point number without a warning."""
    import warnings
    try:
        with torch.no_grad(), warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            loss = loss_fn(output, target)
    except Exception:  # noqa: BLE001 - any failure means loss_fn does not take this target
        return False
    return (not warned and isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point()
            and (loss.is_meta or bool(torch.isfinite(loss).all())))


def model_outputs(gm: torch.fx.GraphModule) -> tuple[list[tuple[bool, Any]], pytree.TreeSpec]:
    """What the model returns in a graph whose loss attach_loss attached: per leaf (True, node name)
    or (False, the constant), and the spec that rebuilds the model's output structure."""
    return gm.meta["fxpipe_model_out"]


def has_loss(gm: torch.fx.GraphModule) -> bool:
    """Whether attach_loss has put a loss into `gm`."""
    return bool(gm.meta.get("fxpipe_loss", False))


def attach_loss(gm: torch.fx.GraphModule, loss_fn: Callable[[Any, Any], torch.Tensor],
                example: tuple[Any, Any, torch.Tensor] | None = None) -> str | None:
    """Append `loss_fn(output, target)` to gm's graph, in place; None on success, else why not.

    `output` is what the model returns, in its own structure (partition.trace records it);
    the graph gains a last placeholder `fxpipe_target` and returns the loss instead.
    `loss_fn` must be traceable by torch.fx (no control flow on tensor values), hold no
    parameters and return one tensor; when it does not qualify, gm is left as it was and the
    reason is returned. With `example` = (the model's output on an example, its target, and
    loss_fn's value on them) the traced loss must give that value before it is attached.
    """
    from partition.trace import flatten_outputs
    if has_loss(gm):
        return None
    out = next(n for n in gm.graph.nodes if n.op == "output")
    leaves, spec = flatten_outputs(gm)
    wrapper = _Loss(loss_fn)
    if any(True for _ in wrapper.parameters()):
        return "the loss function holds parameters (they would get no gradient in the graph)"
    try:
        loss_graph = _LossTracer(leaves, spec).trace(wrapper)
    except Exception as e:  # fx raises many kinds of errors on untraceable code
        return f"torch.fx cannot trace the loss function ({type(e).__name__}: {first_line(e)})"
    grads = [str(n.target) for n in loss_graph.nodes if n.op == "get_attr"
             and isinstance(t := _attr(wrapper, str(n.target)), torch.Tensor) and t.requires_grad]
    if grads:  # w.pow(2).sum() of a parameter the loss reaches through a closure: computed once, when traced
        return ("the loss function computes a value from a tensor that requires grad and is not one of its "
                "arguments (a parameter reached through a closure, as in `ce + 0.01 * w.pow(2).sum()`): traced, it "
                "would be a constant, its value fixed and its grads lost")
    result = next(n for n in loss_graph.nodes if n.op == "output").args[0]
    if not isinstance(result, torch.fx.Node):
        return f"the loss function returns {type(result).__name__}, not one tensor"
    if example is not None:
        values = [v for x, v in zip(leaves, pytree.tree_leaves(example[0])) if isinstance(x, torch.fx.Node)]
        why = _differs(torch.fx.GraphModule(wrapper, loss_graph), values, *example[1:])
        if why:
            return why
    g = gm.graph
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    with g.inserting_after(placeholders[-1]) if placeholders else g.inserting_before(next(iter(g.nodes))):
        # a default keeps the code valid after placeholders with defaults (forward(x, mask=None)); the
        # graph is always called with every input (partition.trace.flatten_inputs)
        target = g.placeholder(TARGET, default_value=None)
    ins = {n.name: n for n in loss_graph.nodes if n.op == "placeholder"}
    mapping = {ins[f"output_{i}"]: x for i, x in enumerate(leaves) if isinstance(x, torch.fx.Node)}
    mapping[ins["target"]] = target
    uses_module = False
    for n in loss_graph.nodes:
        if n.op in ("call_module", "get_attr"):
            n.target = f"{_SUBMODULE}.{n.target}"
            uses_module = True
    if type(g._codegen) is not torch.fx.graph.CodeGen:  # torch.export's: flat placeholders from here on,
        g.set_codegen(torch.fx.graph.CodeGen())          # and no hook checking the (args, kwargs) structure
        gm._forward_pre_hooks.clear()
        gm._forward_pre_hooks_with_kwargs.clear()
    # the model's own outputs, for inference (partition.split.inference_stage): node names, or constants
    gm.meta["fxpipe_model_out"] = ([(True, x.name) if isinstance(x, torch.fx.Node) else (False, x) for x in leaves],
                                   spec)
    g.erase_node(out)
    loss = g.graph_copy(loss_graph, mapping)
    g.output(loss)
    if uses_module:
        gm.add_submodule(_SUBMODULE, wrapper)
    gm.meta["fxpipe_out_spec"] = pytree.tree_flatten(torch.zeros(()))[1]  # the loss: one tensor
    if hasattr(gm, "_out_spec"):
        gm._out_spec = gm.meta["fxpipe_out_spec"]
    gm.meta["fxpipe_loss"] = True
    g.lint()
    gm.recompile()
    return None


def _differs(traced: torch.fx.GraphModule, leaves: list[Any], target: Any, expected: torch.Tensor) -> str | None:
    """Why the traced loss on the model's output `leaves` is not loss_fn's `expected` value, or None."""
    try:
        with torch.no_grad():
            got = traced(*leaves, target)
    except Exception as e:  # whatever the traced ops raise where the eager loss did not
        return (f"the loss traced by torch.fx fails where loss_fn itself runs ({type(e).__name__}: "
                f"{first_line(e)})")
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape or not (got.is_meta or expected.is_meta) and (
            not torch.allclose(got, expected, rtol=1e-5, atol=1e-6, equal_nan=True)):  # meta: the shape only
        return "the loss traced by torch.fx differs from loss_fn's value on the example"
    return None


def _attr(root: torch.nn.Module, path: str) -> Any:
    from partition.costs import attr_of
    try:
        return attr_of(root, path)
    except AttributeError:
        return None
