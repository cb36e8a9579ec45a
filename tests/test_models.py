"""Tests for bench/models.py and bench/corpus.py: shapes, gradients, fx tracing, data."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from bench import corpus as corpus_mod
from bench import models
from bench.corpus import corpus, windows
from partition.workload import Workload

# Small configurations so each workload builds and runs in well under a second.
SMALL: dict[str, dict[str, Any]] = {
    "gpt": dict(n_layer=2, d_model=32, n_head=2, seq_len=16, vocab=64, microbatch_size=3),
    "gpt_wide_vocab": dict(n_layer=2, d_model=32, n_head=2, seq_len=8, vocab=2000),
    "gpt_text": dict(n_layer=2, d_model=32, n_head=2, seq_len=16, max_bytes=100_000),
    "mlp": dict(depth=3, width=32, in_features=8, n_classes=5, microbatch_size=6),
    "resnet": dict(blocks=3, channels=8, image=16, n_classes=7, microbatch_size=4),
    "unet": dict(depth=2, channels=8, image=16, microbatch_size=2),
}

# Expected output shape of one microbatch, from the small configuration.
SHAPES: dict[str, Callable[[dict[str, Any], int], tuple[int, ...]]] = {
    "gpt": lambda c, b: (b, c["seq_len"], c["vocab"]),
    "gpt_wide_vocab": lambda c, b: (b, c["seq_len"], c["vocab"]),
    "gpt_text": lambda c, b: (b, c["seq_len"], 256),
    "mlp": lambda c, b: (b, c["n_classes"]),
    "resnet": lambda c, b: (b, c["n_classes"]),
    "unet": lambda c, b: (b, 3, c["image"], c["image"]),
}

NAMES = sorted(SMALL)


def build(name: str, **extra: Any) -> Workload:
    factory: Callable[..., Workload] = getattr(models, name)
    return factory(**{**SMALL[name], **extra})


@pytest.mark.parametrize("name", NAMES)
def test_forward_backward_reaches_every_parameter(name: str) -> None:
    w = build(name)
    assert w.name == name
    out = w.model(*w.example_args, **w.example_kwargs)
    assert tuple(out.shape) == SHAPES[name](SMALL[name], w.microbatch_size)
    _, target = w.make_batch(w.microbatch_size, 0)
    loss = w.loss_fn(out, target)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    missing = [n for n, p in w.model.named_parameters() if p.grad is None]
    assert missing == []
    assert all(torch.isfinite(p.grad).all() for p in w.model.parameters() if p.grad is not None)


@pytest.mark.parametrize("name", NAMES)
def test_symbolic_trace_matches_model(name: str) -> None:
    w = build(name)
    gm = torch.fx.symbolic_trace(w.model)
    torch.testing.assert_close(gm(*w.example_args), w.model(*w.example_args))
    args, _ = w.make_batch(5, 1)  # another batch size: nothing was baked in by tracing
    torch.testing.assert_close(gm(*args), w.model(*args))


@pytest.mark.parametrize("name", NAMES)
def test_make_batch_is_deterministic_per_step(name: str) -> None:
    w = build(name)
    args, target = w.make_batch(5, 3)
    again, target_again = w.make_batch(5, 3)
    other, _ = w.make_batch(5, 4)
    assert all(a.size(0) == 5 for a in args) and target.size(0) == 5
    assert all(torch.equal(a, b) for a, b in zip(args, again))
    assert torch.equal(target, target_again)
    assert not torch.equal(args[0], other[0])
    assert all(a.size(0) == w.microbatch_size for a in w.example_args)


@pytest.mark.parametrize("name", NAMES)
def test_layer_prefixes_run_in_listed_order(name: str) -> None:
    w = build(name)
    modules = dict(w.model.named_modules())
    called: list[str] = []
    handles = [
        modules[p].register_forward_pre_hook(lambda m, a, p=p: called.append(p))
        for p in w.layer_prefixes
    ]
    w.model(*w.example_args)
    for h in handles:
        h.remove()
    assert len(w.layer_prefixes) >= 2
    assert called == list(w.layer_prefixes)


@pytest.mark.parametrize("name", NAMES)
def test_seed_fixes_the_initial_parameters(name: str) -> None:
    a, b, c = build(name, seed=1), build(name, seed=1), build(name, seed=2)
    sa, sb, sc = a.model.state_dict(), b.model.state_dict(), c.model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa if sa[k].is_floating_point())


def test_gpt_tie_shares_the_parameter_object() -> None:
    tied = build("gpt").model
    assert isinstance(tied, models.GPT)
    assert tied.lm_head.weight is tied.tok_emb.weight
    assert "lm_head.weight" not in dict(tied.named_parameters())
    gm = torch.fx.symbolic_trace(tied)
    assert gm.get_submodule("lm_head").weight is gm.get_submodule("tok_emb").weight
    untied = build("gpt", tie=False).model
    assert isinstance(untied, models.GPT)
    assert untied.lm_head.weight is not untied.tok_emb.weight
    assert "lm_head.weight" in dict(untied.named_parameters())


def test_gpt_wide_vocab_defaults() -> None:
    w = models.gpt_wide_vocab(n_layer=1, d_model=16, n_head=2, seq_len=8)
    assert w.name == "gpt_wide_vocab" and w.tokens_per_sample == 8
    assert isinstance(w.model, models.GPT)
    assert w.model.cfg.vocab == 16000 and w.model.cfg.tie


def test_gpt_is_causal() -> None:
    w = build("gpt")
    (idx,) = w.example_args
    changed = idx.clone()
    changed[:, -1] = (changed[:, -1] + 1) % SMALL["gpt"]["vocab"]
    torch.testing.assert_close(w.model(idx)[:, :-1], w.model(changed)[:, :-1])


def test_gpt_text_loss_falls() -> None:
    w = models.gpt_text(
        n_layer=2, d_model=64, n_head=4, seq_len=32, microbatch_size=16, max_bytes=1_000_000
    )
    opt = torch.optim.Adam(w.model.parameters(), lr=3e-3)
    losses = []
    for step in range(30):
        args, target = w.make_batch(w.microbatch_size, step)
        loss = w.loss_fn(w.model(*args), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5, losses


@pytest.mark.parametrize(
    ("factory", "kwargs", "words"),
    [
        (models.gpt, dict(d_model=30, n_head=4), "divisible by n_head"),
        (models.unet, dict(depth=3, image=20), "multiple of 8"),
        (models.mlp, dict(depth=0), "depth >= 1"),
    ],
)
def test_bad_configs_say_why(factory: Callable[..., Workload], kwargs: Any, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        factory(**kwargs)


def test_corpus_is_cached_bytes_of_python_source() -> None:
    data = corpus(50_000)
    assert data.dtype == torch.uint8 and data.shape == (50_000,)
    assert corpus(50_000) is data
    text = bytes(data.tolist()).decode("utf-8", errors="replace")
    assert "def " in text and "import " in text


def test_windows_are_deterministic_shifted_and_split() -> None:
    data = corpus(50_000)
    x, y = windows(data, 4, 32, step=7)
    x2, y2 = windows(data, 4, 32, step=7)
    assert x.shape == y.shape == (4, 32) and x.dtype == torch.int64
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert not torch.equal(x, windows(data, 4, 32, step=8)[0])
    n_train = int(50_000 * (1 - corpus_mod.VAL_FRACTION))
    for split, part in (("train", data[: n_train]), ("val", data[n_train:])):
        sx, sy = windows(data, 16, 32, step=0, split=split)
        inside = part.long().unfold(0, 33, 1)  # (L, 33): every window of the split
        pairs = torch.cat([sx, sy[:, -1:]], dim=1)  # (16, 33)
        assert (pairs[:, None, :] == inside[None]).all(-1).any(-1).all(), split
    with pytest.raises(ValueError, match="'train' or 'val'"):
        windows(data, 1, 8, 0, split="test")
    with pytest.raises(ValueError, match="smaller seq_len"):
        windows(data[:100], 1, 200, 0)


def test_corpus_without_stdlib_sources_says_so(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    monkeypatch.setattr(corpus_mod, "stdlib_dir", lambda: str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no Python standard library sources"):
        corpus_mod.corpus.__wrapped__(1000)
