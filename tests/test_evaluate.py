"""Pipeline.evaluate: a batch's mean loss without grads, against the unpartitioned model's under no_grad,
on 2 ranks in one launch (the loss outside the graph and in it, a head in vocabulary slices, zero bubble,
V placement, interleaved, recompute, offloaded activations, compiled stages, the NCCL-semantics
transport, parameters streamed in chunks (offload='states')), leaving the grads and the step count as they
were, the step after it with the whole model's grads; refused calls on every rank; eval mode (pp.eval())
on a model with dropout, against the plain model's eval mode, the loss in the graph and outside it, with
and without streamed parameters, and Hugging Face GPT-2 and T5 (torch.export) with dropout, and its ResNet
with batch norm; a model whose eval mode skips a layer refused. The data-parallel case (the mean over the
replicas' batches) is in test_data_parallel."""
import contextlib
import itertools
import time
import warnings
from typing import Any

import pytest
import torch

from partition.plan import PlanError
from tests.mp import run_ranks
from tests.nccl_like import NcclLike

GPT = dict(n_layer=2, d_model=32, n_head=2, seq_len=16, vocab=64)
WIDE = dict(n_layer=2, d_model=32, n_head=2, seq_len=16, vocab=2000)
M = 4
CASES = {  # name: (workload, its arguments, Pipeline's, the loss in the graph)
    "loss outside, 1f1b": ("gpt", GPT, {}, False),
    "loss in the graph, zb-h1": ("gpt", GPT, dict(schedule="zb-h1"), True),
    "vocabulary slices": ("gpt_wide_vocab", WIDE, {}, True),
    "zbv": ("gpt", GPT, dict(schedule="zbv"), True),
    "interleaved, nccl-like": ("gpt", GPT, dict(schedule="interleaved-1f1b", stages_per_rank=2, nccl_like=True),
                               False),
    "recompute": ("gpt", GPT, dict(recompute="full"), True),
    "offloaded activations": ("gpt", GPT, dict(offload="activations"), False),
    "streamed states": ("gpt", GPT, dict(offload="states"), False),
    "streamed states, loss in the graph, zb-h1": ("gpt", GPT, dict(offload="states", schedule="zb-h1"), True),
    "compiled": ("gpt", GPT, dict(schedule="zb-h1", compile={"backend": "aot_eager"}), True),
}


def _reference(ref: Any, args: Any, kwargs: dict[str, Any], target: Any) -> float:
    """The unpartitioned model's mean loss over the M microbatches, without grads."""
    from pipe.runtime import split_microbatches
    with torch.no_grad():
        return sum(float(ref.loss_fn(ref.model(*a, **k), t)) for (a, k), t in
                   zip(split_microbatches((args, kwargs), M), split_microbatches(target, M, "target"))) / M


def _case(spec: str, model_args: dict[str, Any], pipe_kw: dict[str, Any], fused: bool) -> dict[str, Any]:
    """Evaluate before training, after a step (its grads untouched), and after the optimizer's step."""
    import partition
    import pipe
    from tests.nccl_like import NcclLike
    w, ref = partition.load(spec, **model_args), partition.load(spec, **model_args)
    nccl_like = pipe_kw.pop("nccl_like", False)
    pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=M, cost="flops",
                       example_target=w.example_target if fused else None, trace_loss=fused,
                       transport=NcclLike() if nccl_like else None, **pipe_kw)
    assert pp.plan.loss == fused
    opt = torch.optim.SGD(list(pp.parameters()), lr=0.5)
    ref_opt = torch.optim.SGD(ref.model.parameters(), lr=0.5)
    out: dict[str, Any] = {"losses": [], "rewrites": [list(r) for r in pp.plan.rewrites]}
    held = 10  # a held-out batch
    args, kwargs, target = w.batch(w.microbatch_size * M, held)
    out["losses"].append((pp.evaluate(*args, target=target, **kwargs), _reference(ref, args, kwargs, target)))
    assert all(p.grad is None for p in pp.parameters()) and pp.steps_done == 0
    b_args, b_kwargs, b_target = w.batch(w.microbatch_size * M, 0)
    pp.step(*b_args, target=b_target, **b_kwargs)
    ref.loss_fn(ref.model(*b_args, **b_kwargs), b_target).backward()
    grads = {n: p.grad.clone() for n, p in pp.named_parameters() if p.grad is not None}
    mine = dict(ref.model.named_parameters())  # the step after an evaluate: the whole model's grads
    for n, g in grads.items():
        torch.testing.assert_close(g, mine[n].grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")
    out["losses"].append((pp.evaluate(*args, target=target, **kwargs), _reference(ref, args, kwargs, target)))
    assert {n: p.grad for n, p in pp.named_parameters() if p.grad is not None}.keys() == grads.keys()
    assert all(torch.equal(p.grad, grads[n]) for n, p in pp.named_parameters() if p.grad is not None)
    assert pp.steps_done == 1
    opt.step()
    ref_opt.step()
    out["losses"].append((pp.evaluate(*args, target=target, **kwargs), _reference(ref, args, kwargs, target)))
    if pipe_kw.get("offload") == "states":  # the model's output, its parameters streamed as for evaluate
        with torch.no_grad():
            torch.testing.assert_close(pp.forward(*args, **kwargs), ref.model(*args, **kwargs), rtol=1e-5, atol=1e-5)
        assert all(p.grad is None for p in pp.parameters()) == (not grads)  # (the grads left as they were)
        _streamed_and_back(pp)
    return out


def _streamed_and_back(pp: Any) -> None:
    """The passes fetched this rank's chunks of parameters to the device and left none there."""
    store = pp.memory.store
    assert store is not None and any(e[0] in "FP" for e in store.log) and not any(ch.resident for ch in store.chunks)


def _refusals() -> dict[str, str]:
    import partition
    import pipe
    out = {}
    w = partition.load("gpt", **GPT)
    pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=M, cost="flops")
    args, kwargs, target = w.batch(w.microbatch_size * M, 0)
    # found by review: a target of another batch size failed inside the step, in the loss, ending the job
    for case, call in (("no target", lambda: pp.evaluate(*args, target=None, **kwargs)),
                       ("short target", lambda: pp.step(*args, target=target[:M], **kwargs))):
        try:
            call()
            out[case] = "no error"
        except pipe.PipelineError as e:
            out[case] = str(e)
    out["then"] = str(pp.step(*args, target=target, **kwargs))  # the refusals left the pipeline usable
    return out


