"""A full state dict of the unpartitioned model: out of a checkpoint (one process), into a
pipeline (from a .pt, a .safetensors, a folder of Hugging Face shards or a checkpoint, each rank
reading only its tensors), and exported as one file."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pipe.ckpt_format import (CheckpointError, check_model, check_tensors, dcp_load, optimizer_state_dict, share,
                              resolve_everywhere, everywhere, key_difference, model_tensors, optimizer_targets,
                              read_manifest, read_metadata, resolve, verify)
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

if TYPE_CHECKING:
    from pipe.runtime import Pipeline

__all__ = ["load_full_state_dict", "load_full_optimizer_state", "load_model_state", "export"]

def load_full_state_dict(path: str | Path, *, allow_nonfinite: bool = False) -> dict[str, torch.Tensor]:
    """The unpartitioned model's state dict from a checkpoint, on one process (no group needed).

    Every file is verified first; every key of the model's state dict is present (tied names
    share one tensor, as in the model); a NaN or infinite value is an error unless
    `allow_nonfinite` (a model saved after its loss diverged, say).
    """
    folder = resolve(path)
    manifest = read_manifest(folder)
    verify(folder, manifest)
    md = read_metadata(folder)
    sources = sorted(set(manifest["state_keys"].values()))
    targets = {}
    for name in sources:
        entry = md.state_dict_metadata.get(f"model.{name}")
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(f"{folder} holds no tensor for {name!r}; the checkpoint is damaged")
        targets[f"model.{name}"] = torch.full(tuple(entry.size), math.nan, dtype=entry.properties.dtype) if (
            entry.properties.dtype.is_floating_point) else torch.zeros(tuple(entry.size), dtype=entry.properties.dtype)
    dcp_load(targets, folder, no_dist=True)
    out = {}
    for key, name in manifest["state_keys"].items():
        t = targets[f"model.{name}"]
        if not allow_nonfinite and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise CheckpointError(f"{folder}: {key} holds NaN or infinite values; the model was saved so (or the "
                                  "file is damaged): pass allow_nonfinite=True to load it anyway")
        out[key] = t
    return out


def load_full_optimizer_state(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load the checkpoint's optimizer state into `optimizer`, built from `model.parameters()` of
    the unpartitioned model, on one process (no group needed); returns the step saved."""
    folder = resolve(path)
    manifest = read_manifest(folder)
    verify(folder, manifest)
    named = {id(p): n for n, p in model.named_parameters()}
    targets = optimizer_targets(named, optimizer, manifest, folder)
    check_tensors(read_metadata(folder), targets, folder)
    dcp_load(targets, folder, no_dist=True)
    optimizer.load_state_dict(optimizer_state_dict(named, optimizer, manifest, targets))
    return int(manifest["step"])


