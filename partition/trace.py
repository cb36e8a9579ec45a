"""Trace a model into a torch.fx GraphModule: symbolic_trace first, torch.export as the fallback."""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import re
import io
import itertools
import math
import operator
import sys
import warnings
from typing import Any, Iterator, Sequence

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.fx._pytree import tree_flatten_spec

from partition.errors import FxpipeError, first_line
from partition.costs import preserve_state
from partition.loss import TARGET, has_loss
from partition.meta import on_meta, to_meta

__all__ = ["trace", "TraceError", "flatten_inputs", "flatten_outputs", "unflatten_outputs", "register_dataclasses",
           "graph_copy"]


class TraceError(FxpipeError, TypeError):
    """Neither torch.fx.symbolic_trace nor torch.export could trace the model."""


class _Tracer(torch.fx.Tracer):
    def __init__(self, leaf_modules: tuple[type[torch.nn.Module], ...]) -> None:
        super().__init__()
        self._leaves = leaf_modules

    def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
        return isinstance(m, self._leaves) or super().is_leaf_module(m, qualname)


def _same(a: Any, b: Any) -> str | None:
    """None when `a` (a traced graph's output) is `b` (the model's): the same structure, types
    included, and the same leaves; else what differs."""
    la, sa = pytree.tree_flatten(a)
    lb, sb = pytree.tree_flatten(b)
    if not _same_layout(sa, sb):
        return f"its output is structured as {_describe(sa)}, the model's as {_describe(sb)}"
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return "a tensor of its output is not a tensor in the model's"
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor)
            if x.shape != y.shape or x.dtype != y.dtype or not (x.is_meta or y.is_meta) and not torch.allclose(
                    x, y, rtol=1e-4, atol=1e-5, equal_nan=True):  # on the meta device: shapes and dtypes only
                return "its output differs from the model's on the example inputs"
        elif x != y:
            return f"its output holds {x!r} where the model's holds {y!r}"
    return None


def _same_layout(got: pytree.TreeSpec, want: pytree.TreeSpec) -> bool:
    """The same structure, or one torch.fx builds for it: fx turns a dict subclass (a ModelOutput)
    into a plain dict with the same keys in the same order, so the leaves come in the same order
    and the recorded structure (the model's) rebuilds the output exactly."""
    if got == want:
        return True
    return (got.type is dict and isinstance(want.type, type) and issubclass(want.type, dict)
            and list(got.context) == list(want.context) and got.num_children == want.num_children
            and all(_same_layout(g, w) for g, w in zip(got.children(), want.children())))


def _describe(spec: pytree.TreeSpec) -> str:
    text = str(spec)
    return text if len(text) <= 200 else text[:200] + "..."


def register_dataclasses(value: Any) -> None:
    """Register with torch's pytree every dataclass type in `value` that it does not know, so
    that the structure flattens to its tensors (transformers registers its ModelOutput types
    itself); a type is registered once per process."""
    todo = [value]
    while todo:
        x = todo.pop()
        if dataclasses.is_dataclass(x) and not isinstance(x, type) and type(x) not in pytree.SUPPORTED_NODES:
            cls = type(x)  # a serialized name lets a plan record (treespec_dumps) inputs of this type
            pytree.register_dataclass(cls, serialized_type_name=f"{cls.__module__}.{cls.__qualname__}")
        if type(x) in pytree.SUPPORTED_NODES:
            todo += pytree.tree_flatten(x, is_leaf=lambda y: y is not x)[0]


def _symbolic(model: torch.nn.Module, leaf_modules: tuple[type[torch.nn.Module], ...]) -> torch.fx.GraphModule:
    graph = _Tracer(leaf_modules).trace(model)
    return torch.fx.GraphModule(model, graph, model.__class__.__name__)


def _is_check(node: torch.fx.Node) -> bool:
    """Guard and assertion nodes torch.export leaves in its graph; they compute nothing."""
    if node.op == "call_module" and str(node.target).startswith("_guards_fn"):
        return True
    name = getattr(node.target, "__name__", "") if node.op == "call_function" else ""
    return name.startswith(("_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range"))


