"""pipe.calls: the digest by which the ranks of a pipeline agree on a call (pure; the ranks' agreement
itself runs in tests/test_reliability.py's launch)."""
from typing import Any

import torch

from pipe.calls import SAMPLE, call_of


def _tokens(seed: int, shape: tuple[int, ...] = (8, 16)) -> torch.Tensor:
    return torch.randint(0, 1000, shape, generator=torch.Generator().manual_seed(seed))


def test_the_same_call_has_the_same_digest_and_another_batch_another() -> None:
    x, y = _tokens(0), _tokens(1)
    same = call_of((x.clone(),), {"scale": 0.5}, y.clone())
    assert call_of((x,), {"scale": 0.5}, y).digest == same.digest
    assert call_of((x,), {"scale": 0.5}, y).parts == same.parts
    others = [call_of((_tokens(2),), {"scale": 0.5}, y),            # other samples, same shape
              call_of((x,), {"scale": 0.5}, _tokens(2)),            # another target
              call_of((x[:, :8],), {"scale": 0.5}, y),              # another shape
              call_of((x.int(),), {"scale": 0.5}, y),               # another dtype
              call_of((x,), {"scale": 0.25}, y),                    # another constant
              call_of((x,), {"scale": 0.5}, None),                  # no target
              call_of((x,), {}, y)]                                 # an input missing
    digests = [c.digest for c in others]
    assert same.digest not in digests and len(set(digests)) == len(digests)
    assert all(0 <= d < 2 ** 62 for d in digests)  # fits an int64 with room


def test_a_large_tensor_is_sampled_and_a_strided_one_read_as_its_contiguous_copy() -> None:
    big = torch.randn(64, 3, 32, 32)
    assert big.numel() > 16 * SAMPLE
    changed = big.clone()
    changed.view(-1)[0] += 1  # the first element is always sampled
    assert call_of((big,), {}).digest != call_of((changed,), {}).digest
    grid = torch.arange(6000).reshape(60, 100)
    for view in (grid[:, ::2], grid.t(), grid[5:, 3:]):
        assert not view.is_contiguous()
        assert call_of((view,), {}).digest == call_of((view.contiguous(),), {}).digest
        assert call_of((view,), {}).digest != call_of((view.contiguous() + 1,), {}).digest


def test_the_parts_name_each_input_and_the_target_by_path() -> None:
    c = call_of((torch.zeros(2, 3, dtype=torch.long),), {"mask": torch.ones(2, 3, dtype=torch.bool), "n": 3},
                {"labels": torch.zeros(2)})
    assert [p.split(":")[0] for p in c.parts] == ["args[0]", "kwargs['mask']", "kwargs['n']", "target['labels']"]
    assert c.parts[0].startswith("args[0]: a tensor [2, 3] int64, sampled bytes ")
    assert c.parts[2] == "kwargs['n']: int 3"


class _Opaque:
    pass


def test_an_object_is_compared_by_its_type_not_its_address() -> None:
    # its repr holds its address, which differs from process to process for the same call
    a, b = call_of((torch.zeros(2), _Opaque()), {}), call_of((torch.zeros(2), _Opaque()), {})
    assert a.digest == b.digest and a.parts[1] == "args[1]: a tests.test_calls._Opaque"


