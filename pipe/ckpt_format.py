"""The on-disk format of fxpipe checkpoints, and reading it safely.

A checkpoint folder holds version folders (step-NNNNNNNN-<hex>) and LATEST, the name of the newest
complete one. A version holds torch.distributed.checkpoint's files (.metadata, __R_0.distcp) and
fxpipe.json, the manifest, written last: the plan, the step, the state keys, the optimizer's
state by parameter name, and the size and SHA-256 of every file. Reading verifies every file,
unpickles DCP's metadata into DCP's own record types only and refuses pickled objects in the data,
so no pickled code runs; `agree` makes a failure on any rank the same CheckpointError on all.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import pickle
import re
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
import torch.distributed as dist
# (imported with pipe, before any process group is up: imported while one is, torch.distributed.checkpoint and FSDP
# keep that group's gloo threads after it is destroyed, measured in torch 2.13; a lazy import of them was reverted)
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import empty as dtensor_empty

from partition.errors import FxpipeError

if TYPE_CHECKING:
    from pipe.runtime import Pipeline

__all__ = ["CheckpointError", "FORMAT", "MANIFEST", "LATEST", "VERSION", "agree", "everywhere", "resolve",
           "read_manifest", "verify", "read_metadata", "dcp_load", "check_tensors", "check_model", "model_tensors",
           "optimizer_targets", "optimizer_state_dict", "dtype_named", "resolve_everywhere", "write_atomic",
           "sha256", "in_group", "share", "quiet", "dcp_error"]

FORMAT = 2
MANIFEST = "fxpipe.json"
LATEST = "LATEST"
VERSION = re.compile(r"step-\d{8}-[0-9a-f]{12}")


class CheckpointError(FxpipeError, ValueError):
    """A checkpoint that is incomplete, damaged, unsafe, or of another model; the message names the
    file, the check that failed and the fix. Raised alike on every rank."""


# ----- agreement: every rank raises the same error, or none does -----
def in_group() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def share() -> tuple[int, int]:
    """(global rank, world size): this rank's part of the job's files to write and to hash (with
    data-parallel replicas several ranks hold each pipeline rank)."""
    return (dist.get_rank(), dist.get_world_size()) if in_group() else (0, 1)


def agree(error: str | None) -> None:
    """Raise the first failing rank's CheckpointError on every rank (a collective call)."""
    errors: list[Any] = [error]
    if in_group():
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    for e in errors:
        if e is not None:
            raise CheckpointError(e)


def _collect(fn: Callable[[], Any]) -> tuple[Any, str | None]:
    try:
        return fn(), None
    except CheckpointError as e:
        return None, str(e)
    except Exception as e:  # noqa: BLE001 - any failure on one rank must reach every rank, never hang them
        return None, f"{type(e).__name__}: {e}"


def everywhere(fn: Callable[[], Any]) -> Any:
    """Run `fn` on every rank; when it fails on any, raise that error on all."""
    out, error = _collect(fn)
    agree(error)
    return out


