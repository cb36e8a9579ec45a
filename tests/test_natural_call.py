"""The natural call, Pipeline(model, example_args, loss_fn=...) without example_target: the loss goes into
the graph with a target inferred from loss_fn and the output, any real target still gets loss_fn's loss,
and forward() returns the model's own output."""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import partition
from partition.loss import attach_loss, infer_target
from partition.split import assemble_outputs, inference_stage, split_graph
from partition.trace import flatten_inputs
from bench import models
from tests.mp import run_ranks


def _lm(o: Any, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(o.flatten(0, 1), y.flatten())


@pytest.mark.parametrize("loss_fn, output, want", [
    (_lm, torch.randn(2, 5, 11), (torch.int64, [2, 5])),                    # a language model's logits
    (lambda o, y: F.cross_entropy(o, y), torch.randn(4, 3), (torch.int64, [4])),  # a classifier's
    (lambda o, y: F.cross_entropy(o, y), torch.randn(4, 3, 6, 6), (torch.int64, [4, 6, 6])),  # classes on dim 1
    # int64[4] broadcasts against [4, 1] with a warning: a wrong guess, passed over for the output's own shape
    (lambda o, y: F.mse_loss(o, y), torch.randn(4, 1), (torch.float32, [4, 1])),
    (lambda o, y: F.binary_cross_entropy_with_logits(o, y), torch.randn(4, 3), (torch.float32, [4, 3])),
    # int64[4] broadcasts against [4, 4] without a warning, but not at twice the samples ([8, 4] - [8]): passed over
    (lambda o, y: ((o - y) ** 2).sum(), torch.randn(4, 4), (torch.float32, [4, 4])),
    (lambda o, y: F.cross_entropy(o["logits"], y), {"logits": torch.randn(4, 3), "n": 2}, (torch.int64, [4])),
])
def test_infer_target_finds_the_target_loss_fn_takes(loss_fn: Any, output: Any, want: tuple[Any, list[int]]) -> None:
    target, how = infer_target(loss_fn, output)
    assert target is not None and (target.dtype, list(target.shape)) == want, how
    assert f"inferred as {str(want[0]).removeprefix('torch.')}{want[1]}" in how


def test_infer_target_says_what_it_tried_when_nothing_fits() -> None:
    target, how = infer_target(lambda o, y: o.sum() * y["scale"], torch.randn(4, 3))
    assert target is None and "takes none of int64[4], float32[4, 3]" in how
    target, how = infer_target(lambda o, y: o.sum(), torch.zeros(4, dtype=torch.long))
    assert target is None and "no floating-point tensor" in how


class _TwoHeads(torch.nn.Module):
    """A dict output: logits the loss reads, an auxiliary head it does not, and a constant."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 10)
        self.aux = torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        h = torch.relu(self.b(torch.relu(self.a(x))))
        return {"logits": self.head(h), "aux": self.aux(torch.tanh(h)), "n": 3}


def _head_loss(o: dict[str, Any], y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(o["logits"], y)


def _infer_in_order(model: torch.nn.Module, p: partition.Plan, loss_fn: Any, args: tuple[Any, ...]) -> Any:
    """The stages without the loss (partition.split.inference_stage), run in order with no target."""
    gm = partition.trace(model, args)
    assert attach_loss(gm, loss_fn) is None
    stages = split_graph(gm, p)
    flat = flatten_inputs(gm, args, None, None)
    env: dict[str, Any] = {}
    found: dict[Any, Any] = {}
    for s, st in enumerate(stages):
        module, inputs, extras = inference_stage(gm, p, s, st)
        assert inputs == st.io.inputs
        outs = list(module(*[env[r] for r in st.io.recv], *[flat[i] for i in inputs]))
        sent = len(outs) - len(extras)
        assert sent == (0 if st.io.last else len(st.io.send))
        env.update(zip(st.io.send if not st.io.last else [], outs[:sent]))
        found.update(zip(extras, outs[sent:]))
    return assemble_outputs(gm, found)


def test_plan_infers_the_target_and_inference_stages_return_the_models_output() -> None:
    torch.manual_seed(0)
    m, x = _TwoHeads(), torch.randn(4, 8)
    p = partition.plan(m, (x,), 3, cost="flops", loss_fn=_head_loss)
    assert p.loss and p.inputs[-1] is not None and (p.inputs[-1].dtype, p.inputs[-1].shape) == ("int64", [4])
    assert "traced into the graph; its target inferred as int64[4] from loss_fn" in p.table()
    outside = partition.plan(m, (x,), 3, cost="flops", loss_fn=lambda o, y: o["logits"].sum() * y["w"])
    assert not outside.loss and "takes none of" in outside.table()
    out = _infer_in_order(m, p, _head_loss, (x,))
    with torch.no_grad():
        ref = m(x)
    assert out.keys() == ref.keys() and out["n"] == 3
    torch.testing.assert_close(out["logits"], ref["logits"])
    torch.testing.assert_close(out["aux"], ref["aux"])


def test_inference_stages_form_the_logits_of_a_head_cut_into_vocabulary_slices() -> None:
    w = models.gpt_wide_vocab()
    p = partition.plan(w.model, w.example_args, 4, cost="flops", loss_fn=w.loss_fn)  # the natural call
    vocab = [r for r in p.rewrites if list(r[2:]) == ["vocab"]]
    assert p.loss and len(vocab) == 1 and len(vocab[0][1]) > 2, p.rewrites  # two slices or more
    given = partition.plan(w.model, w.example_args, 4, cost="flops", loss_fn=w.loss_fn, example_target=w.example_target)
    assert [s.nodes for s in p.stages] == [s.nodes for s in given.stages] and p.rewrites == given.rewrites
    logits = _infer_in_order(w.model, p, w.loss_fn, w.example_args)
    with torch.no_grad():
        torch.testing.assert_close(logits, w.model(*w.example_args))


class _OwnLoss(torch.nn.Module):
    """A model computing its own loss from labels padded with -100: a cross entropy plus an L2 penalty of its
    weights (`penalty`), or two cross entropies summed over a count of the labels (a masked mean written by hand),
    scaled after (`scaled ratio`) or before by a learned weight (`weighted ratio`), or with a penalty of the weights
    in its numerator (`ratio penalty`, which the batch's numerator adds once); or a cross entropy plus a
    router's load-balancing loss, a statistic of the whole microbatch (`router`, as a mixture of experts adds), or
    the two cross entropies summed over a count of the labels (unclamped) plus that term (`router ratio`)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.a, self.b, self.c, self.how = torch.nn.Linear(8, 16), torch.nn.Linear(16, 10), torch.nn.Linear(16, 10), how
        if how == "weighted ratio":  # a learned weight of the summed cross entropies
            self.alpha = torch.nn.Parameter(torch.tensor(1.5))
        if how == "router":  # class weights of its cross entropy
            self.register_buffer("classes", torch.ones(10))

    def terms(self, x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`router`'s cross entropy and its load-balancing term (squared mean routing probabilities)."""
        h = torch.relu(self.a(x))
        routed = torch.softmax(self.c(h), -1).mean(0)
        return F.cross_entropy(self.b(h), labels, weight=self.classes), 0.1 * (routed * routed).sum() * 10

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.how == "router":
            ce, balance = self.terms(x, labels)
            return ce + balance
        h = torch.relu(self.a(x))
        if self.how == "penalty":
            return F.cross_entropy(self.b(h), labels) + 0.01 * (self.a.weight.pow(2).sum() + self.b.weight.pow(2).sum())
        both = F.cross_entropy(self.b(h), labels, reduction="sum") + F.cross_entropy(self.c(h), labels, reduction="sum")
        if self.how == "ratio penalty":  # a penalty of the weights in the numerator: added once to the batch's
            return (both + 0.01 * self.a.weight.pow(2).sum()) / (labels != -100).sum().clamp(min=1)
        if self.how == "router ratio":
            routed = torch.softmax(self.c(h), -1).mean(0)
            return both / (labels != -100).sum() + (routed * routed).sum()
        if self.how == "weighted ratio":
            return both * self.alpha / (labels != -100).sum().clamp(min=1)
        ratio = both / (labels != -100).sum().clamp(min=1)
        return ratio if self.how == "ratio" else 0.5 * ratio  # (the model's own op reading the ratio)


def _own_loss_in_parity(x: torch.Tensor, labels: torch.Tensor, how: str, schedule: str = "1f1b",
                        modes: bool = True) -> tuple[float, str]:
    """One step of a pipeline (M=4) of _OwnLoss against the model on the whole batch: loss and grads, then
    forward() and evaluate() in both modes. `router`: against the batch's cross entropy (each microbatch's
    weighed by its labels) plus the mean of the microbatches' load-balancing terms, as a pipeline forms it."""
    import pipe
    from tests.nccl_like import NcclLike
    torch.manual_seed(2)
    model, ref = _OwnLoss(how), _OwnLoss(how)
    ref.load_state_dict(model.state_dict())
    weights = None
    if how == "router":  # built on the meta device, its class weights loaded by weights=: read where loaded
        ref.classes.copy_(torch.linspace(0.5, 2.0, 10))
        weights = ref.state_dict()
        with torch.device("meta"):
            model = _OwnLoss(how)
    pp = pipe.Pipeline(model, (x[:4], labels[:4]), loss_fn=lambda out, _: out, microbatches=4, cost="flops",
                       transport=NcclLike(), schedule=schedule, weights=weights)
    loss = pp.step(x, labels)
    if how == "router":
        ce = F.cross_entropy(ref.b(torch.relu(ref.a(x))), labels, weight=ref.classes)
        want = ce + sum(ref.terms(xm, lm)[1] for xm, lm in zip(x.chunk(4), labels.chunk(4))) / 4
    elif how == "router ratio":  # (the batch's ratio: the model's on the batch less its term, plus the mean term)
        def term(xm: torch.Tensor) -> torch.Tensor:
            routed = torch.softmax(ref.c(torch.relu(ref.a(xm))), -1).mean(0)
            return (routed * routed).sum()
        want = ref(x, labels) - term(x) + sum(term(xm) for xm in x.chunk(4)) / 4
    else:
        want = ref(x, labels)
    want.backward()
    torch.testing.assert_close(loss, want.item(), rtol=1e-5, atol=1e-6)
    grads = dict(pp.named_parameters())
    assert grads, "no stage holds parameters"
    for name, p in ref.named_parameters():
        if name in grads:
            torch.testing.assert_close(grads[name].grad, p.grad, msg=name)
    for mode in (True, False) if modes else ():  # forward() returned the sum of the numerators (10x the ratio)
        pp.train(mode)
        torch.testing.assert_close(pp.forward(x, labels), want.detach(), msg=lambda m: f"{how} {mode}: {m}")
        torch.testing.assert_close(pp.evaluate(x, labels), want.item(), rtol=1e-5, atol=1e-6)
    return loss, pp.weighting.describe()


def natural_body(rank: int, world: int) -> dict[str, Any]:
    import pipe
    from tests.nccl_like import NcclLike
    from tests.parity import check_step
    pipe.init()
    out: dict[str, Any] = {}
    torch.manual_seed(0)
    x = torch.randn(16, 8)
    labels = torch.randint(0, 10, (16,))
    soft = torch.softmax(torch.randn(16, 10), 1)  # another target than the inferred one: probabilities
    # plain gloo: the zoo (tests/test_exact.py) runs the loss in the graph; zb-h1: forward() from stages whose
    # training module is the zero-bubble one (with_param_outputs)
    for schedule in ("1f1b", "zb-h1"):
        torch.manual_seed(1)
        model, ref_model = _TwoHeads(), _TwoHeads()
        ref_model.load_state_dict(model.state_dict())
        pp = pipe.Pipeline(model, (x[:4],), loss_fn=_head_loss, microbatches=4, cost="flops", schedule=schedule,
                           transport=NcclLike())
        assert pp.plan.loss and "inferred as int64[4]" in pp.plan.loss_note, pp.plan.table()
        assert pp._target_fixed == "", pp._target_fixed
        ref = partition.Workload(name="two_heads", model=ref_model, example_args=(x[:4],), loss_fn=_head_loss,
                                 make_batch=lambda n, step: ((x[:n],), labels[:n]), microbatch_size=4)
        opt = torch.optim.Adam(list(pp.parameters()), lr=1e-3, eps=1e-6)
        ref_opt = torch.optim.Adam(ref_model.parameters(), lr=1e-3, eps=1e-6)
        for target in (labels, soft):
            loss = pp.step(x, target=target)
            check_step(pp, loss, ref, (x,), {}, target, 4, opt, ref_opt, f"{schedule} rank {rank}")
        got = pp.forward(x)
        with torch.no_grad():
            want = ref_model(x)
        assert got["n"] == 3 and got.keys() == want.keys()
        torch.testing.assert_close(got["logits"], want["logits"])
        torch.testing.assert_close(got["aux"], want["aux"])
        with pytest.raises(pipe.PipelineError, match="got no target.*target=y"):
            pp.step(x)
        out[schedule] = loss
    # a wide head: the natural call spreads it in vocabulary slices, and forward() still returns the logits
    w, ref = partition.load("gpt_wide_vocab"), partition.load("gpt_wide_vocab")
    pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=2, cost="flops",
                       transport=NcclLike())
    assert [list(r[2:]) for r in pp.plan.rewrites] == [["vocab"]], pp.plan.table()
    assert "class indices" in pp._target_fixed
    opt = torch.optim.Adam(list(pp.parameters()), lr=1e-3, eps=1e-6)
    ref_opt = torch.optim.Adam(ref.model.parameters(), lr=1e-3, eps=1e-6)
    args, _, target = w.batch(2 * w.microbatch_size, 0)
    check_step(pp, pp.step(*args, target=target), ref, args, {}, target, 2, opt, ref_opt, f"wide rank {rank}")
    with torch.no_grad():
        torch.testing.assert_close(pp.forward(*args), ref.model(*args))
    with pytest.raises(pipe.PipelineError, match=r"the target is float32\[\*, 64\] .* made for int64\[\*, 64\], and "
                       r"the cross entropy of lm_head is cut into vocabulary slices that read class indices"):
        pp.step(*args, target=target.float())
    # trace_loss=False: outside the graph, as the plan table says
    torch.manual_seed(1)
    pp = pipe.Pipeline(_TwoHeads(), (x[:4],), loss_fn=_head_loss, microbatches=4, cost="flops", trace_loss=False)
    assert not pp.plan.loss and "outside the graph (trace_loss=False)" in pp.plan.table()
    out["outside"] = pp.step(x, target=labels)
    # outside the graph, a .sum() over the samples is known to be one only from the target's shape: found at the
    # first step (found by review: averaged, 1/M of the batch's loss and grads)
    torch.manual_seed(1)
    model, ref_model = _TwoHeads(), _TwoHeads()
    ref_model.load_state_dict(model.state_dict())

    def summed(o: dict[str, Any], y: torch.Tensor) -> torch.Tensor:
        return ((o["logits"] - y) ** 2).sum()
    pp = pipe.Pipeline(model, (x[:4],), loss_fn=summed, microbatches=4, cost="flops", trace_loss=False)
    assert pp.weighting.kind == "mean", pp.weighting
    loss = pp.step(x, target=soft)
    want = summed(ref_model(x), soft)
    want.backward()
    torch.testing.assert_close(loss, want.item())
    grads = dict(pp.named_parameters())
    for name, p in ref_model.named_parameters():
        if name in grads:
            torch.testing.assert_close(grads[name].grad, p.grad, msg=name)
    assert any("the sum of the microbatches'" in n and "found at the first call with a target" in n
               for n in pp.plan.notes), pp.plan.notes
    # found in session 35: the model's own loss adding an L2 penalty of its weights to a cross entropy was averaged
    # over the microbatches (each counting another number of labels) and said NOT to be the batch's; two cross
    # entropies summed over a count of the labels (the model's own loss, so outside the graph) were averaged
    # silently (3.438 for 4.604): weighed by the counts and by the batch's divisor, exact
    uneven = torch.randint(0, 10, (16,))
    uneven[:6] = -100  # microbatch 0 counts no label, microbatch 1 two
    for kind, said in (("penalty", "(the same in every microbatch) weighs by its targets"),
                       ("ratio", "each microbatch's numerator over the batch's divisor"),
                       ("scaled ratio", "each microbatch's numerator over the batch's divisor"),
                       ("weighted ratio", "each microbatch's numerator over the batch's divisor"),
                       ("ratio penalty", "(computed from the inputs); mul, the same in every microbatch, added once")):
        out[f"own loss {kind}"], how = _own_loss_in_parity(x, uneven, kind)
        assert said in how, how
    # a mixture of experts' loss: a cross entropy plus a router's load-balancing term was averaged as one loss (the
    # cross entropy then weighed as a mean; a microbatch counting no label made the step's loss NaN): each term is
    # weighed its own way, the cross entropy the batch's; under zero bubble too (B and W through the weighing)
    for schedule in ("1f1b", "zb-h1"):
        out[f"router {schedule}"], how = _own_loss_in_parity(x, uneven, "router", schedule, modes=schedule == "1f1b")
        assert ": weighed by its targets other than ignore_index=-100 (by class weight) over the batch's; mul_2: " \
            "the mean of the microbatches' (the batch's where each" in how, how
    # a ratio term (its divisor 0 on microbatch 0: a NaN ratio) with such a term: its numerator over the batch's
    # divisor, finite (it was averaged as one loss: NaN)
    out["router ratio"], how = _own_loss_in_parity(x, uneven, "router ratio")
    assert "each microbatch's numerator over the batch's divisor; " in how, how
    out["z-loss over a size"] = _sum_over_a_size_in_parity()
    return out


def _sum_over_a_size_in_parity() -> float:
    """tests/test_weighting.py's _OverSize on 2 ranks: a cross entropy plus a z-loss written as a sum over the
    microbatch's size in a graph torch.export traced (the size a number there), weighed as the mean it is (it was
    weighed as a sum: M x, silently)."""
    import pipe
    from tests.test_weighting import _OverSize
    torch.manual_seed(3)
    model, ref = _OverSize(), _OverSize()
    ref.load_state_dict(model.state_dict())
    x, t = torch.randn(8, 4), torch.randint(0, 5, (8,))
    t[:2] = -100
    pp = pipe.Pipeline(model, (x[:2], t[:2]), loss_fn=lambda out, _: out, microbatches=4, cost="flops")
    assert pp.weighting.kind == "terms" and "torch.export.export" in pp.plan.table(), pp.plan.table()
    loss = pp.step(x, t)
    o = ref.lin(x)
    want = F.cross_entropy(o, t) + 0.01 * sum((om.logsumexp(-1) ** 2).sum() / 2 for om in o.chunk(4)) / 4
    want.backward()
    torch.testing.assert_close(loss, want.item(), rtol=1e-5, atol=1e-6)
    grads = dict(pp.named_parameters())
    for name, p in ref.named_parameters():
        if name in grads:
            torch.testing.assert_close(grads[name].grad, p.grad, msg=name)
    return loss


def test_the_natural_call_trains_in_parity_and_forward_returns_the_output_on_two_ranks() -> None:
    results = run_ranks("tests.test_natural_call:natural_body", 2, timeout=180)
    assert results[0] == results[1]
