"""Recomputation in a stage's backward: whole-stage checkpoint ('full'), or fx nodes rematerialised on unpack.

'full' is torch's non-reentrant `checkpoint` around the whole stage, once per microbatch.
'selective' and 'auto' work on the stage's fx graph instead, without a dispatch mode: after a
chosen node runs, a marker records a `Recipe` (the node's callable and its input values). When a
later op saves that node's output for backward (saved_tensors_hooks), the manager stores the
recipe instead of the tensor, provided every input of the recipe is held anyway (saved by
another op, a parameter or a leaf); the backward recomputes the output, without grad, when it
unpacks it. Matmul outputs (and what matmuls save besides their input) are never recomputed.
'auto' may also checkpoint runs of nodes on their own (memory.regions).
"""
from __future__ import annotations

import contextlib
import functools
import operator
import weakref
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx
from torch.utils.checkpoint import checkpoint

from partition.costs import node_callable
from partition.split import is_in_place

__all__ = ["ChainedHooks", "KeptBuffers", "Markers", "Recipe", "Remat", "Recomputed", "bases", "instrument",
           "is_matmul_node", "is_random_node", "make_recipe", "remat_candidates", "savers", "saves_input_only",
           "with_markers"]

_MATMUL_MODULES = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d,
                   torch.nn.ConvTranspose1d, torch.nn.ConvTranspose2d, torch.nn.ConvTranspose3d,
                   torch.nn.MultiheadAttention, torch.nn.Bilinear)
_aten = torch.ops.aten
_MATMUL_FUNCTIONS: set[Any] = {
    torch.matmul, torch.mm, torch.bmm, torch.baddbmm, torch.addmm, torch.einsum, operator.matmul,
    torch.nn.functional.linear, torch.nn.functional.conv1d, torch.nn.functional.conv2d,
    torch.nn.functional.conv3d, torch.nn.functional.scaled_dot_product_attention,
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.convolution.default,
    _aten.linear.default, _aten.matmul.default, _aten.scaled_dot_product_attention.default}
# Ops whose backward keeps their input (held anyway) and not their output: recomputing their output
# frees it wherever a consumer (typically a matmul) saved it. The planner counts these savings only.
_SAVES_INPUT_MODULES = (torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.GELU, torch.nn.SiLU, torch.nn.Mish,
                        torch.nn.Softplus)
_SAVES_INPUT_FUNCTIONS: set[Any] = {torch.nn.functional.layer_norm, torch.nn.functional.group_norm,
                                    torch.nn.functional.gelu, torch.nn.functional.silu,
                                    torch.nn.functional.mish, _aten.layer_norm.default, _aten.gelu.default}
_RANDOM_FUNCTIONS: set[Any] = {torch.nn.functional.dropout, torch.nn.functional.dropout1d,
                               torch.nn.functional.dropout2d, torch.nn.functional.dropout3d,
                               torch.nn.functional.alpha_dropout, torch.nn.functional.feature_alpha_dropout,
                               torch.nn.functional.rrelu, torch.nn.functional.gumbel_softmax,
                               torch.dropout, torch.feature_dropout, torch.alpha_dropout, torch.feature_alpha_dropout,
                               torch.rrelu, torch.rand, torch.randn, torch.randint, torch.rand_like, torch.randn_like,
                               torch.randint_like, torch.randperm, torch.bernoulli, torch.multinomial, torch.normal,
                               torch.poisson}
_RANDOM_METHODS = {"bernoulli", "bernoulli_", "uniform_", "normal_", "random_", "exponential_", "geometric_",
                   "log_normal_", "cauchy_", "multinomial"}


