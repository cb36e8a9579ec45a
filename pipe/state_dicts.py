"""A full state dict of the unpartitioned model: out of a checkpoint (one process), into a
pipeline (from a .pt, a .safetensors, a folder of Hugging Face shards or a checkpoint, each rank
reading only its tensors), and exported as one file."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from pipe import hf_keys
from pipe.ckpt_format import (CheckpointError, check_model, check_tensors, dcp_load, optimizer_state_dict, share,
                              resolve_everywhere, everywhere, key_difference, model_tensors, optimizer_targets,
                              read_manifest, read_metadata, resolve, verify)
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

if TYPE_CHECKING:
    from pipe.runtime import Pipeline

__all__ = ["load_full_state_dict", "load_full_optimizer_state", "load_model_state", "export", "full_state_dict"]

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
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
                       "F8_E5M2": torch.float8_e5m2}


class _Safetensors:
    """One .safetensors file, read tensor by tensor with plain reads (the format: an 8-byte little-endian
    header size, a JSON header of dtype, shape and byte offsets per tensor, then the data). Not mapped:
    a mapped file's pages count in the reader's resident set as long as the mapping lives, so reading a
    rank's share through a mapping would hold it twice."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 0 < size < 1 << 30:
                raise ValueError(f"a header of {size} bytes")
            header = json.loads(f.read(size))
        self.start = 8 + size
        self.entries = {k: v for k, v in header.items() if k != "__metadata__"}
        for k, v in self.entries.items():
            if v.get("dtype") not in _SAFETENSORS_DTYPES:
                raise ValueError(f"{k} has dtype {v.get('dtype')!r}, which fxpipe does not read")

    def keys(self) -> list[str]:
        return list(self.entries)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.entries[key]["shape"])

    def read_into(self, key: str, dst: torch.Tensor) -> bool:
        """Read `key` straight into `dst` when `dst` can take its bytes as they are (a contiguous host
        tensor of its dtype and shape); False when it cannot (read with get_tensor and copy then)."""
        e = self.entries[key]
        if (dst.device.type != "cpu" or not dst.is_contiguous() or dst.dtype != _SAFETENSORS_DTYPES[e["dtype"]]
                or list(dst.shape) != list(e["shape"]) or dst.numel() == 0):
            return False
        lo, hi = e["data_offsets"]
        with torch.no_grad(), open(self.path, "rb") as f:
            f.seek(self.start + lo)
            if f.readinto(dst.detach().reshape(-1).view(torch.uint8).numpy().data) != hi - lo:
                raise CheckpointError(f"{self.path} ends inside {key}; the file is damaged")
        return True

    def get_tensor(self, key: str) -> torch.Tensor:
        e = self.entries[key]
        lo, hi = e["data_offsets"]
        buf = bytearray(hi - lo)
        with open(self.path, "rb") as f:
            f.seek(self.start + lo)
            if f.readinto(buf) != hi - lo:
                raise CheckpointError(f"{self.path} ends inside {key}; the file is damaged")
        dtype = _SAFETENSORS_DTYPES[e["dtype"]]
        flat = torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype)
        return flat.reshape(e["shape"])


