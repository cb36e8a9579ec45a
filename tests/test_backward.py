"""pipe.backward without processes: the zero-bubble B and W passes give the full backward's grads."""
from __future__ import annotations

import torch

import partition
from partition.split import stage_io
from pipe.backward import Saved, backward_input, backward_weight, with_param_outputs

SMALL = {"n_layer": 2, "d_model": 32, "n_head": 2, "seq_len": 16, "vocab": 64}


def _grads(stage: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in stage.named_parameters() if p.grad is not None}
    stage.zero_grad(set_to_none=True)
    return out


def test_w_from_the_linear_inputs_equals_the_full_backward() -> None:
    """B then W, with W by an autograd call per node or (direct) by matrix products for the nn.Linear
    nodes from the inputs the forward kept, both equal one full backward, over two microbatches
    (the second accumulates); a linear whose weight is frozen keeps no input."""
    w = partition.load("gpt", **SMALL)
    plan = partition.plan(w.model, w.example_args, 1, cost="flops")
    stage = partition.split(w.model, plan)[0]
    io = stage_io(stage)
    xs = [w.batch(w.microbatch_size, k)[0][0] for k in range(2)]
    for x in xs:
        stage(x)[0].float().pow(2).mean().backward()  # a stage returns a tuple of its outputs
    want = _grads(stage)
    for direct in (False, True):
        zb, extra, multi = with_param_outputs(stage, io.param_nodes, direct=direct)
        for x in xs:
            outs, param_outs, *ins = zb(x)
            assert bool(ins) == direct
            if direct:  # one input per linear node, None for the others (embeddings, norms)
                linear = [n for (n, _), t in zip(extra, ins[0]) if t is not None]
                assert len(linear) == 4 * SMALL["n_layer"], linear  # qkv, proj, fc, proj (the head is tied)
            loss = outs[0].float().pow(2).mean()
            saved = Saved(roots=[loss], leaves=[], param_outs=list(param_outs), param_ins=list(ins[0]) if ins else [])
            backward_input(saved, [None], multi)
            backward_weight(saved, extra)
        assert not any(p.grad.requires_grad for p in stage.parameters() if p.grad is not None)
        got = _grads(stage)
        assert set(got) == set(want)
        for n in want:
            torch.testing.assert_close(got[n], want[n], msg=f"direct={direct} {n}")
    stage.get_submodule("blocks.0.attn.qkv").weight.requires_grad_(False)
    zb, extra, _ = with_param_outputs(stage, io.param_nodes, direct=True)
    ins = zb(xs[0])[2]
    assert [t is None for (n, _), t in zip(extra, ins) if n.startswith("blocks_0_attn_")] == [True, False]
