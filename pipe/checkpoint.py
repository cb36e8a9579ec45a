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

import collections
import contextlib
import fcntl
import json
import os
import random
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import memory
from pipe.ckpt_format import (FORMAT, LATEST, MANIFEST, VERSION, CheckpointError, agree, dtype_named,
                              optimizer_state_dict,
                              check_model, check_tensors, dcp_error, dcp_load, everywhere, in_group,
                              model_tensors, optimizer_names, optimizer_targets, param_ids, quiet, read_manifest,
                              read_metadata, resolve, resolve_everywhere, sha256, share, verify, write_atomic)
from pipe.state_dicts import export, load_full_optimizer_state, load_full_state_dict, load_model_state

if TYPE_CHECKING:
    from partition.plan import Plan
    from pipe.runtime import Pipeline

__all__ = ["save", "load", "load_full_state_dict", "load_full_optimizer_state", "load_model_state", "read_plan",
           "plan_at", "read_extra", "export", "resolve", "CheckpointError", "Loaded", "MANIFEST", "LATEST"]


@dataclass
class Loaded:
    """What `load` restored: the step to resume at, the loop's extra state, the version folder."""
    step: int
    extra: dict[str, Any] = field(default_factory=dict)
    folder: str = ""



# ----- what is saved -----
def _rng_state(rank: int, device: torch.device) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This rank's random state: torch's on the host and on its own CUDA device, and Python's."""
    version, state, gauss = random.getstate()
    tensors = {f"rng.{rank}.torch": torch.get_rng_state(), f"rng.{rank}.python": torch.tensor(state, dtype=torch.int64)}
    if device.type == "cuda":
        tensors[f"rng.{rank}.cuda"] = torch.cuda.get_rng_state(device)
    return tensors, {"python_version": version, "python_gauss": gauss}


def _rng_targets(md: Any, src: int, device: torch.device, folder: Path) -> dict[str, torch.Tensor]:
    """Empty tensors for saved rank `src`'s random state (its CUDA state when both have a device)."""
    want = {"torch": torch.uint8, "python": torch.int64} | ({"cuda": torch.uint8} if device.type == "cuda" else {})
    out = {}
    for k, dtype in want.items():
        entry = md.state_dict_metadata.get(f"rng.{src}.{k}")
        if isinstance(entry, TensorStorageMetadata):
            out[f"rng.{src}.{k}"] = torch.empty(tuple(entry.size), dtype=dtype)
        elif k != "cuda":  # a checkpoint saved on the host has none
            raise CheckpointError(f"{folder} holds no random state for rank {src} ({k}); the checkpoint is damaged")
    return out


def _rng_source(pp: "Pipeline", manifest: dict[str, Any]) -> int:
    """The saved rank whose random state this rank takes: its own when the job's world size is the one saved,
    else rank (r mod saved world)'s. Saved by global rank (each replica its own), or, by checkpoints of an
    earlier format, by pipeline rank."""
    if manifest.get("rng_by") == "global rank":
        return pp.ctx.rank % len(manifest["rng"])
    return pp.rank % int(manifest["world_size"])


def _set_rng_state(tensors: dict[str, torch.Tensor], info: dict[str, Any], rank: int, device: torch.device) -> None:
    torch.set_rng_state(tensors[f"rng.{rank}.torch"])
    random.setstate((info["python_version"], tuple(int(x) for x in tensors[f"rng.{rank}.python"].tolist()),
                     info["python_gauss"]))
    if f"rng.{rank}.cuda" in tensors:
        torch.cuda.set_rng_state(tensors[f"rng.{rank}.cuda"], device)


def _json(x: Any, where: str) -> Any:
    try:
        text = json.dumps(x, allow_nan=True)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where} cannot be saved ({e}); pass numbers, strings, lists, dicts and "
                              "tensors") from None
    return json.loads(text)


