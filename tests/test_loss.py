"""partition.loss and the vocabulary-parallel rewrite: the loss in the graph, a head spread over stages."""
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import partition
from bench import models
from partition.loss import TARGET, attach_loss, has_loss
from partition.costs import node_costs
from partition.rewrite import vocab_parallel, vocab_parallel_loss
from partition.trace import flatten_inputs

SMALL = {"n_layer": 1, "d_model": 32, "n_head": 2, "seq_len": 16, "vocab": 1000}


def _head(gm: torch.fx.GraphModule, name: str = "lm_head") -> torch.fx.Node:
    return next(n for n in gm.graph.nodes if n.name == name)


def _shapes(gm: torch.fx.GraphModule, flat: list[Any]) -> dict[str, list[int]]:
    return {k: list(c.shape) for k, c in node_costs(gm, flat, cost="flops").items()}


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _ignore_some(target: torch.Tensor) -> torch.Tensor:
    t = target.clone()
    t[0, :5] = -100
    return t


class _ModuleLoss(torch.nn.Module):
    """A loss held as a module that calls nn.CrossEntropyLoss (a call_module node once traced)."""

    def __init__(self) -> None:
        super().__init__()
        self.ce = torch.nn.CrossEntropyLoss()

    def forward(self, out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.ce(out.reshape(-1, out.shape[-1]), t.reshape(-1))  # the logits' own size asked too


@pytest.mark.parametrize("loss_name", ["mean", "sum", "module", "ignore"])
@pytest.mark.parametrize("bounds", [3, [0, 1, 999, 1000], [0, 1000]], ids=["3", "ragged", "1"])
def test_vocab_parallel_gives_the_same_loss_and_grads(loss_name: str, bounds: Any) -> None:
    w = models.gpt_wide_vocab(**SMALL)
    (x,), y = w.make_batch(4, 0)
    loss_fn: Any = {
        "mean": w.loss_fn,
        "sum": lambda out, t: F.cross_entropy(out.view(-1, out.size(-1)), t.reshape(-1), reduction="sum"),
        "module": _ModuleLoss(),  # a loss module calling nn.CrossEntropyLoss: a call_module node once traced
        "ignore": lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten(), ignore_index=-100),
    }[loss_name]
    if loss_name == "ignore":  # padding tokens: left out of the mean
        y = _ignore_some(y)
    ref = loss_fn(w.model(x), y)
    ref.backward()
    expected = _grads(w.model)
    gm = partition.trace(w.model, (x,))
    assert attach_loss(gm, loss_fn) is None and has_loss(gm)
    flat = flatten_inputs(gm, (x,), None, y)
    shapes = _shapes(gm, flat)
    assert vocab_parallel_loss(gm, _head(gm), shapes) is not None
    vocab_parallel(gm, "lm_head", bounds, shapes)
    assert not any(n.name == "lm_head" for n in gm.graph.nodes)
    got = gm(*flat)
    got.backward()
    torch.testing.assert_close(got, ref)
    grads = _grads(w.model)
    assert grads.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(grads[name], expected[name], msg=lambda m: f"{name}: {m}")


class _BiasHead(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(8, 8)
        self.w = torch.nn.Parameter(torch.randn(50, 8))
        self.b = torch.nn.Parameter(torch.randn(50))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.body(x).relu(), self.w, self.b)  # 2-D logits straight into the loss


def test_vocab_parallel_function_form_with_bias_and_per_row_loss() -> None:
    m = _BiasHead()
    x, y = torch.randn(6, 8), torch.randint(50, (6,))
    loss_fn = lambda out, t: F.cross_entropy(out, t, reduction="none")  # noqa: E731
    ref = loss_fn(m(x), y)
    ref.sum().backward()
    expected = _grads(m)
    gm = partition.trace(m, (x,))
    assert attach_loss(gm, loss_fn) is None
    flat = flatten_inputs(gm, (x,), None, y)
    lin = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target is F.linear)
    vocab_parallel(gm, lin.name, 4, _shapes(gm, flat))
    got = gm(*flat)
    got.sum().backward()
    torch.testing.assert_close(got, ref)
    for name, g in _grads(m).items():
        torch.testing.assert_close(g, expected[name], msg=lambda msg: f"{name}: {msg}")


