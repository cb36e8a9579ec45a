"""Hugging Face checkpoints whose keys are not the model's, read as transformers' from_pretrained
reads them (pipe.hf_keys): a head renamed on save (GPT-NeoX's embed_out), experts stored one tensor
each and stacked in the model (Mixtral), a checkpoint of the base model loaded into one with a head
(GPT-2). Pure: each view's keys, shapes and tensors against the model from_pretrained loads from the
same folder. Parity of a pipeline built from such a folder runs in tests/test_meta.py's 2-rank launch."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.conversion_mapping")  # transformers 5


def _mixtral() -> Any:
    cfg = transformers.MixtralConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
                                     intermediate_size=48, vocab_size=64, num_local_experts=3, use_cache=False,
                                     max_position_embeddings=64)
    return transformers.MixtralForCausalLM(cfg)


def _neox() -> Any:
    cfg = transformers.GPTNeoXConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                                     vocab_size=64, max_position_embeddings=64, use_cache=False)
    return transformers.GPTNeoXForCausalLM(cfg)


def _gpt2_base() -> Any:
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    return transformers.GPT2Model(cfg)


def _view(folder: Path, model: Any) -> Any:
    from pipe import hf_keys
    from pipe.state_dicts import _Source
    return hf_keys.converted(_Source(folder), model, set(model.state_dict()))


@pytest.mark.parametrize("make,into,renamed,converted", [
    (_mixtral, None, 2, 4),                                   # gate renamed, experts stacked (w1+w3, w2)
    (_neox, None, 1, 0),                                      # embed_out -> lm_head
    (_gpt2_base, transformers.GPT2LMHeadModel, None, 0)])     # "transformer." added to every key
def test_a_checkpoint_is_read_as_from_pretrained_reads_it(tmp_path: Path, make: Any, into: Any, renamed: Any,
                                                           converted: int) -> None:
    torch.manual_seed(0)
    saved = make()
    saved.save_pretrained(str(tmp_path))
    cls = into or type(saved)
    want = cls.from_pretrained(str(tmp_path)).state_dict()
    model = cls(saved.config)  # the model to load into: other values
    from pipe.state_dicts import _Source
    assert _Source(tmp_path).keys != set(want)  # the file's keys are not the model's
    view = _view(tmp_path, model)
    assert view is not None
    assert view.keys == set(want) - ({"lm_head.weight"} if into else set())  # a tied head is not in the file
    assert len(view.made) == converted
    if renamed is not None:
        assert view.renames == renamed, view.describe()
    for k in view.keys:
        assert view.shape(k) == tuple(want[k].shape), k
        torch.testing.assert_close(view.get(k), want[k], rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")
        dst = torch.full_like(want[k], float("nan"))
        view.copy_into(k, dst)
        torch.testing.assert_close(dst, want[k], rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")
    assert not view._done  # every converted target copied in, none kept
    assert "from_pretrained" in view.describe() and type(model).__name__ in view.describe()


def test_only_where_keys_differ_and_only_for_transformers_models(tmp_path: Path) -> None:
    torch.manual_seed(0)
    m = _mixtral()
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, str(tmp_path / "model.safetensors"))
    assert _view(tmp_path, m) is None  # the model's own keys: nothing changes
    lin = torch.nn.Linear(2, 2)
    save_file(dict(lin.state_dict()), str(tmp_path / "lin.safetensors"))
    from pipe import hf_keys
    from pipe.state_dicts import _Source
    assert hf_keys.converted(_Source(tmp_path / "lin.safetensors"), lin, {"weight", "bias"}) is None


def test_two_file_keys_read_as_one_are_refused(tmp_path: Path) -> None:
    from safetensors.torch import save_file
    from pipe.ckpt_format import CheckpointError
    torch.manual_seed(0)
    m = _neox()
    sd = {k: v.contiguous() for k, v in m.state_dict().items()}
    sd["embed_out.weight"] = sd["lm_head.weight"].clone()  # both the old and the new name
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"holds both .*embed_out.weight.* lm_head.weight|holds both "
                                              r".*lm_head.weight.* embed_out.weight"):
        _view(tmp_path, m)


def test_keys_from_pretrained_skips_are_named() -> None:
    """Found by review: keys transformers skips on loading (a class's _keys_to_ignore_on_load_unexpected, the
    per-layer rotary frequencies and position ids older checkpoints hold) were refused as keys the model has not."""
    from pipe import hf_keys
    neox = _neox()
    legacy = {"gpt_neox.layers.0.attention.rotary_emb.inv_freq", "gpt_neox.layers.1.attention.bias",
              "gpt_neox.layers.1.attention.masked_bias", "gpt_neox.layers.0.attention.extra", "position_ids"}
    assert hf_keys.ignored_on_load(neox, legacy) == ["gpt_neox.layers.0.attention.rotary_emb.inv_freq",
                                                     "gpt_neox.layers.1.attention.bias",
                                                     "gpt_neox.layers.1.attention.masked_bias"]
    bert = transformers.BertModel(transformers.BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                                          intermediate_size=64, vocab_size=64))
    if "embeddings.position_ids" not in bert.state_dict():  # a non-persistent buffer: an older file's key skipped
        assert hf_keys.ignored_on_load(bert, {"embeddings.position_ids", "pooler.other"}) == ["embeddings.position_ids"]
    plain = torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert hf_keys.ignored_on_load(plain, {"0.rotary_emb.inv_freq", "0.attention.bias"}) == []