class _Source:
    """Tensors by name from a dict, a .pt/.bin, a .safetensors, a folder of Hugging Face shards or a
    torch.distributed.checkpoint folder (not fxpipe's: those go through the manifest)."""

    def __init__(self, path: str | Path | Mapping[str, torch.Tensor]) -> None:
        self.files: dict[str, Path] = {}   # key -> file holding it
        self._open: dict[Path, Any] = {}
        self._dict: Mapping[str, torch.Tensor] | None = None
        self._dcp: Any = None  # the DCP folder's metadata
        if isinstance(path, Mapping):
            bad = [k for k, v in path.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
            if bad:
                raise CheckpointError(f"the state dict given maps {bad[:4]} to something other than a tensor; give "
                                      "a dict of parameter and buffer names to tensors (model.state_dict())")
            self._dict, self.path, self.keys = path, Path("the state dict given"), set(path)
            return
        self.path = Path(path)
        p = self.path
        if p.is_dir() and (p / ".metadata").is_file() and not any((p / n).exists() for n in (
                "model.safetensors.index.json", "pytorch_model.bin.index.json")):
            self._dcp = read_metadata(p)
            self.keys = {k for k, v in self._dcp.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
            return
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
                    self._open[f] = _Safetensors(f)
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
        if self._dict is not None:
            return tuple(self._dict[key].shape)
        if self._dcp is not None:
            return tuple(self._dcp.state_dict_metadata[key].size)
        h = self._handle(self.files[key])
        if self._safetensors(self.files[key]):
            return h.shape(key)
        t = h[key]
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"{self.files[key]}: {key} is a {type(t).__name__}, not a tensor")
        return tuple(t.shape)

    def get(self, key: str) -> torch.Tensor:
        if self._dict is not None:
            return self._dict[key]
        if self._dcp is not None:
            return self.read([key])[key]
        h = self._handle(self.files[key])
        return h.get_tensor(key) if self._safetensors(self.files[key]) else h[key]

    def copy_into(self, key: str, dst: torch.Tensor) -> None:
        """dst <- the tensor `key`; a .safetensors file is read straight into a host tensor."""
        if not (self._dict is None and self._dcp is None and self._safetensors(self.files[key])
                and self._handle(self.files[key]).read_into(key, dst)):
            dst.copy_(self.get(key))

    @property
    def batched(self) -> bool:
        """Whether tensors are best read together (a DCP folder) rather than one at a time."""
        return self._dcp is not None

    def read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """The tensors of `keys` (a DCP folder reads them in one pass, only those)."""
        if self._dcp is None:
            return {k: self.get(k) for k in keys}
        entries = self._dcp.state_dict_metadata
        out = {k: torch.empty(tuple(entries[k].size), dtype=entries[k].properties.dtype) for k in keys}
        dcp_load(out, self.path, no_dist=True)
        return out


def load_model_state(pp: "Pipeline", path: str | Path | Mapping[str, torch.Tensor]) -> str | None:
    """Load a state dict of the unpartitioned model into the pipeline (a collective call), strictly:
    every key of the model (a tied weight under any of its names), no key it lacks, the same
    shapes. `path`: a .pt/.bin (read with weights_only and mmap), a .safetensors, a folder of
    Hugging Face shards (model.safetensors.index.json or pytorch_model.bin.index.json, or one
    model.safetensors / pytorch_model.bin), an fxpipe checkpoint or another torch.distributed.checkpoint
    folder, or a dict. Each rank reads only the tensors its stages hold; every key and shape is
    checked before any tensor changes, then a file's tensors are read and copied one at a time. A
    Hugging Face checkpoint whose keys are not the model's is read as transformers' from_pretrained
    reads it (pipe.hf_keys); returns what was so read, or None."""
    names = pp.state_key_names()
    aliases: dict[str, list[str]] = {}
    for key, first in names.items():
        aliases.setdefault(first, []).append(key)

    # an fxpipe checkpoint: the version rank 0 resolved
    folder = None if isinstance(path, Mapping) else resolve_everywhere(path, optional=True)
    where = "the state dict given" if isinstance(path, Mapping) else str(path)
    read_as: list[str] = []  # how a Hugging Face checkpoint's keys were read (pipe.hf_keys)
    ignored: list[str] = []  # its keys from_pretrained skips for this model

    def check() -> dict[str, Any]:
        """This rank's tensors, read and checked before anything changes."""
        if folder is not None:
            manifest = read_manifest(folder)
            check_model(pp, manifest, folder)
            verify(folder, manifest, share())
            model = model_tensors(pp)
            check_tensors(read_metadata(folder), model, folder)
            return {k: torch.empty_like(t.detach(), device="cpu") for k, t in model.items()}
        src: Any = _Source(path)

        def difference(keys: set[str]) -> str:
            skipped = hf_keys.ignored_on_load(pp._model, keys - set(names))  # as from_pretrained does
            if skipped and not ignored:
                ignored.extend(skipped)
            unexpected = sorted(keys - set(names) - set(skipped))
            missing = sorted(first for first, ks in aliases.items() if not any(k in keys for k in ks))
            return key_difference(missing, unexpected) if unexpected or missing else ""
        differs = difference(src.keys)
        view = hf_keys.converted(src, pp._model, set(names)) if differs else None
        if view is not None:  # a Hugging Face checkpoint in an older layout, or of the base model
            if difference(view.keys):
                raise CheckpointError(f"{where} does not match this model: it {differs}, and it "
                                      f"{difference(view.keys)} {view.describe()}; load a state dict of this model")
            src, differs = view, ""
            read_as.append(view.describe())
        if differs:
            raise CheckpointError(f"{where} does not match this model: it {differs}; load a state dict of this model "
                                  "(strip or add a prefix to its keys if that is all that differs)")
        first = {}
        wrong = []
        for k, t in model_tensors(pp).items():
            present = [a for a in aliases[k.removeprefix("model.")] if a in src.keys]
            if src.shape(present[0]) != tuple(t.shape):
                wrong.append(f"{present[0]} has shape {list(src.shape(present[0]))}, this model's {list(t.shape)}")
            first[k] = present
        if wrong:
            raise CheckpointError(f"{where} does not match this model's shapes: {'; '.join(wrong[:4])}"
                                  f"{' (and more)' if len(wrong) > 4 else ''}; load a state dict of this model")
        for present in first.values():  # names the model ties must hold one value
            for other in present[1:]:
                if not torch.equal(src.get(other), src.get(present[0])):
                    raise CheckpointError(f"{where} holds different values for {present[0]} and {other}, which this "
                                          "model ties (one tensor); load a state dict of a model with the same ties")
        if src.batched:  # a DCP folder: this rank's tensors in one read
            values = src.read([present[0] for present in first.values()])
            return {k: values[present[0]] for k, present in first.items()}
        # each read when copied, straight into its tensor where it can be
        return {k: lambda dst, key=present[0]: src.copy_into(key, dst) for k, present in first.items()}

    targets = everywhere(check)
    if folder is not None:
        dcp_load(targets, folder)

    def apply() -> None:
        """Copy in, one tensor at a time (a file's tensor is read, copied and dropped in turn)."""
        with torch.no_grad():
            for k, t in model_tensors(pp).items():
                value = targets[k]
                if callable(value):
                    value(t)
                else:
                    t.copy_(value)
    everywhere(apply)
    if ignored:
        read_as.append(f"{len(ignored)} key{'s' if len(ignored) > 1 else ''} the model's class skips on loading, "
                       f"as from_pretrained does ({', '.join(ignored[:3])}{', ...' if len(ignored) > 3 else ''}), "
                       "not read")
    return "; ".join(read_as) if read_as else None


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


def full_state_dict(pp: Pipeline) -> dict[str, torch.Tensor] | None:
    """pp.full_state_dict: on rank 0, a state dict that loads into the unpartitioned model (every rank's
    tensors gathered); None on other ranks."""
    held = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu()
            for n, p in pp.named_parameters()}
    held.update({k: t.detach().cpu() for k, t in (*pp.unread_parameters().items(), *pp.local_buffers().items())})
    mine = {k: held[first] for k, first in pp.state_key_names().items() if first in held}
    parts: list[Any] = [None] * pp.world
    if pp.world > 1:
        dist.all_gather_object(parts, mine, group=pp.pp_group)
    else:
        parts = [mine]
    if pp.rank != 0:
        return None
    full = {k: v.detach().cpu().clone() for k, v in pp._model.state_dict().items() if not v.is_meta}
    for part in parts:
        full.update(part)
    return full