# JSON objects standing for a tensor, a tuple, a dict, a dict with keys other than strings, a Counter
_MARKS = ({"__tensor__"}, {"__tuple__"}, {"__dict__"}, {"__items__"}, {"__counter__"})


def _encode_extra(extra: Any, tensors: dict[str, torch.Tensor], path: str = "extra") -> Any:
    """The loop's extra state as JSON, its tensors moved to `tensors` (saved by DCP); a tuple, and a dict of
    the user's whose keys are a mark's, are marked, so that they come back as given (found by review: a tuple
    came back a list, and {"__tensor__": ...} another tensor)."""
    if isinstance(extra, torch.Tensor):
        key = f"extra.{len(tensors)}"
        tensors[key] = extra.detach().cpu()
        return {"__tensor__": key}
    if isinstance(extra, dict):  # keys other than strings (MultiStepLR's milestones, a Counter of ints) as pairs,
        if isinstance(extra, collections.Counter) or not all(isinstance(k, str) for k in extra):  # (found by review:
            pairs = [[_encode_extra(k, tensors, f"{path} key {k!r}"), _encode_extra(v, tensors, f"{path}[{k!r}]")]
                     for k, v in extra.items()]  # refused, and string keys' fix kept the LR from decaying)
            return {"__counter__" if isinstance(extra, collections.Counter) else "__items__": pairs}
        out = {k: _encode_extra(v, tensors, f"{path}[{k!r}]") for k, v in extra.items()}
        return {"__dict__": out} if set(out) in _MARKS else out
    if isinstance(extra, (list, tuple)):
        items = [_encode_extra(v, tensors, f"{path}[{i}]") for i, v in enumerate(extra)]
        return {"__tuple__": items} if isinstance(extra, tuple) else items
    if extra is None or isinstance(extra, (bool, int, float, str)):
        return extra
    raise CheckpointError(f"{path} is a {type(extra).__name__}, which a checkpoint does not pickle; pass numbers, "
                          "strings, lists, dicts and tensors (a scheduler's state_dict(), say)")


