"""Tests for partition/trace.py: fx first, torch.export as the fallback, inputs flattened, clear errors."""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.fx

import partition
from bench import models
from partition.trace import TraceError, flatten_inputs, flatten_outputs, unflatten_outputs
from tests.test_split import hf_bert, hf_gpt2


class Keywords(torch.nn.Module):
    """A model with keyword inputs, one of them optional and one a Python flag."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, scale: float = 1.0,
                double: bool = False) -> dict[str, torch.Tensor]:
        h = self.lin(x) * scale
        if mask is not None:
            h = h * mask
        return {"h": h * 2 if double else h, "x": x}


class ValueBranch(torch.nn.Module):
    """Python control flow on a tensor's value: symbolic_trace and torch.export both refuse it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if h.sum().item() > 0:
            return h * 2
        return h - 1


class Box:
    def __init__(self, value: torch.Tensor) -> None:
        self.value = value


class OpaqueOutput(torch.nn.Module):
    """.item() turned into a size, and an output type that is no pytree."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> Box:
        h = self.lin(x)
        n = int(h.abs().sum().item() > -1)
        return Box(h[: n + 1])


def test_symbolic_trace_is_tried_first_and_keeps_parameters() -> None:
    w = models.gpt(n_layer=2, d_model=64, seq_len=32, vocab=128)
    gm = partition.trace(w.model, w.example_args)
    assert gm.meta["fxpipe_tracer"] == "torch.fx.symbolic_trace"
    own = dict(w.model.named_parameters())
    for name, p in gm.named_parameters():
        assert p is own[name]


def test_hf_models_fall_back_to_export_with_no_guard_nodes() -> None:
    for build in (hf_gpt2, hf_bert):
        model, args, kwargs = build()
        gm = partition.trace(model, args, kwargs)
        assert gm.meta["fxpipe_tracer"] == "torch.export.export"
        assert not [n for n in gm.graph.nodes if "_guards_fn" in str(n.target) or "assert" in str(n.target)]
        own = {id(p) for p in model.parameters()}
        assert all(id(p) in own for p in gm.parameters())  # the model's own tensors, not copies


def test_keyword_inputs_none_and_python_flags() -> None:
    model = Keywords()
    x, mask = torch.randn(3, 4), torch.ones(3, 4)
    for kwargs in ({"mask": mask}, {"mask": None, "scale": 0.5}, {"double": True}):
        gm = partition.trace(model, (x,), kwargs)
        flat = flatten_inputs(gm, (x,), kwargs)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        assert len(flat) == len(placeholders)
        torch.testing.assert_close(gm.forward(*flat), model(x, **kwargs))  # placeholders in order
        torch.testing.assert_close(gm(x, **kwargs), model(x, **kwargs))


def test_export_flattening_follows_keyword_names_not_order() -> None:
    model, args, kwargs = hf_bert()
    gm = partition.trace(model, args, kwargs)
    flat = flatten_inputs(gm, args, dict(reversed(list(kwargs.items()))))
    assert flat[0] is args[0] and flat[1] is kwargs["attention_mask"] and flat[2] is kwargs["labels"]


def test_outputs_flatten_and_rebuild() -> None:
    model = Keywords()
    x = torch.randn(3, 4)
    gm = partition.trace(model, (x,))
    leaves, spec = flatten_outputs(gm)
    assert all(isinstance(leaf, torch.fx.Node) for leaf in leaves)
    values = [torch.full((1,), float(i)) for i in range(len(leaves))]
    rebuilt = unflatten_outputs(values, spec)
    assert set(rebuilt) == {"h", "x"}


@pytest.mark.parametrize("model", [ValueBranch(), OpaqueOutput()], ids=lambda m: type(m).__name__)
def test_untraceable_model_names_both_reasons_and_the_fix(model: torch.nn.Module) -> None:
    with pytest.raises(partition.TraceError) as err:
        partition.trace(model, (torch.randn(2, 4),))
    msg = str(err.value)
    assert type(model).__name__ in msg
    assert "torch.fx.symbolic_trace failed" in msg and "torch.export.export failed" in msg
    assert "leaf_modules" in msg and "control flow" in msg


def test_untraceable_model_fails_plan_with_the_same_error() -> None:
    with pytest.raises(partition.TraceError, match="ValueBranch"):
        partition.plan(ValueBranch(), (torch.randn(2, 4),), 2, cost="flops")


def test_wrong_example_inputs_say_so() -> None:
    with pytest.raises(partition.TraceError, match="calling it on the example inputs fails"):
        partition.trace(torch.nn.Linear(4, 4), (torch.randn(2, 5),))


def test_leaf_modules_keep_a_dynamic_module_whole() -> None:
    class Outer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pre = torch.nn.Linear(4, 4)
            self.dyn = ValueBranch()

        def forward(self, x: torch.Tensor) -> Any:
            return self.dyn(self.pre(x))

    model = Outer()
    x = torch.randn(2, 4)
    gm = partition.trace(model, (x,), leaf_modules=[ValueBranch])
    assert gm.meta["fxpipe_tracer"] == "torch.fx.symbolic_trace"
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["pre", "dyn"]


def test_trace_leaves_buffers_alone() -> None:
    w = models.resnet(blocks=2, channels=8, image=8)
    before = {n: b.clone() for n, b in w.model.named_buffers()}
    partition.trace(w.model, w.example_args)
    assert all(torch.equal(b, before[n]) for n, b in w.model.named_buffers())


def test_a_meta_model_writing_buffers_is_traced_as_the_model_itself() -> None:
    """Found by review: on the meta device the eager run's check of which buffers it wrote raised (their values
    are unknown there), so a model with batch norm was traced by torch.export alone, where the same model on the
    CPU is traced by torch.fx: a sharded pipeline's trace of its meta copy in eval mode then matched nothing of
    the plan's graph (a ModeError)."""
    from partition.meta import meta_copy
    w = models.resnet(blocks=2, channels=8, image=8)
    for model in (w.model, meta_copy(w.model)):
        assert partition.trace(model, w.example_args).meta["fxpipe_tracer"] == "torch.fx.symbolic_trace"