def _modes(fused: bool, **pipe_kw: Any) -> dict[str, Any]:
    """A GPT with dropout, built in training mode: in eval mode (its `self.training` read in forward traced
    as a constant, so the stages are cut from an eval-mode trace) evaluate() and forward() give the plain
    model's eval-mode loss and output; back in training mode dropout draws again; step() in eval mode is
    refused; the user's model keeps its flags."""
    import partition
    import pipe
    kw = dict(GPT, dropout=0.3)
    w, ref = partition.load("gpt", **kw), partition.load("gpt", **kw)
    pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=M, cost="flops",
                       example_target=w.example_target if fused else None, trace_loss=fused, **pipe_kw)
    args, kwargs, target = w.batch(w.microbatch_size * M, 3)
    out: dict[str, Any] = {"train": [pp.evaluate(*args, target=target, **kwargs) for _ in range(2)]}
    assert pp.eval() is pp and not pp.training
    out["eval"] = [pp.evaluate(*args, target=target, **kwargs) for _ in range(2)]
    output = pp.forward(*args, **kwargs)
    if pipe_kw.get("offload") == "states":
        _streamed_and_back(pp)
    ref.model.eval()
    out["ref"] = _reference(ref, args, kwargs, target)
    with torch.no_grad():
        torch.testing.assert_close(output, ref.model(*args, **kwargs), rtol=1e-5, atol=1e-5)
    try:
        pp.step(*args, target=target, **kwargs)
        out["step"] = "no error"
    except pipe.PipelineError as e:
        out["step"] = str(e)
    out["flags"] = all(m.training for m in w.model.modules())  # the user's model, untouched
    pp.train()
    out["again"] = pp.evaluate(*args, target=target, **kwargs)
    pp.step(*args, target=target, **kwargs)  # trains again
    return out


def _hugging_face(name: str) -> dict[str, Any]:
    """A Hugging Face model traced by torch.export with dropout 0.2: in eval mode export drops the dropouts
    (for copies) and names the operations after them otherwise; the loss is the plain model's in eval mode."""
    import partition
    w, ref = partition.load(name), partition.load(name)
    for m in (w.model, ref.model):
        for mod in m.modules():
            if isinstance(mod, torch.nn.Dropout):
                mod.p = 0.2
    import pipe
    pp = pipe.Pipeline(w.model, w.example_args, example_kwargs=w.example_kwargs, loss_fn=w.loss_fn,
                       microbatches=2, cost="flops")
    args, kwargs, target = w.batch(w.microbatch_size * 2, 1)
    train = [pp.evaluate(*args, target=target, **kwargs) for _ in range(2)]
    evaluated = [pp.eval().evaluate(*args, target=target, **kwargs) for _ in range(2)]
    ref.model.eval()
    from pipe.runtime import split_microbatches
    with torch.no_grad():
        want = sum(float(ref.loss_fn(ref.model(*a, **k), t)) for (a, k), t in
                   zip(split_microbatches((args, kwargs), 2), split_microbatches(target, 2, "target"))) / 2
    try:  # (found by review: refused, export naming the operations of eval mode otherwise, for every Hugging Face
        got = pp.forward(*args, **kwargs)  # model with dropout: GPT-2, BERT, ViT, T5)
        with torch.no_grad():
            torch.testing.assert_close(got, ref.model(*args, **kwargs), rtol=1e-5, atol=1e-5)
        forward = "ran"
    except pipe.PipelineError as e:
        forward = f"{type(e).__name__}: {e}"
    return {"train": train, "eval": evaluated, "ref": want, "loss in graph": pp.plan.loss, "forward": forward}


