"""The batch's loss from its microbatches' (partition.reduction): which losses are weighed by their
counted targets, summed or averaged, the counts, and that the weighted sum is the whole batch's loss.
Pure logic, no processes; the pipeline's parity with ignored targets is in tests/test_data_parallel.py
(2 replicas of 2 stages) and tests/test_conditions.py (one pipeline, losses in and out of the graph)."""
import functools
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree

from partition.loss import attach_loss
from partition.reduction import loss_weighting
from partition.trace import flatten_inputs, trace

V = 5


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, V)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class WithLoss(nn.Module):
    """A loss module holding a cross entropy with class weights (a buffer of the loss, not the model)."""
    def __init__(self, **kw: Any) -> None:
        super().__init__()
        self.ce = nn.CrossEntropyLoss(**kw)

    def forward(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.ce(out.flatten(0, 1), target.flatten())


class Labels(nn.Module):
    """The loss computed by the model from a labels input, shifted as a causal LM shifts them."""
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, V)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.lin(x)[:, :-1]
        shifted = F.pad(labels, (0, 1), value=-100)[:, 1:-1]
        return F.cross_entropy(logits.flatten(0, 1), shifted.flatten())


class LabelsExported(Labels):
    """The same, with control flow on a size: torch.fx cannot trace it, torch.export does."""
    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if x.size(0) > 0:
            return super().forward(x, labels)
        return x.sum()