class _InstallsHooks(torch.nn.Module):
    """Installs a forward hook on a submodule at its first call (as Hugging Face's output capture does) and
    keeps the last input: left after tracing, the hook would fire twice on the user's next call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.seen: list[Any] = []
        self.last: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not getattr(self, "_installed", False):
            self.lin.register_forward_hook(lambda m, a, out: self.seen.append(1))
            self._installed = True
        self.last = x
        return self.lin(x)


def test_trace_leaves_the_users_model_as_it_was() -> None:
    m = _InstallsHooks()
    seen = m.seen
    partition.trace(m, (torch.randn(2, 4),))
    assert not m.lin._forward_hooks and not hasattr(m, "_installed") and m.last is None
    assert m.seen is seen and seen == []  # the list the traced runs appended to, as it was
    m(torch.randn(2, 4))
    assert len(m._modules["lin"]._forward_hooks) == 1 and len(m.seen) == 1  # the model's own first call



class _Counts(torch.nn.Module):
    """A step counter and a running average written in place on buffers: fx's graph left them out (they ran
    once, while it traced), so the pipeline's counter stayed 0."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        h = self.lin(x)
        self.ema.mul_(0.9).add_(0.1 * h.mean(0).detach())
        return h


def test_a_graph_that_loses_the_models_buffer_writes_is_not_taken() -> None:
    m = _Counts()
    gm = partition.trace(m, (torch.randn(2, 4),))
    assert gm.meta["fxpipe_tracer"] == "torch.export.export"
    assert int(m.steps) == 0 and torch.equal(m.ema, torch.ones(4))  # the user's model as it was