@pytest.mark.parametrize("loss_fn", [
    lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten(), label_smoothing=0.1),
    lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten()) + out.mean(),  # logits used twice
    lambda out, t: F.cross_entropy((2 * out).flatten(0, 1), t.flatten()),  # not a reshape in between
    lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten(), weight=torch.ones(out.shape[-1])),
    lambda out, t: F.cross_entropy(out.transpose(1, 2), t),  # classes not last
], ids=["label-smoothing", "used-twice", "scaled", "class-weights", "transposed"])
def test_vocab_parallel_refuses_losses_it_would_change(loss_fn: Any) -> None:
    w = models.gpt_wide_vocab(**SMALL)
    (x,), y = w.make_batch(4, 0)
    gm = partition.trace(w.model, (x,))
    assert attach_loss(gm, loss_fn) is None
    shapes = _shapes(gm, flatten_inputs(gm, (x,), None, y))
    assert vocab_parallel_loss(gm, _head(gm), shapes) is None
    with pytest.raises(ValueError, match="cannot make node 'lm_head' vocabulary-parallel"):
        vocab_parallel(gm, "lm_head", 2, shapes)


class _Pair(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(x), x


class _ShapeBranch(torch.nn.Module):
    """Control flow on a shape: torch.fx cannot trace it, torch.export can."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(8, 20)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] == 8:
            x = x * 2
        return self.head(x)


class _Weighted(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(()))

    def forward(self, out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.scale * F.mse_loss(out, t)


def _value_branch(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    if t.sum() > 0:  # control flow on a value: fx cannot trace it
        return F.mse_loss(out, t)
    return out.sum()


def test_attach_loss_says_why_not_and_leaves_the_graph_alone() -> None:
    x = torch.randn(3, 4)
    m = _Pair()
    gm = partition.trace(m, (x,))
    code = gm.code
    out = m(x)
    # fx traces F.mse_loss on a tuple (the call goes to __torch_function__), but the traced loss
    # cannot run: the example check says so instead of attaching a loss that would fail later
    why = attach_loss(gm, lambda o, t: F.mse_loss(o, t), example=(out, x, torch.zeros(())))
    assert why is not None and "fails where loss_fn itself runs" in why
    wrong = attach_loss(gm, lambda o, t: F.mse_loss(o[0], t), example=(out, x, torch.ones(())))
    assert wrong == "the loss traced by torch.fx differs from loss_fn's value on the example"
    assert gm.code == code and not has_loss(gm)
    lin = partition.trace(torch.nn.Linear(4, 4), (x,))
    code = lin.code
    assert "cannot trace the loss function" in str(attach_loss(lin, _value_branch))
    assert str(attach_loss(lin, _Weighted())).startswith("the loss function holds parameters")
    assert "returns tuple, not one tensor" in str(attach_loss(lin, lambda o, t: (o.sum(), t)))
    w = torch.nn.Parameter(torch.ones(3))  # reached through a closure: traced, w.pow(2).sum() was a constant
    assert "a parameter reached through a closure" in str(attach_loss(lin, lambda o, t: o.sum() + w.pow(2).sum()))
    assert lin.code == code and not has_loss(lin)


def test_attach_loss_to_an_exported_graph() -> None:
    m = _ShapeBranch()
    x, y = torch.randn(2, 5, 8), torch.randint(20, (2, 5))
    gm = partition.trace(m, (x,))
    assert gm.meta["fxpipe_tracer"] == "torch.export.export"
    loss_fn = models._lm_loss
    assert attach_loss(gm, loss_fn) is None
    flat = flatten_inputs(gm, (x,), None, y)
    assert flat[-1] is y and [n.target for n in gm.graph.nodes if n.op == "placeholder"][-1] == TARGET
    torch.testing.assert_close(gm(*flat), loss_fn(m(x), y))


def test_plan_spreads_the_head_and_split_needs_the_loss() -> None:
    w = models.gpt_wide_vocab()
    p = partition.plan(w.model, w.example_args, 4, cost="flops", loss_fn=w.loss_fn, example_target=w.example_target)
    plain = partition.plan(w.model, w.example_args, 4, cost="flops")  # loss outside: logits must travel
    assert p.loss and not plain.loss
    (vocab,) = [r for r in p.rewrites if list(r[2:]) == ["vocab"]]
    holders = [s.index for s in p.stages if any(n.startswith("lm_head_vocab") for n in s.nodes)]
    assert len(vocab[1]) - 1 == len(holders) >= 2, (vocab, holders)  # one merged slice per stage
    # the head and its loss cost about three times the 8 layers: whole, they take one stage's cut from the layers
    assert p.bottleneck_ms < 0.9 * plain.bottleneck_ms
    assert "vocabulary slices" in p.table() and "loss: computed in the last stage (3), traced" in p.table()
    again = partition.Plan.load(p.save("/tmp/fxpipe-vocab-plan.json"))
    assert again == p
    with pytest.raises(partition.PlanError, match="loss_fn="):
        partition.split(w.model, again, w.example_args)
    stages = partition.split(w.model, again, w.example_args, loss_fn=w.loss_fn)
    gm = partition.trace(w.model, w.example_args)
    attach_loss(gm, w.loss_fn)
    flat = flatten_inputs(gm, w.example_args, None, w.example_target)
    env: dict[str, Any] = {}
    loss = None
    for st in stages:
        io = st.io
        res = st(*[env[r] for r in io.recv], *[flat[i] for i in io.inputs])
        if io.last:
            (loss,) = res
        else:
            env.update(zip(io.send, res))
    torch.testing.assert_close(loss, w.loss_fn(w.model(*w.example_args), w.example_target))
    logits = 4 * w.example_args[0].numel() * 16000  # bytes of one microbatch's logits
    assert all(s.send_bytes < logits / 8 for s in p.stages), [s.send_bytes for s in p.stages]


def test_a_target_that_does_not_fit_the_example_is_a_clear_error() -> None:
    w = models.gpt_wide_vocab(**SMALL)
    wrong = torch.zeros(3, 7, dtype=torch.long)
    with pytest.raises(partition.PlanError, match=r"fails on the example \(ValueError: Expected input batch_size.*"
                       r"the model returns a tensor of shape \[4, 16, 1000\].*example_target is a tensor of shape "
                       r"\[3, 7\]"):
        partition.plan(w.model, w.example_args, 2, cost="flops", loss_fn=w.loss_fn, example_target=wrong)
    with pytest.raises(partition.PlanError, match=r"must return a scalar tensor.*returned a tensor of shape \[64\]"):
        partition.plan(w.model, w.example_args, 2, cost="flops", example_target=w.example_target,
                       loss_fn=lambda o, t: F.cross_entropy(o.flatten(0, 1), t.flatten(), reduction="none"))
    # found by review: a Hugging Face model called without labels= returns out.loss None; the message said to
    # reduce it with .mean()
    with pytest.raises(partition.PlanError, match=r"returned None \(a Hugging Face model's out.loss is None unless "
                                                  r"the call passes labels="):
        partition.plan(w.model, w.example_args, 2, cost="flops", example_target=w.example_target,
                       loss_fn=lambda o, t: None)


def _float_loss(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.float().flatten(0, 1), t.flatten())  # .float() of float32 logits: no op


def _smoothed(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), t.flatten(), label_smoothing=0.1)


def test_a_no_op_cast_keeps_the_head_vocabulary_parallel_and_a_fallback_is_named() -> None:
    w = models.gpt_wide_vocab()
    plans = {name: partition.plan(w.model, w.example_args, 4, cost="flops", loss_fn=fn,
                                  example_target=w.example_target)
             for name, fn in (("plain", w.loss_fn), ("float", _float_loss), ("smoothed", _smoothed))}
    assert [r[2:] for r in plans["float"].rewrites] == [r[2:] for r in plans["plain"].rewrites] == [["vocab"]]
    assert plans["float"].bottleneck_ms == pytest.approx(plans["plain"].bottleneck_ms, rel=0.05)
    assert not plans["float"].notes
    smoothed = plans["smoothed"]  # label smoothing: row slices, and the table says why not vocabulary slices
    assert all(list(r[2:]) != ["vocab"] for r in smoothed.rewrites)
    assert any("not into vocabulary slices with its loss: its cross entropy has class weights, label smoothing"
               in n for n in smoothed.notes), smoothed.notes
    assert "note: lm_head may be cut into row slices" in smoothed.table()
    # a loss whose target cannot be inferred (it reads a dict) stays outside, and the table says why
    outside = partition.plan(w.model, w.example_args, 4, cost="flops", loss_fn=lambda o, t: w.loss_fn(o, t["y"]))
    why = "no example_target given, and loss_fn takes none of int64[4, 64], int64[4, 16000], float32[4, 64, 16000]"
    assert f"loss: computed after the last stage (3) by loss_fn, outside the graph ({why}" in outside.table()
    assert any(f"the loss is outside the graph ({why}" in n for n in outside.notes), outside.notes


def test_slice_bounds_of_a_count_fall_on_multiples_of_8() -> None:
    """The bounds vocab_parallel and split_linear cut at (pure): multiples of 8 where every slice keeps
    at least 8 features, within 4 of the even cut; else the even cut; always rising from 0 to out."""
    from partition.rewrite import _bounds
    assert _bounds(3, 16000) == [0, 5336, 10664, 16000]
    assert _bounds(3, 20) == [0, 7, 13, 20]
    for out in range(1, 300):
        for k in range(1, 7):
            b = _bounds(k, out)
            n = min(k, out)
            assert len(b) == n + 1 and b[0] == 0 and b[-1] == out, (k, out, b)
            assert all(x < y for x, y in zip(b, b[1:])), (k, out, b)
            even = [round(i * out / n) for i in range(n + 1)]
            if out >= 8 * n:
                assert all(x % 8 == 0 for x in b[:-1]) and all(abs(x - e) <= 4 for x, e in zip(b, even)), (k, out, b)
            else:
                assert b == even, (k, out, b)


def test_vocab_parallel_works_out_the_loss_in_float32_under_autocast() -> None:
    """Under autocast the logits are bfloat16 and F.cross_entropy works in float32; the slices' log-sum-exp
    and statistics did their sums in bfloat16 (a loss lower by up to 0.02 here), and now work in float32."""
    torch.manual_seed(0)
    w = models.gpt_wide_vocab(**SMALL)
    (x,), y = w.make_batch(4, 0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = w.loss_fn(w.model(x), y)
    gm = partition.trace(w.model, (x,))
    assert attach_loss(gm, w.loss_fn) is None
    flat = flatten_inputs(gm, (x,), None, y)
    vocab_parallel(gm, "lm_head", 4, _shapes(gm, flat))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = gm(*flat)
    assert got.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=2e-3, atol=0)  # the logits' rounding alone (bfloat16)


def test_vocab_parallel_refuses_soft_labels_and_out_of_range_targets() -> None:
    """Probabilities as the target (distillation, mixup) keep the loss whole, with the reason (planning
    crashed in the slice's gather); a target outside the vocabulary is an error, as in F.cross_entropy."""
    from partition.rewrite import vocab_loss, vocab_parallel_why
    w = models.gpt_wide_vocab(**SMALL)
    (x,), _ = w.make_batch(4, 0)
    soft = torch.softmax(torch.randn(4, SMALL["seq_len"], SMALL["vocab"]), -1)
    gm = partition.trace(w.model, (x,))
    assert attach_loss(gm, lambda o, t: F.cross_entropy(o.flatten(0, 1), t.flatten(0, 1))) is None
    flat = flatten_inputs(gm, (x,), None, soft)
    costs = node_costs(gm, flat, cost="flops")
    dtypes = {k: str(c.dtype).removeprefix("torch.") for k, c in costs.items() if getattr(c, "dtype", None)}
    ce, why = vocab_parallel_why(gm, _head(gm), {k: list(c.shape) for k, c in costs.items()}, dtypes)
    assert ce is None and "probabilities" in why, why
    stats = torch.zeros(3, 2)
    with pytest.raises(RuntimeError, match="outside"):
        vocab_loss(stats, torch.tensor([1, -100, 7]), 0, "mean", vocab=5)
    assert vocab_loss(stats, torch.tensor([1, -100, 4]), -100, "mean", vocab=5).item() == 0.0