def _ce(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(o.flatten(0, 1), t.flatten())


def _weighting(loss_fn: Any, in_graph: bool, model: nn.Module | None = None) -> Any:
    x, t = torch.randn(2, 3, 4), torch.randint(0, V, (2, 3))
    gm = trace(model or Head(), (x,), {})
    if in_graph:
        assert attach_loss(gm, loss_fn) is None
        return loss_weighting(gm, loss_fn, True, [x, t])
    return loss_weighting(gm, loss_fn, False, [x], t)


def _ce_none(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(o.flatten(0, 1), t.flatten(), reduction="none").view_as(t)


def _masked_mean(o: torch.Tensor, t: torch.Tensor, floor: int | None = None) -> torch.Tensor:
    """A mean over the targets other than 0, written by hand (a masked mean), its divisor clamped or not."""
    mask = t != 0
    per = F.cross_entropy(o.flatten(0, 1), t.flatten(), reduction="none") * mask.flatten()
    count = mask.sum().float()
    return per.sum() / (count if floor is None else count.clamp(min=floor))


WEIGHTS = torch.tensor([0.5, 1.0, 2.0, 0.25, 1.5])
CRITERION = nn.CrossEntropyLoss(ignore_index=2)  # held by a closure, not by the loss: traced through
CASES = [  # (loss_fn, kind, what the plan's note says)
    (_ce, "count", "cross_entropy weighs by its targets other than ignore_index=-100"),
    (lambda o, t: CRITERION(o.flatten(0, 1), t.flatten()), "count", "targets other than ignore_index=2 over"),
    (WithLoss(weight=WEIGHTS, ignore_index=1, label_smoothing=0.1), "count", "ignore_index=1 (by class weight)"),
    (lambda o, t: F.nll_loss(F.log_softmax(o, -1).flatten(0, 1), t.flatten(), ignore_index=3), "count",
     "nll_loss weighs by its targets other than ignore_index=3"),
    (lambda o, t: F.cross_entropy(o.flatten(0, 1), t.flatten(), reduction="sum"), "sum",
     "the sum of the microbatches' (cross_entropy, reduction='sum')"),
    (lambda o, t: F.mse_loss(o, t.float().unsqueeze(-1).expand_as(o), reduction="sum"), "sum", "mse_loss"),
    (lambda o, t: F.mse_loss(o, t.float().unsqueeze(-1).expand_as(o)), "mean",
     "the loss is call_function mse_loss, not a cross entropy or NLL loss"),
    # found by review: a mean over the values a mask selects (labels missing) was averaged over the microbatches
    (lambda o, t: F.mse_loss(o[t != 0], t.float().unsqueeze(-1).repeat(1, 1, V)[t != 0]), "count",
     "mse_loss weighs by its target's elements (the values a mask selects)"),
    (lambda o, t: nn.L1Loss()(o[t != 0], t.float().unsqueeze(-1).repeat(1, 1, V)[t != 0]), "count",
     "l1_loss weighs by its target's elements"),  # (a module of the closure's: traced through)
    (lambda o, t: 2 * _ce(o, t), "count", "cross_entropy weighs by its targets"),  # scaled by a shared number
    (lambda o, t: F.cross_entropy(o.flatten(0, 1), t.flatten(), reduction="sum") / 7.0, "sum", "reduction='sum'"),
    (lambda o, t: _ce(o, t) * o.mean(), "mean", "the loss is call_function mul"),  # by a value of the microbatch
    (lambda o, t: ((o - t.unsqueeze(-1)) ** 2).sum(), "sum", "(sum_1: a .sum() over the samples)"),
    (lambda o, t: -((o - t.unsqueeze(-1)) ** 2).sum(), "sum", "a .sum() over the samples"),  # negated (review)
    (lambda o, t: ((o - t.unsqueeze(-1)) ** 2).sum(-1).sum((0, 1)).mul(0.5), "sum", "a .sum() over the samples"),
    (lambda o, t: ((o - t.unsqueeze(-1)) ** 2).mean(0).sum(), "mean",  # over no sample's terms: one per microbatch
     "the loss is call_method mean"),
    # found by review: a sum over the samples alone, then a mean over the features, was averaged (1/M)
    (lambda o, t: ((o - t.unsqueeze(-1)) ** 2).sum(0).mean(), "sum", "a .sum() over the samples"),
    (lambda o, t: ((o - t.unsqueeze(-1)) ** 2).sum(0).sum(), "sum", "a .sum() over the samples"),
    (lambda o, t: ((o - t.unsqueeze(-1)) ** 2).sum(0).pow(2).mean(), "mean", "the loss is call_method pow"),
    (lambda o, t: ((_ce_none(o, t) * (t != 0)).sum(0) / (t != 0).sum()).mean(), "ratio", "over the batch's divisor"),
    (lambda o, t: (((o - t.unsqueeze(-1)) ** 2).sum(0) / (t != 0).sum(0).unsqueeze(-1)).mean(), "mean",
     "not a cross entropy"),  # a divisor per feature: no one number to divide by
    (lambda o, t: _ce(o, t).float().sum(), "count", "cross_entropy weighs by its targets"),  # one number: as it is
    (lambda o, t: _masked_mean(o, t), "ratio", "each microbatch's numerator over the batch's divisor (computed"),
    (lambda o, t: _masked_mean(o, t, 1), "ratio", "over the batch's divisor, at least 1 (computed from the inputs)"),
    (lambda o, t: F.cross_entropy(o.flatten(0, 1), t.flatten(), reduction="sum") / (t != 0).sum(), "ratio",
     "(cross_entropy, reduction='sum') / sum"),
    # found in session 35: a sum of sums over a count was averaged
    (lambda o, t: (F.cross_entropy(o.flatten(0, 1), t.flatten(), reduction="sum") + F.cross_entropy(
        o.flatten(0, 1), t.flatten(), label_smoothing=0.1, reduction="sum")) / (t != 0).sum(), "ratio",
     "each microbatch's numerator over the batch's divisor"),
    # found by review of the change: a numerator scaling a sum by a number is a sum; one adding a term that is not
    # (a mean, a weight's penalty) was averaged and said to be the batch's where the microbatches average alike
    (lambda o, t: (F.cross_entropy(o.flatten(0, 1), t.flatten(), reduction="sum") - 0.5 * F.cross_entropy(
        o.flatten(0, 1), t.flatten(), label_smoothing=0.1, reduction="sum")) / (t != 0).sum(), "ratio",
     "each microbatch's numerator over the batch's divisor"),
    (lambda o, t: (F.cross_entropy(o.flatten(0, 1), t.flatten(), reduction="sum") + o.abs().mean()) / (t != 0).sum(),
     "mean", "NOT the batch's"),
    (lambda o, t: _ce(o, t) / (t != 0).sum(), "mean", "NOT the batch's"),  # a mean over a count
    # found by review: a sum of terms each divided by a value of the whole microbatch was summed (4x the loss)
    (lambda o, t: ((o - t.unsqueeze(-1)) ** 2 / o.shape[0]).sum(), "mean", "not each from its own sample"),
    (lambda o, t: (_ce_none(o, t) * (t != 0) / (t != 0).sum().clamp(min=1)).sum(), "mean", "not each from its own"),
    (lambda o, t: (o - o.mean(0)).pow(2).sum(), "mean", "not each from its own sample"),
    (lambda o, t: F.mse_loss(o - o.mean(0), t.float().unsqueeze(-1).expand_as(o), reduction="sum"), "mean",
     "the loss is call_function mse_loss"),
    (lambda o, t: ((o - t.unsqueeze(-1)) ** 2 / o.shape[1]).sum(), "sum", "a .sum() over the samples"),  # a length
    (lambda o, t: ((o - t.unsqueeze(-1)) ** 2).view(o.shape[0], -1).sum(), "sum", "a .sum() over the samples"),
    (lambda o, t: ((o - t.unsqueeze(-1)) ** 2).sum() / o.abs().sum(), "mean",
     "over a sum whose value is computed by call_module lin, not from the inputs alone"),
    (lambda o, t: F.cross_entropy(o.flatten(0, 1), o.argmax(-1).flatten()), "mean",
     "target is computed by call_module lin, not from the inputs alone"),
]


@pytest.mark.parametrize("in_graph", [True, False])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_which_losses_are_weighed_and_what_the_plan_says(case: int, in_graph: bool) -> None:
    loss_fn, kind, said = CASES[case]
    w = _weighting(loss_fn, in_graph)
    if kind == "ratio" and not in_graph:  # the step calls loss_fn, which returns the ratio, not its numerator
        assert w.kind == "mean" and "which fxpipe weighs only where the graph computes it" in w.describe() \
            and "NOT the batch's" in w.describe(), w
        return
    assert w.kind == kind, (case, w)
    assert said in w.describe(), w.describe()
    if kind != "mean":
        assert w.describe(replicas=2).endswith("over every replica's batch"), w.describe(2)


def test_a_loss_outside_the_graph_that_fx_cannot_trace_is_averaged_and_says_why() -> None:
    def untraceable(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return _ce(o, t) if bool(o.sum() > -1e9) else o.sum()
    w = _weighting(untraceable, False)
    assert w.kind == "mean" and "the loss stays outside the graph and its kind is unknown" in w.describe(), w


@pytest.mark.parametrize("loss_fn", [_ce, CASES[1][0], CASES[2][0], CASES[3][0]],
                         ids=["ce", "criterion in a closure", "weighted smoothed", "nll"])
@pytest.mark.parametrize("in_graph", [True, False])
def test_counted_microbatches_weigh_to_the_whole_batchs_loss(loss_fn: Any, in_graph: bool) -> None:
    """Microbatches with 0, few and many counted targets: sum of count / total x each microbatch's loss
    (0 for the one without targets, whose loss is NaN) is the loss over the whole batch."""
    torch.manual_seed(0)
    model = Head()
    w = _weighting(loss_fn, in_graph)
    x, t = torch.randn(8, 3, 4), torch.randint(0, V, (8, 3))
    ignore = w.ignore_index
    t[:2] = ignore          # microbatch 0: every target ignored
    t[2:4] = ignore         # microbatch 1: one counted
    t[2, 0] = 4
    counts = [w.count([xm, tm]) for xm, tm in zip(x.chunk(4), t.chunk(4))]
    assert float(counts[0]) == 0.0
    total = sum(counts)
    got = sum(torch.where(c > 0, loss_fn(model(xm), tm), 0.0) * c / total
              for c, xm, tm in zip(counts, x.chunk(4), t.chunk(4)))
    torch.testing.assert_close(got.float(), loss_fn(model(x), t), rtol=1e-6, atol=1e-6)
    if loss_fn is CASES[2][0]:  # counted by class weight
        assert float(counts[1]) == float(WEIGHTS[4])
    else:
        assert float(counts[1]) == 1.0


def test_a_models_own_loss_from_shifted_labels_is_counted_on_both_tracers() -> None:
    """The loss the model computes from a labels input it shifts (F.pad, slices: a causal LM's), as fx
    and torch.export trace it: each microbatch counts the shifted labels, not the given ones."""
    x, labels = torch.randn(4, 5, 4), torch.randint(0, V, (4, 5))
    labels[0, :3] = -100
    for cls, tracer in ((Labels, "torch.fx.symbolic_trace"), (LabelsExported, "torch.export.export")):
        gm = trace(cls(), (x[:2],), {"labels": labels[:2]})
        assert gm.meta["fxpipe_tracer"] == tracer, gm.meta["fxpipe_tracer"]
        w = loss_weighting(gm, lambda out, _: out, False)
        assert w.kind == "count", (tracer, w.why)
        counts = [float(w.count([xm, lm, None])) for xm, lm in zip(x.chunk(2), labels.chunk(2))]
        assert counts == [2 * 4 - 2, 2 * 4], (tracer, counts)  # positions 1..4 of each row; 1, 2 ignored in row 0


def _masked_copy(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t.masked_fill_(t == 0, -100)  # its result unused: the write is what counts
    return F.cross_entropy(o.flatten(0, 1), t.flatten())


def _masked_target(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    t.masked_fill_(t == 0, -100)  # the target itself, written
    return F.cross_entropy(o.flatten(0, 1), t.flatten())


@pytest.mark.parametrize("in_graph", [True, False])
def test_writes_to_the_target_count_and_class_weights_are_read_when_counting(in_graph: bool) -> None:
    """A target masked in place by an op whose result goes unused counts as masked (it was counted unmasked:
    grads up to 84% off); a target the loss writes itself is copied before counting (the step's loss then
    writes it once); class weights are read when counting, not as they were when the pipeline was built
    (weights= or a checkpoint loads them later). Found by review."""
    t = torch.tensor([[0, 1, 2], [0, 0, 3]])
    for loss_fn, written in ((_masked_copy, False), (_masked_target, True)):
        w = _weighting(loss_fn, in_graph)
        assert w.kind == "count" and bool(w.written) == written, (w.kind, w.why, w.written)
        given = t.clone()
        assert float(w.count([torch.randn(2, 3, 4), given])) == 3.0
        assert torch.equal(given, t)  # the user's target as given
    held = WithLoss(weight=torch.ones(V), ignore_index=-100)
    w = _weighting(held, in_graph)
    assert float(w.count([torch.randn(2, 3, 4), t])) == 6.0
    with torch.no_grad():
        held.ce.weight.fill_(0.5)  # as a load writes it
    assert float(w.count([torch.randn(2, 3, 4), t])) == 3.0


class SumOverItems(nn.Module):
    """A Hugging Face causal LM's loss given num_items_in_batch: a summed cross entropy over the whole batch's
    count, an input every microbatch shares (a 0-dim tensor, repeated rather than split)."""
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, V)

    def forward(self, x: torch.Tensor, labels: torch.Tensor, num_items: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.lin(x).flatten(0, 1), labels.flatten(), reduction="sum") / num_items


def test_a_sum_over_the_batchs_count_sums_the_microbatches() -> None:
    """Found by review: HF's loss with num_items_in_batch was averaged, halving the loss and every grad."""
    x, labels, n = torch.randn(2, 3, 4), torch.randint(0, V, (2, 3)), torch.tensor(12.0)
    gm = trace(SumOverItems(), (x, labels, n), {})
    w = loss_weighting(gm, lambda out, _: out, False, example=[x, labels, n])
    assert w.kind == "sum" and "reduction='sum'" in w.describe(), w
    assert loss_weighting(gm, lambda out, _: out, False).kind == "mean"  # (without the example: not known shared)


@pytest.mark.parametrize("floor", [None, 1])
def test_a_ratio_of_sums_is_the_batchs_with_a_microbatch_whose_divisor_is_0(floor: int | None) -> None:
    """A masked mean written by hand, (loss * mask).sum() / mask.sum() (clamped below or not), with a
    microbatch whose every target is masked: the graph returns the numerator (keep_numerator), each scaled by
    one over the batch's divisor, as a step does; loss and grads are the whole batch's, finite (that
    microbatch's own ratio is NaN without the floor, and so were its grads through it)."""
    torch.manual_seed(0)
    model, ref = Head(), Head()
    ref.load_state_dict(model.state_dict())
    x, t = _uneven_batch()
    gm = trace(model, (x[:2],), {})
    assert attach_loss(gm, lambda o, tt: _masked_mean(o, tt, floor)) is None
    w = loss_weighting(gm, None, True, [x[:2], t[:2]])
    assert w.kind == "ratio" and w.floor == floor, w
    _numerators_give_the_batchs(gm, w, model, x, t, lambda: _masked_mean(ref(x), t, floor), ref)


def _uneven_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """8 samples of 3 targets in 1..V-1 (0 ignored) for 4 microbatches: microbatch 0 counts none, 1 two."""
    x, t = torch.randn(8, 3, 4), torch.randint(1, V, (8, 3))
    t[:2] = 0
    t[2:4, 1:] = 0
    return x, t


def _numerators_give_the_batchs(gm: Any, w: Any, model: nn.Module, x: torch.Tensor, t: torch.Tensor,
                                want_fn: Any, ref: nn.Module) -> None:
    """A "ratio" weighting, as a step applies it to _uneven_batch's 4 microbatches: the graph returns the
    numerator (keep_numerator), each scaled by one over the batch's divisor (its floor too); loss and grads are
    `want_fn()`'s and ref's, finite."""
    from partition.reduction import keep_numerator
    keep_numerator(gm, w)
    counts = [w.count([xm, tm]) for xm, tm in zip(x.chunk(4), t.chunk(4))]
    assert [float(c) for c in counts] == [0.0, 2.0, 6.0, 6.0]
    total = sum(counts)
    scale = 1 / (total if w.floor is None else total.clamp(min=w.floor))
    got = sum(gm(xm, tm) * scale for xm, tm in zip(x.chunk(4), t.chunk(4)))
    got.backward()
    want = want_fn()
    want.backward()
    torch.testing.assert_close(got.float(), want, rtol=1e-6, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None and bool(torch.isfinite(p.grad).all()), name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")


def test_a_sum_over_the_samples_sums_the_microbatches_and_one_over_none_is_averaged() -> None:
    """A .sum() over every sample's terms is the sum of the microbatches' (it was averaged: loss and grads 1/M
    of the batch's); a .sum() of values without the batch (a mean over it first, a parameter's) is not."""
    x = torch.randn(2, 3, 4)
    for loss_fn, kind in ((lambda o, t: (o - t.unsqueeze(-1)).pow(2).sum(), "sum"),
                          (lambda o, t: (o - t.unsqueeze(-1)).pow(2).mean((0, 1)).sum(), "mean")):
        w = _weighting(loss_fn, True)
        assert w.kind == kind, w
    summed = lambda o, t: (o - t.unsqueeze(-1)).pow(2).sum()  # noqa: E731
    outside = loss_weighting(trace(Head(), (x,), {}), summed, False, [x], None)  # no target: not known to be over
    assert outside.kind == "mean" and "no example target was given (example_target=" in outside.describe(), outside
    gm = trace(Head(), (x,), {})
    assert attach_loss(gm, summed) is None
    w = loss_weighting(gm, None, True)
    assert w.kind == "mean" and "no example of its inputs was given" in w.describe(), w


@pytest.mark.parametrize("ratio", [False, True])
def test_a_sum_over_the_samples_alone_then_a_mean_is_the_batchs(ratio: bool) -> None:
    """`((o - t) ** 2).sum(0).mean()` (each feature's sum over the samples, averaged over the features), and the
    same over a masked count: the microbatches' losses (numerators over the batch's divisor) add up to the
    batch's loss and grads."""
    from partition.reduction import keep_numerator
    torch.manual_seed(0)
    model, ref = Head(), Head()
    ref.load_state_dict(model.state_dict())
    x, t = torch.randn(8, 3, 4), torch.randint(0, V, (8, 3))
    t[2:4] = 0

    def loss_fn(o: torch.Tensor, tt: torch.Tensor) -> torch.Tensor:
        per = (o - tt.unsqueeze(-1)) ** 2
        return (per.sum(0) / (tt != 0).sum()).mean() if ratio else per.sum(0).mean()
    gm = trace(model, (x[:2],), {})
    assert attach_loss(gm, loss_fn) is None
    w = loss_weighting(gm, None, True, [x[:2], t[:2]])
    assert w.kind == ("ratio" if ratio else "sum"), w
    keep_numerator(gm, w)
    scale = 1 / sum(w.count([xm, tm]) for xm, tm in zip(x.chunk(4), t.chunk(4))) if ratio else 1.0
    got = sum(gm(xm, tm) * scale for xm, tm in zip(x.chunk(4), t.chunk(4)))
    got.backward()
    want = loss_fn(ref(x), t)
    want.backward()
    torch.testing.assert_close(got.float(), want, rtol=1e-6, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


class DictIn(nn.Module):
    """Takes its inputs in a dict (microbatches split the tensors in it) and returns its own summed loss over
    the microbatch's size, read from the dict."""
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, b: dict[str, torch.Tensor]) -> torch.Tensor:
        return ((self.lin(b["x"]).squeeze(-1) - b["y"]) ** 2).sum() / b["x"].shape[0]


def test_an_input_dict_of_tensors_is_split_not_shared() -> None:
    """Found by review: a dict input was taken as a value every microbatch shares, so a sum over the size read
    from it was summed over the microbatches (4x the loss, grads 3x off)."""
    b = {"x": torch.randn(2, 3, 4), "y": torch.randn(2, 3)}
    gm = trace(DictIn(), (b,), {})
    w = loss_weighting(gm, lambda out, _: out, False, flatten_inputs(gm, (b,), {}), torch.zeros(2))
    assert w.kind == "mean", w


def test_values_made_of_the_sequence_length_or_device_do_not_mix_the_samples() -> None:
    """The GPT's positions, arange(T, device=idx.device) with T read from idx's shape, are not a value of the
    batch (T and the device are the same at any batch size): a masked mean on its logits is a ratio (it was
    taken for one mixing the samples, and averaged)."""
    import partition
    from partition.loss import attach_loss as attach

    def masked(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        mask = (target >= 0).flatten()
        per = F.cross_entropy(logits.flatten(0, 1), target.clamp(min=0).flatten(), reduction="none")
        return (per * mask).sum() / mask.sum()
    w = partition.load("gpt", n_layer=1, d_model=16, n_head=2, seq_len=8, vocab=32)
    gm = trace(w.model, w.example_args, {})
    assert attach(gm, masked) is None
    got = loss_weighting(gm, None, True, flatten_inputs(gm, w.example_args, {}, w.example_target))
    assert got.kind == "ratio", got


class _Pairs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.a(x) @ self.b(z).t()


def _in_batch_negatives(logits: torch.Tensor, _: Any) -> torch.Tensor:
    labels = torch.arange(logits.shape[0])
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


@pytest.mark.parametrize("in_graph", [True, False])
def test_a_loss_pairing_the_samples_is_said_not_to_be_the_batchs(in_graph: bool) -> None:
    """Found by review: CLIP's loss over in-batch negatives (logits [B, B]) was said to be the batch's: each
    microbatch pairs its own samples only, 1.403 where the batch's is 2.785. Its logits grow 4x at twice the
    samples."""
    x, z, t = torch.randn(3, 4), torch.randn(3, 4), torch.zeros(3, dtype=torch.long)
    gm = trace(_Pairs(), (x, z), {})
    if in_graph:
        assert attach_loss(gm, _in_batch_negatives) is None
        w = loss_weighting(gm, None, True, [x, z, t])
    else:
        w = loss_weighting(gm, _in_batch_negatives, False, [x, z], t)
    assert w.kind == "mean" and w.inexact, w
    assert w.describe().startswith("loss: NOT the batch's, the mean of the microbatches' losses: the loss pairs the "
                                   "samples of a microbatch (matmul has 9 elements on one microbatch and 36 on two"), \
        w.describe()


def _sq(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return (o - t.float().unsqueeze(-1)) ** 2


@pytest.mark.parametrize("loss_fn, kind, said", [
    # every term a sum: the sum of the microbatches' (it was averaged: 1/M of the batch's loss and grads)
    (lambda o, t: F.mse_loss(o, _sq(o, t), reduction="sum") + F.l1_loss(o, _sq(o, t), reduction="sum"), "sum",
     "the sum of the microbatches' (mse_loss"),
    (lambda o, t: _sq(o, t).sum() - 0.5 * _sq(o, t).abs().sum(), "sum", "the sum of the microbatches'"),
    # a count of the same targets twice, a shared number added: counted
    (lambda o, t: _ce(o, t) + 0.1 * F.cross_entropy(o.flatten(0, 1), t.flatten(), label_smoothing=0.2), "count",
     "weighs by its targets other than ignore_index=-100"),
    (lambda o, t: _ce(o, t) + 1.0, "count", "weighs by its targets"),
    (lambda o, t: _sq(o, t).mean() + 0.01 * o.pow(2).mean(), "mean", "the loss adds terms each formed as a mean"),
    # terms formed otherwise: each weighed its own way (test_terms_formed_otherwise_are_each_weighed_their_way)
    (lambda o, t: _sq(o, t).sum() + 0.1 * o.abs().mean(), "terms", "sum_1 (a .sum() over the samples): the sum of "
                                                                   "the microbatches'; mul: the mean of the "
                                                                   "microbatches'"),
    (lambda o, t: _ce(o, t) + 0.01 * o.pow(2).mean(), "terms", "cross_entropy: weighed by its targets"),
])
@pytest.mark.parametrize("in_graph", [True, False])
def test_a_loss_adding_terms_is_weighed_by_its_terms(loss_fn: Any, kind: str, said: str, in_graph: bool) -> None:
    """Found in review: mse_loss(reduction='sum') + a mean penalty was averaged over the microbatches with a note
    naming only the add (10.64 where the batch's loss is 42.49); two summed terms were averaged too."""
    w = _weighting(loss_fn, in_graph)
    if kind == "terms" and not in_graph:  # weighed apart only where the graph adds them
        kind, said = "mean", "NOT the batch's, the mean of the microbatches' losses: the loss adds terms"
        assert "leave trace_loss on, and give example_target= where" in w.describe(), w.describe()
    assert w.kind == kind and said in w.describe(), w.describe()
    if kind == "count":  # the counts still weigh the microbatches to the batch's loss
        x, t = torch.randn(4, 3, 4), torch.randint(0, V, (4, 3))
        t[:3] = -100
        model = Head()
        want = loss_fn(model(x), t)
        counts = [w.count([x[i:i + 1], t[i:i + 1]]) for i in range(4)]
        assert [float(c) for c in counts] == [0, 0, 0, 3], counts
        got = sum(c / sum(counts) * torch.nan_to_num(loss_fn(model(x[i:i + 1]), t[i:i + 1]), nan=0.0)
                  for i, c in enumerate(counts))
        torch.testing.assert_close(got, want.double())


def _balance(o: torch.Tensor, _: Any = None) -> torch.Tensor:
    """A statistic of the whole microbatch, as a router's load-balancing loss: not linear in its samples."""
    routed = o.softmax(-1).mean((0, 1))
    return (routed * routed).sum() * V


@pytest.mark.parametrize("terms", [
    [(_ce, "count"), (lambda o, t: 0.01 * o.pow(2).mean(), "mean")],
    [(_ce, "count"), (lambda o, t: 0.5 * _balance(o), "mean")],
    [(lambda o, t: _sq(o, t).sum(), "sum"), (lambda o, t: -0.1 * _balance(o), "mean")],
    [(_ce, "count"), (lambda o, t: F.cross_entropy(o.flatten(0, 1), t.clamp(min=0).flatten(), ignore_index=1),
                      "count")],
    [(_ce, "count"), (lambda o, t: 0.3 * _sq(o, t).sum(), "sum"), (lambda o, t: 2.0 * _balance(o), "mean"),
     (lambda o, t: 1.5, "mean")],
    [(lambda o, t: _masked_mean(o, t.clamp(min=0)) * 0.5, "ratio"), (lambda o, t: _balance(o), "mean"),
     (_ce, "count")],
], ids=["ce+mean", "ce+balance", "sum-balance", "two counts", "nested", "ratio"])
def test_terms_formed_otherwise_are_each_weighed_their_way(terms: list[tuple[Any, str]]) -> None:
    """Found in session 36 (a mixture of experts: Mixtral's cross entropy + coef x its router's load-balancing
    loss): a loss adding terms the batch forms in different ways was averaged as one loss, its cross entropy then
    weighed as a mean (5.1805 where the batch's is 5.1725), and a microbatch counting no target made the step's
    loss NaN. Each term is now weighed in its microbatch by its own weight (weigh_terms: the stage takes the
    weights as an input), as a step gives them: the count and sum terms are the batch's, a mean term the mean of
    the microbatches', and loss and grads are finite with a microbatch counting no target."""
    from partition.reduction import TERMS, weigh_terms

    def loss_fn(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        total = terms[0][0](o, t)
        for fn, _ in terms[1:]:
            total = total + fn(o, t)
        return total
    torch.manual_seed(0)
    x, t = torch.randn(8, 3, 4), torch.randint(0, V, (8, 3))
    t[:2] = -100  # microbatch 0 counts no target
    t[2:4, 1:] = 1  # microbatch 1: ignore_index=1 counts two fewer
    model = Head()
    gm = trace(model, (x[:2],), {})
    assert attach_loss(gm, loss_fn) is None
    w = loss_weighting(gm, loss_fn, True, [x[:2], t[:2]])
    assert w.kind == "terms" and [p.kind for p in w.parts] == [k for _, k in terms], w.describe()
    # a stage that does not add the terms (a plan adding them before its last stage) is left as it is, and the
    # pipeline averages the whole loss, said NOT to be the batch's
    from pipe.runtime import weigh_on
    other = trace(Head(), (x[:2],), {})
    code = other.code
    assert not weigh_terms(other, w) and other.code == code
    assert weigh_on({n.name for n in other.graph.nodes}, w).describe().startswith(
        "loss: NOT the batch's, the mean of the microbatches' losses: the loss adds terms")
    assert weigh_on({n.name for n in gm.graph.nodes}, w) is w
    ratio = next((p for p in w.parts if p.kind == "ratio"), None)
    if ratio is not None:  # a ratio term divided on an earlier stage: averaged, said so (not refused at the split)
        assert weigh_on({n.name for n in gm.graph.nodes} - {ratio.ratio}, w).inexact
    assert weigh_terms(gm, w) and [n.name for n in gm.graph.nodes if n.op == "placeholder"][-1] == TERMS
    xs, ts = x.chunk(4), t.chunk(4)
    weights = []
    for p in w.parts:  # as pipe.step's _term_weights gives them (one replica)
        if p.kind == "count":
            counts = torch.stack([p.count([xm, tm]) for xm, tm in zip(xs, ts)])
            weights.append(counts / counts.sum())
        elif p.kind == "ratio":  # its numerator over the batch's divisor
            total = torch.stack([p.count([xm, tm]) for xm, tm in zip(xs, ts)]).sum()
            weights.append((1 / (total if p.floor is None else total.clamp(min=p.floor))).expand(4))
        else:
            weights.append(torch.full((4,), 1.0 if p.kind == "sum" else 0.25, dtype=torch.float64))
    per_mb = torch.stack(weights, 1).float()
    got = sum(gm(xm, tm, per_mb[m]) for m, (xm, tm) in enumerate(zip(xs, ts)))
    got.backward()
    grads = {n: q.grad.clone() for n, q in model.named_parameters()}
    model.zero_grad()
    want = 0.0
    for fn, kind in terms:  # the batch's count and sum terms, and the mean of the microbatches' mean terms
        want = want + (fn(model(x), t) if kind != "mean" else sum(fn(model(xm), tm) for xm, tm in zip(xs, ts)) / 4)
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for name, q in model.named_parameters():
        assert bool(torch.isfinite(grads[name]).all()), name
        torch.testing.assert_close(grads[name], q.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


class _RatioPenaltyBeside(nn.Module):
    """A cross entropy plus a masked mean whose numerator adds a penalty of the weights."""
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, V)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        o = self.lin(x)
        mask = t != -100
        summed = (F.cross_entropy(o, t.clamp(min=0), reduction="none") * mask).sum()
        return F.cross_entropy(o, t) + (summed + 0.01 * self.lin.weight.pow(2).sum()) / mask.sum()


def test_a_ratio_adding_a_penalty_beside_other_terms_is_said_not_the_batchs() -> None:
    """Found by review: beside another term, a ratio whose numerator adds a penalty of the weights was weighed as
    a ratio alone, its penalty then added M times (4.548 where the batch's is 4.536), silently: it is averaged, and
    said so."""
    x, t = torch.randn(2, 4), torch.randint(0, V, (2,))
    model = _RatioPenaltyBeside()
    w = loss_weighting(trace(model, (x, t), {}), lambda out, _: out, False, [x, t], None)
    assert w.kind == "mean" and w.inexact and "whose numerator adds a penalty of the weights" in w.describe(), \
        w.describe()


class _Penalised(nn.Module):
    """A model computing its own loss: a cross entropy (or a sum) plus an L2 penalty of its weights."""
    def __init__(self, summed: bool) -> None:
        super().__init__()
        self.a, self.b, self.summed = nn.Linear(4, 6), nn.Linear(6, V), summed

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        o = self.b(torch.relu(self.a(x)))
        fit = _sq(o, t).sum() if self.summed else _ce(o, t)
        if hasattr(self, "scale"):
            fit = fit * self.scale
        return fit + 0.01 * (self.a.weight.pow(2).sum() + self.b.weight.pow(2).sum())


class _PenalisedExported(_Penalised):
    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        if x.size(0) > 0:
            return super().forward(x, t)
        return x.sum()


@pytest.mark.parametrize("cls", [_Penalised, _PenalisedExported])
def test_a_penalty_of_the_weights_is_the_same_in_every_microbatch(cls: type) -> None:
    """Found in session 35: a model's loss adding an L2 penalty of its own weights to a cross entropy was averaged
    and said NOT to be the batch's; the penalty is the same in every microbatch, so the counts weigh the
    microbatches' losses to the batch's. Added to a sum, it would count M times: averaged, and said so."""
    torch.manual_seed(0)
    x, t = torch.randn(4, 3, 4), torch.randint(0, V, (4, 3))
    t[:3] = -100
    t[0, 1] = 2
    from pipe.inference import literals_at_twice
    model = cls(summed=False)
    gm = trace(model, (x[:1], t[:1]), {})
    literals = functools.cache(lambda: literals_at_twice(model, (x[:1], t[:1]), {}, gm))
    w = loss_weighting(gm, lambda out, _: out, False, literals=literals)  # (torch.export's numbers: constants)
    assert w.kind == "count" and "(the same in every microbatch) weighs by its targets" in w.describe(), \
        w.describe()
    if cls is _PenalisedExported:  # unknown numbers (no such trace): its penalty may be over a size, and is said so
        w = loss_weighting(gm, lambda out, _: out, False)
        assert w.kind == "terms" and w.describe().startswith("loss: NOT the batch's"), w.describe()
        w = loss_weighting(gm, lambda out, _: out, False, literals=literals)
    counts = [w.count([x[i:i + 1], t[i:i + 1], None]) for i in range(4)]
    assert [float(c) for c in counts] == [1, 0, 0, 3], counts
    got = sum(c / sum(counts) * torch.nan_to_num(model(x[i:i + 1], t[i:i + 1]), nan=0.0)
              for i, c in enumerate(counts))
    torch.testing.assert_close(got, model(x, t).double())
    # added to a sum, the penalty was averaged (M x in the batch's loss), and said so: now a term of its own, weighed
    # 1/M in each microbatch, which sums the batch's
    summed = cls(summed=True)
    _penalty_once(summed, x, t)
    # found by review of the change: a cross entropy scaled by a weight (a learned loss weight) was counted, and a
    # microbatch counting no target (its loss NaN, weighed 0) gave that weight the grad 0 x NaN, silently: a weight
    # may be added to a loss, not scale it
    scaled = cls(summed=False)
    scaled.scale = nn.Parameter(torch.tensor(1.5))
    w = loss_weighting(trace(scaled, (x[:1], t[:1]), {}), lambda out, _: out, False, [x[:1], t[:1]], None)
    assert w.kind == "mean" and "is scaled by a weight" in w.describe() and "NOT the batch's" in w.describe(), \
        w.describe()
    summed.scale = nn.Parameter(torch.tensor(1.5))  # a sum scaled by a weight stays a sum (its microbatches' add)
    _penalty_once(summed, x, t)


def _penalty_once(model: nn.Module, x: torch.Tensor, t: torch.Tensor) -> None:
    """_Penalised(summed=True): its sum and its penalty each weighed their way (the sum's microbatches summed, the
    penalty 1/M in each), loss and grads the model's on the batch."""
    from partition.reduction import weigh_terms
    model.zero_grad()
    gm = trace(model, (x[:1], t[:1]), {})
    w = loss_weighting(gm, lambda out, _: out, False, [x[:1], t[:1]], None)
    assert w.kind == "terms" and [p.kind for p in w.parts] == ["sum", "mean"], w.describe()
    gm.graph._codegen = torch.fx.graph.CodeGen()  # flat inputs, as a stage's (torch.export's takes a pytree)
    gm = torch.fx.GraphModule(gm, gm.graph)
    assert weigh_terms(gm, w)
    weights = torch.tensor([1.0, 0.25])
    got = sum(pytree.tree_leaves(gm(xm, tm, weights))[0] for xm, tm in zip(x.chunk(4), t.chunk(4)))
    got.backward()
    grads = {n: q.grad.clone() for n, q in model.named_parameters()}
    model.zero_grad()
    want = model(x, t)
    want.backward()
    torch.testing.assert_close(got, want)
    for name, q in model.named_parameters():
        torch.testing.assert_close(grads[name], q.grad, msg=lambda m: f"{name}: {m}")


class _WeightedRatio(nn.Module):
    """A model computing its own loss: a summed cross entropy times a learned weight over the batch's count of
    targets (`ce_sum * alpha / count`)."""
    def __init__(self) -> None:
        super().__init__()
        self.a, self.alpha = nn.Linear(4, V), nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        ce = F.cross_entropy(self.a(x).flatten(0, 1), t.flatten(), ignore_index=0, reduction="sum")
        return ce * self.alpha / (t != 0).sum()


def test_a_ratio_whose_numerator_is_a_sum_times_a_weight_is_the_batchs() -> None:
    """Left in session 35: `ce_sum * alpha / count` was averaged and said NOT to be the batch's (2.989 for the
    model's 3.955). The microbatches' numerators times the one weight add to the batch's, and a microbatch counting
    no target adds 0 (its own ratio NaN): the step's loss and grads, the weight's too, are the model's."""
    torch.manual_seed(0)
    model, ref = _WeightedRatio(), _WeightedRatio()
    ref.load_state_dict(model.state_dict())
    x, t = _uneven_batch()
    gm = trace(model, (x[:2], t[:2]), {})
    w = loss_weighting(gm, lambda out, _: out, False, [x[:2], t[:2]], None)
    assert w.kind == "ratio" and "each microbatch's numerator over the batch's divisor" in w.describe(), w.describe()
    _numerators_give_the_batchs(gm, w, model, x, t, lambda: ref(x, t), ref)


class _OwnPairsLoss(nn.Module):
    """CLIP's shape: the model computes its own loss over in-batch negatives, and torch.fx cannot trace it (control
    flow on a size), so torch.export fixes the graph's sizes."""
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> dict[str, torch.Tensor]:
        if x.size(0) > 0:
            logits = self.a(x) @ self.b(z).t()
            return {"loss": _in_batch_negatives(logits, None), "logits": logits}
        return {"loss": x.sum(), "logits": x}


@pytest.mark.parametrize("in_graph", [True, False])
def test_a_models_own_loss_over_in_batch_negatives_in_a_graph_of_fixed_sizes_is_said_not_to_be_the_batchs(
        in_graph: bool) -> None:
    """Found by review: CLIP's own loss (computed inside the model, its graph torch.export's, of fixed sizes) was
    said to be the batch's, its cross entropies counted (1.214 for the batch's 2.875). The model's outputs as a meta
    copy shapes them at twice the samples show the logits pairing: the loss read from them is said not to be."""
    from partition.reduction import pairing_read
    from pipe.inference import output_shapes
    model, x, z = _OwnPairsLoss(), torch.randn(3, 4), torch.randn(3, 4)
    gm = trace(model, (x, z), {})
    assert gm.meta["fxpipe_tracer"] == "torch.export.export"
    shapes = output_shapes(model, (x, z), {}, gm)
    assert sorted(shapes.values()) == [((), ()), ((3, 3), (6, 6))], shapes
    if in_graph:  # the natural call's loss_fn, out["loss"], traced into the graph
        assert attach_loss(gm, lambda o, _: o["loss"]) is None
        w = pairing_read(gm, loss_weighting(gm, None, True, [x, z, None]), shapes)
    else:  # a loss_fn of the logits outside the graph: the loss's own ops run on the outputs so shaped
        w = loss_weighting(gm, lambda o, _: _in_batch_negatives(o["logits"], None), False, [x, z],
                           torch.zeros(3, dtype=torch.long),
                           lambda: {n: two for n, (_, two) in shapes.items()})
    assert w.kind == "mean" and w.inexact, w
    assert w.describe().startswith("loss: NOT the batch's, the mean of the microbatches' losses: "), w.describe()


def test_batch_norms_in_training_mode_are_found_on_both_tracers() -> None:
    """The plan says a batch norm normalizes each microbatch by its own statistics (not the batch's)."""
    from partition.reduction import batch_statistics

    class Normed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.bn = nn.Linear(4, 4), nn.BatchNorm1d(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.batch_norm(self.bn(self.lin(x)), None, None, training=True)

    class Exported(Normed):  # (control flow on a size: torch.export traces it, its batch norm an aten op)
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.bn(self.lin(x)) if x.size(0) > 0 else x
    x = torch.randn(3, 4)
    assert batch_statistics(trace(Normed(), (x,), {})) == ["bn", "batch_norm"]
    assert batch_statistics(trace(Normed().eval(), (x,), {})) == ["batch_norm"]  # (the functional one trains)
    gm = trace(Exported(), (x,), {})
    assert gm.meta["fxpipe_tracer"] == "torch.export.export" and len(batch_statistics(gm)) == 1, gm.graph
    assert batch_statistics(trace(Exported().eval(), (x,), {})) == []


class HeadExported(Head):
    """Control flow on a size: torch.export traces it, with the example's sizes fixed in its graph."""
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x.reshape(-1, 4)).view(x.shape[0], x.shape[1], V) if x.size(0) > 0 else x


@pytest.mark.parametrize("loss_fn, kind", [(lambda o, t: ((o - t.unsqueeze(-1)) ** 2).sum(), "sum"),
                                           (lambda o, t: _masked_mean(o, t), "ratio"),
                                           (lambda o, t: ((o - t.unsqueeze(-1)) ** 2).mean(0).sum(), "mean")])
def test_on_a_graph_with_fixed_sizes_the_losss_own_ops_are_weighed(loss_fn: Any, kind: str) -> None:
    """Found by review: on torch.export's graphs (Hugging Face models) a .sum() loss and a masked mean were averaged
    (a token sum at 1/M of the batch's): the graph does not run at twice the samples. The loss's own ops are then
    run alone, the model's outputs as export recorded them, doubled along dim 0."""
    x, t = torch.randn(2, 3, 4), torch.randint(0, V, (2, 3))
    gm = trace(HeadExported(), (x,), {})
    assert gm.meta["fxpipe_tracer"] == "torch.export.export"
    assert attach_loss(gm, loss_fn) is None
    w = loss_weighting(gm, None, True, [x, t])
    assert w.kind == kind, w


class _Packed(nn.Module):
    """The microbatch packed into one sequence, attending with a block-diagonal mask [B T, B T]: no sample reads
    another's tokens, though the mask grows 4x at twice the samples."""
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.qkv, self.head = nn.Embedding(V, 8), nn.Linear(8, 24), nn.Linear(8, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        h = self.emb(ids).reshape(1, b * t, 8)
        seg = torch.arange(b * t, device=ids.device) // t
        q, k, v = self.qkv(h).chunk(3, -1)
        h = h + F.scaled_dot_product_attention(q, k, v, attn_mask=seg[:, None] == seg[None, :])
        return self.head(h).reshape(b, t, V)


class _Centres(nn.Module):
    """The prediction [B, 4] and K cluster centres [K, 4] (parameters: no sample's), traced by torch.export."""
    def __init__(self, k: int) -> None:
        super().__init__()
        self.lin, self.centres = nn.Linear(4, 4), nn.Parameter(torch.randn(k, 4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.lin(x).view(x.shape[0], 4), self.centres) if x.size(0) > 0 else (x, self.centres)


def test_pairing_is_judged_on_what_the_loss_reads() -> None:
    """Found by review: a block-diagonal mask inside a model (packed sequences), or offsets [B + 1], made the loss
    "NOT the batch's", averaged where its counted targets weigh it (2.8236 for 2.7535); and on a graph with fixed
    sizes, K centres with K the microbatch size were doubled as if one per sample."""
    ids, t = torch.randint(0, V, (2, 3)), torch.randint(0, V, (2, 3))
    gm = trace(_Packed(), (ids,), {})
    assert attach_loss(gm, _ce) is None
    w = loss_weighting(gm, None, True, [ids, t])
    assert w.kind == "count" and not w.inexact, w.describe()
    nearest = lambda out, _: torch.cdist(out[0], out[1]).min(1).values.pow(2).sum()  # noqa: E731
    for k in (3, 2):
        x = torch.randn(2, 4)
        gm = trace(_Centres(k), (x,), {})
        assert gm.meta["fxpipe_tracer"] == "torch.export.export"
        assert attach_loss(gm, nearest) is None
        w = loss_weighting(gm, None, True, [x, torch.zeros(2)])
        assert w.kind == "sum", (k, w.describe())


class _OwnSummedExported(nn.Module):
    """Its own summed squared error, traced by torch.export: an ATen mse_loss with reduction 2 (sum)."""
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.lin(x).view(x.shape[0]) if x.size(0) > 0 else x.sum(-1)
        return F.mse_loss(out, y, reduction="sum")


def test_an_aten_element_wise_loss_is_read_as_the_function_is() -> None:
    """The element-wise losses are read by one function for their three forms (function, module, ATen op): a
    model's own mse_loss(reduction="sum") in torch.export's graph is the microbatches' sum (it was averaged)."""
    x, y = torch.randn(2, 4), torch.randn(2)
    gm = trace(_OwnSummedExported(), (x, y), {})
    assert gm.meta["fxpipe_tracer"] == "torch.export.export"
    assert any(n.target is torch.ops.aten.mse_loss.default for n in gm.graph.nodes), gm.graph
    w = loss_weighting(gm, lambda out, _: out, False, [x, y], None)
    assert w.kind == "sum" and "mse_loss, reduction='sum'" in w.describe(), w.describe()


class _OverSize(nn.Module):
    """Its own loss a cross entropy plus a router z-loss written as a sum over the microbatch's size (as Switch
    Transformers writes it), or that z-loss alone (`alone`), its sum scaled (`how`): over the size ("n"), times one
    over it ("inverse"), over a number that is no size ("constant": 2.0, the microbatch's size), over sqrt(n), or
    over n where a trace at twice the samples fails ("fails": it refuses more samples) or takes other ops ("branch");
    or a penalty of its weights over n ("penalty": no longer the same in every microbatch).
    Control flow on a size: torch.export traces it, fixing x.shape[0] as a number."""
    def __init__(self, alone: bool = False, how: str = "n") -> None:
        super().__init__()
        self.lin, self.alone, self.how = nn.Linear(4, V), alone, how

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        if x.size(0) == 0 or self.how == "fails" and x.size(0) > 2:
            raise ValueError("no more than 2 samples")
        if self.how == "branch" and x.size(0) > 2:
            x = x * 1.0
        o = self.lin(x)
        z = (o.logsumexp(-1) ** 2).sum()
        n = x.shape[0]
        z = {"inverse": lambda: z * (1 / n), "constant": lambda: z / 2.0, "sqrt": lambda: z / n ** 0.5,
             "penalty": lambda: self.lin.weight.pow(2).sum() / n}.get(self.how, lambda: z / n)()
        return z if self.alone else F.cross_entropy(o, t) + 0.01 * z


@pytest.mark.parametrize("alone, how, kind", [(False, "n", "terms"), (True, "n", "mean"), (True, "inverse", "mean"),
                                              (True, "constant", "sum"), (True, "sqrt", "NOT"),
                                              (False, "fails", "NOT"), (False, "branch", "terms"),
                                              (False, "penalty", "NOT")])
def test_a_sum_over_a_size_torch_export_fixed_is_a_mean(alone: bool, how: str, kind: str) -> None:
    """Found by review: under torch.export, x.sum() / x.shape[0] (a mean over the microbatch: the size is a number in
    the graph) was weighed as a sum, M x the batch's loss and grads, silently (21.298 where the batch's is 5.325;
    in a loss of terms 2.479 for 2.319). A number that doubles in a trace at twice the samples counts them: a sum
    over it, or times one over it, is a mean; one that stays (though equal to the microbatch's size) keeps a sum a
    sum. One that changes otherwise (sqrt(n)), or that fxpipe cannot tell (that trace fails: found by review of the
    change, which then read it as a constant, silently), makes the term the microbatches' mean, said NOT to be the
    batch's. The two traces' ops are aligned in order, so an op one has and the other lacks (a branch on the size;
    Hugging Face models' expands at other sizes) shifts no comparison (found by review: by name, another node was
    compared, silently; by the whole sequence, every HF model's number was unknown). forward()'s value of it is
    formed alike."""
    from partition.reduction import output_forms
    from pipe.inference import literals_at_twice
    torch.manual_seed(0)
    model = _OverSize(alone, how)
    x, t = torch.randn(8, 4), torch.randint(0, V, (8,))
    t[:2] = -100
    gm = trace(model, (x[:2], t[:2]), {})
    assert gm.meta["fxpipe_tracer"] == "torch.export.export"
    literals = functools.cache(lambda: literals_at_twice(model, (x[:2], t[:2]), {}, gm))  # (one trace at twice)
    w = loss_weighting(gm, lambda out, _: out, False, [x[:2], t[:2]], None, literals=literals)
    if kind == "NOT":  # (alone: the whole loss; beside a cross entropy, that term, the cross entropy still counted)
        assert w.describe().startswith("loss: NOT the batch's") and "fxpipe cannot tell from a constant" in \
            w.describe() and w.kind == ("mean" if alone else "terms"), w.describe()
        assert alone or [p.kind for p in w.parts] == ["count", "mean"] and w.parts[1].inexact, w.describe()
        return
    assert w.kind == kind, w.describe()
    mean = [w] if kind == "mean" else [p for p in w.parts if p.kind == "mean"]
    assert kind == "sum" or "over the microbatch's count of samples, a number torch.export fixed" in mean[0].why, \
        w.describe()
    out = next(n for n in gm.graph.nodes if n.op == "output")
    leaf = pytree.tree_leaves(out.args)[0]
    form = output_forms(gm, [leaf], [x[:2], t[:2]], literals)[0][0]
    assert form == {"terms": None, "mean": "mean", "sum": "sum"}[kind], form
    if kind == "mean":  # the mean of the microbatches' z-losses is the model's on the batch
        got = sum(model(xm, tm) for xm, tm in zip(x.chunk(4), t.chunk(4))) / 4
        torch.testing.assert_close(got, model(x, t))


class _ScaledBySize(nn.Module):
    """A router z-loss scaled by the microbatch's size, which torch.fx keeps as a value and torch.export fixes as a
    number (`export`: a branch on the size, which torch.fx cannot trace): over it ("sum / n", a mean), a mean times
    it ("mean * n", a sum written so), a mean over it ("mean / n"), a sum over its square ("sum / n^2"), or a mean
    times a coefficient ("mean * 0.5", one over it the size here; "mean * 0.001"); alone or beside a cross
    entropy."""
    def __init__(self, how: str, alone: bool, export: bool = False) -> None:
        super().__init__()
        self.lin, self.how, self.alone, self.export = nn.Linear(4, V), how, alone, export

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        if self.export and x.size(0) == 0:
            raise ValueError("no samples")
        o = self.lin(x)
        z = o.logsumexp(-1) ** 2
        n = x.shape[0]
        z = {"sum / n": lambda: z.sum() / n, "mean * n": lambda: z.mean() * n, "sum / n^2": lambda: z.sum() / (n * n),
             "mean / n": lambda: z.mean() / n, "mean * 0.5": lambda: z.mean() * 0.5,
             "mean * 0.001": lambda: z.mean() * 0.001, "mean * sqrt(n)": lambda: z.mean() * n ** 0.5,
             "mean * (n - 1)": lambda: z.mean() * (n - 1),
             "ratio * sqrt(n)": lambda: (z * (t > 0)).sum() / (t > 0).sum().clamp(min=1) * n ** 0.5,
             "ratio / (n / 2)": lambda: (z * (t > 0)).sum() / (t > 0).sum().clamp(min=1) / (n / 2),
             "mean * (n / 2)": lambda: z.mean() * (n / 2), "mean * (3 * n)": lambda: z.mean() * (3 * n),
             "ce / (n / 2)": lambda: F.cross_entropy(o, t) / (n / 2),
             "mean * o.numel()": lambda: z.mean() * o.numel()}[self.how]()
        return z if self.alone else F.cross_entropy(o, t) + 0.01 * z


@pytest.mark.parametrize("export", [False, True], ids=["torch.fx", "torch.export"])
@pytest.mark.parametrize("how, alone, said", [
    ("sum / n", True, "loss: the mean of the microbatches' losses"), ("sum / n", False, "loss: its terms"),
    ("mean * n", True, "loss: NOT the batch's"), ("sum / n^2", True, "loss: NOT the batch's"),
    ("mean * n", False, "loss: NOT the batch's, its terms"), ("mean / n", True, "loss: NOT the batch's"),
    ("mean * 0.5", True, "loss: the mean of the microbatches' losses"),
    ("mean * 0.001", False, "loss: its terms"), ("mean * sqrt(n)", True, "loss: NOT the batch's"),
    ("mean * (n - 1)", True, "loss: NOT the batch's"), ("ratio * sqrt(n)", True, "loss: NOT the batch's"),
    ("mean * o.numel()", True, "loss: NOT the batch's"),
    ("mean * o.numel()", False, "loss: NOT the batch's, its terms")])
def test_a_loss_scaled_by_a_size_is_a_mean_only_over_the_count(how: str, alone: bool, said: str,
                                                               export: bool) -> None:
    """Found by review: z.mean() * x.shape[0] (a sum written so) fell to the mean of the microbatches' losses with a
    note saying it is the batch's where each averages as many elements: 21.30 where the batch's is 85.19, silently in
    effect; under torch.fx first, then under torch.export, whose graph fixes the size as a number. A sum over the
    samples over their count is a mean; another scaling by a size is said NOT to be the batch's (beside a cross
    entropy, that term alone: the cross entropy still counted), and forward() does not average it. Under
    torch.export a trace at twice the samples tells a size from a constant; it is made only where a number could be
    a count of the samples (0.5 is one over the 2 samples here; 0.001, as a mixture of experts' coefficient, is no
    count, and no trace is made)."""
    from partition.reduction import output_forms
    from pipe.inference import literals_at_twice
    x, t = torch.randn(2, 4), torch.randint(0, V, (2,))
    model = _ScaledBySize(how, alone, export)
    gm = trace(model, (x, t), {})
    assert gm.meta["fxpipe_tracer"] == ("torch.export.export" if export else "torch.fx.symbolic_trace")
    traces: list[int] = []
    literals = functools.cache(lambda: traces.append(1) or literals_at_twice(model, (x, t), {}, gm))
    w = loss_weighting(gm, lambda out, _: out, False, [x, t], None, literals=literals)
    assert w.describe().startswith(said), w.describe()
    assert alone or [p.kind for p in w.parts] == ["count", "mean"], w.describe()
    assert traces == ([] if how == "mean * 0.001" or not export else [1]), (traces, w.describe())
    if alone:  # forward()'s value: the mean of the microbatches' only where the loss is
        out = next(n for n in gm.graph.nodes if n.op == "output")
        form = output_forms(gm, pytree.tree_leaves(out.args)[:1], [x, t], literals)[0][0]
        assert form == ("mean" if said.endswith("losses") else None), (form, w.describe())


@pytest.mark.parametrize("export", [False, True], ids=["torch.fx", "torch.export"])
def test_a_loss_scaled_by_a_multiple_of_a_size_is_not_the_batch_s(export: bool) -> None:
    """Found by review: under torch.export a count (a cross entropy) or a ratio scaled by n / 2, which Python folds
    into one number, was weighed as the batch's, without the trace at twice the samples that tells it from a
    constant: 0.6554 where the batch's is 0.1638 (M x); so was a mean times n / 2 or 3 x n (10.59 for 42.36). Each
    is said NOT to be the batch's (on 8 samples, where no coincidence of small numbers makes them sizes); a mean
    times 0.001 still asks for no trace."""
    from pipe.inference import literals_at_twice
    x, t = torch.randn(8, 4), torch.randint(0, V, (8,))
    for how in ("ratio / (n / 2)", "ce / (n / 2)", "mean * (n / 2)", "mean * (3 * n)", "mean * 0.001"):
        model = _ScaledBySize(how, True, export)
        gm = trace(model, (x, t), {})
        traces: list[int] = []
        literals = functools.cache(lambda: traces.append(1) or literals_at_twice(model, (x, t), {}, gm))
        said = loss_weighting(gm, lambda out, _: out, False, [x, t], None, literals=literals).describe()
        assert said.startswith("loss: the mean of the microbatches' losses" if how == "mean * 0.001" else
                               "loss: NOT the batch's"), (how, said)
        assert traces == ([1] if export and how != "mean * 0.001" else []), (how, traces)