def test_trace_keeps_what_a_models_first_call_settles_and_takes_fx_with_a_nan_buffer() -> None:
    """A lazy module's first call (here, the trace's) removes its initializing hook and makes its parameters: put
    back, the hook broke every later call. A buffer holding NaN, never written, is not a write fx lost."""
    lazy = torch.nn.Sequential(torch.nn.LazyLinear(4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    gm = partition.trace(lazy, (torch.randn(2, 3),))
    assert lazy(torch.randn(2, 3)).shape == gm(torch.randn(2, 3)).shape == (2, 2)

    class Sentinel(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.register_buffer("unset", torch.full((2,), float("nan")))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x)
    assert partition.trace(Sentinel(), (torch.randn(2, 4),)).meta["fxpipe_tracer"] == "torch.fx.symbolic_trace"


class _DecaysFromZero(torch.nn.Module):
    """A write whose value the example does not change: the decay of an average that starts at 0. fx ran it once,
    on the buffer, while it traced; its graph left it out, and the buffer's value after the check could not tell
    (0 * 0.9 is 0), so from the second step on the average never decayed."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.ema.mul_(0.9)
        h = self.lin(x)
        self.ema.add_(0.1 * h.mean(0).detach())
        return h + self.ema


def test_a_write_fx_ran_while_tracing_is_not_taken_even_where_it_left_the_value() -> None:
    m = _DecaysFromZero()
    gm = partition.trace(m, (torch.randn(2, 4),))
    assert gm.meta["fxpipe_tracer"] == "torch.export.export"
    assert torch.equal(m.ema, torch.zeros(4))
    twin = copy.deepcopy(m)  # (the graph writes the model's own buffer)
    x = torch.randn(2, 4)  # (export fixes the sizes)
    for _ in range(3):  # the graph decays the average at each call, as the model does
        assert torch.allclose(gm(x), twin(x))
    assert torch.allclose(m.ema, twin.ema)


class _ClampsInForward(torch.nn.Module):
    def __init__(self, through_data: bool) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.through_data = through_data

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.through_data:
            self.lin.weight.data.clamp_(-0.1, 0.1)
        else:
            with torch.no_grad():
                self.lin.weight.clamp_(-0.1, 0.1)
        return self.lin(x)


def test_a_parameter_written_under_no_grad_in_forward_is_refused_by_name() -> None:
    """The graph keeps the write but not the no_grad block: planning failed with autograd's "a leaf Variable that
    requires grad is being used in an in-place operation", naming neither the parameter nor the fix."""
    with pytest.raises(TraceError, match=r"writes parameters \['lin.weight'\] in place.*\.data"):
        partition.trace(_ClampsInForward(False), (torch.randn(2, 4),))
    gm = partition.trace(_ClampsInForward(True), (torch.randn(2, 4),))  # through .data: a write autograd allows
    gm(torch.randn(2, 4)).sum().backward()
    frozen = _ClampsInForward(False).requires_grad_(False)  # nothing to train: the write is the model's
    partition.trace(frozen, (torch.randn(2, 4),))


class _Averages(_Counts):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # the output reads the average it writes
        return super().forward(x) + self.ema


def test_export_runs_from_the_state_the_eager_run_started_from() -> None:
    gm = partition.trace(_Averages(), (torch.randn(2, 4),))
    assert gm.meta["fxpipe_tracer"] == "torch.export.export"



class _Cube(torch.autograd.Function):
    """x ** 2 forward with the backward of x ** 3 (3x^2): a trace keeps the forward only."""
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return g * 3 * x * x


class _GradOnly(torch.nn.Module):
    """Values a trace keeps, grads it does not: a torch.no_grad() block over a layer, a custom autograd.Function,
    a hook on a grad registered inside forward, a backward hook on the module, by `kind`."""
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.a, self.b, self.kind = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2), kind
        if kind == "module hook":
            self.register_full_backward_pre_hook(lambda m, g: (g[0] * 3,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "no_grad":
            with torch.no_grad():
                h = self.a(x)
        elif self.kind == "function":
            h = _Cube.apply(self.a(x))
        elif self.kind == "hook":
            h = self.a(x)
            h.register_hook(lambda g: g * 3)
        elif self.kind == "guarded hook":  # (registered only where the check runs with grads)
            h = self.a(x)
            if h.requires_grad:
                h.register_hook(lambda g: g * 3)
        else:
            h = self.a(x)
        return self.b(torch.tanh(h))


@pytest.mark.parametrize("kind", ["no_grad", "function", "hook", "guarded hook", "module hook"])
def test_a_graph_whose_grads_differ_from_the_models_is_refused(kind: str) -> None:
    """Found by review: each traced silently (the forward's values are the model's): a.weight got grads the model
    gives none (no_grad), or grads of x^2 for the user's backward of x^3, or not tripled (hooks). The eager run,
    under autograd, watches for what only autograd sees, then the grads are compared (a hook registered only
    `if h.requires_grad` was not seen while the check ran without grads). Kept whole as a leaf module, the
    model's own code runs."""
    with pytest.raises(TraceError, match="its grads differ from the model's for a.weight"):
        partition.trace(_GradOnly(kind), (torch.randn(3, 4),))
    gm = partition.trace(_Outer(_GradOnly(kind)), (torch.randn(3, 4),), leaf_modules=(_GradOnly,))
    assert any(n.op == "call_module" for n in gm.graph.nodes)


class _Outer(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner, self.c = inner, torch.nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.inner(x))


class _Ema(torch.nn.Module):
    """An EMA of activations kept in a buffer, written under torch.no_grad() and read after."""
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        with torch.no_grad():
            self.ema.add_(0.1 * (h.mean(0) - self.ema))
        return self.b(h - self.ema)


def test_an_ema_written_under_no_grad_is_refused_and_the_buffer_left_as_it_was() -> None:
    """Found by review: traced without its no_grad block, the EMA carried grads from one microbatch into the next
    (a step failed with 'backward through the graph a second time'); refused, the model's buffer as it was,
    without autograd history."""
    m = _Ema()
    with pytest.raises(TraceError, match="its grads differ from the model's for a.weight"):
        partition.trace(m, (torch.randn(3, 4),))
    assert m.ema.grad_fn is None and not m.ema.requires_grad and not m.ema.any()


def test_a_generation_cache_in_the_output_is_named_first_with_its_fix() -> None:
    """Found by review: a causal LM with use_cache=True (Hugging Face's default) was refused with the generic list
    of fixes, config.use_cache=False somewhere inside it."""
    import transformers as tf
    cfg = tf.LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64)
    with pytest.raises(TraceError, match=r"^cannot trace LlamaForCausalLM: its output holds a DynamicCache .*"
                                         r"train with config.use_cache=False"):
        partition.trace(tf.LlamaForCausalLM(cfg), (), {"input_ids": torch.randint(0, 64, (2, 8))})
    moe = tf.MixtralConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=64, num_local_experts=2)
    with torch.device("meta"):  # its eager call cannot run on meta tensors: torch.export's error names the cache
        meta = tf.MixtralForCausalLM(moe)
    with pytest.raises(TraceError, match=r"^cannot trace MixtralForCausalLM: its output holds a DynamicCache .*"
                                         r"train with config.use_cache=False"):
        partition.trace(meta, (), {"input_ids": torch.randint(0, 64, (2, 8))})


class _Energy(torch.nn.Module):
    """Forces as the grad of an energy, taken inside forward (kept whole with leaf_modules=)."""
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.lin, self.kind = torch.nn.Linear(4, 1), kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "autograd":
            with torch.enable_grad():
                x = x if x.requires_grad else x.detach().requires_grad_()
                return -torch.autograd.grad(torch.tanh(self.lin(x)).sum(), x, create_graph=True)[0]
        return -torch.func.grad(lambda v: torch.tanh(self.lin(v)).sum())(x)


class _Forces(torch.nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.inp, self.f, self.out = torch.nn.Linear(4, 4), _Energy(kind), torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.f(self.inp(x)))


@pytest.mark.parametrize("kind", ["autograd", "func"])
def test_a_forward_taking_grads_itself_is_checked_with_its_saved_tensors(kind: str) -> None:
    """Found by review: the check's run keeps no saved tensors, so a forward calling torch.autograd.grad (or
    torch.func.grad, which refuses saved-tensor hooks) failed, and the model was refused as if its example were
    wrong. Such a run is made again keeping them."""
    gm = partition.trace(_Forces(kind), (torch.randn(8, 4),), leaf_modules=(_Energy,))
    assert any(n.op == "call_module" and n.target == "f" for n in gm.graph.nodes)


class _HooksAnInput(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.register_hook(lambda g: g)  # (an input requires no grad: the model's own call fails)
        return self.lin(x)


def test_a_hook_that_fails_in_forward_is_named() -> None:
    with pytest.raises(TraceError, match=r"its forward registers a hook on a tensor, which fails \(RuntimeError"):
        partition.trace(_HooksAnInput(), (torch.randn(2, 4),))


class _WritesSaved(torch.nn.Module):
    """tanh's output written in place (`tanh(h).mul_(1.5)`), or the input itself (`x.add_(1)` after a linear read it),
    or legal writes (ReLU in place on a linear's output, which the linear does not save)."""
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.lins = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])
        self.relu = torch.nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.lins:
            h = lin(x)
            if self.kind == "tanh":
                h = torch.tanh(h).mul_(1.5)
            elif self.kind == "input":
                x.add_(1)
            elif self.kind == "module":  # nn.ReLU(inplace=True) on tanh's output (found by review: fx keeps the
                h = self.relu(torch.tanh(h))  # module whole, so the check did not run)
            else:
                h = torch.nn.functional.relu(h, inplace=True)
            x = x + h
        return x


