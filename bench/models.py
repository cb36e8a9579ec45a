"""Bundled workloads: a nanoGPT-style decoder, a deep MLP, a small ResNet and a U-Net."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from bench.corpus import VOCAB as BYTE_VOCAB
from bench.corpus import corpus, windows
from partition.workload import Workload

__all__ = [
    "GPT", "MLP", "GPTConfig", "ResNet", "UNet",
    "gpt", "gpt_text", "gpt_wide_vocab", "mlp", "resnet", "unet",
]  # fmt: skip

# Legend for shape comments: B batch, T tokens, C channels/width, H heads, D head
# width, V vocabulary, K classes, S image side.

_TEACHER_SEED = 1234  # the fixed "teacher" that labels synthetic data; independent of `seed`
_IMAGE_CHANNELS = 3


# ---------------------------------------------------------------------------- GPT


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shape of a nanoGPT-style decoder."""

    n_layer: int = 4
    d_model: int = 128
    n_head: int = 4
    seq_len: int = 64
    vocab: int = 512
    tie: bool = True
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(
                f"d_model must be divisible by n_head (d_model: {self.d_model}, "
                f"n_head: {self.n_head}); pick n_head among the divisors of d_model"
            )


class _CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.d_model // cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C)
        qkv = self.qkv(x).unflatten(-1, (3, self.n_head, self.head_dim))  # (B, T, 3, H, D)
        qkv = qkv.permute(2, 0, 3, 1, 4)  # (3, B, H, T, D)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).flatten(2)  # (B, T, C)
        return self.resid_drop(self.proj(y))


class _GPTMLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C)
        return self.drop(self.proj(self.act(self.fc(x))))


class _Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = _CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = _GPTMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C)
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token + learned position embeddings, `n_layer` pre-LN blocks, final LN, LM head."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.apply(_init_gpt_weights)
        for name, p in self.named_parameters():  # GPT-2: scale the residual projections
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))
        if cfg.tie:
            self.lm_head.weight = self.tok_emb.weight

    def _init_weights(self, module: nn.Module) -> None:
        """GPT-2's init of one module, as Hugging Face's `_init_weights` (pipe.weights' default init of a
        model built on the meta device calls it on each module after reset_parameters)."""
        _init_gpt_weights(module)
        if isinstance(module, (_CausalSelfAttention, _GPTMLP)):  # the residual projections, scaled
            nn.init.normal_(module.proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * self.cfg.n_layer))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # (B, T) int64
        pos = torch.arange(idx.size(1), device=idx.device)  # (T,)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        return self.lm_head(self.ln_f(x))  # (B, T, V)