def _batch_norm_exported() -> dict[str, Any]:
    """Hugging Face's ResNet (torch.export) after a step, its batch norms' running statistics updated once per
    microbatch: evaluate() and forward() in eval mode (found by review: refused with a ModeError, export tracing
    batch norm in eval mode as another op, without the updates of its statistics), each (got, expected) against
    the plain model given the step's microbatches in training mode, then in eval mode."""
    import copy

    import transformers as tf

    import pipe
    torch.manual_seed(0)
    model = tf.ResNetForImageClassification(tf.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                                            num_labels=3))
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 3, (8,), generator=g)
    pp = pipe.Pipeline(model, (x[:2],), example_kwargs={"labels": y[:2]}, loss_fn=lambda o, _: o.loss,
                       microbatches=M, cost="flops")
    out: dict[str, Any] = {"tracer": pp.plan.table().split("traced by ")[-1].split()[0]}
    out["step"] = (torch.tensor(pp.step(x, labels=y)),
                   torch.tensor(sum(ref(a, labels=b).loss.item() for a, b in zip(x.chunk(M), y.chunk(M))) / M))
    ref.eval()
    with torch.no_grad():
        want = ref(x, labels=y)
        out["evaluate"] = (torch.tensor(pp.eval().evaluate(x, labels=y)), torch.tensor(want.loss.item()))
        out["forward"] = (pp.forward(x, labels=y).logits, want.logits)
    return out


def _llama_attention_dropout() -> dict[str, Any]:
    """Found by review: Llama with attention dropout (read from `self.training`), built in training mode, then
    forward() in eval mode with its loss in the graph: the eval graph's names match the plan's, but cutting the
    stages without the loss failed with a KeyError on rank 0 while rank 1 waited for it until the timeout. Then
    refused on every rank at once; now the eval graph's nodes take the names of the plan's they stand for, and
    forward() gives the model's eval output; evaluate() its eval loss."""
    import transformers as tf
    import pipe
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64, max_position_embeddings=32, use_cache=False,
                         attention_dropout=0.2)
    model = tf.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 64, (2 * M, 8), generator=torch.Generator().manual_seed(0))
    pp = pipe.Pipeline(model, (), example_kwargs={"input_ids": ids[:2], "labels": ids[:2]},
                       loss_fn=lambda out, _: out.loss, microbatches=M, cost="flops", example_target=ids[:2])
    out: dict[str, Any] = {"loss in graph": pp.plan.loss}
    with torch.no_grad():
        out["evaluate"] = (pp.eval().evaluate(input_ids=ids, labels=ids, target=ids),
                           float(model.eval()(input_ids=ids, labels=ids).loss))
        start = time.monotonic()
        try:
            got, want = pp.forward(input_ids=ids, labels=ids), model(input_ids=ids, labels=ids)
            torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
            out["forward"] = "ran"
        except pipe.PipelineError as e:
            out["forward"] = f"{type(e).__name__}: {e}"
        out["s"] = time.monotonic() - start
    pp.train()
    return out


def _user_switched() -> dict[str, str]:
    """Found by review: a model built into a pipeline in eval mode (as from_pretrained returns it), then put in
    training mode by the user's loop (model.train()), trained without dropout: the pipeline's mode is its own.
    Now refused at the call, naming the fix; switched back, the step runs."""
    import partition
    import pipe
    w = partition.load("gpt", **{**GPT, "dropout": 0.1})
    pp = pipe.Pipeline(w.model.eval(), w.example_args, loss_fn=w.loss_fn, microbatches=M, cost="flops")
    args, _, target = w.batch(w.microbatch_size * M, 0)
    w.model.train()
    out = {}
    for call in ("step", "evaluate"):
        try:
            getattr(pp, call)(*args, target=target)
            out[call] = "ran"
        except pipe.PipelineError as e:
            out[call] = str(e)
    w.model.eval()
    out["back"] = str(pp.step(*args, target=target))
    return out


def _refused_mode() -> str:
    """A model whose eval mode skips a layer: refused on every rank."""
    import pipe
    from tests.bad_models import mode_branch
    w = mode_branch()
    pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=2, cost="flops")
    args, _, target = w.batch(4, 0)
    try:
        pp.eval().evaluate(*args, target=target)
        return "no error"
    except pipe.PipelineError as e:
        return f"{type(e).__name__}: {e}"


