"""partition.rewrite: a linear layer cut into row slices computes the same numbers and lets stages balance."""
import torch

import partition
from bench import models
from partition.rewrite import apply_rewrites, split_linear
from partition.trace import flatten_inputs, unflatten_outputs


class _Functional(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(10, 8))
        self.b = torch.nn.Parameter(torch.randn(10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.w, self.b).relu()


def test_split_linear_is_exact_for_module_and_function_forms() -> None:
    w = models.gpt_wide_vocab(n_layer=1, vocab=1000)
    gm = partition.trace(w.model, w.example_args)
    ref = gm(*w.example_args)
    split_linear(gm, "lm_head", 3)
    names = [n.name for n in gm.graph.nodes if "rows" in n.name or "cat" in n.name]
    assert names == ["lm_head_rows0", "lm_head_rows1", "lm_head_rows2", "lm_head_cat"]
    assert torch.equal(gm(*w.example_args), ref)
    m = _Functional()
    x = torch.randn(3, 8)
    g2 = partition.trace(m, (x,))
    target = next(n.name for n in g2.graph.nodes if n.op == "call_function" and "linear" in n.name)
    split_linear(g2, target, 4)
    assert torch.equal(g2(x), m(x))
    g2(x).sum().backward()
    assert m.w.grad is not None and m.b.grad is not None


def test_plan_splits_a_head_slower_than_a_fair_stage() -> None:
    w = models.gpt_wide_vocab()
    plain = partition.plan(w.model, w.example_args, 4, cost="flops", analysis=partition.Analysis(
        w.model, w.example_args, cost="flops"))  # an analysis given: no rewrite
    p = partition.plan(w.model, w.example_args, 4, cost="flops")
    assert plain.rewrites == [] and p.rewrites and p.rewrites[0][0] == "lm_head"
    assert p.bottleneck_ms < 0.8 * plain.bottleneck_ms
    holders = [s.index for s in p.stages if "tok_emb.weight" in s.params]
    assert len(holders) >= 2 and all("tok_emb.weight" in p.stages[h].shared for h in holders)
    stages = partition.split(w.model, p, w.example_args)  # re-traces and applies the rewrite
    gm = apply_rewrites(partition.trace(w.model, w.example_args), p.rewrites)
    flat = flatten_inputs(gm, w.example_args, {})
    env: dict = {}
    out = None
    for st in stages:
        io = st.io
        res = st(*[env[r] for r in io.recv], *[flat[i] for i in io.inputs])
        if io.last:
            out = unflatten_outputs(list(res), io.out_spec)
        else:
            env.update(zip(io.send, res))
    torch.testing.assert_close(out, w.model(*w.example_args))
    again = partition.Plan.load(p.save("/tmp/fxpipe-rewrite-plan.json"))
    assert again.rewrites == p.rewrites


def test_with_rewrites_reuses_the_trace_and_leaves_it_as_it_was() -> None:
    """Analysis.with_rewrites costs a copy of the analysis's own trace (no new trace): the same graph as
    tracing afresh with the rewrites, the model's own parameters, and the first analysis untouched;
    also for torch.export's graphs with the loss attached (their flat call kept)."""
    from partition.plan import fingerprint
    from tests import zoo
    w = models.gpt_wide_vocab(n_layer=1, vocab=1000)
    cases = [(w.model, w.example_args, {}, w.loss_fn, w.example_target, [("lm_head", 3, "vocab")])]
    z = zoo.workload("dict_input", "dataclass")  # traced by torch.export, its loss in the graph
    cases.append((z.model, z.example_args, z.example_kwargs, z.loss_fn, z.example_target, None))
    for model, args, kwargs, loss_fn, target, rewrites in cases:
        a = partition.Analysis(model, args, kwargs, cost="flops", loss_fn=loss_fn, example_target=target)
        before = fingerprint(a.gm)
        if rewrites is None:  # the zoo's first linear, in row slices
            rewrites = [(next(n.name for n in a.gm.graph.nodes if "linear" in n.name or n.target == "a"), 2)]
        b = a.with_rewrites(rewrites)
        fresh = partition.Analysis(model, args, kwargs, cost="flops", loss_fn=loss_fn, example_target=target,
                                   rewrites=rewrites)
        assert fingerprint(a.gm) == before and a.loss and b.loss  # the first analysis is as it was
        assert fingerprint(b.gm) == fingerprint(fresh.gm) != before
        assert {n.name for n in b.gm.graph.nodes} == {n.name for n in fresh.gm.graph.nodes}
        params = dict(model.named_parameters())
        assert all(p is params[n] for n, p in b.gm.named_parameters())
        torch.testing.assert_close(b.gm(*b.flat), fresh.gm(*fresh.flat))
        assert b.with_rewrites(rewrites).costs.keys() == b.costs.keys()  # from its own pristine copy


def test_a_vocab_slice_s_fused_gradient_is_autograd_s() -> None:
    """The logits' gradient in one buffer (partition.rewrite._LseAndPicked) against finite differences,
    with both outputs used and with either alone (its grad None), and in float32 against autograd's own."""
    from partition.rewrite import _LseAndPicked, vocab_slice
    torch.manual_seed(0)
    z = torch.randn(6, 9, dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([0, 3, 8, 2, 2, 5])
    inside = torch.tensor([True, True, False, True, False, True])
    assert torch.autograd.gradcheck(lambda x: _LseAndPicked.apply(x, idx, inside), (z,))
    assert torch.autograd.gradcheck(lambda x: _LseAndPicked.apply(x, idx, inside)[0], (z,))
    assert torch.autograd.gradcheck(lambda x: _LseAndPicked.apply(x, idx, inside)[1], (z,))
    h, w = torch.randn(8, 4, requires_grad=True), torch.randn(12, 4, requires_grad=True)
    t = torch.randint(0, 12, (8,))
    stats = vocab_slice(h, w, None, t, 3, 10, None)
    z32 = torch.nn.functional.linear(h, w[3:10])
    inside32 = (t >= 3) & (t < 10)
    ref = torch.stack((torch.logsumexp(z32, 1), z32.gather(1, (t - 3).clamp(0, 6).unsqueeze(1)).squeeze(1)
                       .masked_fill(~inside32, 0.0)), 1)
    g = torch.randn(8, 2)
    torch.testing.assert_close(stats, ref)
    for a, b in zip(torch.autograd.grad(stats, (h, w), g), torch.autograd.grad(ref, (h, w), g)):
        torch.testing.assert_close(a, b)