# ----- files -----
def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` by a durable temporary file and one rename."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def resolve_everywhere(path: str | Path, optional: bool = False) -> Any:
    """`resolve` on rank 0, its answer (or its error) on every rank: all load one version, also
    while another job replaces LATEST (a collective call). `optional`: None where `path` is not
    an fxpipe checkpoint at all (a state dict file or a folder of shards)."""
    def mine() -> str:
        if in_group() and dist.get_rank() != 0:
            return ""
        p = Path(path)
        if optional and not (p.is_dir() and ((p / MANIFEST).is_file() or (p / LATEST).is_file()
                                             or (p / "manifest.json").is_file())):
            return ""
        return str(resolve(p))
    box = [everywhere(mine)]
    if in_group():
        dist.broadcast_object_list(box, src=0)
    return Path(box[0]) if box[0] else None


def resolve(path: str | Path) -> Path:
    """The complete version folder `path` stands for: its LATEST, or `path` itself when it is one."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    if (path / "manifest.json").is_file():
        raise CheckpointError(f"{path} was written by an earlier fxpipe (format 1, one .pt per rank), which "
                              "this version does not read; load it with that version and save it again")
    latest = path / LATEST
    if not latest.is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint (no {LATEST} and no {MANIFEST}); a save may "
                              "have been interrupted before its first version was complete: resume from an "
                              "earlier checkpoint, or check the path")
    name = latest.read_text().strip()
    if not VERSION.fullmatch(name):
        raise CheckpointError(f"{latest} names {name[:80]!r}, not a version folder (step-NNNNNNNN-<hex>); the file "
                              "is damaged: write the name of a complete version folder of it into it")
    folder = path / name
    if not (folder / MANIFEST).is_file():
        raise CheckpointError(f"{latest} names {name}, which has no {MANIFEST}: the version is incomplete or was "
                              "removed; write the name of another complete version folder into it")
    return folder


def read_manifest(folder: Path) -> dict[str, Any]:
    file = folder / MANIFEST
    try:
        m = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file} cannot be read as JSON ({type(e).__name__}: {e}); the manifest is "
                              "damaged: resume from an earlier checkpoint") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT or not isinstance(m.get("files"), dict):
        raise CheckpointError(f"{file} is not an fxpipe format-{FORMAT} manifest (format "
                              f"{m.get('format') if isinstance(m, dict) else None!r}); resume from a checkpoint "
                              "this version wrote")
    return m


def verify(folder: Path, manifest: dict[str, Any], share: tuple[int, int] = (0, 1)) -> None:
    """Check the size and hash of every file in the manifest; rank r of w hashes files r, r+w, ..."""
    rank, world = share
    for i, (name, info) in enumerate(sorted(manifest["files"].items())):
        f = folder / name
        if "/" in name or not f.is_file():
            raise CheckpointError(f"{f} is missing; the checkpoint is incomplete: resume from an earlier one")
        if f.stat().st_size != info["bytes"]:
            raise CheckpointError(f"{f} has {f.stat().st_size} bytes, its manifest says {info['bytes']}: the file is "
                                  "truncated or was replaced; resume from an earlier checkpoint")
        if i % world == rank and sha256(f) != info["sha256"]:
            raise CheckpointError(f"{f} does not match its SHA-256 in {MANIFEST}: the file is damaged or was "
                                  "swapped; resume from an earlier checkpoint")


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata records and nothing else (no pickled code runs)."""
    ALLOWED = {("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
        ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
        ("pathlib._local", "PosixPath"), ("pathlib._local", "WindowsPath"),  # Python 3.13's
        ("collections", "OrderedDict")}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refused to build {module}.{name}: DCP metadata holds only its own records")


def read_metadata(folder: Path) -> Metadata:
    file = folder / ".metadata"
    try:
        with open(file, "rb") as f:
            md = _MetadataUnpickler(f).load()
    except Exception as e:  # noqa: BLE001 - any failure to read it is a damaged or unsafe file
        raise CheckpointError(f"{file} cannot be read as DCP metadata ({type(e).__name__}: {e}); the file is "
                              "damaged or not a checkpoint's: resume from an earlier checkpoint") from None
    if not isinstance(md, Metadata):
        raise CheckpointError(f"{file} holds a {type(md).__name__}, not DCP metadata; resume from an earlier "
                              "checkpoint")
    return md


class _Reader(dcp.FileSystemReader):
    # no **kwargs: DCP would otherwise fall back, on the one rank whose read failed, to reading a
    # rank's own metadata without collectives, and the ranks' calls would no longer match
    def read_metadata(self, *args: Any) -> Metadata:
        return read_metadata(Path(self.path))


class _Planner(DefaultLoadPlanner):
    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        raise CheckpointError(f"the checkpoint holds a pickled object for {read_item.dest_index.fqn!r}; fxpipe "
                              "loads tensors only and never runs pickled code")


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """DCP warns on every call without a group that it assumes one process; that is meant here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def dcp_error(e: BaseException) -> str:
    """One line for a DCP failure: each failing rank's exception, without the tracebacks."""
    if isinstance(e, CheckpointException):
        parts = []
        for r, (exc, _) in sorted(e.failures.items()):
            if isinstance(exc, CheckpointError):
                return str(exc)
            parts.append(f"rank {r}: {type(exc).__name__}: {str(exc)[:200] or '(no message)'}")
        return "; ".join(parts)
    return f"{type(e).__name__}: {str(e)[:400]}"


def dcp_load(state: dict[str, torch.Tensor], folder: Path, no_dist: bool = False) -> None:
    """DCP loads `state` in place; its errors (gathered on every rank by DCP) become CheckpointError."""
    try:
        with quiet():
            dcp.load(state, storage_reader=_Reader(folder), planner=_Planner(), no_dist=no_dist or not in_group())
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # DCP's (a BaseException) holds every rank's failure
        raise CheckpointError(f"reading {folder} failed ({dcp_error(e)}); the checkpoint is damaged: resume "
                              "from an earlier one") from None


def check_tensors(md: Metadata, want: dict[str, torch.Tensor], folder: Path) -> None:
    """Every tensor asked for is a tensor of the checkpoint with the same shape."""
    for key, t in want.items():
        entry = md.state_dict_metadata.get(key)
        if entry is None:
            raise CheckpointError(f"{folder} holds no {key!r}; it was saved from another model or without it")
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(f"{folder} holds {key!r} as a pickled object, not a tensor; fxpipe never loads "
                                  "pickled objects: the checkpoint is not fxpipe's or was tampered with")
        if tuple(entry.size) != tuple(t.shape):
            raise CheckpointError(f"{folder} holds {key!r} of shape {list(entry.size)}, this model's is "
                                  f"{list(t.shape)}: the checkpoint is another model's; load it into the model "
                                  "it was saved from")



def model_tensors(pp: "Pipeline") -> dict[str, torch.Tensor]:
    """This rank's parameters and persistent buffers under `model.<original name>` (rank 0's: also those no
    stage reads)."""
    persistent = set(pp.state_key_names())
    out: dict[str, torch.Tensor] = {f"model.{n}": p for n, p in (*pp.named_parameters(),
                                                                  *pp.unread_parameters().items())}
    out.update({f"model.{k}": b for k, b in pp.local_buffers().items() if k in persistent})
    return out


def optimizer_names(named: dict[int, str], optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each parameter the optimizer steps, in its order; `named`: id(param) -> name."""
    order = [named.get(id(p)) for group in optimizer.param_groups for p in group["params"]]
    if any(n is None for n in order):
        raise CheckpointError("the optimizer holds parameters that are not this rank's stages' (built from "
                              "model.parameters(), it holds the whole model's); build it from pp.parameters()")
    return [str(n) for n in order]


def param_ids(pp: "Pipeline") -> dict[int, str]:
    return {id(p): n for n, p in pp.named_parameters()}



def key_difference(missing: list[str], unexpected: list[str]) -> str:
    said = []
    if missing:
        said.append(f"lacks {len(missing)} of this model's state keys ({', '.join(missing[:4])}"
                    f"{', ...' if len(missing) > 4 else ''})")
    if unexpected:
        said.append(f"holds {len(unexpected)} keys this model does not have ({', '.join(unexpected[:4])}"
                    f"{', ...' if len(unexpected) > 4 else ''})")
    return " and ".join(said)


def check_model(pp: "Pipeline", manifest: dict[str, Any], folder: Path) -> None:
    saved, mine = manifest["state_keys"], pp.state_key_names()
    if set(saved) != set(mine):
        raise CheckpointError(f"{folder} was saved from another model: it "
                              f"{key_difference(sorted(set(mine) - set(saved)), sorted(set(saved) - set(mine)))}; "
                              "load it into the model it was saved from")
    # the same keys tied otherwise (found by review: an untied model's head loaded into a model tying it to the
    # embedding was dropped, its optimizer state too, without a word)
    tied = [k for k in sorted(mine) if saved[k] != mine[k]]
    if tied:
        said = "; ".join(f"{k}: saved as {saved[k]}, read here as {mine[k]}" for k in tied[:3])
        more = " ..." if len(tied) > 3 else ""
        raise CheckpointError(f"{folder} ties its weights otherwise than this model ({said}{more}): its tensors are "
                              "not this model's; load it into a model that ties them as the saved one did (e.g. the "
                              "same tie_word_embeddings)")



def dtype_named(name: str, folder: Path) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"{folder / MANIFEST} names dtype {name!r}, which this torch does not have; load the "
                              "checkpoint with the torch version that saved it")
    return dtype


def optimizer_targets(named: dict[int, str], optimizer: torch.optim.Optimizer, manifest: dict[str, Any],
                       folder: Path) -> dict[str, torch.Tensor]:
    """Empty tensors for the optimizer's saved state, on its parameters' devices (`step` on the host)."""
    saved = manifest.get("optimizer")
    if saved is None:
        raise CheckpointError(f"{folder} holds no optimizer state; save it with pp.save(dir, optimizer=opt), or "
                              "load without optimizer=")
    if manifest.get("optimizer_class") != type(optimizer).__name__:
        raise CheckpointError(f"{folder} holds the state of a {manifest.get('optimizer_class')} optimizer, not of "
                              f"this {type(optimizer).__name__}; build the same optimizer class as when saving")
    param = {n: p for group in optimizer.param_groups for p in group["params"] for n in [named.get(id(p))]}
    out: dict[str, torch.Tensor] = {}
    for name in optimizer_names(named, optimizer):
        if name not in saved:
            raise CheckpointError(f"{folder} holds no optimizer state for {name}; the optimizer was built from "
                                  "other parameters than when saving: build it from pp.parameters()")
        p = param[name]
        for k, t in saved[name]["tensors"].items():
            dtype = dtype_named(t["dtype"], folder)
            if isinstance(p, DTensor) and list(t["shape"]) == list(p.shape):  # sharded like its parameter
                out[t["key"]] = dtensor_empty(t["shape"], dtype=dtype, device_mesh=p.device_mesh,
                                              placements=p.placements)
            else:
                out[t["key"]] = torch.empty(t["shape"], dtype=dtype, device=p.device if k != "step" else "cpu")
    return out


def optimizer_state_dict(named: dict[int, str], optimizer: torch.optim.Optimizer, manifest: dict[str, Any],
                         loaded: dict[str, torch.Tensor], outer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """The state dict for `optimizer.load_state_dict` from the state saved by parameter name; each of
    its groups takes the settings its parameters were saved with (its own `param_names` kept). A group holding
    none of them (ZeRO's shard of a group on another replica; `outer`: the ZeroRedundancyOptimizer) takes those of
    the outer group's parameters (found by review: it kept its fresh settings, a learning rate the scheduler
    had since changed)."""
    saved = manifest["optimizer"]
    names = optimizer_names(named, optimizer)
    state: dict[int, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    index = 0
    for group in optimizer.param_groups:
        settings = None
        for _ in group["params"]:
            entry = saved[names[index]]
            if settings is not None and entry["group"] != settings:
                raise CheckpointError(f"the optimizer's group holding {names[index]} mixes parameters saved with "
                                      "different settings; build the optimizer's groups as when saving")
            settings = entry["group"]
            s = dict(entry["scalars"])
            s.update({k: loaded[t["key"]] for k, t in entry["tensors"].items()})
            if s:
                state[index] = s
            index += 1
        mine = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        if settings is None and outer is not None and len(outer.param_groups) == len(optimizer.param_groups):
            whole = outer.param_groups[len(groups)]["params"]
            settings = next((saved[named[id(p)]]["group"] for p in whole if named.get(id(p)) in saved), None)
        groups.append({**(settings if settings is not None else mine),
                       "params": list(range(index - len(group["params"]), index)),
                       **({"param_names": group["param_names"]} if "param_names" in group else {})})
    return {"state": state, "param_groups": groups}