def _init_gpt_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def _lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy; logits (B, T, V), target (B, T)."""
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _random_tokens(
    batch_size: int, step: int, *, vocab: int, seq_len: int
) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(vocab, (batch_size, seq_len + 1), generator=gen)  # (B, T + 1)
    return (tokens[:, :-1],), tokens[:, 1:]


def _text_windows(
    batch_size: int, step: int, *, seq_len: int, max_bytes: int
) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    x, y = windows(corpus(max_bytes), batch_size, seq_len, step, split="train")  # (B, T)
    return (x,), y


def gpt(
    *,
    n_layer: int = 4,
    d_model: int = 128,
    n_head: int = 4,
    seq_len: int = 64,
    vocab: int = 512,
    microbatch_size: int = 4,
    tie: bool = True,
    dropout: float = 0.0,
    seed: int = 0,
) -> Workload:
    """nanoGPT-style decoder on random tokens; the LM head shares the token embedding if `tie`."""
    cfg = GPTConfig(n_layer, d_model, n_head, seq_len, vocab, tie, dropout)
    torch.manual_seed(seed)
    model = GPT(cfg)
    make_batch = functools.partial(_random_tokens, vocab=vocab, seq_len=seq_len)
    return Workload(
        name="gpt",
        model=model,
        example_args=make_batch(microbatch_size, 0)[0],
        loss_fn=_lm_loss,
        make_batch=make_batch,
        microbatch_size=microbatch_size,
        tokens_per_sample=seq_len,
        layer_prefixes=tuple(f"blocks.{i}" for i in range(n_layer)),
    )


def gpt_wide_vocab(*, vocab: int = 16000, **kwargs: Any) -> Workload:
    """`gpt` (same keyword arguments) with a 16k vocabulary: embedding and head dominate.

    The head stays tied to the token embedding by default (as in GPT-2), so one weight
    is used by the first and the last stage, which a partitioner must handle.
    """
    return dataclasses.replace(gpt(vocab=vocab, **kwargs), name="gpt_wide_vocab")


def gpt_text(*, seq_len: int = 64, max_bytes: int = 4_000_000, **kwargs: Any) -> Workload:
    """Byte-level `gpt` (vocab 256; other keyword arguments as `gpt`) on the stdlib corpus.

    Batches are windows of the first `max_bytes` bytes of the corpus (train split), so
    the loss falls in training.
    """
    make_batch = functools.partial(_text_windows, seq_len=seq_len, max_bytes=max_bytes)
    w = gpt(vocab=BYTE_VOCAB, seq_len=seq_len, **kwargs)
    return dataclasses.replace(
        w, name="gpt_text", example_args=make_batch(w.microbatch_size, 0)[0], make_batch=make_batch
    )


# ---------------------------------------------------------------------------- MLP


class _Dense(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C_in)
        return self.act(self.fc(x))  # (B, C_out)


class MLP(nn.Module):
    """`depth` Linear+GELU layers in `layers`, then a linear classifier `head`."""

    def __init__(self, depth: int, width: int, in_features: int, n_classes: int) -> None:
        super().__init__()
        dims = [in_features] + [width] * depth
        self.layers = nn.Sequential(*(_Dense(a, b) for a, b in itertools.pairwise(dims)))
        self.head = nn.Linear(width, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C_in)
        return self.head(self.layers(x))  # (B, K)


def _teacher_vectors(
    batch_size: int, step: int, *, teacher: torch.Tensor
) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(batch_size, teacher.size(0), generator=gen)  # (B, C_in)
    return (x,), (x @ teacher).argmax(-1)  # (B,)


def mlp(
    *,
    depth: int = 8,
    width: int = 256,
    in_features: int = 64,
    n_classes: int = 10,
    microbatch_size: int = 16,
    seed: int = 0,
) -> Workload:
    """Deep MLP learning the classes a fixed random linear teacher assigns to Gaussian inputs."""
    if depth < 1:
        raise ValueError(f"mlp needs depth >= 1 (depth: {depth})")
    torch.manual_seed(seed)
    model = MLP(depth, width, in_features, n_classes)
    gen = torch.Generator().manual_seed(_TEACHER_SEED)
    teacher = torch.randn(in_features, n_classes, generator=gen)  # (C_in, K)
    make_batch = functools.partial(_teacher_vectors, teacher=teacher)
    return Workload(
        name="mlp",
        model=model,
        example_args=make_batch(microbatch_size, 0)[0],
        loss_fn=F.cross_entropy,
        make_batch=make_batch,
        microbatch_size=microbatch_size,
        layer_prefixes=tuple(f"layers.{i}" for i in range(depth)),
    )


# ---------------------------------------------------------------------------- ResNet


class _ResBlock(nn.Module):
    """conv-BN-ReLU-conv-BN plus a shortcut (1x1 conv + BN when the shape changes), ReLU."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C_in, S, S)
        h = F.relu(self.bn1(self.conv1(x)))  # (B, C_out, S / stride, S / stride)
        h = self.bn2(self.conv2(h))
        return F.relu(h + self.shortcut(x))