def test_a_build_is_compared_by_its_arguments_example_shapes_and_model_values() -> None:
    from bench.models import GPT, GPTConfig
    from pipe.calls import build_of

    def model(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return GPT(GPTConfig(n_layer=1, d_model=16, n_head=2, seq_len=8, vocab=32))

    base = build_of(model(0), (_tokens(0, (2, 8)),), {}, None, {"schedule": "1f1b", "microbatches": 4})
    # the example's values only shape the trace: another draw of the same shape is the same build
    assert build_of(model(0), (_tokens(5, (2, 8)),), {}, None, {"schedule": "1f1b", "microbatches": 4}).digest \
        == base.digest
    others = {
        "another seed": build_of(model(1), (_tokens(0, (2, 8)),), {}, None, {"schedule": "1f1b", "microbatches": 4}),
        "another schedule": build_of(model(0), (_tokens(0, (2, 8)),), {}, None,
                                     {"schedule": "gpipe", "microbatches": 4}),
        "another example shape": build_of(model(0), (_tokens(0, (2, 4)),), {}, None,
                                          {"schedule": "1f1b", "microbatches": 4}),
    }
    for name, c in others.items():
        assert c.digest != base.digest, name
    assert "schedule='1f1b'" in base.parts and "example args[0]: a tensor [2, 8] int64" in base.parts
    assert any(p.startswith("parameter tok_emb.weight: a tensor [32, 16] float32, sampled bytes ") for p in base.parts)


def test_a_plan_setting_is_compared_by_its_stages_not_its_cost_figures() -> None:
    import dataclasses
    import partition
    from pipe.calls import _setting
    w = partition.load("gpt", n_layer=2, d_model=16, n_head=2, seq_len=8, vocab=32)
    p = partition.plan(w.model, w.example_args, 2, cost="flops")
    timed = dataclasses.replace(p, bottleneck_ms=p.bottleneck_ms * 2, stages=[
        dataclasses.replace(st, fwd_ms=st.fwd_ms * 3) for st in p.stages])
    assert _setting(timed) == _setting(p)
    moved = dataclasses.replace(p, stages=[dataclasses.replace(p.stages[0], nodes=p.stages[0].nodes[:-1]),
                                           dataclasses.replace(p.stages[1], nodes=p.stages[0].nodes[-1:]
                                                               + p.stages[1].nodes)])
    assert _setting(moved) != _setting(p)
    assert _setting(print) == "builtins.print" and _setting([1, "a"]) == "[1, 'a']"


def test_with_weights_the_model_s_own_values_are_not_compared_but_the_weights_are() -> None:
    from pipe.calls import build_of
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)  # two random inits
    sd = {k: v.clone() for k, v in a.state_dict().items()}
    given = build_of(a, (torch.zeros(2, 4),), {}, None, {"weights": sd})
    assert build_of(b, (torch.zeros(2, 4),), {}, None, {"weights": {k: v.clone() for k, v in sd.items()}}).digest \
        == given.digest  # the values come from weights=
    other = {k: v + 1 for k, v in sd.items()}
    assert build_of(b, (torch.zeros(2, 4),), {}, None, {"weights": other}).digest != given.digest
    assert build_of(b, (torch.zeros(2, 4),), {}, None, {"weights": "model.safetensors"}).digest != given.digest
    assert build_of(a, (torch.zeros(2, 4),), {}, None, {"weights": None}).digest \
        != build_of(b, (torch.zeros(2, 4),), {}, None, {"weights": None}).digest
    assert any(p.startswith("weights=a state dict of 2 entries, digest ") for p in given.parts)


def test_a_keyword_given_as_its_default_is_the_call_the_example_made() -> None:
    """Found by review: `attention_mask=None` passed explicitly to a pipeline built without it (its default) was
    refused as an input the plan does not know; and the reverse. A tensor is never taken as a default."""
    from types import SimpleNamespace
    from pipe.calls import _defaults_as_planned

    class Model(torch.nn.Module):
        def forward(self, x: torch.Tensor, attention_mask: Any = None, scale: float = 1.0) -> torch.Tensor:
            return x

    x = torch.zeros(2)
    pp = SimpleNamespace(_model=Model(), _example=((x,), {}))
    assert _defaults_as_planned(pp, {"attention_mask": None, "scale": 1.0}) == {}
    assert _defaults_as_planned(pp, {"scale": 2.0}) == {"scale": 2.0}  # not the default: the check refuses it
    assert _defaults_as_planned(pp, {"scale": 1}) == {"scale": 1}  # (an int for a float default: another constant)
    assert list(_defaults_as_planned(pp, {"attention_mask": x})) == ["attention_mask"]
    pp = SimpleNamespace(_model=Model(), _example=((x,), {"attention_mask": None}))
    assert _defaults_as_planned(pp, {}) == {"attention_mask": None}
