"""Checkpoints of a pipeline through torch.distributed.checkpoint (DCP), by original names.

Every tensor is saved under the model's own name (`model.<name>`, optimizer state as
`optim.<param name>.<key>`), so a checkpoint any plan saved loads into a pipeline of any other
plan of the same model (stage count, boundaries, world size, schedule, memory features): each
rank reads exactly the tensors its stages hold (DCP's resharding), and a weight two stages
share is written once (DCP deduplicates a name saved by several ranks).

On disk, `pp.save("ckpt")` writes a fresh version folder and then points at it:

    ckpt/LATEST                           the name of the newest complete version
    ckpt/step-00000120-1f2e3d4c5b6a/      .metadata and __R_0.distcp (DCP), fxpipe.json

`fxpipe.json` (plan, step, names, the size and SHA-256 of every file) is written last, so a
folder without it is never taken for complete; `LATEST` is replaced by one atomic rename after
that, so an interrupted save (at any point, between any two renames) leaves the previous
checkpoint the one loaded. The next save removes what interrupted saves left.

Loading verifies every file against the manifest (the ranks share the hashing), reads DCP's
metadata with an unpickler that builds only DCP's own record types, and refuses pickled
objects in the data, so no pickled code ever runs; any failure is raised as the same
`CheckpointError` on every rank, after which the ranks are in step and may go on.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import os
import pickle
import random
import re
import shutil
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from partition.errors import FxpipeError

if TYPE_CHECKING:
    from partition.plan import Plan
    from pipe.runtime import Pipeline

__all__ = ["save", "load", "load_full_state_dict", "load_full_optimizer_state", "load_model_state", "read_plan",
           "read_extra", "export", "CheckpointError", "Loaded", "MANIFEST", "LATEST"]

FORMAT = 2
MANIFEST = "fxpipe.json"
LATEST = "LATEST"
_VERSION = re.compile(r"step-\d{8}-[0-9a-f]{12}")


class CheckpointError(FxpipeError, ValueError):
    """A checkpoint that is incomplete, damaged, unsafe, or of another model; the message names the
    file, the check that failed and the fix. Raised alike on every rank."""


@dataclass
class Loaded:
    """What `load` restored: the step to resume at, the loop's extra state, the version folder."""
    step: int
    extra: dict[str, Any] = field(default_factory=dict)
    folder: str = ""


# ----- agreement: every rank raises the same error, or none does -----
def _group() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _agree(error: str | None) -> None:
    """Raise the first failing rank's CheckpointError on every rank (a collective call)."""
    errors: list[Any] = [error]
    if _group():
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
    except (OSError, ValueError, TypeError, KeyError, RuntimeError, pickle.UnpicklingError) as e:
        return None, f"{type(e).__name__}: {e}"


def _everywhere(fn: Callable[[], Any]) -> Any:
    """Run `fn` on every rank; when it fails on any, raise that error on all."""
    out, error = _collect(fn)
    _agree(error)
    return out


# ----- files -----
def _sha256(path: Path) -> str:
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