class ResNet(nn.Module):
    """Conv stem, residual `blocks` (the middle one halves the side, doubles channels), head."""

    def __init__(self, blocks: int, channels: int, n_classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(_IMAGE_CHANNELS, channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
        )
        layers = []
        c = channels
        for i in range(blocks):
            down = blocks >= 2 and i == blocks // 2
            layers.append(_ResBlock(c, 2 * c if down else c, stride=2 if down else 1))
            c = 2 * c if down else c
        self.blocks = nn.ModuleList(layers)
        self.head = nn.Linear(c, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 3, S, S)
        x = self.stem(x)  # (B, C, S, S)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3)))  # (B, K)


def _teacher_images(
    batch_size: int, step: int, *, teacher: torch.Tensor, image: int
) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(batch_size, _IMAGE_CHANNELS, image, image, generator=gen)  # (B, 3, S, S)
    features = F.adaptive_avg_pool2d(x, 4).flatten(1)  # (B, 48)
    return (x,), (features @ teacher).argmax(-1)  # (B,)


def resnet(
    *,
    blocks: int = 4,
    channels: int = 32,
    image: int = 32,
    n_classes: int = 10,
    microbatch_size: int = 8,
    seed: int = 0,
) -> Workload:
    """Small BatchNorm ResNet classifying random images by a fixed teacher of their 4x4 means."""
    if blocks < 1 or image < 4:
        raise ValueError(
            f"resnet needs blocks >= 1 and image >= 4 (blocks: {blocks}, image: {image})"
        )
    torch.manual_seed(seed)
    model = ResNet(blocks, channels, n_classes)
    gen = torch.Generator().manual_seed(_TEACHER_SEED)
    teacher = torch.randn(_IMAGE_CHANNELS * 16, n_classes, generator=gen)  # (48, K)
    make_batch = functools.partial(_teacher_images, teacher=teacher, image=image)
    return Workload(
        name="resnet",
        model=model,
        example_args=make_batch(microbatch_size, 0)[0],
        loss_fn=F.cross_entropy,
        make_batch=make_batch,
        microbatch_size=microbatch_size,
        layer_prefixes=tuple(f"blocks.{i}" for i in range(blocks)),
    )


# ---------------------------------------------------------------------------- U-Net


class _ConvBlock(nn.Module):
    """(conv3x3-GroupNorm-SiLU) twice."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        groups = math.gcd(8, c_out)
        self.conv1 = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.norm1 = nn.GroupNorm(groups, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1)
        self.norm2 = nn.GroupNorm(groups, c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C_in, S, S)
        x = F.silu(self.norm1(self.conv1(x)))  # (B, C_out, S, S)
        return F.silu(self.norm2(self.conv2(x)))


class _Up(nn.Module):
    """Transposed conv doubles the side; the encoder skip is concatenated; a conv block mixes."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.upconv = nn.ConvTranspose2d(c_in, c_out, 2, stride=2)
        self.block = _ConvBlock(2 * c_out, c_out)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        x = self.upconv(x)  # (B, C_out, 2S, 2S)
        return self.block(torch.cat([x, skip], dim=1))  # (B, C_out, 2S, 2S)


class UNet(nn.Module):
    """Encoder `down`, bottleneck `mid`, decoder `up`; each level's encoder output skips across."""

    def __init__(self, depth: int, channels: int) -> None:
        super().__init__()
        widths = [channels * 2**i for i in range(depth + 1)]  # per level, deepest last
        self.inp = nn.Conv2d(_IMAGE_CHANNELS, channels, 3, padding=1)
        self.down = nn.ModuleList(
            _ConvBlock(widths[max(i - 1, 0)], widths[i]) for i in range(depth)
        )
        self.pool = nn.MaxPool2d(2)
        self.mid = _ConvBlock(widths[depth - 1], widths[depth])
        self.up = nn.ModuleList(_Up(widths[i + 1], widths[i]) for i in reversed(range(depth)))
        self.out = nn.Conv2d(channels, _IMAGE_CHANNELS, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 3, S, S)
        x = self.inp(x)  # (B, C, S, S)
        skips = []
        for down in self.down:
            x = down(x)  # (B, C * 2^l, S / 2^l, S / 2^l) at level l
            skips.append(x)
            x = self.pool(x)
        x = self.mid(x)  # (B, C * 2^depth, S / 2^depth, S / 2^depth)
        for up, skip in zip(self.up, reversed(skips)):
            x = up(x, skip)
        return self.out(x)  # (B, 3, S, S)


def _noisy_images(
    batch_size: int, step: int, *, image: int
) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    coarse = torch.randn(batch_size, _IMAGE_CHANNELS, 4, 4, generator=gen)  # (B, 3, 4, 4)
    clean = F.interpolate(coarse, size=(image, image), mode="bilinear", align_corners=False)
    noise = torch.randn(clean.shape, generator=gen)  # (B, 3, S, S)
    return (clean + 0.5 * noise,), clean


def unet(
    *,
    depth: int = 3,
    channels: int = 16,
    image: int = 32,
    microbatch_size: int = 4,
    seed: int = 0,
) -> Workload:
    """GroupNorm U-Net denoising smooth random images (MSE); skips cross stages when cut."""
    if depth < 1 or image % 2**depth:
        raise ValueError(
            f"unet needs depth >= 1 and image divisible by 2**depth (depth: {depth}, "
            f"image: {image}); use an image side that is a multiple of {2 ** max(depth, 1)}"
        )
    torch.manual_seed(seed)
    model = UNet(depth, channels)
    make_batch = functools.partial(_noisy_images, image=image)
    return Workload(
        name="unet",
        model=model,
        example_args=make_batch(microbatch_size, 0)[0],
        loss_fn=F.mse_loss,
        make_batch=make_batch,
        microbatch_size=microbatch_size,
        layer_prefixes=(
            *(f"down.{i}" for i in range(depth)),
            "mid",
            *(f"up.{i}" for i in range(depth)),
        ),
    )