def is_matmul_node(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """A matmul, convolution or attention node: never recomputed by 'selective'."""
    if node.op == "call_module":
        return isinstance(gm.get_submodule(str(node.target)), _MATMUL_MODULES)
    if node.op == "call_method":
        return node.target in ("matmul", "mm", "bmm", "__matmul__")
    return node.op == "call_function" and node.target in _MATMUL_FUNCTIONS


def is_random_node(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """A node whose output depends on the RNG (dropout with p > 0, random factories, an aten op torch tags
    nondeterministic_seeded, a module kept whole holding any of them): not recomputed."""
    if node.op == "call_module":
        return any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 or
                   isinstance(m, (torch.nn.RReLU, torch.nn.RNNBase))
                   for m in gm.get_submodule(str(node.target)).modules())
    if node.op == "call_method":
        return str(node.target) in _RANDOM_METHODS
    if node.op != "call_function":
        return False
    if isinstance(node.target, torch._ops.OpOverload):
        return torch.Tag.nondeterministic_seeded in node.target.tags
    return node.target in _RANDOM_FUNCTIONS or bool(node.kwargs.get("dropout_p"))


# Ops that save none of their inputs for backward, and ops whose output is a view of an input.
_NO_SAVE_FUNCTIONS: set[Any] = {operator.add, operator.sub, operator.neg, operator.iadd, operator.getitem, getattr,
                                torch.add, torch.sub, torch.cat, torch.stack, torch.flatten, torch.reshape,
                                torch.permute, torch.transpose, torch.unsqueeze, torch.squeeze}
_NO_SAVE_METHODS = {"view", "reshape", "flatten", "unflatten", "permute", "transpose", "unsqueeze", "squeeze",
                    "expand", "contiguous", "split", "chunk", "size", "dim", "add", "sub", "to", "type_as",
                    "narrow", "select", "t"}
_VIEW_FUNCTIONS: set[Any] = {operator.getitem, torch.permute, torch.transpose, torch.unsqueeze, torch.squeeze}
_VIEW_METHODS = {"view", "unflatten", "permute", "transpose", "unsqueeze", "squeeze", "expand", "split", "chunk",
                 "narrow", "select", "t"}
# Ops that do not save their own output (matmuls, norms and activations that save their input, adds).
_KEEPS_NOT_OUTPUT_MODULES = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d,
                             torch.nn.Conv3d, torch.nn.Bilinear) + _SAVES_INPUT_MODULES


