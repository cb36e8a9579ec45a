"""Checkpoints of a pipeline: one file per rank plus a manifest written last; resumable bitwise."""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from partition.errors import FxpipeError

if TYPE_CHECKING:
    from pipe.runtime import Pipeline

__all__ = ["save", "load", "load_full_state_dict", "CheckpointError", "MANIFEST"]

MANIFEST = "manifest.json"


class CheckpointError(FxpipeError, ValueError):
    """A checkpoint that is incomplete or does not fit the pipeline loading it."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _shared_token(pp: "Pipeline") -> str:
    box = [uuid.uuid4().hex[:12]]
    if pp.world > 1:
        dist.broadcast_object_list(box, src=0)
    return str(box[0])


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1]),
                             "python_version": random.getstate()[0], "python_gauss": random.getstate()[2]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((state["python_version"], tuple(state["python"]), state["python_gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(pp: "Pipeline", path: str | Path, optimizer: torch.optim.Optimizer | None = None) -> Path:
    """Write this pipeline's state to `path` (a collective call: every rank calls it).

    Each rank writes `rank-R.pt` (parameters and buffers by original name, optimizer state
    by parameter name, step, RNG state) into a fresh folder; rank 0 writes the manifest last
    (plan, world size, sizes and hashes of the files), then the folder replaces `path` by
    rename. A save killed halfway leaves no manifest in `path`, so it is never loaded as complete;
    the previous checkpoint at `path` stays intact until the new one is whole.
    """
    path = Path(path)
    token = _shared_token(pp)
    tmp = path.with_name(f".{path.name}.partial-{token}")
    tmp.mkdir(parents=True, exist_ok=True)
    names = dict(pp.named_parameters())
    by_id = {id(p): n for n, p in names.items()}
    state: dict[str, Any] = {
        "params": {n: p.detach().cpu() for n, p in names.items()},
        "buffers": {k: v.detach().cpu() for k, v in pp.local_buffers().items()},
        "step": pp.steps_done, "rank": pp.rank, "rng": _rng_state(),
    }
    if optimizer is not None:
        osd = optimizer.state_dict()
        order = [by_id.get(id(p)) for group in optimizer.param_groups for p in group["params"]]
        if any(n is None for n in order):
            raise CheckpointError("the optimizer holds parameters that are not this pipeline's; build it "
                                  "from pp.parameters()")
        state["optimizer"] = {"state": {order[i]: v for i, v in osd["state"].items()},
                              "param_groups": osd["param_groups"], "order": order}
    file = tmp / f"rank-{pp.rank}.pt"
    torch.save(state, file)
    info = {"file": file.name, "bytes": file.stat().st_size, "sha256": _sha256(file)}
    infos: list[Any] = [None] * pp.world
    if pp.world > 1:
        dist.all_gather_object(infos, info)
    else:
        infos = [info]
    if pp.rank == 0:
        manifest = {"format": 1, "world_size": pp.world, "step": pp.steps_done, "plan": pp.plan.to_dict(),
                    "files": infos, "state_keys": pp.state_key_names(), "schedule": pp.schedule_name,
                    "microbatches": pp.M, "stages_per_rank": pp.v}
        (tmp / (MANIFEST + ".tmp")).write_text(json.dumps(manifest, indent=1))
        os.replace(tmp / (MANIFEST + ".tmp"), tmp / MANIFEST)
        old = path.with_name(f".{path.name}.old-{token}")
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    if pp.world > 1:
        dist.barrier()
    return path


def _manifest(path: Path) -> dict[str, Any]:
    m = path / MANIFEST
    if not m.exists():
        raise CheckpointError(f"{path} is not a complete checkpoint (no {MANIFEST}); it may have been "
                              "interrupted while saving: resume from an earlier checkpoint")
    manifest: dict[str, Any] = json.loads(m.read_text())
    for info in manifest["files"]:
        f = path / info["file"]
        if not f.exists() or f.stat().st_size != info["bytes"]:
            raise CheckpointError(f"{f} is missing or has the wrong size ({info['bytes']} bytes expected); "
                                  "the checkpoint is damaged: resume from an earlier one")
    return manifest


def load(pp: "Pipeline", path: str | Path, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Restore what `save` wrote into a freshly built pipeline; returns the step to resume at."""
    path = Path(path)
    manifest = _manifest(path)
    if manifest["world_size"] != pp.world or manifest["plan"]["fingerprint"] != pp.plan.fingerprint:
        raise CheckpointError(
            f"{path} was saved by {manifest['world_size']} ranks for model fingerprint "
            f"{manifest['plan']['fingerprint']}; this pipeline has {pp.world} ranks and fingerprint "
            f"{pp.plan.fingerprint}: build the same model on as many ranks, or export a full state dict")
    if [st["params"] for st in manifest["plan"]["stages"]] != [st.params for st in pp.plan.stages]:
        raise CheckpointError(f"{path} was saved with other stage boundaries than this pipeline's plan; load it "
                              "with plan= set to the checkpoint's plan (its manifest holds it)")
    info = manifest["files"][pp.rank]
    file = path / info["file"]
    if _sha256(file) != info["sha256"]:
        raise CheckpointError(f"{file} does not match its hash in the manifest; the checkpoint is damaged")
    state = torch.load(file, weights_only=True)
    params = dict(pp.named_parameters())
    with torch.no_grad():
        for n, t in state["params"].items():
            params[n].copy_(t)
        buffers = pp.local_buffers()
        for k, t in state["buffers"].items():
            buffers[k].copy_(t)
    if optimizer is not None:
        if "optimizer" not in state:
            raise CheckpointError(f"{path} holds no optimizer state; save it with pp.save(dir, optimizer=opt)")
        o = state["optimizer"]
        by_id = {id(p): n for n, p in params.items()}
        order = [by_id.get(id(p)) for group in optimizer.param_groups for p in group["params"]]
        if sorted(map(str, order)) != sorted(map(str, o["order"])):
            raise CheckpointError("the optimizer's parameters differ from the saved ones; build it from "
                                  "pp.parameters() as when saving")
        index = {n: i for i, n in enumerate(order)}
        optimizer.load_state_dict({"state": {index[n]: v for n, v in o["state"].items()},
                                   "param_groups": o["param_groups"]})
    _set_rng_state(state["rng"])
    pp.steps_done = int(state["step"])
    if pp.world > 1:
        dist.barrier()
    return pp.steps_done


def load_full_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The unpartitioned model's state dict from a checkpoint, on one process (no group needed)."""
    path = Path(path)
    manifest = _manifest(path)
    merged: dict[str, torch.Tensor] = {}
    for info in manifest["files"]:
        state = torch.load(path / info["file"], weights_only=True)
        merged.update(state["params"])
        merged.update(state["buffers"])
    out: dict[str, torch.Tensor] = {}
    for key, source in manifest["state_keys"].items():
        if source in merged:
            out[key] = merged[source]
    return out