# ----- a full state dict of the unpartitioned model, into a pipeline -----
class _Source:
    """Tensors by name from a .pt/.bin, a .safetensors or a folder of Hugging Face shards."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.files: dict[str, Path] = {}   # key -> file holding it
        self._open: dict[Path, Any] = {}
        p = self.path
        if p.is_dir():
            for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
                if (p / index).is_file():
                    try:
                        weight_map = json.loads((p / index).read_text())["weight_map"]
                    except (OSError, ValueError, KeyError, TypeError) as e:
                        raise CheckpointError(f"{p / index} is not a shard index ({type(e).__name__}: {e}); the "
                                              "file is damaged") from None
                    self.files = {k: p / v for k, v in weight_map.items()}
                    break
            else:
                single = [p / n for n in ("model.safetensors", "pytorch_model.bin") if (p / n).is_file()]
                if not single:
                    raise CheckpointError(f"{p} holds no model.safetensors, pytorch_model.bin, shard index or fxpipe "
                                          "checkpoint; give one of those or a .pt/.safetensors file")
                self.files = {k: single[0] for k in self._keys_of(single[0])}
        elif p.is_file():
            self.files = {k: p for k in self._keys_of(p)}
        else:
            raise CheckpointError(f"{p} does not exist; give a .pt, .safetensors, a folder of shards or a checkpoint")
        self.keys = set(self.files)

    @staticmethod
    def _safetensors(f: Path) -> bool:
        return f.suffix == ".safetensors"

    def _handle(self, f: Path) -> Any:
        if f not in self._open:
            if not f.is_file():
                raise CheckpointError(f"{f} is missing (named by the shard index of {self.path})")
            try:
                if self._safetensors(f):
                    from safetensors import safe_open
                    self._open[f] = safe_open(str(f), framework="pt")
                else:
                    try:  # mapped, so a rank reads only the tensors it asks for
                        self._open[f] = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
                    except RuntimeError as e:
                        if "mmap" not in str(e):
                            raise
                        self._open[f] = torch.load(f, map_location="cpu", weights_only=True)  # a legacy .pt
            except Exception as e:  # noqa: BLE001 - torch.load refuses pickled code; all is a damaged file
                raise CheckpointError(f"{f} cannot be read as a state dict ({type(e).__name__}: {str(e)[:300]}); "
                                      "the file is damaged or holds pickled objects, which are never loaded") from None
            if not self._safetensors(f) and not isinstance(self._open[f], dict):
                raise CheckpointError(f"{f} holds a {type(self._open[f]).__name__}, not a state dict")
        return self._open[f]

    def _keys_of(self, f: Path) -> list[str]:
        return list(self._handle(f).keys())

    def shape(self, key: str) -> tuple[int, ...]:
        h = self._handle(self.files[key])
        if self._safetensors(self.files[key]):
            return tuple(h.get_slice(key).get_shape())
        t = h[key]
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"{self.files[key]}: {key} is a {type(t).__name__}, not a tensor")
        return tuple(t.shape)

    def get(self, key: str) -> torch.Tensor:
        h = self._handle(self.files[key])
        return h.get_tensor(key) if self._safetensors(self.files[key]) else h[key]


def load_model_state(pp: "Pipeline", path: str | Path) -> None:
    """Load a state dict of the unpartitioned model into the pipeline (a collective call), strictly:
    every key of the model (a tied weight under any of its names), no key it lacks, the same
    shapes. `path`: a .pt/.bin (read with weights_only and mmap), a .safetensors, a folder of
    Hugging Face shards (model.safetensors.index.json or pytorch_model.bin.index.json, or one
    model.safetensors / pytorch_model.bin), or an fxpipe checkpoint. Each rank reads only the
    tensors its stages hold."""
    names = pp.state_key_names()
    aliases: dict[str, list[str]] = {}
    for key, first in names.items():
        aliases.setdefault(first, []).append(key)

    folder = resolve_everywhere(path, optional=True)  # an fxpipe checkpoint: the version rank 0 resolved

    def check() -> dict[str, torch.Tensor]:
        """This rank's tensors, read and checked before anything changes."""
        if folder is not None:
            manifest = read_manifest(folder)
            check_model(pp, manifest, folder)
            verify(folder, manifest, share())
            model = model_tensors(pp)
            check_tensors(read_metadata(folder), model, folder)
            return {k: torch.empty_like(t.detach(), device="cpu") for k, t in model.items()}
        src = _Source(path)
        unexpected = sorted(src.keys - set(names))
        missing = sorted(first for first, keys in aliases.items() if not any(k in src.keys for k in keys))
        if unexpected or missing:
            raise CheckpointError(f"{path} does not match this model: it {key_difference(missing, unexpected)}; "
                                  "load a state dict of this model (strip or add a prefix to its keys if that "
                                  "is all that differs)")
        loaded = {}
        for k, t in model_tensors(pp).items():
            present = [a for a in aliases[k.removeprefix("model.")] if a in src.keys]
            if src.shape(present[0]) != tuple(t.shape):
                raise CheckpointError(f"{path}: {present[0]} has shape {list(src.shape(present[0]))}, this model's "
                                      f"is {list(t.shape)}; load a state dict of this model")
            loaded[k] = src.get(present[0])
            for other in present[1:]:  # names the model ties must hold one value
                if not torch.equal(src.get(other), loaded[k]):
                    raise CheckpointError(f"{path} holds different values for {present[0]} and {other}, which this "
                                          "model ties (one tensor); load a state dict of a model with the same ties")
        return loaded

    targets = everywhere(check)
    if folder is not None:
        dcp_load(targets, folder)

    def apply() -> None:
        with torch.no_grad():
            for k, t in model_tensors(pp).items():
                t.copy_(targets[k])
    everywhere(apply)


# ----- one file of the unpartitioned model -----
def export(path: str | Path, to: str | Path, *, allow_nonfinite: bool = False) -> Path:
    """Write the checkpoint's model as one .safetensors or .pt file (every state key, loadable with
    model.load_state_dict(..., strict=True)); returns the file."""
    to = Path(to)
    if to.suffix not in (".safetensors", ".pt", ".bin"):
        raise CheckpointError(f"--to {to} must end in .safetensors, .pt or .bin")
    state = load_full_state_dict(path, allow_nonfinite=allow_nonfinite)
    to.parent.mkdir(parents=True, exist_ok=True)
    tmp = to.with_name(to.name + ".tmp")
    if to.suffix == ".safetensors":
        from safetensors.torch import save_file
        seen: dict[int, str] = {}
        flat = {}
        for k, t in state.items():  # a tied tensor once per name, as separate tensors
            flat[k] = t.clone() if id(t) in seen else t.contiguous()
            seen.setdefault(id(t), k)
        save_file(flat, str(tmp), metadata={"format": "pt"})
    else:
        torch.save(state, tmp)
    os.replace(tmp, to)
    return to