def _updates_next_to_values(graph: torch.fx.Graph) -> None:
    """Move each buffer update torch.export appends (copy_ of a new batch-norm statistic into its
    buffer) to just after its value and the buffer's readers, so it runs on the stage that makes
    the value instead of the value travelling to the last stage."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        if (node.op != "call_function" or node.target is not torch.ops.aten.copy_.default or node.users
                or not isinstance(node.args[0], torch.fx.Node) or node.args[0].op != "get_attr"):
            continue
        dst = node.args[0]
        after = max([a for a in node.all_input_nodes] + [u for u in dst.users if u is not node],
                    key=lambda n: order[n])
        after.append(node)


def _export(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.fx.GraphModule:
    """torch.export, lowered so the graph holds only ATen ops and reads no global state.

    `run_decompositions({})` inlines higher-order ops such as the vmap that transformers
    uses to build attention masks (its nesting counters are side effects that a stage
    holding only part of the graph would break) and keeps the ATen ops themselves.
    """
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")  # deprecations inside torch.export, and its graph dumps
        ep = torch.export.export(model, args, kwargs, strict=False)
        gm = ep.run_decompositions({}).module()
    assert isinstance(gm, torch.fx.GraphModule)
    for node in reversed(list(gm.graph.nodes)):
        if _is_check(node) and not node.users:
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()
    _updates_next_to_values(gm.graph)
    _differentiable_copies(gm.graph)
    for node in gm.graph.nodes:
        # export fixes each view against the layouts it saw while tracing; kernels may lay
        # outputs out differently with autograd on (SDPA, e.g.) or after a value crosses a
        # stage boundary, so a reshape (a view where the layout allows one) is the safe op
        if node.op == "call_function" and node.target is torch.ops.aten.view.default:
            node.target = torch.ops.aten.reshape.default
    for name, _ in list(gm.named_children()):
        if name.startswith("_guards_fn"):
            delattr(gm, name)
    gm.recompile()
    return gm


def export_graph(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.fx.GraphModule:
    """The graph `trace` makes with torch.export, without its checks (the model's tensors as they are: a meta
    copy at other sizes, whose numbers are compared with the trace's)."""
    return _export(model, *_distinct(tuple(args), dict(kwargs)))


def _differentiable_copies(graph: torch.fx.Graph) -> None:
    """Each functional `aten.copy(dst, src)` (what export makes of `dst.copy_(src)` into a fresh tensor:
    DeepSeek-V3's attention writes its keys into `new_empty(...)[..., :k]`) as the ops it computes, src cast to
    dst's dtype and broadcast to its shape, which autograd differentiates (found by review: "derivative for
    aten::copy is not implemented", the model refused). dst's values are not read: copy overwrites them all."""
    aten = torch.ops.aten
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.copy.default or len(node.args) < 2:
            continue
        dst, src = node.args[:2]
        want, got = getattr(dst, "meta", {}).get("val"), getattr(src, "meta", {}).get("val")
        if not isinstance(want, torch.Tensor) or not isinstance(got, torch.Tensor) or want.device != got.device:
            continue
        with graph.inserting_before(node):
            value = src
            if got.dtype != want.dtype:
                value = graph.call_function(aten._to_copy.default, (value,), {"dtype": want.dtype})
                value.meta["val"] = got.to(want.dtype)
            if tuple(got.shape) != tuple(want.shape):
                value = graph.call_function(aten.expand.default, (value, list(want.shape)))
                value.meta["val"] = want
            value = graph.call_function(aten.clone.default, (value,))
        value.meta.update(node.meta)
        node.replace_all_uses_with(value)
        graph.erase_node(node)


def _distinct(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The example with a tensor given as two inputs copied for the second (`labels=ids`, as Hugging Face
    writes a causal LM's call): torch.export takes one tensor object given twice for one input, so its graph
    would read the labels where the model reads the ids, and a step whose labels differ would train on them."""
    seen: set[int] = set()

    def once(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if id(x) in seen:
            return x.clone()
        seen.add(id(x))
        return x
    return pytree.tree_map(once, (args, kwargs))


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal buffers: NaN where NaN (a sentinel), floats up to a device's nondeterministic sums."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(torch.allclose(a, b, rtol=1e-5, atol=1e-6, equal_nan=True))
    return torch.equal(a, b)


def _restore(model: torch.nn.Module, values: dict[str, torch.Tensor]) -> None:
    """The buffers as `values` has them, with no autograd history (a graph without the model's torch.no_grad()
    block writes them with grad)."""
    with torch.no_grad():
        for n, b in model.named_buffers():
            if n in values:
                if b.grad_fn is not None:
                    b.detach_()
                b.copy_(values[n])


def _versions(model: torch.nn.Module) -> dict[str, int]:
    """Each parameter's and buffer's version counter (an in-place write bumps it, whatever value it writes)."""
    return {n: t._version for n, t in itertools.chain(model.named_parameters(), model.named_buffers())
            if not t.is_inference()}


def _never_unpacked(_: Any) -> torch.Tensor:
    raise RuntimeError("the trace's check runs no backward")


def _run(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], watch: list[str] | None = None,
         restore: Any = None, switched: list[tuple[torch.nn.Module, str]] | None = None) -> Any:
    """fn(*args, **kwargs) as training calls it, under autograd (what a forward does only when its values require
    grad, a hook registered `if h.requires_grad`, is done), but keeping no tensor for a backward (the activations
    are freed as without autograd); from a fixed RNG state (dropout draws the same masks), on copies of the input
    tensors: a model that writes its inputs in place leaves the example as it was for the next run.
    `watch`: where to record what the call does that only autograd sees (_watching); `switched`: the modules
    whose forward enters a torch.autocast or asks for one, and which it does."""
    given = (args, kwargs)
    for keep in (False, True):  # (kept only where the forward takes grads itself: torch.autograd.grad, torch.func)
        args, kwargs = pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, given)
        seen = len(watch) if watch is not None else 0
        try:
            with torch.random.fork_rng(devices=[]), torch.enable_grad(), contextlib.nullcontext() if keep else \
                    torch.autograd.graph.saved_tensors_hooks(lambda t: None, _never_unpacked):
                torch.manual_seed(0)
                with _watching(watch, switched) if watch is not None else contextlib.nullcontext():
                    out = fn(*args, **kwargs)
            return pytree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, out) if keep else out
        except Exception:
            if keep or restore is None:
                raise
            restore()  # the state the failed run started from
            if watch is not None:
                del watch[seen:]
            if switched is not None:
                switched.clear()
    raise AssertionError("unreachable")


@contextlib.contextmanager
def _watching(seen: list[str], switched: list[tuple[torch.nn.Module, str]] | None = None) -> Iterator[None]:
    """Record in `seen` what a forward does that only autograd sees, so that a trace would lose it: a grad
    mode switch (torch.no_grad(), @torch.no_grad()), a custom autograd.Function (reentrant checkpointing
    is one), a hook registered on a tensor; and in `switched` what _watching_autocast records."""
    import torch.autograd.function as function
    grad_mode, hook = torch._C._set_grad_enabled, torch.Tensor.register_hook
    apply = function.Function.__dict__["apply"]  # the classmethod itself, put back as it was

    def switch(mode: bool) -> None:
        seen.append("a grad mode switch")
        grad_mode(mode)

    def applied(cls: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(f"the autograd.Function {cls.__name__}")
        return apply.__func__(cls, *args, **kwargs)

    def hooked(self: torch.Tensor, fn: Any) -> Any:
        seen.append("a hook on a tensor")
        return hook(self, fn)
    torch._C._set_grad_enabled = switch  # type: ignore[assignment]
    function.Function.apply = classmethod(applied)  # type: ignore[assignment,method-assign]
    torch.Tensor.register_hook = hooked  # type: ignore[method-assign]
    try:
        with _watching_autocast(switched) if switched is not None else contextlib.nullcontext():
            yield
    finally:
        torch._C._set_grad_enabled = grad_mode
        function.Function.apply = apply  # type: ignore[method-assign]
        torch.Tensor.register_hook = hook  # type: ignore[method-assign]


# what a forward may ask to decide by the autocast in force (torch's own modules' attributes)
_AUTOCAST_QUERIES = ("is_autocast_enabled", "is_autocast_cpu_enabled", "get_autocast_dtype", "get_autocast_gpu_dtype",
                     "get_autocast_cpu_dtype")
_ASKS = ("asks whether an autocast is in force (and so may run otherwise under one: transformers' maybe_autocast "
         "enters its float32 region only then)")


@contextlib.contextmanager
def _watching_autocast(switched: list[tuple[torch.nn.Module, str]]) -> Iterator[None]:
    """Record in `switched` each module whose forward enters a torch.autocast (a region run at another precision,
    which neither tracer keeps: fx records no context manager, export's lowering applies the autocast in force
    while tracing, none), or asks whether one is in force or its dtype, or calls transformers' maybe_autocast,
    with which it does. Only code outside torch's own counts. maybe_autocast enters its float32 region only under
    an autocast, so a trace made without one has not the region, and would run it at the autocast's precision;
    and on the meta device (a meta model's trace) it asks nothing, so each transformers module that imported it
    is watched too."""
    from torch.amp import autocast_mode
    enter = autocast_mode.autocast.__enter__
    queries = {q: getattr(torch, q) for q in _AUTOCAST_QUERIES if hasattr(torch, q)}
    helper = getattr(sys.modules.get("transformers.utils.generic"), "maybe_autocast", None)
    importers = [m for k, m in list(sys.modules.items()) if helper is not None and k.startswith("transformers.")
                 and getattr(m, "maybe_autocast", None) is helper]

    def record(how: str) -> None:
        """The innermost module whose forward the caller of the caller runs in, unless that caller is torch's."""
        frame = sys._getframe(2)
        if str(frame.f_globals.get("__name__", "")).startswith("torch."):
            return
        while frame is not None and not isinstance(frame.f_locals.get("self"), torch.nn.Module):
            frame = frame.f_back  # type: ignore[assignment]
        if frame is not None:
            switched.append((frame.f_locals["self"], how))

    def entered(self: Any) -> Any:
        record("enters a torch.autocast")
        return enter(self)

    def asking(query: Any) -> Any:
        def asked(*args: Any, **kwargs: Any) -> Any:
            record(_ASKS)
            return query(*args, **kwargs)
        return asked
    autocast_mode.autocast.__enter__ = entered  # type: ignore[method-assign]
    for q, query in queries.items():
        setattr(torch, q, asking(query))
    for m in importers:
        setattr(m, "maybe_autocast", asking(helper))
    try:
        yield
    finally:
        autocast_mode.autocast.__enter__ = enter  # type: ignore[method-assign]
        for q, query in queries.items():
            setattr(torch, q, query)
        for m in importers:
            setattr(m, "maybe_autocast", helper)


def _switching(model: torch.nn.Module, switched: list[tuple[torch.nn.Module, str]], leaves: tuple[type, ...]
               ) -> tuple[tuple[type, ...], bool, dict[type | None, str]]:
    """From what _watching_autocast recorded: the module classes to keep whole, whether the model's own forward
    switches or asks for the autocast, and how each does (the first seen; the model's own under None)."""
    how = {(None if m is model else type(m)): h for m, h in reversed(switched)}
    kept = tuple(dict.fromkeys(type(m) for m, _ in switched if m is not model and not isinstance(m, leaves)))
    return kept, None in how, how


def _grads_differ(model: torch.nn.Module, gm: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                  start: dict[str, torch.Tensor]) -> str | None:
    """Why the graph's grads of the trained parameters differ from the model's on the example (the grads of
    a fixed random projection of the float outputs, from the same RNG state, each compared as its projection
    on a fixed random direction and its norm), or None. A trace keeps the forward's values but can lose what
    only autograd sees: a torch.no_grad() block (its parameters then get grads), a custom autograd.Function's
    own backward, hooks on grads."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    theirs = dict(gm.named_parameters())  # (a parameter the graph does not read is not in it: no grad)
    if not named or not any(n in theirs for n, _ in named):
        return None
    seen: list[list[tuple[float, float] | None]] = []
    for fn, params in ((model, [p for _, p in named]), (gm, [theirs.get(n, p) for n, p in named])):
        _restore(model, start)
        a, k = pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, (args, kwargs))
        # (a graph writing a buffer it read for its grads, as torch.export writes batch norm's statistics: the
        # stages run such writes, and here the grads see the values read)
        with torch.random.fork_rng(devices=[]), torch.enable_grad(), \
                torch.autograd.graph.allow_mutation_on_saved_tensors(), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # (a full backward hook's: the example needs no grads)
            torch.manual_seed(0)
            outs = [x for x in pytree.tree_leaves(fn(*a, **k)) if isinstance(x, torch.Tensor) and x.requires_grad
                    and x.is_floating_point()]
            g = torch.Generator().manual_seed(1)
            total = sum(((x * torch.randn(x.shape, generator=g).to(x)).sum() for x in outs), torch.zeros(()))
            grads = torch.autograd.grad(total, params, allow_unused=True) if total.requires_grad \
                else (None,) * len(params)
        g = torch.Generator().manual_seed(2)
        seen.append([None if t is None else (float((t.double() * torch.randn(t.shape, generator=g, dtype=torch.float64))
                                                   .sum()), float(t.double().norm())) for t in grads])
        del grads
    _restore(model, start)
    differ = [n for (n, _), a, b in zip(named, *seen) if (a is None) != (b is None) or a is not None and b is not None
              and not all(math.isclose(x, y, rel_tol=1e-3, abs_tol=1e-5 * max(1.0, a[1])) or math.isnan(x) and
                          math.isnan(y) for x, y in zip(a, b))]
    if not differ:
        return None
    return (f"its grads differ from the model's for {', '.join(differ[:3])}{' ...' if len(differ) > 3 else ''} (a "
            "trace keeps no torch.no_grad() block, custom autograd.Function backward or hook on a grad registered "
            "inside forward; keep the module doing it whole with leaf_modules=)")


def _backward_hooks(model: torch.nn.Module) -> bool:
    """Whether a module of `model`, or every module, has a backward hook."""
    from torch.nn.modules import module as hooks
    return bool(hooks._global_backward_hooks or hooks._global_backward_pre_hooks) or any(
        m._backward_hooks or m._backward_pre_hooks for m in model.modules())


def graph_copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of `gm` to rewrite without touching it: its graph, modules and meta copied, its parameters,
    buffers and tensor constants shared (the same objects, under the same names and in the same order)."""
    memo: dict[int, Any] = {}
    for m in gm.modules():
        for t in (*m._parameters.values(), *m._buffers.values(), *vars(m).values()):
            if isinstance(t, torch.Tensor):
                memo[id(t)] = t
    for kept in gm.meta.values():  # what trace recorded: rewrites leave it as it is
        memo[id(kept)] = kept
    with warnings.catch_warnings():  # torch.fx's Graph copies its pytree calling convention, and copying
        warnings.filterwarnings("ignore", ".*LeafSpec", FutureWarning)  # a TreeSpec warns in this torch
        out = copy.deepcopy(gm, memo)
    was = next(n.name for n in reversed(gm.graph.nodes) if n.op == "output")
    next(n for n in reversed(out.graph.nodes) if n.op == "output")._rename(was)  # the copy names it "output" (the
    # name of the first one, which attach_loss replaced) and plans record node names. The names the graph
    # has used (erased nodes' too) go with it, so a node added later (a loss attached) is named as it would
    # be in `gm`: torch.fx's namespace keeps them in private fields, left as they are if it has none
    ns: Any = getattr(gm.graph, "_graph_namespace", None)
    mine: Any = getattr(out.graph, "_graph_namespace", None)
    used, counts = getattr(ns, "_used_names", None), getattr(ns, "_base_count", None)
    if isinstance(used, set) and isinstance(counts, dict) and type(mine) is type(ns):
        mine._used_names |= used
        for base, k in counts.items():
            mine._base_count[base] = max(k, mine._base_count.get(base, 0))
    out.recompile()
    for k in ("_in_spec", "_out_spec"):  # torch.export's call structure (flatten_inputs), kept after attach_loss
        if k in vars(gm):                # made the code flat, which GraphModule's copy would drop
            setattr(out, k, getattr(gm, k))
    return out


def trace(model: torch.nn.Module, example_args: Sequence[Any], example_kwargs: dict[str, Any] | None = None,
          leaf_modules: Sequence[type[torch.nn.Module]] = ()) -> torch.fx.GraphModule:
    """The model as a GraphModule whose parameters are the model's own, under their original names.

    `torch.fx.symbolic_trace` is tried first and its result is checked against the model on
    the example inputs (control flow on values can make a trace silently wrong, and fx turns
    a dict subclass such as a ModelOutput into a plain dict); when it fails or disagrees,
    `torch.export.export(strict=False)` traces the model instead. The output's structure
    (tuple, dict, dataclass, ModelOutput, ...) is recorded in `gm.meta["fxpipe_out_spec"]`
    (see flatten_outputs). The model is left as it was: buffers, grads, training modes,
    attributes and the RNG state.

    A model on the meta device (partition.meta) is traced on meta copies of the inputs and checked by
    its output's structure, shapes and dtypes. Where its eager call cannot run on meta tensors (control
    flow on values, as in Hugging Face's mask helpers), torch.export traces it alone: export runs the
    model's own Python code, and its graph returns the model's output structure.
    """
    args, kwargs = _distinct(tuple(example_args), dict(example_kwargs or {}))
    leaves = tuple(leaf_modules)
    name = type(model).__name__
    meta = on_meta(model)
    if meta:
        args, kwargs = to_meta((args, kwargs))
    from partition.split import read_written_inputs, trained_parameters_written
    exported: list[tuple[torch.nn.Module, str]] = []  # a meta model's: what its export ran (its eager run may not)

    def export() -> torch.fx.GraphModule:
        with _watching_autocast(exported) if meta else contextlib.nullcontext():
            return _export(model, args, kwargs)
    tracers = [("torch.fx.symbolic_trace", lambda: _symbolic(model, leaves)), ("torch.export.export", export)]
    with preserve_state(model):
        expected: Any = None
        eager = ""
        start = {n: b.detach().clone() for n, b in model.named_buffers()}
        written: dict[str, torch.Tensor] = {}  # the buffers the eager run wrote, as it left them
        autograd_only: list[str] = []  # what the eager run did that only autograd sees (then grads are compared)
        switched: list[tuple[torch.nn.Module, str]] = []  # modules whose forward enters or asks for an autocast
        try:
            expected = _run(model, args, kwargs, autograd_only, restore=lambda: _restore(model, start),
                            switched=switched)
            # (on meta a buffer's values are unknown: comparing them raised, and the eager run was taken to have
            # failed, so a batch norm's model went to torch.export alone, found by review: another mode's trace of
            # a sharded pipeline's meta copy then matched no node of the plan's torch.fx graph)
            written = {} if meta else {n: b.detach().clone() for n, b in model.named_buffers()
                                       if not _close(b, start[n])}
        except Exception as e:
            if not meta and "a hook on a tensor" in autograd_only:  # (on a tensor that requires no grad)
                raise TraceError(f"cannot trace {name}: its forward registers a hook on a tensor, which fails "
                                 f"({type(e).__name__}: {first_line(e, 200)}) and which a graph would not keep; "
                                 "register the hook outside the forward (a module's register_full_backward_hook "
                                 "is kept with the module, given in leaf_modules=)") from e
            if not meta:
                raise TraceError(f"cannot trace {name}: calling it on the example inputs fails "
                                 f"({type(e).__name__}: {first_line(e, 300)}); pass one microbatch the model "
                                 "accepts as example_args (positional) and example_kwargs (keywords)") from e
            tracers = tracers[1:]
            eager = f"{type(e).__name__}: {first_line(e, 200)}"
        # fx keeps a module that switches autocast whole, so its context runs as written at run time
        kept, at_top, how = _switching(model, switched, tuple(leaf_modules))
        leaves += kept
        register_dataclasses(expected)
        register_dataclasses((args, kwargs))
        reasons: list[str] = []
        for tracer, fn in tracers:
            versions = _versions(model)
            try:
                gm = fn()
            except Exception as e:  # both tracers raise many kinds of errors
                reasons.append(f"{tracer} failed with {type(e).__name__}: {first_line(e, 300)}")
                continue
            rewritten = [n for n, v in _versions(model).items() if v != versions[n]]
            written_params = trained_parameters_written(gm)
            if written_params:
                raise TraceError(f"cannot train {name}: its forward writes parameters {written_params[:3]} in "
                                 "place (a clamp or a renormalization under torch.no_grad()), which a traced "
                                 "graph runs under autograd and cannot; write them through .data "
                                 "(`self.w.data.clamp_(...)`) or after optimizer.step()")
            try:
                _restore(model, start)  # each graph runs from the state the eager run started from
                got = _run(gm, args, kwargs, restore=lambda: _restore(model, start))
            except Exception as e:
                reasons.append(f"{tracer} gave a graph that fails: {type(e).__name__}: {first_line(e, 300)}")
                continue
            if tracer == "torch.fx.symbolic_trace" and rewritten:  # run once at tracing, on the tensor itself
                reasons.append(f"{tracer} wrote {rewritten[:3]} in place while tracing, a write the graph does not "
                               "hold (an update of a buffer or parameter from no traced value, e.g. "
                               "`self.ema.mul_(0.9)`)")
                continue
            if tracer == "torch.fx.symbolic_trace" and not meta:
                lost = [n for n, b in model.named_buffers() if not _close(b, written.get(n, start[n]))]
                if lost:  # a write outside the traced values (a step counter): run at tracing, not in the graph
                    reasons.append(f"{tracer} gave a graph that does not write buffers {lost[:3]} as the model "
                                   "does (writes of values fx does not trace)")
                    continue
            if len(tracers) == 1 and meta:  # export alone: its graph is the model's code on these shapes
                expected = got
                gm.meta["fxpipe_unchecked"] = f"not run eagerly on the meta device ({eager})"
            why = _same(got, expected)
            if why is None and not meta and (autograd_only or _backward_hooks(model)):
                try:
                    why = _grads_differ(model, gm, args, kwargs, start)
                except Exception:  # noqa: BLE001 - a backward that needs the stages' handling (a buffer the graph
                    _restore(model, start)  # writes after reading it for its grads): the forward check stands
            spec = pytree.tree_flatten(expected)[1]
            if why is None and len(flatten_outputs(gm, check=False)[0]) != spec.num_leaves:
                why = "its output node does not list the output's tensors one by one (a dataclass built in the graph)"
            if why is None:
                overwritten = _saved_then_written(gm, args, kwargs)
                if overwritten is not None:
                    raise TraceError(f"cannot train {name}: its forward writes in place a tensor that an op saved "
                                     "for its backward, which PyTorch's own backward refuses "
                                     f"({overwritten}); {SAVED_WRITTEN_FIX}")
                gm.meta["fxpipe_tracer"] = tracer
                gm.meta["fxpipe_out_spec"] = spec
                if not meta:  # (partition.split.check_state_writes: a module called whole writes these)
                    gm.meta["fxpipe_buffers_written"] = sorted(written)
                if exported:
                    kept, at_top, how = _switching(model, switched + exported, tuple(leaf_modules))
                if kept and tracer == "torch.fx.symbolic_trace":
                    gm.meta["fxpipe_autocast_kept"] = [f"{c.__module__}.{c.__qualname__}" for c in kept]
                if at_top or kept and tracer != "torch.fx.symbolic_trace":
                    where = f"{name}'s own forward {how[None]}" if at_top else "; ".join(
                        f"{c.__name__} {how[c]}" for c in kept)
                    gm.meta["fxpipe_autocast_lost"] = (
                        f"{where}, which {tracer}'s graph does not keep (" + (
                            "fx records no context manager: move the region into a submodule, which fxpipe then "
                            "keeps whole" if tracer == "torch.fx.symbolic_trace" else "export lowers it to the "
                            "autocast in force while tracing, none") + ")")
                read_written_inputs(gm)  # an input written in place: later readers read the write's value
                return gm
            reasons.append(f"{tracer} gave a graph that is not the model: {why}")
    cache = _cache_in(expected) or _cache_named(reasons)
    raise TraceError(
        f"cannot trace {name}: " + (f"its output holds a {cache} (a cache of keys and values for generation, "
                                    "use_cache=True): train with config.use_cache=False (model.config.use_cache = "
                                    "False before building the pipeline), or pass use_cache=False in the call; " if
                                    cache else "") + "; ".join(reasons) + ". Fix: make control flow independent of "
        "tensor values (no `if` on a tensor, no .item()/.tolist() deciding what runs), or move the "
        "dynamic part into a module passed as leaf_modules=(ThatModule,) (to partition.plan and "
        "pipe.Pipeline, or a Workload's leaf_modules) so fx treats it as one op; "
        "return tensors in tuples, lists, dicts, dataclasses or registered pytree types; turn off caches and "
        "dropout for tracing (e.g. config.use_cache=False); pass the inputs the model really takes "
        "as example_args/example_kwargs.")


# the fix for a tensor written in place after an op saved it (the trace's refusal and memory/'s run-time one)
SAVED_WRITTEN_FIX = ("write that value out of place (h = h * 2, not h.mul_(2)) where an op saved it for its backward "
                     "(tanh, sigmoid and exp save their outputs, a product its inputs)")

# h += 1 as fx records it: on a tensor, in place
_AUGMENTED = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.imod,
              operator.ipow, operator.imatmul, operator.iand, operator.ior, operator.ixor, operator.ilshift,
              operator.irshift}


def _writes_in_place(gm: torch.fx.GraphModule) -> bool:
    """Whether the graph has an op that may write a tensor in place (x.mul_(2), F.relu(x, inplace=True), aten's mul_,
    nn.ReLU(inplace=True), a module of the user's kept whole, whose code fx does not see)."""
    for n in gm.graph.nodes:
        if n.op == "call_module":
            m = gm.get_submodule(str(n.target))
            if getattr(m, "inplace", False) or not type(m).__module__.startswith("torch.nn"):
                return True
        if n.op == "call_method" and n.target.endswith("_") and not n.target.startswith("__"):
            return True
        if n.op == "call_function" and (n.kwargs.get("inplace") or n.target in _AUGMENTED
                                        or getattr(n.target, "__name__", "").endswith("_")
                                        and not getattr(n.target, "__name__", "").startswith("__")
                                        or getattr(getattr(n.target, "_schema", None), "is_mutable", False)):
            return True
    return False


def _saved_then_written(gm: torch.fx.GraphModule, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """What the graph writes in place after an op saved it for its backward (`tanh(h).mul_(2)`), which eager PyTorch
    refuses at the backward while the pipeline's saved-tensor hooks (memory/) turn that check off: a forward and
    backward of a meta copy on meta inputs (no values, no compute), each saved tensor checked by its version when the
    backward reads it, as autograd checks it. Parameters and buffers are not checked: a graph writes batch norm's
    statistics after the op that read them (torch.export's), which the stages run as written. None when nothing
    saved was written, or the backward fails otherwise (an op with no meta backward)."""
    if not _writes_in_place(gm):
        return None
    from partition.meta import meta_copy
    written: list[str] = []

    def unpack(saved: Any) -> torch.Tensor:
        if isinstance(saved, tuple):
            t, version = saved
            if t._version != version:
                written.append(f"a {list(t.shape)} {str(t.dtype).removeprefix('torch.')} tensor saved at version "
                               f"{version} is at version {t._version} when the backward reads it")
            return t
        return saved
    every = True  # the backward from each output reads a written tensor: so does any loss's (one reading no
    try:  # output aside); an output no loss may read (an attention map written in place) is not judged here
        copy = meta_copy(gm)
        held = {id(t) for t in (*copy.parameters(), *copy.buffers())}
        margs, mkwargs = to_meta((args, kwargs))
        with torch.random.fork_rng(devices=[]), torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(
                lambda t: t if id(t) in held else (t, t._version), unpack):
            out = copy(*margs, **mkwargs)
        leaves = [t for t in pytree.tree_leaves(out)
                  if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]
        for i, t in enumerate(leaves):
            seen = len(written)
            torch.autograd.backward([t.sum()], retain_graph=i < len(leaves) - 1)
            every = every and len(written) > seen
    except Exception:  # noqa: BLE001 - anything else is not this check's to judge
        return None
    return written[0] if written and every else None


def _cache_named(reasons: list[str]) -> str | None:
    """A generation cache torch.export found in the output (where the eager call could not run to show it:
    a model on the meta device), by the type its error names."""
    found = re.search(r"<class '[\w.]*?(\w+Cache)'> in output", " ".join(reasons))
    return found.group(1) if found else None


def _cache_in(value: Any, depth: int = 0) -> str | None:
    """The type name of a generation cache in a model's output (Hugging Face's DynamicCache), or None."""
    if type(value).__name__.endswith("Cache"):
        return type(value).__name__
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return next((c for c in (_cache_in(v, depth + 1) for v in items) if c), None) if depth < 4 else None


def flatten_inputs(gm: torch.fx.GraphModule, args: Sequence[Any], kwargs: dict[str, Any] | None = None,
                   target: Any = None) -> list[Any]:
    """The values of gm's placeholders, in order, for a call `model(*args, **kwargs)`; when the
    loss is in the graph (partition.loss), `target` is the last."""
    kwargs = dict(kwargs or {})
    extra = [target] if has_loss(gm) else []
    spec = getattr(gm, "_in_spec", None)
    if spec is not None:  # torch.export: placeholders are the flattened (args, kwargs)
        return list(tree_flatten_spec((tuple(args), kwargs), spec)) + extra
    names = [n.target for n in gm.graph.nodes if n.op == "placeholder" and n.target != TARGET]
    sig = inspect.signature(type(gm).forward)
    bound = sig.bind_partial(None, *args, **kwargs)
    bound.apply_defaults()
    missing = [str(n) for n in names if str(n) not in bound.arguments]
    if missing:
        raise TypeError(f"{type(gm).__name__} needs inputs {missing} that the call does not give")
    return [bound.arguments[str(n)] for n in names] + extra


def flatten_outputs(gm: torch.fx.GraphModule, check: bool = True) -> tuple[list[Any], pytree.TreeSpec]:
    """The output node's leaves (fx Nodes or constants) and the spec that rebuilds the model's
    output from them: the one trace recorded, the model's own structure with its types."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    leaves, spec = pytree.tree_flatten(out.args[0])
    recorded = gm.meta.get("fxpipe_out_spec")
    if recorded is not None:
        assert not check or recorded.num_leaves == len(leaves), (recorded, leaves)
        return leaves, recorded
    return leaves, getattr(gm, "_out_spec", None) or spec


def unflatten_outputs(leaves: Sequence[Any], spec: pytree.TreeSpec) -> Any:
    return pytree.tree_unflatten(list(leaves), spec)