def _different_calls(rank: int) -> dict[str, Any]:
    """Found by review: step() on rank 0 and evaluate() on rank 1 with the same batch (a loop evaluating on the last
    rank alone) waited the whole timeout, then each rank named the other as lost. The call's kind is in the digest
    the ranks compare before any message: refused at once on both, and the next calls run."""
    import partition
    import pipe
    w = partition.load("gpt", **GPT)
    pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=M, cost="flops")
    args, _, target = w.batch(w.microbatch_size * M, 0)
    start = time.monotonic()
    try:
        (pp.step if rank == 0 else pp.evaluate)(*args, target=target)
        out: dict[str, Any] = {"error": "ran"}
    except pipe.PipelineError as e:
        out = {"error": str(e)}
    out["s"] = time.monotonic() - start
    try:  # clipping on one rank only (found by review: the gathers paired with the other's call, read garbage values
        # as its max_norm, and gloo aborted that rank)
        if rank == 0:
            pp.clip_grad_norm_(1.0)
        else:
            pp.evaluate(*args, target=target)
        out["clip"] = "ran"
    except pipe.PipelineError as e:
        out["clip"] = str(e)
    out["then"] = pp.evaluate(*args, target=target)  # every rank alike: runs
    # the same call and batch in other states (found by review: told "different batches" and to fix the data loader)
    for state, enter in (("autocast", lambda: torch.autocast("cpu", dtype=torch.bfloat16, enabled=rank == 0)),
                         ("mode", lambda: contextlib.nullcontext(pp.eval() if rank == 0 else pp.train()))):
        try:
            with enter():
                pp.evaluate(*args, target=target)
            out[state] = "ran"
        except pipe.PipelineError as e:
            out[state] = str(e)
    return out


