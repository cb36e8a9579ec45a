"""Hugging Face workloads from small configs (random weights, nothing downloaded): GPT-2, BERT, T5."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from partition.workload import Workload

__all__ = ["gpt2", "gpt2_lm", "bert", "t5"]


def _lm_loss(out: Any, target: Any) -> torch.Tensor:
    return out.loss


def _tokens(vocab: int, batch_size: int, seq_len: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (batch_size, seq_len), generator=g)


class _GPT2Batch:
    def __init__(self, vocab: int, seq_len: int) -> None:
        self.vocab, self.seq_len = vocab, seq_len

    def __call__(self, batch_size: int, step: int) -> tuple[tuple[Any, ...], dict[str, Any], torch.Tensor]:
        ids = _tokens(self.vocab, batch_size, self.seq_len, step)
        return (ids,), {"labels": ids}, ids


def gpt2(*, n_layer: int = 2, n_embd: int = 64, n_head: int = 4, vocab: int = 256, seq_len: int = 32,
         microbatch_size: int = 2, seed: int = 0) -> Workload:
    """GPT2LMHeadModel (tied embeddings); inputs (input_ids, labels), loss = the model's own loss."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab, n_positions=seq_len,
                     use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg)
    batch = _GPT2Batch(vocab, seq_len)
    args, kwargs, _ = batch(microbatch_size, 0)
    return Workload(name="gpt2", model=model, example_args=args, example_kwargs=kwargs,
                    loss_fn=_lm_loss, make_batch=batch, microbatch_size=microbatch_size,
                    tokens_per_sample=seq_len,
                    layer_prefixes=tuple(f"transformer.h.{i}" for i in range(n_layer)))


def _next_token_loss(out: Any, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy from the model's logits, as a Hugging Face user writes it."""
    return F.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


class _IdsBatch(_GPT2Batch):
    def __call__(self, batch_size: int, step: int) -> tuple[tuple[Any, ...], dict[str, Any], torch.Tensor]:
        ids = _tokens(self.vocab, batch_size, self.seq_len, step)
        return (ids,), {}, ids


def gpt2_lm(*, n_layer: int = 2, n_embd: int = 64, n_head: int = 4, vocab: int = 256, seq_len: int = 32,
            microbatch_size: int = 2, seed: int = 0) -> Workload:
    """GPT2LMHeadModel called with input ids alone; the loss reads `out.logits` (a ModelOutput)."""
    w = gpt2(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab=vocab, seq_len=seq_len,
             microbatch_size=microbatch_size, seed=seed)
    batch = _IdsBatch(vocab, seq_len)
    args, kwargs, _ = batch(microbatch_size, 0)
    return Workload(name="gpt2_lm", model=w.model, example_args=args, example_kwargs=kwargs,
                    loss_fn=_next_token_loss, make_batch=batch, microbatch_size=microbatch_size,
                    tokens_per_sample=seq_len, layer_prefixes=w.layer_prefixes)


class _BertBatch:
    def __init__(self, vocab: int, seq_len: int) -> None:
        self.vocab, self.seq_len = vocab, seq_len

    def __call__(self, batch_size: int, step: int) -> tuple[tuple[Any, ...], dict[str, Any], torch.Tensor]:
        ids = _tokens(self.vocab, batch_size, self.seq_len, step)
        g = torch.Generator().manual_seed(2000 + step)
        lengths = torch.randint(self.seq_len // 2, self.seq_len + 1, (batch_size,), generator=g)
        mask = (torch.arange(self.seq_len)[None, :] < lengths[:, None]).long()  # (B, T) padding mask
        labels = torch.where(torch.rand(ids.shape, generator=g) < 0.15, ids, torch.full_like(ids, -100))
        return (ids,), {"attention_mask": mask, "labels": labels}, labels


def bert(*, n_layer: int = 2, hidden: int = 64, n_head: int = 4, vocab: int = 256, seq_len: int = 32,
         microbatch_size: int = 2, seed: int = 0) -> Workload:
    """BertForMaskedLM with a padding attention mask; loss = the model's masked-LM loss."""
    from transformers import BertConfig, BertForMaskedLM
    torch.manual_seed(seed)
    cfg = BertConfig(num_hidden_layers=n_layer, hidden_size=hidden, num_attention_heads=n_head,
                     intermediate_size=4 * hidden, vocab_size=vocab, max_position_embeddings=seq_len,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = BertForMaskedLM(cfg)
    batch = _BertBatch(vocab, seq_len)
    args, kwargs, _ = batch(microbatch_size, 0)
    return Workload(name="bert", model=model, example_args=args, example_kwargs=kwargs, loss_fn=_lm_loss,
                    make_batch=batch, microbatch_size=microbatch_size, tokens_per_sample=seq_len,
                    layer_prefixes=tuple(f"bert.encoder.layer.{i}" for i in range(n_layer)))


class _T5Batch:
    def __init__(self, vocab: int, seq_len: int) -> None:
        self.vocab, self.seq_len = vocab, seq_len

    def __call__(self, batch_size: int, step: int) -> tuple[tuple[Any, ...], dict[str, Any], torch.Tensor]:
        ids = _tokens(self.vocab, batch_size, self.seq_len, step)
        labels = _tokens(self.vocab, batch_size, self.seq_len // 2, step + 7919)
        mask = torch.ones_like(ids)
        return (ids,), {"attention_mask": mask, "labels": labels}, labels


def t5(*, n_layer: int = 2, d_model: int = 64, n_head: int = 4, vocab: int = 256, seq_len: int = 32,
       microbatch_size: int = 2, seed: int = 0) -> Workload:
    """T5ForConditionalGeneration (encoder-decoder); labels make the decoder inputs; loss = the model's."""
    from transformers import T5Config, T5ForConditionalGeneration
    torch.manual_seed(seed)
    cfg = T5Config(num_layers=n_layer, num_decoder_layers=n_layer, d_model=d_model, d_kv=d_model // n_head,
                   d_ff=4 * d_model, num_heads=n_head, vocab_size=vocab, dropout_rate=0.0, use_cache=False,
                   decoder_start_token_id=0)  # type: ignore[call-arg]  # a PretrainedConfig keyword
    model = T5ForConditionalGeneration(cfg)
    batch = _T5Batch(vocab, seq_len)
    args, kwargs, _ = batch(microbatch_size, 0)
    return Workload(name="t5", model=model, example_args=args, example_kwargs=kwargs, loss_fn=_lm_loss,
                    make_batch=batch, microbatch_size=microbatch_size, tokens_per_sample=seq_len,
                    layer_prefixes=tuple([f"encoder.block.{i}" for i in range(n_layer)] +
                                         [f"decoder.block.{i}" for i in range(n_layer)]))