def _decode_extra(x: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(x, dict):
        if set(x) == {"__tensor__"}:
            return tensors[x["__tensor__"]]
        if set(x) == {"__tuple__"}:
            return tuple(_decode_extra(v, tensors) for v in x["__tuple__"])
        if set(x) == {"__dict__"}:
            return {k: _decode_extra(v, tensors) for k, v in x["__dict__"].items()}
        if set(x) in ({"__items__"}, {"__counter__"}):  # (a key made a tuple stays one: hashable)
            pairs = {_decode_extra(k, tensors): _decode_extra(v, tensors) for k, v in next(iter(x.values()))}
            return collections.Counter(pairs) if "__counter__" in x else pairs
        return {k: _decode_extra(v, tensors) for k, v in x.items()}
    if isinstance(x, list):
        return [_decode_extra(v, tensors) for v in x]
    return x


def _extra_tensors(manifest: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: torch.empty(v["shape"], dtype=dtype_named(v["dtype"], Path("."))) for k, v in
            manifest["extra_tensors"].items()}



def _optimizer_state(pp: "Pipeline", optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor]
                     ) -> dict[str, Any]:
    """Per parameter name: its group's settings, its scalar state; its tensor state into `tensors`."""
    names = optimizer_names(param_ids(pp), optimizer)
    osd = optimizer.state_dict()
    out: dict[str, Any] = {}
    for group in osd["param_groups"]:
        settings = _json({k: v for k, v in group.items() if k not in ("params", "param_names")},
                         f"the optimizer's settings {group}")
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
    by parameter name, the step, every rank's random-number state, the grad scaler's state
    (make_grad_scaler), the plan, and `extra` (the
    training loop's own state: numbers, strings, lists, dicts and tensors, as rank 0 has it).
    `keep` complete versions stay (the newest; older ones and the leftovers of interrupted saves
    are removed). Returns the version folder.
    """
    path = Path(path)
    _same_optimizer(pp, optimizer, "save")
    if optimizer is not None:  # ZeRO (dp_shard="optimizer"): each replica saves its shard's state
        inner = memory.local_optimizer(optimizer)
        if inner is not None:  # with its groups' settings as the outer ones hold them now: ZeRO copies them
            sync = getattr(type(optimizer), "_sync_param_groups")  # in at its step, and an LR scheduler's step
            sync(optimizer.param_groups, inner.param_groups)  # after that changed only the outer ones
        optimizer = inner or optimizer
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise CheckpointError(f"keep={keep!r} must be a positive number of versions to keep, e.g. keep=1")
    box = [uuid.uuid4().hex[:12]]
    if in_group():
        dist.broadcast_object_list(box, src=0)
    folder = path / f"step-{pp.steps_done:08d}-{box[0]}"
    me = share()[0]
    tensors: dict[str, torch.Tensor] = {}

    def prepare() -> dict[str, Any]:
        if (path / MANIFEST).is_file():
            raise CheckpointError(f"{path} is a version folder of a checkpoint; save to the checkpoint's folder "
                                  f"({path.parent}) or to a new one")
        tensors.update(model_tensors(pp))
        rng, rng_info = _rng_state(pp.ctx.rank, pp.ctx.device)  # by global rank: replicas draw apart
        tensors.update(rng)
        info: dict[str, Any] = {"rng": rng_info, "rank": pp.ctx.rank, "optimizer": None, "extra": None,
                                "folder": str(folder.absolute())}
        if optimizer is not None:
            info["optimizer"] = _optimizer_state(pp, optimizer, tensors)
            info["optimizer_class"] = type(optimizer).__name__
        if me == 0:
            extra_tensors: dict[str, torch.Tensor] = {}
            info["extra"] = _encode_extra(dict(extra or {}), extra_tensors)
            info["extra_tensors"] = {k: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                                     for k, t in extra_tensors.items()}
            tensors.update(extra_tensors)
            # make_grad_scaler's scale and growth tracker, the same on every rank (found by review: a resume
            # started from the initial scale, and its first steps overflowed and were skipped without a word)
            info["grad_scaler"] = _json(pp.grad_scaler.state_dict(), "the grad scaler's state") \
                if pp.grad_scaler is not None else None
            folder.mkdir(parents=True)
            _writing[folder] = _lock(folder / WRITING)  # held until committed: no other writer's clean removes it
        return info

    info = everywhere(prepare)
    try:
        return _write(pp, path, folder, tensors, info, keep, me)
    finally:
        fd = _writing.pop(folder, None)
        if fd is not None:
            (folder / WRITING).unlink(missing_ok=True)
            os.close(fd)


def _write(pp: "Pipeline", path: Path, folder: Path, tensors: dict[str, torch.Tensor], info: dict[str, Any],
           keep: int, me: int) -> Path:
    """save's writing and commit, once every rank has prepared."""
    try:
        with quiet():
            dcp.save(tensors, storage_writer=dcp.FileSystemWriter(folder, sync_files=True), no_dist=not in_group())
        error = None
    except (Exception, CheckpointException) as e:  # DCP gathers every rank's failure and raises it on all
        error = f"writing {folder} failed ({dcp_error(e)}); check the disk has room and the folder is writable"
    agree(error)

    def hashes() -> dict[str, Any]:
        mine = sorted(folder.glob(f"__{me}_*.distcp")) + ([folder / ".metadata"] if me == 0 else [])
        return {f.name: {"bytes": f.stat().st_size, "sha256": sha256(f)} for f in mine}
    files = everywhere(hashes)
    everyone: list[Any] = [(files, info)]
    if in_group():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (files, info))

    def commit() -> None:
        if me != 0:
            return
        _all_seen(folder, everyone)
        manifest: dict[str, Any] = {
            "format": FORMAT, "step": pp.steps_done, "world_size": pp.world, "schedule": pp.schedule_name,
            "microbatches": pp.M, "stages_per_rank": pp.v, "plan": pp.plan.to_dict(),
            "state_keys": pp.state_key_names(), "files": {}, "rng": [None] * len(everyone), "rng_by": "global rank",
            "optimizer": None, "optimizer_class": None, "extra": info["extra"], "extra_tensors": info["extra_tensors"],
            "grad_scaler": info["grad_scaler"] or None,
            "committed_ns": time.time_ns()}  # the versions' order: a run resumed from an older one saves newer
        for f, i in everyone:
            manifest["files"].update(f)
            manifest["rng"][i["rank"]] = i["rng"]
            if i["optimizer"] is not None:
                manifest["optimizer"] = {**(manifest["optimizer"] or {}), **i["optimizer"]}
                manifest["optimizer_class"] = i["optimizer_class"]
        fd = _lock(path / COMMITTING)  # one writer at a time commits and cleans (two jobs given one folder)
        try:
            write_atomic(folder / MANIFEST, json.dumps(manifest, indent=1))   # the version is complete
            write_atomic(path / LATEST, folder.name + "\n")                   # and the one loaded
            _clean(path, folder, keep)
        finally:
            os.close(fd)
    everywhere(commit)
    return folder