def _saves_inputs(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """False only for ops known to save none of their inputs; True (maybe) otherwise."""
    if node.op == "call_function":
        return node.target not in _NO_SAVE_FUNCTIONS
    if node.op == "call_method":
        return str(node.target) not in _NO_SAVE_METHODS
    return node.op == "call_module" and not _identity(gm, node)


def _identity(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Dropout with p = 0 (or in eval mode): its input, or a copy of the same size."""
    if node.op == "call_module":
        m = gm.get_submodule(str(node.target))
        return isinstance(m, torch.nn.modules.dropout._DropoutNd) and (m.p == 0 or not m.training)
    return False


def _is_view(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """The output is a view of (or an element of) an input: it owns no storage."""
    if node.op == "call_function":
        return node.target in _VIEW_FUNCTIONS
    if node.op == "call_module":
        return _identity(gm, node)
    return node.op == "call_method" and str(node.target) in _VIEW_METHODS


def _saves_output(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """False only for ops known not to save their own output."""
    if node.op == "call_module":
        return not isinstance(gm.get_submodule(str(node.target)), _KEEPS_NOT_OUTPUT_MODULES) and \
            not _identity(gm, node)
    if is_matmul_node(gm, node) and node.target is not torch.nn.functional.scaled_dot_product_attention:
        return False
    return _saves_inputs(gm, node) and node.target not in _SAVES_INPUT_FUNCTIONS


def bases(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, torch.fx.Node | None]:
    """The call node owning each node's output storage: itself, or for a view the owner of what it
    views (None: a placeholder or a parameter, not an activation of this graph)."""
    base: dict[torch.fx.Node, torch.fx.Node | None] = {}
    for n in gm.graph.nodes:
        if n.op not in ("call_function", "call_method", "call_module"):
            base[n] = None
        elif _is_view(gm, n) and n.all_input_nodes:
            base[n] = base.get(n.all_input_nodes[0])
        else:
            base[n] = n
    return base


def savers(gm: torch.fx.GraphModule) -> dict[str, tuple[str, ...]]:
    """For each call node owning its output's storage: the nodes that may save that storage for
    backward (itself, users saving their inputs, and those of every view of it); an upper bound
    built from what ops are known not to save. View nodes map to ()."""
    base = bases(gm)
    out: dict[str, set[str]] = {}
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method", "call_module"):
            name: str = node.name
            out[name] = {name} if _saves_output(gm, node) and base[node] is node else set()
    for node in gm.graph.nodes:
        b = base.get(node)
        if b is not None:
            out[b.name].update(u.name for u in node.users
                               if u.op != "output" and _saves_inputs(gm, u) and not _is_view(gm, u))
    return {k: tuple(sorted(v)) for k, v in out.items()}


def _in_place(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    return is_in_place(gm, node)  # (torch.relu_, inplace= by position, aten schemas too)


def saves_input_only(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """An op whose backward saves its input, not its output (layer norm, GELU, SiLU, ...)."""
    if node.op == "call_module":
        return isinstance(gm.get_submodule(str(node.target)), _SAVES_INPUT_MODULES)
    return node.op == "call_function" and node.target in _SAVES_INPUT_FUNCTIONS


def _has_state(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """A module with buffers (batch norm's running statistics): running it again would update them."""
    if node.op == "call_module":
        return any(True for _ in gm.get_submodule(str(node.target)).buffers())
    return node.op == "call_function" and node.target in (torch.nn.functional.batch_norm,
                                                          torch.nn.functional.instance_norm)


def remat_candidates(gm: torch.fx.GraphModule) -> list[str]:
    """Call nodes the 'selective' policy may recompute on unpack: not matmuls, not random, not in place,
    not updating module state, and not read in place later (a recipe must find its inputs unchanged)."""
    mutated = {a.name for n in gm.graph.nodes if n.op.startswith("call") and _in_place(gm, n)
               for a in n.all_input_nodes}
    out = []
    for n in gm.graph.nodes:
        if n.op not in ("call_function", "call_method", "call_module") or n.name in mutated:
            continue
        if is_matmul_node(gm, n) or is_random_node(gm, n) or _in_place(gm, n) or _has_state(gm, n):
            continue
        if n.op == "call_function" and n.target in (operator.getitem, getattr):
            continue
        out.append(n.name)
    return out


_AUTOCAST_DEVICES = ("cpu", "cuda")


def autocast_state() -> tuple[tuple[str, torch.dtype], ...]:
    """The autocasts in force (device type, dtype): what a forward ran under, for its recomputation."""
    return tuple((d, torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES if torch.is_autocast_enabled(d))


@contextlib.contextmanager
def autocast_as(state: tuple[tuple[str, torch.dtype], ...]) -> Iterator[None]:
    """Run under exactly the autocasts `state` names: those in force now and not in it are turned off (a backward
    runs outside the user's autocast, as torch's AMP runs it, while a recomputation runs as its forward did)."""
    with contextlib.ExitStack() as stack:
        wanted = dict(state)
        for d in _AUTOCAST_DEVICES:
            if d in wanted:
                if not torch.is_autocast_enabled(d) or torch.get_autocast_dtype(d) != wanted[d]:
                    stack.enter_context(torch.autocast(d, dtype=wanted[d]))
            elif torch.is_autocast_enabled(d):
                stack.enter_context(torch.autocast(d, enabled=False))
        yield


class Recipe:
    """How to recompute one node's output (a fresh tensor) from values that are held anyway."""
    __slots__ = ("fn", "args", "kwargs", "inputs", "versions", "stage", "mb", "index", "nbytes", "version",
                 "_value", "cast", "__weakref__")

    def __init__(self, fn: Callable[..., Any], args: Any, kwargs: Any, inputs: list[torch.Tensor],
                 out: torch.Tensor, stage: int, mb: int, index: int) -> None:
        self.fn, self.args, self.kwargs, self.inputs = fn, args, kwargs, inputs
        self.versions = [t._version for t in inputs]
        self.stage, self.mb, self.index = stage, mb, index
        self.nbytes = out.untyped_storage().nbytes()
        self.version = out._version
        self._value: Any = None  # weak reference to the last recomputed value
        self.cast = autocast_state()  # the forward's autocasts, for the recomputation inside the backward

    def alive(self) -> torch.Tensor | None:
        """The last recomputed output while something still holds it."""
        return self._value() if self._value is not None else None

    def compute(self) -> torch.Tensor:
        """Recompute the output (without grad) from the recorded inputs."""
        if [t._version for t in self.inputs] != self.versions:
            raise RuntimeError(f"an input of the node recomputed for backward (stage {self.stage}, node #{self.index}) "
                               "was modified in place after the forward; use recompute='none' or 'full' for "
                               "this model, or avoid the in-place op")
        with torch.no_grad(), autocast_as(self.cast):
            v = self.fn(*self.args, **self.kwargs)
        self._value = weakref.ref(v)
        return v


class Remat:
    """What autograd stores instead of a saved tensor that a recipe recomputes: the recipe and the view."""
    __slots__ = ("recipe", "size", "stride", "offset")

    def __init__(self, recipe: Recipe, t: torch.Tensor) -> None:
        self.recipe, self.size, self.stride, self.offset = recipe, t.size(), t.stride(), t.storage_offset()


class Markers(torch.nn.Module):
    """What an instrumented stage graph calls: `(i,)` before node i runs, `(i, value)` after it, and
    `(i, value, *inputs)` after a node that may be recomputed (`remat`: the node's callable and args)."""

    def __init__(self, before: Callable[[int], None], after: Callable[[int, Any], None],
                 remat: Callable[[int, Any, tuple[Any, ...]], None] | None = None) -> None:
        super().__init__()
        self.before, self.after, self.remat = before, after, remat

    def forward(self, i: int, *value: Any) -> None:
        if i < 0:
            assert self.remat is not None
            self.remat(-1 - i, value[0], value[1:])
        elif value:
            self.after(i, value[0])
        else:
            self.before(i)


def instrument(gm: torch.fx.GraphModule, markers: Markers, before: dict[str, int], after: dict[str, int],
               remat: dict[str, int] | None = None) -> None:
    """Insert calls to `markers` before the nodes in `before`, after those in `after`, and after those
    in `remat` with their inputs (in place)."""
    gm.add_submodule("_fxpipe_memory", markers)
    remat = remat or {}
    for node in list(gm.graph.nodes):
        if node.name in before:
            with gm.graph.inserting_before(node):
                gm.graph.call_module("_fxpipe_memory", (before[node.name],))
        if node.name in remat:
            with gm.graph.inserting_after(node):
                gm.graph.call_module("_fxpipe_memory", (-1 - remat[node.name], node, *node.all_input_nodes))
        if node.name in after:
            with gm.graph.inserting_after(node):
                gm.graph.call_module("_fxpipe_memory", (after[node.name], node))
    gm.recompile()


def with_markers(gm: torch.fx.GraphModule, regions: Sequence[Sequence[str]]) -> list[list[str]]:
    """Each region's node names with the marker calls (`instrument`) of its nodes: the
    one before its first node and those after its last."""
    calls = [n for n in gm.graph.nodes if n.op.startswith("call")]
    at = {n.name: i for i, n in enumerate(calls)}

    def marker(n: torch.fx.Node) -> bool:
        return n.op == "call_module" and n.target == "_fxpipe_memory"
    out = []
    for names in regions:
        inside = [x for x in names if x in at]
        if not inside:
            out.append(list(names))
            continue
        lo, hi = at[inside[0]], at[inside[-1]]
        mine = set(inside)
        while lo > 0 and marker(calls[lo - 1]) and len(calls[lo - 1].args) == 1:  # a before-marker
            lo -= 1
        while hi + 1 < len(calls) and marker(calls[hi + 1]) and len(calls[hi + 1].args) > 1 \
                and getattr(calls[hi + 1].args[1], "name", None) in mine:  # an after-marker of its nodes
            hi += 1
        out.append([n.name for n in calls[lo:at[inside[0]]]] + list(names)
                   + [n.name for n in calls[at[inside[-1]] + 1:hi + 1]])
    return out


def make_recipe(gm: torch.fx.GraphModule, node: torch.fx.Node, value: Any, inputs: Sequence[Any], stage: int,
                mb: int, index: int) -> Recipe | None:
    """A recipe for `node`'s output `value`, or None when it is not a fresh tensor (a view, an alias of
    an input, a tuple) and recomputing could not free it."""
    if not isinstance(value, torch.Tensor) or value.layout != torch.strided or value.numel() == 0:
        return None
    st = value.untyped_storage()
    if value.storage_offset() != 0 or st.nbytes() != value.numel() * value.element_size():
        return None
    tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
    if any(x.untyped_storage().data_ptr() == st.data_ptr() for x in tensors):
        return None
    env = {n.name: v for n, v in zip(node.all_input_nodes, inputs)}
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: env[n.name])
    return Recipe(node_callable(gm, node), args, kwargs, tensors, value, stage, mb, index)


class KeptBuffers:
    """The buffers a module's forward writes (batch norm's running statistics), found by their values on its
    first run (batch norm's kernel writes them without a version bump) and by their versions on every run;
    `again()` puts them back after a recomputation, which would write them a second time."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.written: dict[int, torch.Tensor] = {}
        self.probed = False

    def first(self, run: Callable[[], Any]) -> Any:
        held = list(self.module.buffers())
        before = [b._version for b in held]
        values = [b.detach().clone() for b in held] if not self.probed else [None] * len(held)
        out = run()
        for b, v, old in zip(held, before, values):
            if b._version != v or old is not None and not torch.equal(old, b):
                self.written[id(b)] = b
        self.probed = True
        return out

    @contextlib.contextmanager
    def again(self) -> Iterator[None]:
        kept = [(b, b.detach().clone()) for b in self.written.values()]
        try:
            yield
        finally:
            with torch.no_grad():
                for b, value in kept:
                    b.copy_(value)


class Recomputed(torch.nn.Module):
    """Runs `inner` under non-reentrant checkpoint (whole stage, one per microbatch);
    `recomputed(t)` is told of every tensor the recomputation saves."""

    def __init__(self, inner: torch.nn.Module, *,
                 recomputed: Callable[[torch.Tensor], None] = lambda t: None) -> None:
        super().__init__()
        self.inner, self.recomputed = inner, recomputed
        self.buffers_kept = KeptBuffers(inner)

    def _run(self, calls: list[int], *args: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            return self.buffers_kept.first(lambda: self.inner(*args))
        with ChainedHooks(self.recomputed), self.buffers_kept.again():
            return self.inner(*args)

    def forward(self, *args: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.inner(*args)
        return checkpoint(functools.partial(self._run, [0]), *args, use_reentrant=False)


class ChainedHooks(torch.autograd.graph.saved_tensors_hooks):
    """Observe every tensor saved while active, then hand it to the hooks already in force
    (checkpoint's recomputation hooks), which keep deciding what is stored."""

    def __init__(self, observe: Callable[[torch.Tensor], None]) -> None:
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        outer_pack, outer_unpack = top if top is not None else (lambda t: t, lambda t: t)

        def pack(t: torch.Tensor) -> Any:
            observe(t)
            return outer_pack(t)

        super().__init__(pack, outer_unpack)