def _write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` by a durable temporary file and one rename."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


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
    if not _VERSION.fullmatch(name):
        raise CheckpointError(f"{latest} names {name[:80]!r}, not a version folder (step-NNNNNNNN-<hex>); the file "
                              "is damaged: write the name of a complete version folder of it into it")
    folder = path / name
    if not (folder / MANIFEST).is_file():
        raise CheckpointError(f"{latest} names {name}, which has no {MANIFEST}: the version is incomplete or was "
                              "removed; write the name of another complete version folder into it")
    return folder


def _manifest(folder: Path) -> dict[str, Any]:
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


def _verify(folder: Path, manifest: dict[str, Any], share: tuple[int, int] = (0, 1)) -> None:
    """Check the size and hash of every file in the manifest; rank r of w hashes files r, r+w, ..."""
    rank, world = share
    for i, (name, info) in enumerate(sorted(manifest["files"].items())):
        f = folder / name
        if "/" in name or not f.is_file():
            raise CheckpointError(f"{f} is missing; the checkpoint is incomplete: resume from an earlier one")
        if f.stat().st_size != info["bytes"]:
            raise CheckpointError(f"{f} has {f.stat().st_size} bytes, its manifest says {info['bytes']}: the file is "
                                  "truncated or was replaced; resume from an earlier checkpoint")
        if i % world == rank and _sha256(f) != info["sha256"]:
            raise CheckpointError(f"{f} does not match its SHA-256 in {MANIFEST}: the file is damaged or was "
                                  "swapped; resume from an earlier checkpoint")


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata records and nothing else (no pickled code runs)."""
    ALLOWED = {("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
        ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
        ("collections", "OrderedDict")}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refused to build {module}.{name}: DCP metadata holds only its own records")


def _metadata(folder: Path) -> Metadata:
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
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return _metadata(Path(self.path))


class _Planner(DefaultLoadPlanner):
    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        raise CheckpointError(f"the checkpoint holds a pickled object for {read_item.dest_index.fqn!r}; fxpipe "
                              "loads tensors only and never runs pickled code")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns on every call without a group that it assumes one process; that is meant here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _dcp_error(e: BaseException) -> str:
    """One line for a DCP failure: each failing rank's exception, without the tracebacks."""
    if isinstance(e, CheckpointException):
        parts = []
        for r, (exc, _) in sorted(e.failures.items()):
            if isinstance(exc, CheckpointError):
                return str(exc)
            parts.append(f"rank {r}: {type(exc).__name__}: {str(exc)[:200] or '(no message)'}")
        return "; ".join(parts)
    return f"{type(e).__name__}: {str(e)[:400]}"


def _dcp_load(state: dict[str, torch.Tensor], folder: Path, no_dist: bool = False) -> None:
    """DCP loads `state` in place; its errors (gathered on every rank by DCP) become CheckpointError."""
    try:
        with _quiet():
            dcp.load(state, storage_reader=_Reader(folder), planner=_Planner(), no_dist=no_dist or not _group())
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # DCP's (a BaseException) holds every rank's failure
        raise CheckpointError(f"reading {folder} failed ({_dcp_error(e)}); the checkpoint is damaged: resume "
                              "from an earlier one") from None


def _check_tensors(md: Metadata, want: dict[str, torch.Tensor], folder: Path) -> None:
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


# ----- what is saved -----
def _rng_state(rank: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    version, state, gauss = random.getstate()
    tensors = {f"rng.{rank}.torch": torch.get_rng_state(), f"rng.{rank}.python": torch.tensor(state, dtype=torch.int64)}
    if torch.cuda.is_available():
        for i, t in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.{rank}.cuda.{i}"] = t
    return tensors, {"python_version": version, "python_gauss": gauss}


def _set_rng_state(tensors: dict[str, torch.Tensor], info: dict[str, Any], rank: int) -> None:
    torch.set_rng_state(tensors[f"rng.{rank}.torch"])
    random.setstate((info["python_version"], tuple(int(x) for x in tensors[f"rng.{rank}.python"].tolist()),
                     info["python_gauss"]))
    cuda = [tensors[k] for k in sorted(tensors) if k.startswith(f"rng.{rank}.cuda.")]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


def _json(x: Any, where: str) -> Any:
    try:
        text = json.dumps(x, allow_nan=True)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where} cannot be saved ({e}); pass numbers, strings, lists, dicts and "
                              "tensors") from None
    return json.loads(text)


def _encode_extra(extra: Any, tensors: dict[str, torch.Tensor], path: str = "extra") -> Any:
    """The loop's extra state as JSON, its tensors moved to `tensors` (saved by DCP)."""
    if isinstance(extra, torch.Tensor):
        key = f"extra.{len(tensors)}"
        tensors[key] = extra.detach().cpu()
        return {"__tensor__": key}
    if isinstance(extra, dict):
        if not all(isinstance(k, str) for k in extra):
            bad = [k for k in extra if not isinstance(k, str)][:3]
            raise CheckpointError(f"{path} has keys that are not strings: {bad}; use string keys in extra=")
        return {k: _encode_extra(v, tensors, f"{path}[{k!r}]") for k, v in extra.items()}
    if isinstance(extra, (list, tuple)):
        return [_encode_extra(v, tensors, f"{path}[{i}]") for i, v in enumerate(extra)]
    if extra is None or isinstance(extra, (bool, int, float, str)):
        return extra
    raise CheckpointError(f"{path} is a {type(extra).__name__}, which a checkpoint does not pickle; pass numbers, "
                          "strings, lists, dicts and tensors (a scheduler's state_dict(), say)")


def _decode_extra(x: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(x, dict):
        if set(x) == {"__tensor__"}:
            return tensors[x["__tensor__"]]
        return {k: _decode_extra(v, tensors) for k, v in x.items()}
    if isinstance(x, list):
        return [_decode_extra(v, tensors) for v in x]
    return x


def _extra_tensors(manifest: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: torch.empty(v["shape"], dtype=getattr(torch, v["dtype"])) for k, v in manifest["extra_tensors"].items()}


def _model_tensors(pp: "Pipeline") -> dict[str, torch.Tensor]:
    """This rank's parameters and persistent buffers under `model.<original name>`."""
    persistent = set(pp.state_key_names())
    out: dict[str, torch.Tensor] = {f"model.{n}": p for n, p in pp.named_parameters()}
    out.update({f"model.{k}": b for k, b in pp.local_buffers().items() if k in persistent})
    return out


def _optimizer_names(named: dict[int, str], optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each parameter the optimizer steps, in its order; `named`: id(param) -> name."""
    order = [named.get(id(p)) for group in optimizer.param_groups for p in group["params"]]
    if any(n is None for n in order):
        raise CheckpointError("the optimizer holds parameters that are not the model's; build it from "
                              "pp.parameters() (or model.parameters())")
    return [str(n) for n in order]


def _ids(pp: "Pipeline") -> dict[int, str]:
    return {id(p): n for n, p in pp.named_parameters()}


def _optimizer_state(pp: "Pipeline", optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor]
                     ) -> dict[str, Any]:
    """Per parameter name: its group's settings, its scalar state; its tensor state into `tensors`."""
    names = _optimizer_names(_ids(pp), optimizer)
    osd = optimizer.state_dict()
    out: dict[str, Any] = {}
    for group in osd["param_groups"]:
        settings = _json({k: v for k, v in group.items() if k != "params"}, f"the optimizer's settings {group}")
        for i in group["params"]:
            name = names[i]
            entry: dict[str, Any] = {"group": settings, "scalars": {}, "tensors": {}}
            for k, v in osd["state"].get(i, {}).items():
                if isinstance(v, torch.Tensor):
                    key = f"optim.{name}.{k}"
                    tensors[key] = v.detach()
                    entry["tensors"][k] = {"key": key, "shape": list(v.shape),
                                           "dtype": str(v.dtype).removeprefix("torch.")}
                else:
                    entry["scalars"][k] = _json(v, f"the optimizer state {k!r} of {name}")
            out[name] = entry
    return out


# ----- save -----
def save(pp: "Pipeline", path: str | Path, optimizer: torch.optim.Optimizer | None = None,
         extra: dict[str, Any] | None = None, keep: int = 1) -> Path:
    """Write the pipeline's state to `path` (a collective call: every rank calls it alike).

    Saved: parameters and persistent buffers by original name, the optimizer's state and settings
    by parameter name, the step, every rank's random-number state, the plan, and `extra` (the
    training loop's own state: numbers, strings, lists, dicts and tensors, as rank 0 has it).
    `keep` complete versions stay (the newest; older ones and the leftovers of interrupted saves
    are removed). Returns the version folder.
    """
    path = Path(path)
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise CheckpointError(f"keep={keep!r} must be a positive number of versions to keep, e.g. keep=1")
    box = [uuid.uuid4().hex[:12]]
    if _group():
        dist.broadcast_object_list(box, src=0)
    folder = path / f"step-{pp.steps_done:08d}-{box[0]}"
    tensors: dict[str, torch.Tensor] = {}

    def prepare() -> dict[str, Any]:
        if (path / MANIFEST).is_file():
            raise CheckpointError(f"{path} is a version folder of a checkpoint; save to the checkpoint's folder "
                                  f"({path.parent}) or to a new one")
        tensors.update(_model_tensors(pp))
        rng, rng_info = _rng_state(pp.rank)
        tensors.update(rng)
        info: dict[str, Any] = {"rng": rng_info, "optimizer": None, "extra": None}
        if optimizer is not None:
            info["optimizer"] = _optimizer_state(pp, optimizer, tensors)
            info["optimizer_class"] = type(optimizer).__name__
        if pp.rank == 0:
            extra_tensors: dict[str, torch.Tensor] = {}
            info["extra"] = _encode_extra(dict(extra or {}), extra_tensors)
            info["extra_tensors"] = {k: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                                     for k, t in extra_tensors.items()}
            tensors.update(extra_tensors)
            folder.mkdir(parents=True)
        return info

    info = _everywhere(prepare)
    try:
        with _quiet():
            dcp.save(tensors, storage_writer=dcp.FileSystemWriter(folder, sync_files=True), no_dist=not _group())
        error = None
    except (Exception, CheckpointException) as e:  # DCP gathers every rank's failure and raises it on all
        error = f"writing {folder} failed ({_dcp_error(e)}); check the disk has room and the folder is writable"
    _agree(error)

    def hashes() -> dict[str, Any]:
        mine = sorted(folder.glob(f"__{pp.rank}_*.distcp")) + ([folder / ".metadata"] if pp.rank == 0 else [])
        return {f.name: {"bytes": f.stat().st_size, "sha256": _sha256(f)} for f in mine}
    files = _everywhere(hashes)
    everyone: list[Any] = [(files, info)]
    if _group():
        everyone = [None] * pp.world
        dist.all_gather_object(everyone, (files, info))

    def commit() -> None:
        if pp.rank != 0:
            return
        manifest: dict[str, Any] = {
            "format": FORMAT, "step": pp.steps_done, "world_size": pp.world, "schedule": pp.schedule_name,
            "microbatches": pp.M, "stages_per_rank": pp.v, "plan": pp.plan.to_dict(),
            "state_keys": pp.state_key_names(), "files": {}, "rng": [i["rng"] for _, i in everyone],
            "optimizer": None, "optimizer_class": None, "extra": info["extra"], "extra_tensors": info["extra_tensors"]}
        for f, i in everyone:
            manifest["files"].update(f)
            if i["optimizer"] is not None:
                manifest["optimizer"] = {**(manifest["optimizer"] or {}), **i["optimizer"]}
                manifest["optimizer_class"] = i["optimizer_class"]
        _write_atomic(folder / MANIFEST, json.dumps(manifest, indent=1))   # the version is complete
        _write_atomic(path / LATEST, folder.name + "\n")                   # and the one loaded
        _clean(path, folder, keep)
    _everywhere(commit)
    return folder


def _clean(path: Path, current: Path, keep: int) -> None:
    """Remove leftovers of interrupted saves and all but the newest `keep` complete versions."""
    complete = []
    for entry in path.iterdir():
        if entry == current or not _VERSION.fullmatch(entry.name):
            if entry.name == LATEST + ".tmp":
                entry.unlink(missing_ok=True)
            continue
        if (entry / MANIFEST).is_file():
            complete.append(entry)
        else:
            shutil.rmtree(entry, ignore_errors=True)
    complete.sort(key=lambda e: (int(e.name.split("-")[1]), (e / MANIFEST).stat().st_mtime_ns))
    for entry in complete[:max(0, len(complete) - (keep - 1))]:
        shutil.rmtree(entry, ignore_errors=True)


# ----- load -----
def _key_difference(missing: list[str], unexpected: list[str]) -> str:
    said = []
    if missing:
        said.append(f"lacks {len(missing)} of this model's state keys ({', '.join(missing[:4])}"
                    f"{', ...' if len(missing) > 4 else ''})")
    if unexpected:
        said.append(f"holds {len(unexpected)} keys this model does not have ({', '.join(unexpected[:4])}"
                    f"{', ...' if len(unexpected) > 4 else ''})")
    return " and ".join(said)


def _check_model(pp: "Pipeline", manifest: dict[str, Any], folder: Path) -> None:
    saved, mine = set(manifest["state_keys"]), set(pp.state_key_names())
    if saved != mine:
        raise CheckpointError(f"{folder} was saved from another model: it "
                              f"{_key_difference(sorted(mine - saved), sorted(saved - mine))}; load it into the "
                              "model it was saved from")


def _optimizer_targets(named: dict[int, str], optimizer: torch.optim.Optimizer, manifest: dict[str, Any],
                       folder: Path) -> dict[str, torch.Tensor]:
    """Empty tensors for the optimizer's saved state, on its parameters' devices (`step` on the host)."""
    saved = manifest.get("optimizer")
    if saved is None:
        raise CheckpointError(f"{folder} holds no optimizer state; save it with pp.save(dir, optimizer=opt), or "
                              "load without optimizer=")
    if manifest.get("optimizer_class") != type(optimizer).__name__:
        raise CheckpointError(f"{folder} holds the state of a {manifest.get('optimizer_class')} optimizer, not of "
                              f"this {type(optimizer).__name__}; build the same optimizer class as when saving")
    device = {n: p.device for group in optimizer.param_groups for p in group["params"] for n in [named.get(id(p))]}
    out = {}
    for name in _optimizer_names(named, optimizer):
        if name not in saved:
            raise CheckpointError(f"{folder} holds no optimizer state for {name}; the optimizer was built from "
                                  "other parameters than when saving: build it from pp.parameters()")
        for k, t in saved[name]["tensors"].items():
            out[t["key"]] = torch.empty(t["shape"], dtype=getattr(torch, t["dtype"]),
                                        device=device[name] if k != "step" else "cpu")
    return out


def _apply_optimizer(named: dict[int, str], optimizer: torch.optim.Optimizer, manifest: dict[str, Any],
                     loaded: dict[str, torch.Tensor]) -> None:
    """optimizer.load_state_dict from the state saved by name; each group takes its parameters' settings."""
    saved = manifest["optimizer"]
    names = _optimizer_names(named, optimizer)
    state: dict[int, dict[str, Any]] = {}
    groups = []
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
        groups.append({**(settings or {k: v for k, v in group.items() if k != "params"}),
                       "params": list(range(index - len(group["params"]), index))})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def load(pp: "Pipeline", path: str | Path, optimizer: torch.optim.Optimizer | None = None) -> Loaded:
    """Restore what `save` wrote, from any plan of the same model (a collective call).

    Parameters, buffers and the optimizer's state are read by name, each rank only what its
    stages hold; the random-number state is restored per rank when the world size is the one
    saved (a bitwise resume under the same plan), else each rank takes rank (r mod saved world)'s.
    """
    folder_box: list[Path] = []

    def check() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        folder = resolve(path)
        folder_box.append(folder)
        manifest = _manifest(folder)
        _check_model(pp, manifest, folder)
        _verify(folder, manifest, (pp.rank, pp.world))
        md = _metadata(folder)
        model = _model_tensors(pp)
        _check_tensors(md, model, folder)
        src = pp.rank % int(manifest["world_size"])
        targets = {k: torch.empty_like(t.detach(), device="cpu") for k, t in model.items()}
        targets.update({f"rng.{src}.{k}": torch.empty(md.state_dict_metadata[f"rng.{src}.{k}"].size,  # type: ignore
                                                      dtype=torch.int64 if k == "python" else torch.uint8)
                        for k in ("torch", "python")})
        targets.update(_extra_tensors(manifest))
        if optimizer is not None:
            targets.update(_optimizer_targets(_ids(pp), optimizer, manifest, folder))
        _check_tensors(md, {k: t for k, t in targets.items() if not k.startswith("model.")}, folder)
        return manifest, targets

    manifest, targets = _everywhere(check)
    folder = folder_box[0]
    _dcp_load(targets, folder)

    def apply() -> Loaded:
        if optimizer is not None:
            _apply_optimizer(_ids(pp), optimizer, manifest, targets)
        with torch.no_grad():
            for k, t in _model_tensors(pp).items():
                t.copy_(targets[k])
        src = pp.rank % int(manifest["world_size"])
        _set_rng_state(targets, manifest["rng"][src], src)
        pp.steps_done = int(manifest["step"])
        return Loaded(pp.steps_done, _decode_extra(manifest["extra"], targets), str(folder))
    return _everywhere(apply)


def read_plan(path: str | Path) -> "Plan":
    """The plan the checkpoint at `path` was made with (for pipe.Pipeline(plan=path))."""
    from partition.plan import Plan
    folder = resolve(path)
    return Plan.from_dict(_manifest(folder)["plan"])


def read_extra(path: str | Path) -> dict[str, Any]:
    """The training loop's extra state saved with the checkpoint, on one process."""
    folder = resolve(path)
    manifest = _manifest(folder)
    _verify(folder, manifest)
    tensors = _extra_tensors(manifest)
    if tensors:
        _check_tensors(_metadata(folder), tensors, folder)
        _dcp_load(tensors, folder, no_dist=True)
    return _decode_extra(manifest["extra"], tensors)


def load_full_state_dict(path: str | Path, *, allow_nonfinite: bool = False) -> dict[str, torch.Tensor]:
    """The unpartitioned model's state dict from a checkpoint, on one process (no group needed).

    Every file is verified first; every key of the model's state dict is present (tied names
    share one tensor, as in the model); a NaN or infinite value is an error unless
    `allow_nonfinite` (a model saved after its loss diverged, say).
    """
    folder = resolve(path)
    manifest = _manifest(folder)
    _verify(folder, manifest)
    md = _metadata(folder)
    sources = sorted(set(manifest["state_keys"].values()))
    targets = {}
    for name in sources:
        entry = md.state_dict_metadata.get(f"model.{name}")
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(f"{folder} holds no tensor for {name!r}; the checkpoint is damaged")
        targets[f"model.{name}"] = torch.full(tuple(entry.size), math.nan, dtype=entry.properties.dtype) if (
            entry.properties.dtype.is_floating_point) else torch.zeros(tuple(entry.size), dtype=entry.properties.dtype)
    _dcp_load(targets, folder, no_dist=True)
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
    manifest = _manifest(folder)
    _verify(folder, manifest)
    named = {id(p): n for n, p in model.named_parameters()}
    targets = _optimizer_targets(named, optimizer, manifest, folder)
    _check_tensors(_metadata(folder), targets, folder)
    _dcp_load(targets, folder, no_dist=True)
    _apply_optimizer(named, optimizer, manifest, targets)
    return int(manifest["step"])


# ----- a full state dict of the unpartitioned model, into a pipeline -----
class _Source:
    """Tensors by name from a .pt/.bin, a .safetensors, a folder of Hugging Face shards, or a checkpoint."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.files: dict[str, Path] = {}   # key -> file holding it
        self._open: dict[Path, Any] = {}
        p = self.path
        if p.is_dir():
            if (p / MANIFEST).is_file() or (p / LATEST).is_file():
                self.kind = "fxpipe"
                self.folder = resolve(p)
                manifest = _manifest(self.folder)
                self.manifest = manifest
                self.keys = set(manifest["state_keys"])
                return
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
        self.kind = "files"
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

    def check() -> tuple[_Source, dict[str, str]]:
        src = _Source(path)
        if src.kind == "fxpipe":
            _check_model(pp, src.manifest, src.folder)
            return src, {}
        unexpected = sorted(src.keys - set(names))
        missing = sorted(first for first, keys in aliases.items() if not any(k in src.keys for k in keys))
        if unexpected or missing:
            raise CheckpointError(f"{path} does not match this model: it {_key_difference(missing, unexpected)}; "
                                  "load a state dict of this model (strip or add a prefix to its keys if that "
                                  "is all that differs)")
        plan = {}
        for k, t in _model_tensors(pp).items():
            name = k.removeprefix("model.")
            found = next(a for a in aliases[name] if a in src.keys)
            if src.shape(found) != tuple(t.shape):
                raise CheckpointError(f"{path}: {found} has shape {list(src.shape(found))}, this model's is "
                                      f"{list(t.shape)}; load a state dict of this model")
            plan[k] = found
        return src, plan

    src, plan = _everywhere(check)
    if src.kind == "fxpipe":
        folder = src.folder
        manifest = src.manifest

        def verify() -> dict[str, torch.Tensor]:
            _verify(folder, manifest, (pp.rank, pp.world))
            model = _model_tensors(pp)
            _check_tensors(_metadata(folder), model, folder)
            return {k: torch.empty_like(t.detach(), device="cpu") for k, t in model.items()}
        targets = _everywhere(verify)
        _dcp_load(targets, folder)
    else:
        targets = None

    def apply() -> None:
        with torch.no_grad():
            for k, t in _model_tensors(pp).items():
                t.copy_(targets[k] if targets is not None else src.get(plan[k]))
    _everywhere(apply)


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


def _iter_summary(folder: Path, manifest: dict[str, Any]) -> Iterator[str]:
    plan = manifest["plan"]
    yield f"{folder}: step {manifest['step']}, {manifest['world_size']} ranks, schedule {manifest['schedule']}, " \
          f"{manifest['microbatches']} microbatches, {len(plan['stages'])} stages"
    yield f"  {len(manifest['state_keys'])} state keys, optimizer {manifest['optimizer_class'] or 'none'}, " \
          f"{len(manifest['files'])} files, {sum(f['bytes'] for f in manifest['files'].values())} bytes"


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys
    p = argparse.ArgumentParser(prog="python -m pipe.checkpoint", description="Inspect and export fxpipe checkpoints.")
    sub = p.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="write the unpartitioned model as one .safetensors or .pt file")
    ex.add_argument("dir")
    ex.add_argument("--to", required=True, help="the file to write: model.safetensors or model.pt")
    ex.add_argument("--allow-nonfinite", action="store_true", help="export NaN/inf values instead of refusing")
    show = sub.add_parser("show", help="print what a checkpoint holds")
    show.add_argument("dir")
    plan = sub.add_parser("plan", help="write the plan the checkpoint was made with (for --plan / plan=)")
    plan.add_argument("dir")
    plan.add_argument("--to", required=True, help="the plan file to write, e.g. plan.json")
    a = p.parse_args(argv)
    try:
        if a.command == "export":
            out = export(a.dir, a.to, allow_nonfinite=a.allow_nonfinite)
            print(f"wrote {out}")
        elif a.command == "plan":
            print(f"wrote {read_plan(a.dir).save(a.to)}")
        else:
            folder = resolve(a.dir)
            manifest = _manifest(folder)
            _verify(folder, manifest)
            for line in _iter_summary(folder, manifest):
                print(line)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