WRITING = ".writing"  # in a version folder while its save runs, locked by the writer (rank 0)
COMMITTING = ".commit-lock"  # in the checkpoint's folder, locked around a commit and its clean-up
_writing: dict[Path, int] = {}  # this process's versions being written -> their lock's descriptor


def _lock(file: Path) -> int:
    """An exclusive lock on `file` (made if need be), held until the returned descriptor is closed."""
    fd = os.open(file, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def _being_written(version: Path) -> bool:
    """Whether another save is writing `version` now (it holds the version's lock)."""
    try:
        fd = os.open(version / WRITING, os.O_RDWR)
    except OSError:
        return False  # none: an interrupted save's leftover (or one from before the lock)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def _same_optimizer(pp: "Pipeline", optimizer: torch.optim.Optimizer | None, what: str) -> None:
    """Refuse, on every rank, a save or load where the ranks passed optimizer= differently (some none,
    though they hold parameters): the checkpoint would lack those ranks' optimizer state, found missing
    only at the next load, or a load would restore it on some ranks alone."""
    if not in_group():
        return
    mine = (None if optimizer is None else type(optimizer).__qualname__, next(iter(pp.parameters()), None) is not None)
    got: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(got, mine)
    if len({g for g, params in got if g is not None or params}) > 1:  # a rank without parameters may pass none
        ranks = ", ".join(f"rank {r}: {g or 'none'}" for r, (g, _) in enumerate(got))
        raise CheckpointError(f"pp.{what}() is one call every rank makes alike, but the ranks passed optimizer= "
                              f"differently ({ranks}); pass each rank's optimizer on every rank, or none on any")


def _all_seen(folder: Path, everyone: list[Any]) -> None:
    """Refuse to commit a version whose files rank 0 does not see in its folder, each at the size its
    rank wrote: the ranks were given different folders, or they do not share the filesystem (node-local
    disks). The manifest and LATEST are then not written, so the previous version stays the one loaded;
    the files each rank wrote stay where it wrote them."""
    unseen = [(r, name, i["folder"]) for r, (files, i) in enumerate(everyone) for name, meta in files.items()
              if not (folder / name).is_file() or (folder / name).stat().st_size != meta["bytes"]]
    if unseen:
        r, name, where = unseen[0]
        more = f" (and {len(unseen) - 1} more file{'s' if len(unseen) > 2 else ''})" if len(unseen) > 1 else ""
        raise CheckpointError(
            f"rank {r} wrote {name} to {where}, and rank 0 does not see it in {folder.absolute()}{more}: a checkpoint "
            f"is one folder every rank writes into, so pass pp.save the same path on every rank, on a filesystem "
            f"they all share; this version was not committed (the previous one stays the one loaded)")


def _committed(version: Path) -> tuple[int, int]:
    """When a complete version was committed (its manifest's time, or the file's for an earlier format),
    then its step: saves after a rollback to an older version are the newest, whatever their steps."""
    try:
        when = int(json.loads((version / MANIFEST).read_text()).get("committed_ns") or 0)
    except (OSError, ValueError, AttributeError):
        when = 0
    return when or (version / MANIFEST).stat().st_mtime_ns, int(version.name.split("-")[1])


def _clean(path: Path, current: Path, keep: int) -> None:
    """Remove leftovers of interrupted saves and all but the newest `keep` complete versions (the last
    committed); a version's manifest goes first, so one whose removal is interrupted is never taken for
    complete. Best effort: the save it follows has succeeded whatever happens here."""
    with contextlib.suppress(OSError):
        complete = []
        latest = (path / LATEST).read_text().strip() if (path / LATEST).is_file() else None
        for entry in path.iterdir():
            if entry.name == LATEST + ".tmp":
                entry.unlink(missing_ok=True)
            elif entry != current and entry.name != latest and VERSION.fullmatch(entry.name):
                if (entry / MANIFEST).is_file():
                    complete.append(entry)
                elif not _being_written(entry) and not (entry / MANIFEST).is_file():  # (committed meanwhile)
                    shutil.rmtree(entry, ignore_errors=True)
        complete.sort(key=_committed)
        for entry in complete[:max(0, len(complete) - (keep - 1))]:
            (entry / MANIFEST).unlink(missing_ok=True)
            shutil.rmtree(entry, ignore_errors=True)


# ----- load -----

def load(pp: "Pipeline", path: str | Path, optimizer: torch.optim.Optimizer | None = None) -> Loaded:
    """Restore what `save` wrote, from any plan of the same model (a collective call).

    Parameters, buffers and the optimizer's state are read by name, each rank only what its
    stages hold; the random-number state is restored per rank when the world size is the one
    saved (a bitwise resume under the same plan), else each rank takes rank (r mod saved world)'s.
    """
    _same_optimizer(pp, optimizer, "load")
    folder: Path = resolve_everywhere(path)
    outer = optimizer
    if optimizer is not None:  # ZeRO (dp_shard="optimizer"): each replica loads its shard's state
        optimizer = memory.local_optimizer(optimizer) or optimizer

    def check() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        manifest = read_manifest(folder)
        check_model(pp, manifest, folder)
        verify(folder, manifest, share())
        md = read_metadata(folder)
        model = model_tensors(pp)
        check_tensors(md, model, folder)
        src = _rng_source(pp, manifest)
        if not 0 <= src < len(manifest["rng"]):
            raise CheckpointError(f"{folder / MANIFEST} lists the random state of {len(manifest['rng'])} ranks for "
                                  f"{manifest['world_size']}; the manifest is damaged")
        targets = {k: torch.empty_like(t.detach(), device="cpu") for k, t in model.items()}
        targets.update(_rng_targets(md, src, pp.ctx.device, folder))
        targets.update(_extra_tensors(manifest))
        if optimizer is not None:
            targets.update(optimizer_targets(param_ids(pp), optimizer, manifest, folder))
        check_tensors(md, {k: t for k, t in targets.items() if not k.startswith("model.")}, folder)
        return manifest, targets

    manifest, targets = everywhere(check)
    dcp_load(targets, folder)

    def prepare() -> tuple[dict[str, Any] | None, Any]:  # all that may fail, before anything changes
        osd = None if optimizer is None else optimizer_state_dict(
            param_ids(pp), optimizer, manifest, targets, outer if outer is not optimizer else None)
        return osd, _decode_extra(manifest["extra"], targets)
    osd, extra = everywhere(prepare)

    def apply() -> Loaded:
        if optimizer is not None:
            optimizer.load_state_dict(osd)
            if outer is not None and outer is not optimizer:  # ZeRO copies its groups' settings into
                sync = getattr(type(outer), "_sync_param_groups")  # its local optimizer's at each step
                sync(optimizer.param_groups, outer.param_groups)
        with torch.no_grad():
            for k, t in model_tensors(pp).items():
                t.copy_(targets[k])
        src = _rng_source(pp, manifest)
        _set_rng_state(targets, manifest["rng"][src], src, pp.ctx.device)
        pp.steps_done = int(manifest["step"])
        scaler = manifest.get("grad_scaler")
        if scaler and pp.grad_scaler is not None:
            pp.grad_scaler.load_state_dict(scaler)
        pp._loaded_scaler = scaler or None  # (for a grad scaler made after the load: make_grad_scaler)
        return Loaded(pp.steps_done, extra, str(folder))
    return everywhere(apply)


def read_plan(path: str | Path) -> "Plan":
    """The plan the checkpoint at `path` was made with (for pipe.Pipeline(plan=path))."""
    from partition.plan import Plan
    folder = resolve(path)
    return Plan.from_dict(read_manifest(folder)["plan"])


def plan_at(path: str | Path) -> "Plan":
    """The plan `path` gives (plan=, --plan): a checkpoint's folder, the plan it was made with (a resume that is
    bitwise), else a plan file."""
    from partition.plan import Plan
    return read_plan(path) if Path(path).is_dir() else Plan.load(path)


def read_extra(path: str | Path) -> dict[str, Any]:
    """The training loop's extra state saved with the checkpoint, on one process."""
    folder = resolve(path)
    manifest = read_manifest(folder)
    verify(folder, manifest)
    tensors = _extra_tensors(manifest)
    if tensors:
        check_tensors(read_metadata(folder), tensors, folder)
        dcp_load(tensors, folder, no_dist=True)
    return _decode_extra(manifest["extra"], tensors)



def _iter_summary(folder: Path, manifest: dict[str, Any]) -> Iterator[str]:
    plan = manifest["plan"]
    yield f"{folder}: step {manifest['step']}, {manifest['world_size']} ranks, schedule {manifest['schedule']}, " \
          f"{manifest['microbatches']} microbatches, {len(plan['stages'])} stages"
    yield f"  {len(manifest['state_keys'])} state keys, optimizer {manifest['optimizer_class'] or 'none'}, " \
          f"{len(manifest['files'])} files, {sum(f['bytes'] for f in manifest['files'].values())} bytes"


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys
    from partition.args import file_to_write
    p = argparse.ArgumentParser(prog="python -m pipe.checkpoint", description="Inspect and export fxpipe checkpoints.")
    sub = p.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="write the unpartitioned model as one .safetensors or .pt file")
    ex.add_argument("dir")
    ex.add_argument("--to", required=True, type=file_to_write, help="the file to write: model.safetensors or model.pt")
    ex.add_argument("--allow-nonfinite", action="store_true", help="export NaN/inf values instead of refusing")
    show = sub.add_parser("show", help="print what a checkpoint holds")
    show.add_argument("dir")
    plan = sub.add_parser("plan", help="write the plan the checkpoint was made with (for --plan / plan=)")
    plan.add_argument("dir")
    plan.add_argument("--to", required=True, type=file_to_write, help="the plan file to write, e.g. plan.json")
    a = p.parse_args(argv)
    try:
        if a.command == "export":
            out = export(a.dir, a.to, allow_nonfinite=a.allow_nonfinite)
            print(f"wrote {out}")
        elif a.command == "plan":
            print(f"wrote {read_plan(a.dir).save(a.to)}")
        else:
            folder = resolve(a.dir)
            manifest = read_manifest(folder)
            verify(folder, manifest)
            for line in _iter_summary(folder, manifest):
                print(line)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