def _numbers() -> dict[str, Any]:
    """forward() on 2 ranks of one number's outputs and sequence-first tokens (the pure test below has the
    reasons); an output it refuses is refused on every rank after its messages, and the pipeline steps on."""
    import pipe
    torch.manual_seed(0)
    x, y = torch.randn(8, 3, 4), torch.randn(24, 4)

    def loss_fn(o: Any, t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(o["batch_first"], t)
    out: dict[str, Any] = {}
    model = _Numbers()
    pp = pipe.Pipeline(model, (x[:2],), loss_fn=loss_fn, microbatches=4, cost="flops")
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        got = pp.eval().forward(x)
    with torch.no_grad():
        want = model(x)
    for k in want:
        if k not in ("std", "neg_max"):
            torch.testing.assert_close(got[k], want[k], msg=k)
    out["warned"] = sorted(str(w.message).split(" (")[0] for w in warned if "output leaf" in str(w.message))
    pp = pipe.Pipeline(_Numbers(odd=True), (x[:2],), loss_fn=loss_fn, microbatches=4, cost="flops",
                       transport=NcclLike())
    try:
        pp.forward(x)
        out["refused"] = "ran"
    except pipe.PipelineError as e:
        out["refused"] = str(e)
    out["then"] = [pp.evaluate(x, target=y), pp.step(x, target=y)]  # (found by review: the group was torn down)
    return out


def two_body(rank: int, world: int) -> dict[str, Any]:
    import pipe
    pipe.init()
    res: dict[str, Any] = {name: _case(*case) for name, case in CASES.items()}
    res["refused"] = _refusals()
    res["modes"] = {fused: _modes(fused) for fused in (False, True)}
    res["modes, streamed states"] = {fused: _modes(fused, offload="states") for fused in (False, True)}
    res["hugging face"] = {name: _hugging_face(f"bench.hf_models:{name}") for name in ("gpt2", "t5")}
    res["llama attention dropout"] = _llama_attention_dropout()
    res["batch norm"] = _batch_norm_exported()
    res["user switched"] = _user_switched()
    res["mode refused"] = _refused_mode()
    res["different calls"] = _different_calls(rank)
    res["numbers"] = _numbers()
    return res


def test_evaluate_on_2_ranks_is_the_whole_models_loss_without_grads() -> None:
    res = run_ranks("tests.test_evaluate:two_body", 2, timeout=240)
    for r in res:
        diff = r["different calls"]
        assert diff["error"].startswith("the ranks of this pipeline made different calls for this "), diff
        assert "rank 0: call: pp.step()" in diff["error"] and "rank 1: call: pp.evaluate()" in diff["error"], diff
        assert "evaluate, clip or save on every rank" in diff["error"] and diff["s"] < 20, diff
        assert diff["clip"].startswith("the ranks of this pipeline made different calls") and \
            "rank 0: call: pp.clip_grad_norm_()" in diff["clip"] and "rank 1: " in diff["clip"], diff
    assert res[0]["different calls"]["then"] == res[1]["different calls"]["then"]
    for r in res:
        for state, part in (("autocast", "rank 1: autocast: off"), ("mode", "rank 1: mode: train")):
            got = r["different calls"][state]
            assert got.startswith("the ranks of this pipeline made the same call in different states") and \
                part in got and "pp.train() or pp.eval() on every rank alike" in got, got
    for name in CASES:
        assert res[0][name]["losses"] == res[1][name]["losses"], name  # the same loss on every rank
        got = torch.tensor(res[0][name]["losses"])
        torch.testing.assert_close(got[:, 0], got[:, 1], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        assert abs(got[2, 1] - got[0, 1]) > 1e-3, (name, got)  # evaluated after the SGD step: another loss
    assert any(r[-1:] == ["vocab"] for r in res[0]["vocabulary slices"]["rewrites"])
    for fused, modes in itertools.product((False, True), ("modes", "modes, streamed states")):
        for r in res:
            got = r[modes][fused]
            assert got["eval"][0] == got["eval"][1] and got["train"][0] != got["train"][1], got  # dropout off, on
            torch.testing.assert_close(got["eval"][0], got["ref"], rtol=1e-5, atol=1e-6)
            assert got["again"] != got["eval"][0] and got["flags"], got
            assert "step() in eval mode" in got["step"] and "pp.train()" in got["step"], got["step"]
    for name in ("gpt2", "t5"):
        for r in res:
            got = r["hugging face"][name]
            assert got["eval"][0] == got["eval"][1] and got["train"][0] != got["train"][1], (name, got)
            torch.testing.assert_close(got["eval"][0], got["ref"], rtol=1e-5, atol=1e-6)
            assert got["forward"] == "ran", got
    assert res[0]["hugging face"]["gpt2"]["loss in graph"], res[0]["hugging face"]["gpt2"]  # the refusal was met
    for r in res:
        assert r["mode refused"].startswith("ModeError: ") and "in eval mode the model traces otherwise" in \
            r["mode refused"] and "build a Pipeline from the model in that mode" in r["mode refused"], r["mode refused"]
    for r in res:
        got = r["batch norm"]
        assert got.pop("tracer") == "torch.export.export" and len(got) == 3, got
        for call, pair in got.items():
            torch.testing.assert_close(*pair, rtol=1e-5, atol=1e-6, msg=lambda m: f"batch norm, {call}: {m}")
    for r in res:
        got = r["llama attention dropout"]
        assert got["loss in graph"], got
        torch.testing.assert_close(*got["evaluate"], rtol=1e-5, atol=1e-6)
        assert got["forward"] == "ran", got
    for r in res:
        for call in ("step", "evaluate"):
            assert r["user switched"][call].startswith("the model was put in training mode after this pipeline was "
                                                       "built from it in eval mode"), r["user switched"]
        float(r["user switched"]["back"])
    for r in res:
        got = r["numbers"]
        assert got["warned"] == ["forward(): the model's output leaf 6", "forward(): the model's output leaf 7"], got
        assert got["refused"].startswith("the model's output leaf 1 is a torch.int64 tensor of shape []"), got
        assert got["then"] == res[0]["numbers"]["then"], got
    for r in res:
        assert "got no target" in r["refused"]["no target"] and "target=" in r["refused"]["no target"], r
        assert r["refused"]["short target"].startswith(f"the target's dim 0 is {M} but the batch has"), r
        float(r["refused"]["then"])


def test_another_modes_trace_uses_a_meta_copy_where_the_model_is_split_over_devices() -> None:
    """On a GPU a pipeline has moved its stages' parameters (the model's own) to the device, the rest of the
    model staying where it was: the trace in the other mode is then made on a meta copy, with the graph the
    whole model on one device gives (here the "other device" is meta, as no GPU is at hand)."""
    from pipe import modes
    import partition
    from partition.meta import on_meta
    w = partition.load("gpt", **{**GPT, "dropout": 0.1, "tie": True})
    args, kwargs = w.example_args, w.example_kwargs or {}
    assert modes.traceable(w.model, args, kwargs) is w.model  # all on the example's device: the model itself
    kw = dict(leaf_modules=w.leaf_modules, loss_fn=w.loss_fn, loss=True, device=torch.device("cpu"))
    whole = modes.traced_in_mode(w.model, args, kwargs, False, **kw)
    w.model.blocks[1].to("meta")  # "another device": one block's parameters moved off the example's
    copy = modes.traceable(w.model, args, kwargs)
    assert copy is not w.model and on_meta(copy) and all(p.is_meta for p in copy.parameters())
    assert copy.lm_head.weight is copy.tok_emb.weight  # tied stays tied
    assert not w.model.tok_emb.weight.is_meta  # the model itself untouched
    split = modes.traced_in_mode(copy, args, kwargs, False, **kw)
    ops = [[(n.op, str(n.target)) for n in g.graph.nodes] for g in (whole, split)]
    assert ops[0] == ops[1] and not any("dropout" in t for _, t in ops[1])  # eval mode: no dropout


def test_concat_outputs_forms_the_batch_or_says_why_not() -> None:
    """forward()'s microbatch outputs as one batch: tensors concatenated, a 0-dim float averaged (a loss), a 0-dim
    integer the microbatches agree on kept (it crashed torch.mean before), one they differ on refused."""
    import pytest

    from pipe.errors import PipelineError
    from pipe.step import concat_outputs
    parts = [{"y": torch.ones(2, 3) * k, "loss": torch.tensor(float(k)), "n": torch.tensor(7)} for k in (1, 3)]
    got = concat_outputs(parts)
    assert torch.equal(got["y"], torch.cat([parts[0]["y"], parts[1]["y"]]))
    assert got["loss"].item() == 2.0 and got["n"].item() == 7 and got["n"].dtype == torch.int64
    with pytest.raises(PipelineError, match=r"leaf 2 is a torch.int64 tensor of shape \[\] without the batch"):
        concat_outputs([{"y": torch.ones(1), "loss": torch.tensor(1.0), "n": torch.tensor(k)} for k in (1, 2)])
    # with the microbatches' sizes: a parameter returned is kept once, a reduction over the batch refused
    w = torch.arange(4.0)
    got = concat_outputs([(torch.ones(2, 3), w), (torch.zeros(2, 3), w)], sizes=[2, 2])
    assert got[0].shape == (4, 3) and torch.equal(got[1], w)
    with pytest.raises(PipelineError, match=r"leaf 1 is a torch.float32 tensor of shape \[3\] without the batch"):
        concat_outputs([(torch.ones(2, 3), torch.ones(3) * k) for k in (1, 2)], sizes=[2, 2])
    # the batch folded with the tokens along dim 0 (logits flattened): concatenated too, with a warning that the
    # layout was not known (found by review: a bincount [64] came back [256], silently)
    with pytest.warns(RuntimeWarning, match="leaf 0 has 10 rows in a microbatch of 2 samples, a multiple"):
        assert concat_outputs([torch.randn(10, 7) for _ in range(4)], sizes=[2, 2, 2, 2]).shape == (40, 7)


class _Numbers(torch.nn.Module):
    """Outputs of one number formed over the batch in several ways, and a sequence-first output flattened
    (`odd`: also a number of the batch no microbatches' form it, refused by forward())."""
    def __init__(self, odd: bool = False) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.odd = odd

    def forward(self, x: torch.Tensor) -> Any:
        h = self.lin(x)                                      # [b, T, 4]
        if self.odd:
            return {"batch_first": h.flatten(0, 1), "odd": (x > 0).sum() % 7}
        return {"sum": h.pow(2).sum() * 0.5, "mean": h.mean(), "max": h.max(), "min": h.min().float(),
                "count": (x > 0).sum(), "mse": torch.nn.functional.mse_loss(h, x), "std": h.std(),
                "neg_max": -h.max(), "tokens": h.transpose(0, 1).reshape(-1, 4),
                "tokens_contiguous": h.transpose(0, 1).contiguous().view(-1, 2, 2), "batch_first": h.flatten(0, 1)}


def test_forward_forms_one_number_and_sequence_first_tokens_as_the_batch_gives_them() -> None:
    """Found by review: every 0-dim floating output was averaged over the microbatches (a .sum() came back 1/M
    of the batch's, a max wrong; no warning), a count of the batch refused, and a sequence-first output flattened
    to tokens ([T, B, V].view(-1, V), as PyTorch's word_language_model returns it) concatenated microbatch after
    microbatch, its rows out of order (7 of 24 in place). Now each is formed as the graph shows; a statistic of
    the whole batch (a std) is their mean with a warning."""
    import warnings

    import pytest

    from partition.reduction import output_forms
    from partition.trace import trace
    from pipe.inference import _batch_dims, _computed_from_inputs, _output_nodes
    from pipe.step import concat_outputs
    model, x = _Numbers(), torch.randn(8, 3, 4)
    gm = trace(model, (x[:2],), {})
    got_forms = output_forms(gm, _output_nodes(gm)[0], [x[:2]])
    names = list(model(x[:2]))
    assert dict(zip(names, got_forms)) == {
        "sum": ("sum", None), "mean": ("mean", None), "max": ("max", None), "min": ("min", None),
        "count": ("sum", None), "mse": ("mean", None), "std": (None, None), "neg_max": (None, None),
        "tokens": (None, 3), "tokens_contiguous": (None, 3), "batch_first": (None, None)}, got_forms
    layout = list(zip(_batch_dims(model, (x[:2],), {}, False), _computed_from_inputs(gm)))
    parts = [model(x[i:i + 2]) for i in range(0, 8, 2)]
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        got = concat_outputs(parts, [2] * 4, layout, {}, got_forms)
    want = model(x)
    for k in names:
        if k not in ("std", "neg_max"):
            torch.testing.assert_close(got[k], want[k], msg=k)
            assert got[k].dtype == want[k].dtype, k
    said = [str(w.message) for w in warned]
    assert sorted(m.split("leaf ")[1][:2] for m in said) == ["6 ", "7 "], said
    # without the forms (a model fxpipe could not run on meta tensors): as before, the rows joined along dim 0
    tokens = names.index("tokens")
    assert not torch.equal(concat_outputs([p["tokens"] for p in parts], [2] * 4, [layout[tokens]], {}, None),
                           want["tokens"])
    with pytest.raises(Exception, match="leaf 0"):
        concat_outputs([{"count": p["count"]} for p in parts], [2] * 4, [layout[names.index("count")]], {}, None)


class _Outputs(torch.nn.Module):
    """Outputs of every layout: sequence-first, flattened tokens, a parameter, a count of the batch, a loss."""
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> Any:
        h = self.lin(x)                                      # [b, T, 4]
        return {"seq_first": h.transpose(0, 1), "tokens": h.flatten(0, 1), "weight": self.lin.weight,
                "count": (x > 0).sum(), "loss": h.pow(2).mean(), "length": x.shape[1],
                "zeros": x.new_zeros(x.shape[1], 4), "samples": x.shape[0]}


def test_forward_outputs_are_laid_out_by_the_model_not_by_their_values() -> None:
    """The batch dim of each output from a meta copy of the model run on one and two microbatches' samples,
    and whether it is computed from the inputs: a sequence-first output is concatenated along dim 1 (it was
    joined along its sequence), flattened tokens along dim 0 also when every microbatch gave the same
    (repeated prompts: one microbatch's came back), a parameter kept, a count of the batch refused (a
    microbatch's came back), as is the batch's size; its sequence length is kept. Found by review."""
    import pytest

    from partition.trace import trace
    from pipe.errors import PipelineError
    from pipe.inference import _batch_dims, _computed_from_inputs
    from pipe.step import concat_outputs
    model, x = _Outputs(), torch.randn(2, 3, 4)
    dims = _batch_dims(model, (x,), {}, True)
    fed = _computed_from_inputs(trace(model, (x,), {}))
    assert dims == [1, 0, None, None, None, None, None, "?"], dims
    assert fed == [True, True, False, True, True, True, True, True], fed
    layout = dict(zip(model(x), zip(dims, fed)))
    same = [model(x)] * 2
    kept = [k for k in layout if k not in ("count", "samples")]
    got = concat_outputs([{k: o[k] for k in kept} for o in same], [2, 2], [layout[k] for k in kept])
    assert got["seq_first"].shape == (3, 4, 4) and got["tokens"].shape == (12, 4), got["tokens"].shape
    assert got["weight"] is same[0]["weight"] and got["length"] == 3 and got["zeros"].shape == (3, 4)
    for k, what in (("count", "a torch.int64 tensor of shape \\[\\]"), ("samples", "a int")):
        with pytest.raises(PipelineError, match=f"leaf 0 is {what} computed from the inputs"):
            concat_outputs([{k: o[k]} for o in same], [2, 2], [layout[k]])
    assert model.lin.weight.device.type == "cpu"  # the model itself untouched (a meta copy ran)


class _Mixing(torch.nn.Module):
    """Numbers that combine the samples while keeping their shape: none is formed from the microbatches' alike."""
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> Any:
        h = self.lin(x)                                      # [b, 4]
        return {"cumsum": h.sum(1).cumsum(0).sum(), "softmax over the batch": (h.softmax(0) * h).sum(),
                "by position": (h * torch.arange(x.shape[0]).unsqueeze(1)).sum(), "sorted": h.sort(0).values[0].sum(),
                "softmax over features": h.softmax(-1).sum()}


def test_numbers_combining_the_samples_have_no_form() -> None:
    """Found by review: a .cumsum(0), a softmax over the batch and weights from torch.arange(batch) were taken for
    per-sample terms, their sums formed as the microbatches' sum with no warning (1.573 for 0.967, 2.82 for 9.02)."""
    from partition.reduction import output_forms
    from partition.trace import trace
    from pipe.inference import _output_nodes
    model, x = _Mixing(), torch.randn(2, 4)
    gm = trace(model, (x,), {})
    forms = dict(zip(model(x), output_forms(gm, _output_nodes(gm)[0], [x])))
    assert forms == {"cumsum": (None, None), "softmax over the batch": (None, None), "by position": (None, None),
                     "sorted": (None, None), "softmax over features": ("sum", None)}, forms


def test_export_s_batch_norm_of_training_mode_stands_for_its_eval_mode_s() -> None:
    """torch.export traces batch norm in training mode as another op than in eval mode, with the updates of its
    running statistics beside it: the eval graph's batch norms stand for the training graph's, each node of it for
    one of the same op, and only those updates give way."""
    import transformers as tf

    from pipe import modes
    model = tf.ResNetForImageClassification(tf.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                                            num_labels=3))
    graphs = [modes.traced_in_mode(model, (torch.randn(2, 3, 32, 32),), {}, training, leaf_modules=(), loss_fn=None,
                                   loss=False, device=torch.device("cpu")) for training in (True, False)]
    assert graphs[0].meta["fxpipe_tracer"] == "torch.export.export"
    to, gone, extra = modes.matched(*graphs)
    assert not extra
    train = {n.name: n for n in graphs[0].graph.nodes}
    norms = {torch.ops.aten._native_batch_norm_legit_functional.default,
             torch.ops.aten._native_batch_norm_legit_no_training.default}
    assert len(to) == len(graphs[1].graph.nodes)
    for n in graphs[1].graph.nodes:
        assert train[to[n.name]].target == n.target or {train[to[n.name]].target, n.target} == norms, n
    count = sum(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())
    assert count > 1 and sum(n.target in norms for n in graphs[1].graph.nodes) == count
    updates = [train[g] for g in gone]
    assert sum(n.op == "get_attr" and str(n.target).endswith("num_batches_tracked") for n in updates) == count
    assert sum(n.target is torch.ops.aten.copy_.default for n in updates) == 3 * count  # count, mean, variance
    assert {str(n.target) for n in updates if n.op != "get_attr"} == {"aten.add.Tensor", "aten.copy_.default",
                                                                      "<built-in function getitem>"}
    # (found re-reading the change: every write of a buffer gave way in the training graph, so a model writing one
    # in both modes had a write in eval mode that stood for nothing, and was refused)
    model = _WritesInBothModes()
    graphs = [modes.traced_in_mode(model, (torch.randn(2, 4),), {}, training, leaf_modules=(), loss_fn=None,
                                   loss=False, device=torch.device("cpu")) for training in (True, False)]
    to, gone, extra = modes.matched(*graphs)
    assert len(to) == len(graphs[1].graph.nodes) and len(gone) == 7 and not extra, (to, gone, extra)  # batch norm's


def test_a_copy_only_the_meta_device_s_trace_has_stands_for_nothing() -> None:
    """Under dp_shard="full" another mode is traced on a meta copy of the model, where a `.contiguous()` can copy
    that does not on the CPU (found: Hugging Face GPT-2's attention; torch.export then numbers its copies
    otherwise and the eval mode raised a ModeError): matched aligns it with the plan's own trace, every node of it
    standing for one, and that copy for nothing (stages_in_mode passes its input on)."""
    from partition.meta import meta_copy
    from pipe import modes
    model, x = _Attends(), torch.randn(2, 8)
    kw: dict[str, Any] = dict(leaf_modules=(), loss_fn=None, loss=False, device=torch.device("cpu"))
    fresh = modes.traced_in_mode(model, (x,), {}, True, **kw)
    gm = modes.traced_in_mode(meta_copy(model), (x,), {}, False, **kw)
    assert gm.meta["fxpipe_tracer"] == "torch.export.export"
    to, gone, extra = modes.matched(fresh, gm)
    assert [n.target for n in extra] == [torch.ops.aten.clone.default] and not gone, (extra, gone)
    assert sorted(to.values()) == sorted(n.name for n in fresh.graph.nodes), to
    assert not any(n.target is torch.ops.aten.clone.default for n in fresh.graph.nodes)
    # (found by review: the meta copy's .contiguous() was paired with a .clone() of the user's right after it, of a
    # buffer written after that, and the user's clone was taken for the extra copy: the eval-mode forward read the
    # buffer after its write, 0.88 off the model's, silently)
    model = _Attends(keeps=True)
    fresh = modes.traced_in_mode(model, (x,), {}, True, **kw)
    gm = modes.traced_in_mode(meta_copy(model), (x,), {}, False, **kw)
    to, gone, extra = modes.matched(fresh, gm)
    theirs = {n.name: n for n in fresh.graph.nodes}
    assert [n.kwargs.get("memory_format") for n in extra] == [torch.contiguous_format] and not gone, (extra, gone)
    for n in gm.graph.nodes:  # the user's clone stands for the user's clone, of the buffer
        if n.target is torch.ops.aten.clone.default and n not in extra:
            assert theirs[to[n.name]].target is n.target and theirs[to[n.name]].args[0].op == "get_attr", n
    # and where alignment by op alone pairs nodes reading other values, the graphs are refused
    one = torch.fx.symbolic_trace(lambda x, y: torch.clone(x) + y)
    other = torch.fx.symbolic_trace(lambda x, y: torch.clone(y) + x)
    with pytest.raises(PlanError, match="reads y where the plan's clone reads x"):
        modes.matched(one, other)


class _Attends(torch.nn.Module):
    """A linear layer and attention whose `.contiguous()` copies on the meta device and not on the CPU (the
    attention's output is laid out otherwise there), with a branch on the batch's size (torch.export)."""
    def __init__(self, keeps: bool = False) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.keeps = keeps  # a buffer of its own, copied (.clone()) and then written
        self.register_buffer("state", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.size(0) == 0:
            raise ValueError("no samples")
        q = self.lin(x).view(x.shape[0], 2, 2, 2).transpose(1, 2)
        y = torch.nn.functional.scaled_dot_product_attention(q, q, q).transpose(1, 2).contiguous()
        if not self.keeps:
            return y.view(-1, 8)
        old = self.state.clone()
        self.state.copy_(y.reshape(-1, 8).mean(0).detach())
        return y.reshape(-1, 8) + old


class _WritesInBothModes(torch.nn.Module):
    """Batch norm, and a buffer of its own written in either mode (traced by torch.export: a branch on the size)."""
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.norm = torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)
        self.register_buffer("seen", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.size(0) == 0:
            raise ValueError("no samples")
        y = self.norm(self.lin(x))
        self.seen.copy_(y.detach().mean(0))
        return y