@pytest.mark.parametrize("kind,refused", [("tanh", r"a \[3, 4\] float32 tensor saved at version 0 is at version 1"),
                                          ("input", "is at version 1 when the backward reads it"),
                                          ("module", "is at version 1 when the backward reads it"), ("relu", None)])
def test_a_write_to_a_tensor_saved_for_backward_is_refused_as_autograd_refuses_it(kind: str, refused: Any) -> None:
    """Found by review: the pipeline's saved-tensor hooks turned off autograd's own check, and such a model trained
    on grads that depended on the memory policy (1.41 off with activations kept, the value before the write with
    them offloaded). A forward and backward of the graph on meta tensors finds it at the trace."""
    m = _WritesSaved(kind)
    x = torch.randn(3, 4)
    try:
        m(x.clone()).sum().backward()
        eager = None
    except RuntimeError as e:
        eager = str(e)
    assert (eager is None) == (refused is None), eager  # as PyTorch's own backward judges the model
    if refused is None:
        partition.trace(m, (x,))
        return
    with pytest.raises(TraceError, match=rf"cannot train _WritesSaved: its forward writes in place a tensor that an "
                                         rf"op saved for its backward.*{refused}.*write that value out of place"):
        partition.trace(m, (x,))


class _Region(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            return self.lin(x.float())


class _Regions(torch.nn.Module):
    def __init__(self, at_top: bool) -> None:
        super().__init__()
        self.at_top, self.a, self.r = at_top, torch.nn.Linear(4, 4), _Region()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.at_top:
            with torch.autocast("cpu", enabled=False):
                return self.r.lin(self.a(x).float())
        return self.r(self.a(x))


def test_a_module_switching_autocast_is_kept_whole_and_one_at_the_top_is_named() -> None:
    """Found by review: fx records no context manager, so a region the model runs in float32 under any autocast
    (rotary angles, a router) ran at the autocast's precision. The module whose forward enters the autocast is kept
    whole (it runs as written); one in the model's own forward, or under torch.export, is named for the pipeline to
    refuse a call under an autocast."""
    gm = partition.trace(_Regions(at_top=False), (torch.randn(2, 4),))
    assert gm.meta["fxpipe_tracer"] == "torch.fx.symbolic_trace"
    assert gm.meta["fxpipe_autocast_kept"] == [f"{__name__}._Region"] and "fxpipe_autocast_lost" not in gm.meta
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["a", "r"]
    gm = partition.trace(_Regions(at_top=True), (torch.randn(2, 4),))
    assert gm.meta["fxpipe_autocast_lost"].startswith("_Regions's own forward enters a torch.autocast"), gm.meta
    assert "fxpipe_autocast_kept" not in gm.meta


class _Asks(torch.nn.Module):
    """A float32 region entered only under an autocast (transformers' maybe_autocast), in a submodule, in the
    model's own forward, or in a model only torch.export traces (a branch on a value)."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where, self.a, self.r = where, torch.nn.Linear(4, 4), _Region()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.utils.generic import maybe_autocast
        if self.where == "export" and x.shape[0] > 1:
            x = x * 1.0
        if self.where == "top":
            with maybe_autocast("cpu", enabled=False):
                return self.r.lin(self.a(x).float())
        return self.r(self.a(x))


class _AsksRegion(_Region):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.utils.generic import maybe_autocast
        with maybe_autocast("cpu", enabled=False):
            return self.lin(x.float())


def test_a_module_asking_for_the_autocast_is_kept_whole_and_one_at_the_top_is_named() -> None:
    """Found by review: transformers' maybe_autocast enters a float32 region only when an autocast is in force, so
    the trace (made without one) saw no region, and Ernie 4.5 MoE's router ran in bfloat16 under the user's autocast
    (grads up to 29% off). A module whose forward asks for the autocast is kept whole as one that enters it; one at
    the top, or under torch.export, is named for the pipeline to refuse a call under an autocast."""
    model = _Asks("module")
    model.r = _AsksRegion()
    gm = partition.trace(model, (torch.randn(2, 4),))
    assert gm.meta["fxpipe_tracer"] == "torch.fx.symbolic_trace"
    assert gm.meta["fxpipe_autocast_kept"] == [f"{__name__}._AsksRegion"] and "fxpipe_autocast_lost" not in gm.meta
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["a", "r"]
    gm = partition.trace(_Asks("top"), (torch.randn(2, 4),))
    assert gm.meta["fxpipe_autocast_lost"].startswith("_Asks's own forward asks whether an autocast is in force"), \
        gm.meta
    model = _Asks("export")
    model.r = _AsksRegion()
    gm = partition.trace(model, (torch.randn(2, 4),))
    assert gm.meta["fxpipe_tracer"] == "torch.export.export"
    assert gm.meta["fxpipe_autocast_lost"].startswith("_AsksRegion asks whether an autocast is in force"), gm.meta
    gm = partition.trace(_Asks("export"), (torch.randn(2, 4),))  # a region entered, not asked for, names itself so
    assert gm.meta["fxpipe_autocast_lost"].startswith("_Region enters a torch.autocast"), gm.meta


def test_a_meta_models_maybe_autocast_is_seen_in_its_export() -> None:
    """Found by review: on the meta device transformers' maybe_autocast asks nothing (it returns at once), and a
    meta model's eager run fails in the mask helpers before any layer, so a meta Ernie 4.5 MoE's float32 router was
    not seen: a call under an autocast ran it in bfloat16. Its export (which runs the model's code) is watched."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Ernie4_5_MoeConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                          moe_intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                                          vocab_size=64, moe_num_experts=4, moe_k=2, moe_layer_start_index=0,
                                          use_cache=False)
    with torch.device("meta"):
        model = transformers.Ernie4_5_MoeForCausalLM(cfg)
    gm = partition.trace(model, (torch.randint(0, 64, (2, 8)),))
    assert gm.meta["fxpipe_tracer"] == "torch.export.export"
    assert gm.meta["fxpipe_autocast_lost"].startswith("Ernie4_5_MoeTopKRouter asks whether an autocast is in force"), \
        gm.meta


def test_one_tensor_given_as_two_inputs_is_traced_as_two() -> None:
    """Found by review: `model(input_ids=ids, labels=ids)`, as Hugging Face writes a causal LM's call, gave
    torch.export one tensor object for two inputs, which it takes as one: the graph embedded the labels, and a step
    whose labels differ from its ids (a masked prompt, another target) trained on them (loss 4.169 where the model's
    is 4.118). The second is a copy: the graph reads each input where the model does."""
    model, (ids,), _ = hf_gpt2()
    gm = partition.trace(model, (), {"input_ids": ids, "labels": ids})
    assert gm.meta["fxpipe_tracer"] == "torch.export.export"
    other, labels = torch.randint(0, 128, ids.shape), torch.randint(0, 128, ids.shape)
    want = model(input_ids=other, labels=labels)
    got = gm(input_ids=other, labels=labels)
    torch.testing.assert_close(got.loss, want.loss)
    torch.testing.assert_close(got.logits, want.logits)


class _WritesAuxiliary(torch.nn.Module):
    """Probabilities written in place (softmax saves its output) returned beside the output the loss reads."""
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.g = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(self.g(x), -1)
        probs.mul_(100.0)
        return self.lin(x), probs


def test_an_output_written_after_its_save_is_not_judged_for_a_loss_that_may_not_read_it() -> None:
    """Found by review of the change: the check ran one backward through every output, so a model returning
    probabilities written in place beside the output its loss reads (PyTorch trains it) was refused. Refused only
    when the backward from each output reads a written tensor; the run-time check judges the rest."""
    gm = partition.trace(_WritesAuxiliary(), (torch.randn(3, 4),))
    assert gm.meta["fxpipe_tracer"] == "torch.fx.symbolic_trace"


class _CopiedInto(torch.nn.Module):
    """Keys written into a fresh tensor's slice and a cast (DeepSeek-V3's attention pads its keys so), with control
    flow on a size that torch.fx cannot trace: torch.export makes functional aten.copy of the writes."""
    def __init__(self) -> None:
        super().__init__()
        self.k = torch.nn.Linear(4, 3)
        self.out = torch.nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.size(0) > 0:
            k = self.k(x)
            padded = k.new_empty(*k.shape[:-1], 6)
            padded[..., :3].copy_(k)
            padded[..., 3:].copy_(k.double() * 2)  # (another dtype: cast by the copy)
            return self.out(padded)
        return x


def test_a_copy_into_a_fresh_tensor_is_differentiated() -> None:
    """Found by review: DeepSeek-V3 (and V2, MiniCPM3, GLM4-MoE-Lite) was refused with "derivative for aten::copy
    is not implemented": export makes `dst.copy_(src)` a functional aten.copy, which autograd has no formula for.
    It is traced as src cast and broadcast to dst, and the graph's grads are the model's."""
    torch.manual_seed(0)
    from partition.trace import trace
    model, x = _CopiedInto(), torch.randn(5, 4)
    gm = trace(model, (x,), {})
    assert gm.meta["fxpipe_tracer"] == "torch.export.export"
    assert not any(n.target is torch.ops.aten.copy.default for n in gm.graph.nodes)
    got = gm(x)
    got = got[0] if isinstance(got, (tuple, list)) else got
    want = model(x)
    torch.testing.assert_close(got, want)
    grads = torch.autograd.grad(got.square().sum(), list(gm.parameters()))
    ref = torch.autograd.grad(want.square().sum(), list(model.parameters()))
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r)
