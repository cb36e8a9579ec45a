"""Checkpoints: saved by one plan, resumed by any other (DCP by name), atomic, verified, refused alike
on every rank. A few launches carry every case: 2 ranks save; 2 ranks resume under five other plans
and then meet the corruption table; 4 ranks resume; one process kills saves at each point."""
import contextlib
import json
import os
import pickle
import random
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.mp import run_ranks

KW = dict(n_layer=2, d_model=32, n_head=2, seq_len=16, vocab=64)
K, TOTAL = 2, 5   # saved after K steps; the uninterrupted run goes on to TOTAL


def _train(pp: Any, opt: Any, w: Any, steps: range) -> list[float]:
    out = []
    for step in steps:
        args, target = w.make_batch(16, step)
        out.append(pp.step(*args, target=target))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out


def _pipeline(w: Any, **kw: Any) -> tuple[Any, Any]:
    import pipe
    pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=4, **kw)
    return pp, torch.optim.AdamW(list(pp.parameters()), lr=1e-2)


def _moments(pp: Any, opt: Any) -> dict[str, torch.Tensor]:
    return {n: opt.state[p]["exp_avg"].clone() for n, p in pp.named_parameters() if p in opt.state}


def _bounds(pp: Any) -> list[list[str]]:
    return [st.params for st in pp.plan.stages]


def save_body(rank: int, world: int, *, root: str) -> dict[str, Any]:
    """2 ranks, 1F1B, measured costs: train K steps, save, go on to TOTAL (the uninterrupted run)."""
    import partition
    import pipe
    from pipe.checkpoint import CheckpointError
    pipe.init()
    w = partition.load("gpt", **KW)
    pp, opt = _pipeline(w, cost="measured")
    first = _train(pp, opt, w, range(K))
    with pytest.raises(CheckpointError, match=r"extra\['bad'\] is a object"):  # refused on every rank
        pp.save(f"{root}/ckpt", optimizer=opt, extra={"bad": object()})
    # the optimizer passed on one rank only: its state would be missing from the checkpoint (or restored on one
    # rank); refused on every rank before anything is written or read
    for call in (pp.save, pp.load):
        with pytest.raises(CheckpointError, match=rf"pp.{call.__name__}\(\) is one call .* passed optimizer= "
                                                  r"differently \(rank 0: AdamW, rank 1: none\)"):
            call(f"{root}/ckpt", optimizer=opt if rank == 0 else None)
    # a folder per rank (node-local disks look the same): refused on every rank, nothing committed
    with pytest.raises(CheckpointError, match=r"rank 1 wrote __1_0.distcp to .*ckpt_rank1/step-.*rank 0 does not "
                                              r"see it in .*ckpt_rank0/step-.*same path on every rank"):
        pp.save(f"{root}/ckpt_rank{rank}", optimizer=opt)
    folder = pp.save(f"{root}/ckpt", optimizer=opt, extra={"epoch": 3, "seen": torch.arange(4), "lr": [0.01]})
    moments = _moments(pp, opt)
    drawn = (torch.rand(3), random.random())  # what the restored random state draws next
    rest = _train(pp, opt, w, range(K, TOTAL))
    pp.save(f"{root}/noopt")
    # chunked state offload saves and loads alike
    wo = partition.load("gpt", **KW)
    po, oo = _pipeline(wo, cost="flops", offload="states")
    _train(po, oo, wo, range(K))
    po.save(f"{root}/off", optimizer=oo)
    off_rest = _train(po, oo, wo, range(K, TOTAL))
    wx = partition.load("gpt", **{**KW, "n_layer": 1})  # another model
    px, _ = _pipeline(wx, cost="flops")
    px.save(f"{root}/other")
    return {"first": first, "rest": rest, "off_rest": off_rest, "folder": folder, "moments": moments,
            "drawn": drawn, "bounds": _bounds(pp)}


def resume_body(rank: int, world: int, *, root: str, corrupt: dict[str, str]) -> dict[str, Any]:
    """Resume the 2-rank checkpoint under other plans, then meet every corrupted copy."""
    import partition
    import pipe
    from pipe.checkpoint import CheckpointError
    pipe.init()
    ckpt = f"{root}/ckpt"
    out: dict[str, Any] = {}
    for case, kw, path in [("plan", dict(cost="measured", plan=ckpt), ckpt),
                           ("measured", dict(cost="measured"), ckpt),
                           ("2 per rank", dict(cost="flops", schedule="interleaved-1f1b", stages_per_rank=2), ckpt),
                           ("into offload", dict(cost="flops", offload="states"), ckpt),
                           ("from offload", dict(cost="flops"), f"{root}/off")]:
        w = partition.load("gpt", seed=123, **KW)  # other weights: load replaces them
        pp, opt = _pipeline(w, **kw)
        done = pp.load(path, optimizer=opt)
        drawn = (torch.rand(3), random.random())
        out[case] = {"done": done, "moments": _moments(pp, opt), "drawn": drawn, "extra": pp.loaded.extra,
                     "rest": _train(pp, opt, w, range(done, TOTAL)), "bounds": _bounds(pp)}
    # a full state dict of the unpartitioned model, each rank reading only its tensors
    from pipe import state_dicts
    read: list[str] = []
    get, copy_into = state_dicts._Source.get, state_dicts._Source.copy_into

    def spy(self: Any, key: str) -> torch.Tensor:
        read.append(key)
        return get(self, key)

    def spy_into(self: Any, key: str, dst: torch.Tensor) -> None:  # a .safetensors: read into the tensor
        read.append(key)
        copy_into(self, key, dst)
    state_dicts._Source.get = spy  # type: ignore[method-assign]
    state_dicts._Source.copy_into = spy_into  # type: ignore[method-assign]
    for name in ("model.pt", "model.safetensors", "shards"):
        w = partition.load("gpt", seed=123, **KW)
        pp, opt = _pipeline(w, cost="flops")
        read.clear()
        pp.load_model_state(f"{root}/{name}")
        mine = {n for n, _ in pp.named_parameters()} | set(pp.local_buffers())
        out[name] = {"state": {n: p.detach().clone() for n, p in pp.named_parameters()},
                     "read": sorted(read), "mine": sorted(k for k in mine if k in pp.state_key_names())}
    state_dicts._Source.get, state_dicts._Source.copy_into = get, copy_into  # type: ignore[method-assign]
    # the corruption table: the same CheckpointError on every rank, within seconds, and the group goes on
    errors = {}
    for case, path in corrupt.items():
        start = time.monotonic()
        try:
            if case.startswith("full:"):
                pp.load_model_state(path)
            else:
                pp.load(path, optimizer=opt)
            errors[case] = ("no error", 0.0)
        except CheckpointError as e:
            errors[case] = (str(e), time.monotonic() - start)
    out["errors"] = errors
    w = partition.load("gpt", **KW)
    pp, opt = _pipeline(w, cost="flops")
    out["after"] = _train(pp, opt, w, range(pp.load(ckpt, optimizer=opt), K + 1))
    return out


def four_body(rank: int, world: int, *, root: str) -> dict[str, Any]:
    import partition
    import pipe
    pipe.init()
    w = partition.load("gpt", seed=123, **KW)
    pp, _ = _pipeline(w, cost="flops")
    opt = torch.optim.AdamW(list(pp.named_parameters()), lr=1e-2)  # groups with param_names, unlike the saver's
    done = pp.load(f"{root}/ckpt", optimizer=opt)
    assert opt.param_groups[0]["param_names"] == [n for n, _ in pp.named_parameters()]
    return {"done": done, "moments": _moments(pp, opt), "rest": _train(pp, opt, w, range(done, TOTAL)),
            "bounds": _bounds(pp)}


def _corrupt(root: Path) -> dict[str, str]:
    """Copies of the checkpoint, each damaged one way: name -> path, and the words its error holds."""
    src = root / "ckpt"
    version = (src / "LATEST").read_text().strip()
    cases: dict[str, str] = {}

    def copy(name: str) -> Path:
        dst = root / "bad" / name.replace(" ", "-")
        shutil.copytree(src, dst)
        cases[name] = str(dst)
        return dst / version

    def rehash(v: Path) -> None:  # a forger who also fixes the manifest
        import hashlib
        m = json.loads((v / "fxpipe.json").read_text())
        for f in m["files"]:
            data = (v / f).read_bytes()
            m["files"][f] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        (v / "fxpipe.json").write_text(json.dumps(m))

    v = copy("byte flipped")
    data = bytearray((v / "__0_0.distcp").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (v / "__0_0.distcp").write_bytes(bytes(data))
    v = copy("truncated")
    (v / "__1_0.distcp").write_bytes((v / "__1_0.distcp").read_bytes()[:1000])
    (copy("metadata missing") / ".metadata").unlink()
    v = copy("metadata truncated")
    (v / ".metadata").write_bytes((v / ".metadata").read_bytes()[:100])
    (copy("manifest missing") / "fxpipe.json").unlink()
    v = copy("manifest truncated")
    (v / "fxpipe.json").write_text((v / "fxpipe.json").read_text()[:200])
    (copy("LATEST damaged").parent / "LATEST").write_text("../../etc\n")
    v = copy("files swapped")
    a, b = (v / "__0_0.distcp").read_bytes(), (v / "__1_0.distcp").read_bytes()
    (v / "__0_0.distcp").write_bytes(b)
    (v / "__1_0.distcp").write_bytes(a)
    evil = pickle.dumps(_Evil(str(root / "pwned")))
    v = copy("malicious metadata")
    (v / ".metadata").write_bytes(evil)
    rehash(v)
    v = copy("malicious data")
    (v / "__0_0.distcp").write_bytes(evil * 4)
    rehash(v)
    cases["another model"] = str(root / "other")
    cases["no optimizer state"] = str(root / "noopt")
    (root / "evil.pt").write_bytes(evil)
    cases["full: malicious .pt"] = str(root / "evil.pt")
    sd = torch.load(root / "model.pt", weights_only=True)
    torch.save({**sd, "extra.weight": torch.zeros(2)}, root / "extra.pt")
    cases["full: another model's state dict"] = str(root / "extra.pt")
    return cases


class _Evil:
    """A pickle that would create a file when unpickled (were any pickled code run)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.path}",))


WORDS = {  # what each corrupted copy's error names: the file and the check
    "byte flipped": ["__0_0.distcp", "SHA-256", "resume from an earlier"],
    "truncated": ["__1_0.distcp", "1000 bytes", "truncated"],
    "metadata missing": [".metadata is missing"],
    "metadata truncated": [".metadata has 100 bytes"],
    "manifest missing": ["LATEST names", "no fxpipe.json"],
    "manifest truncated": ["fxpipe.json cannot be read as JSON"],
    "LATEST damaged": ["LATEST names '../../etc'", "not a version folder"],
    "files swapped": ["distcp"],
    "malicious metadata": [".metadata cannot be read as DCP metadata", "refused to build posix.system"],
    "malicious data": ["reading", "damaged"],
    "another model": ["saved from another model", "blocks.1."],
    "no optimizer state": ["holds no optimizer state", "optimizer=opt"],
    "full: malicious .pt": ["evil.pt cannot be read as a state dict", "never loaded"],
    "full: another model's state dict": ["does not match this model", "extra.weight"],
}


def _close(a: list[float], b: list[float]) -> None:
    torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-5)


def test_resume_on_any_plan_and_refuse_damage_alike(tmp_path: Path) -> None:
    import partition
    from pipe import checkpoint
    from pipe.ckpt_format import read_metadata
    saved = run_ranks("tests.test_checkpoint:save_body", 2, timeout=120, root=str(tmp_path))
    ref = saved[0]
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "LATEST").read_text().strip() == Path(ref["folder"]).name
    assert sorted(p.name for p in ckpt.iterdir()) == [".commit-lock", "LATEST", Path(ref["folder"]).name]
    assert not (Path(ref["folder"]) / ".writing").exists()  # the version's lock goes with its save
    # the save into a folder per rank left no LATEST and no manifest: nothing a load would take
    for r in (0, 1):
        assert not (tmp_path / f"ckpt_rank{r}" / "LATEST").exists()
        assert not list((tmp_path / f"ckpt_rank{r}").glob("*/fxpipe.json"))
    assert list((tmp_path / "ckpt_rank1").glob("*/__1_0.distcp"))  # what rank 1 wrote stays where it wrote it
    # the tied embedding/head (held by both ranks) is written once, aliases point at it
    m = json.loads((Path(ref["folder"]) / "fxpipe.json").read_text())
    assert m["state_keys"]["lm_head.weight"] == m["state_keys"]["tok_emb.weight"] == "tok_emb.weight"
    md = read_metadata(Path(ref["folder"]))
    assert sum(k.startswith("model.") for k in md.state_dict_metadata) == len(set(m["state_keys"].values()))

    # one process, no pipeline: the unpartitioned model and its optimizer go on alike
    w = partition.load("gpt", seed=123, **KW)
    w.model.load_state_dict(checkpoint.load_full_state_dict(ckpt), strict=True)
    opt = torch.optim.AdamW(w.model.parameters(), lr=1e-2)
    assert checkpoint.load_full_optimizer_state(ckpt, w.model, opt) == K
    saved_m = {n: t for s in saved for n, t in s["moments"].items()}
    named = dict(w.model.named_parameters())
    assert set(saved_m) == set(named)
    for n, t in saved_m.items():
        torch.testing.assert_close(opt.state[named[n]]["exp_avg"], t, rtol=0, atol=0)
    plain = []
    for step in range(K, TOTAL):
        args, target = w.make_batch(16, step)
        loss = w.loss_fn(w.model(*args), target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        plain.append(float(loss.detach()))
    _close(plain, ref["rest"])
    # exported as one file (and as HF-style shards), loadable strictly outside fxpipe
    assert checkpoint.main(["export", str(ckpt), "--to", str(tmp_path / "model.safetensors")]) == 0
    assert checkpoint.main(["export", str(ckpt), "--to", str(tmp_path / "model.pt")]) == 0
    assert checkpoint.main(["plan", str(ckpt), "--to", str(tmp_path / "plan.json")]) == 0
    assert [st.params for st in partition.Plan.load(tmp_path / "plan.json").stages] == ref["bounds"]
    assert checkpoint.main(["show", str(ckpt)]) == 0 and checkpoint.main(["show", str(tmp_path)]) == 2
    full = checkpoint.load_full_state_dict(ckpt)
    from safetensors.torch import load_file, save_file
    for exported in (load_file(str(tmp_path / "model.safetensors")),
                     torch.load(tmp_path / "model.pt", weights_only=True)):
        partition.load("gpt", **KW).model.load_state_dict(exported, strict=True)
        for k, t in full.items():
            assert torch.equal(exported[k], t), k
    shards = tmp_path / "shards"
    shards.mkdir()
    keys = sorted(k for k in full if k != "lm_head.weight")  # HF omits the tied head
    halves = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for f, ks in halves.items():
        save_file({k: full[k].contiguous() for k in ks}, str(shards / f))
    (shards / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: f for f, ks in halves.items() for k in ks}}))

    corrupt = _corrupt(tmp_path)
    start = time.monotonic()
    res = run_ranks("tests.test_checkpoint:resume_body", 2, timeout=240, root=str(tmp_path), corrupt=corrupt)
    wall = time.monotonic() - start
    four = run_ranks("tests.test_checkpoint:four_body", 4, timeout=120, root=str(tmp_path))
    for r in range(2):
        got = res[r]
        # the same plan, fresh launch: bitwise (floats compared with ==), random state too
        assert got["plan"]["done"] == K and got["plan"]["bounds"] == ref["bounds"]
        assert got["plan"]["rest"] == ref["rest"]
        assert torch.equal(got["plan"]["drawn"][0], saved[r]["drawn"][0])
        assert got["plan"]["drawn"][1] == saved[r]["drawn"][1]
        assert set(got["plan"]["extra"]) == {"epoch", "seen", "lr"} and got["plan"]["extra"]["epoch"] == 3
        assert torch.equal(got["plan"]["extra"]["seen"], torch.arange(4)) and got["plan"]["extra"]["lr"] == [0.01]
        for case in ("measured", "2 per rank", "into offload"):
            assert got[case]["done"] == K, case
            _close(got[case]["rest"], ref["rest"])
        _close(got["from offload"]["rest"], ref["off_rest"])
        assert len(got["2 per rank"]["bounds"]) == 4
    # AdamW's moments, by name, on whichever rank holds each parameter now
    for got in [res[0]["measured"], res[1]["measured"], res[0]["2 per rank"], *[f for f in four]]:
        moments = got["moments"]
        assert moments
        for n, t in moments.items():
            torch.testing.assert_close(t, saved_m[n], rtol=0, atol=0)
    for f in four:
        assert f["done"] == K and len(f["bounds"]) == 4
        _close(f["rest"], ref["rest"])
    assert set().union(*[set(f["moments"]) for f in four]) == set(saved_m)
    # a full state dict, each rank reading exactly its tensors (a tied name under either alias)
    for r in range(2):
        for name in ("model.pt", "model.safetensors", "shards"):
            got = res[r][name]
            for n, t in got["state"].items():
                assert torch.equal(t, full[n]), (name, n)
            aliases = {"lm_head.weight": "tok_emb.weight"}  # a tied name: read to check it holds the same value
            assert sorted({aliases.get(k, k) for k in got["read"]}) == got["mine"], (name, r)
    # the corruption table: every rank the same error, naming the file and the check, within seconds
    for case, words in WORDS.items():
        msgs = [res[r]["errors"][case][0] for r in range(2)]
        assert msgs[0] == msgs[1], (case, msgs)
        for word in words:
            assert word in msgs[0], (case, word, msgs[0])
        assert all(res[r]["errors"][case][1] < 30 for r in range(2)), case
    assert not (tmp_path / "pwned").exists()  # no pickled code ran
    _close(res[0]["after"], ref["rest"][:1])
    assert wall < 240


def kill_body(rank: int, world: int, *, root: str) -> dict[str, Any]:
    """One process: a complete checkpoint, then saves killed at each point (in a forked child, so the
    save is a real interrupted process); after each, what loads and resumes."""
    import torch.distributed.checkpoint.filesystem as fs
    import partition
    import pipe
    from pipe import checkpoint
    pipe.init()
    w = partition.load("gpt", **KW)
    pp, opt = _pipeline(w, cost="flops")
    _train(pp, opt, w, range(K))
    ckpt = f"{root}/ckpt"
    pp.save(ckpt, optimizer=opt)
    cont = _train(pp, opt, w, range(K, TOTAL))   # pp is now at step TOTAL

    def die_on(obj: Any, name: str, call: int) -> None:
        real = getattr(obj, name)
        calls = [0]

        def wrapped(*a: Any, **k: Any) -> Any:
            calls[0] += 1
            if calls[0] == call:
                os._exit(17)
            return real(*a, **k)
        setattr(obj, name, wrapped)

    points = {  # where the save dies
        "while writing the data": (fs, "_write_item", 2),
        "before DCP's metadata rename": (fs.FileSystem, "rename", 1),
        "before the manifest's rename": (os, "replace", 1),
        "between the manifest's and LATEST's renames": (os, "replace", 2),
        "after LATEST, before the clean-up": (checkpoint, "_clean", 1),
    }
    out: dict[str, Any] = {"cont": cont, "points": {}}
    for point, (obj, name, call) in points.items():
        pid = os.fork()
        if pid == 0:
            die_on(obj, name, call)
            pp.save(ckpt, optimizer=opt)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        wr, po = partition.load("gpt", seed=5, **KW), None
        po, oo = _pipeline(wr, cost="flops")
        done = po.load(ckpt, optimizer=oo)
        out["points"][point] = {"exit": os.waitstatus_to_exitcode(status), "done": done,
                                "rest": _train(po, oo, wr, range(done, TOTAL)) if done == K else [],
                                "entries": sorted(p.name for p in Path(ckpt).iterdir())}
    pp.save(ckpt, optimizer=opt)  # a whole save cleans up what the killed ones left
    out["after"] = sorted(p.name for p in Path(ckpt).iterdir())
    pp.save(ckpt, optimizer=opt, keep=2)
    out["keep2"] = sorted(p.name for p in Path(ckpt).iterdir())
    return out


def test_a_save_killed_anywhere_leaves_the_last_checkpoint(tmp_path: Path) -> None:
    out = run_ranks("tests.test_checkpoint:kill_body", 1, timeout=120, root=str(tmp_path))[0]
    points = out["points"]
    assert len(points) == 5
    for point, got in points.items():
        assert got["exit"] == 17, point  # it died where it was meant to
        if point.startswith("after LATEST"):
            assert got["done"] == TOTAL, point  # the new version was complete and current
        else:
            assert got["done"] == K and got["rest"] == out["cont"], point  # the previous one, bitwise
    assert len(points["between the manifest's and LATEST's renames"]["entries"]) > 3  # leftovers there were
    assert len(out["after"]) == 3 and out["after"][:2] == [".commit-lock", "LATEST"]
    assert len(out["keep2"]) == 4


def test_format_1_and_non_checkpoints_are_named(tmp_path: Path) -> None:
    from pipe.checkpoint import CheckpointError, resolve
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "manifest.json").write_text("{}")
    with pytest.raises(CheckpointError, match="earlier fxpipe"):
        resolve(tmp_path / "old")
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        resolve(tmp_path)


class _Scaled(torch.nn.Module):
    """A layer times a persistent buffer its forward reads, which fx copies into the stage (get_attr)."""

    def __init__(self, inner: torch.nn.Module, width: int) -> None:
        super().__init__()
        self.inner = inner
        self.register_buffer("scale", torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * self.scale


def _scaled_mlp() -> Any:
    import partition
    w = partition.load("mlp", depth=4, width=16, in_features=8)
    for i in (0, 3):
        w.model.layers[i] = _Scaled(w.model.layers[i], 16)
    return w


def buffers_body(rank: int, world: int, *, root: str) -> dict[str, Any]:
    """Buffers a stage reads by get_attr, after the stage's were replaced by new tensors (as moving
    a stage to a GPU replaces them): saved, exported and loaded from the stages' own tensors."""
    import pipe
    from pipe.checkpoint import load_full_state_dict
    pipe.init()
    pps = []
    for _ in range(2):
        w = _scaled_mlp()
        pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=2, cost="flops")
        for s in pp.local:
            pp.stages[s]._apply(lambda t: t.clone())
        pps.append((w, pp))
    (w, pp), (w2, p2) = pps
    for b in pp.local_buffers().values():
        b.add_(0.5)  # the stage's value, no longer the model's old tensor's
    bufs = {k: b.clone() for k, b in pp.local_buffers().items()}
    pp.save(f"{root}/bn")
    full = load_full_state_dict(f"{root}/bn")
    p2.load(f"{root}/bn")
    out = {"saved": all(torch.equal(full[k], b) for k, b in bufs.items()), "n": len(bufs),
           "loaded": all(torch.equal(p2.local_buffers()[k], b) for k, b in bufs.items()),
           "moved": all(w.model.get_buffer(k) is not b for k, b in pp.local_buffers().items())}
    out.update(_unread_parameters(root))
    out.update(_grad_scaler(root))
    return out


def _grad_scaler(root: str) -> dict[str, Any]:
    """make_grad_scaler's state saved and restored, also into a scaler made after the load (found by review: a
    resume started from the initial scale, 1.1e12 for 65536, and its first steps overflowed, skipped silently)."""
    import pipe
    w = _scaled_mlp()
    pp = pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=2, cost="flops")
    opt = torch.optim.SGD(list(pp.parameters()), lr=1e-3)
    scaler = pp.make_grad_scaler(init_scale=2.0 ** 40, backoff_factor=2.0 ** -24)
    args, _, target = w.batch(2 * w.microbatch_size, 0)
    with torch.autocast("cpu", dtype=torch.float16):
        pp.step(*args, target=target)
    scaler.step(opt)
    scaler.update()  # an overflow at 2**40: backed off
    state = scaler.state_dict()
    pp.save(f"{root}/scaled", optimizer=opt)
    out = {}
    for before in (True, False):
        w2 = _scaled_mlp()
        p2 = pipe.Pipeline(w2.model, w2.example_args, loss_fn=w2.loss_fn, microbatches=2, cost="flops")
        s2 = p2.make_grad_scaler(init_scale=2.0 ** 40) if before else None
        p2.load(f"{root}/scaled", optimizer=torch.optim.SGD(list(p2.parameters()), lr=1e-3))
        s2 = s2 or p2.make_grad_scaler(init_scale=2.0 ** 40)
        out[f"scaler made {'before' if before else 'after'} the load"] = s2.state_dict() == state
    out["scale"] = state["scale"]
    return out


def _unused(seed: int, meta: bool = False) -> Any:
    """The MLP with a head its forward never calls (a parameter no stage reads)."""
    torch.manual_seed(seed)
    with torch.device("meta") if meta else contextlib.nullcontext():
        w = _scaled_mlp()
        w.model.unused = torch.nn.Linear(3, 2)
    return w


def _unread_parameters(root: str) -> dict[str, Any]:
    """A parameter no stage reads: saved, loaded, exported and given by weights= like the others (it was
    missing from checkpoints, whose own load then refused them as damaged)."""
    import pipe
    from pipe.checkpoint import load_full_state_dict
    (wa, wb), want = (_unused(0), _unused(1)), _unused(0).model.state_dict()
    pa, pb = (pipe.Pipeline(w.model, w.example_args, loss_fn=w.loss_fn, microbatches=2, cost="flops")
              for w in (wa, wb))
    pa.save(f"{root}/unused")
    full = load_full_state_dict(f"{root}/unused")
    pb.load(f"{root}/unused")
    wm = _unused(2, meta=True)
    pm = pipe.Pipeline(wm.model, wm.example_args, loss_fn=wm.loss_fn, microbatches=2, cost="flops", weights=want)
    out = {"checkpoint": sorted(k for k in want if k not in full or not torch.equal(full[k], want[k])),
           "keys": sorted(full) == sorted(want), "loaded": torch.equal(wb.model.unused.weight, want["unused.weight"])}
    for name, p in (("exported", pa), ("meta", pm)):
        sd = p.full_state_dict()
        if sd is not None:  # rank 0's
            out[name] = sorted(k for k in want if k not in sd or not torch.equal(sd[k].cpu(), want[k]))
    return out


def test_buffers_are_the_stages_own_tensors_and_unread_parameters_are_kept(tmp_path: Path) -> None:
    res = run_ranks("tests.test_checkpoint:buffers_body", 2, timeout=90, root=str(tmp_path))
    for r in res:
        assert r["n"] == 1 and r["moved"] and r["saved"] and r["loaded"], r
        assert r["checkpoint"] == [] and r["keys"], r
    assert res[0]["loaded"] and res[0]["exported"] == [] and res[0]["meta"] == [], res[0]
    for r in res:
        assert r["scale"] < 2.0 ** 40 and r["scaler made before the load"] and r["scaler made after the load"], r


def test_keep_counts_versions_in_the_order_they_were_committed(tmp_path: Path) -> None:
    """A run resumed from an older version (steps 800 of 800, 900, 1000) saves 850, 875, 890: those are the
    newest, and keep=3 removes the abandoned 900 and 1000 rather than each new save (ordered by step, it did)."""
    from pipe.checkpoint import _clean
    from pipe.ckpt_format import MANIFEST

    def commit(step: int, tag: str) -> Path:
        folder = tmp_path / f"step-{step:08d}-{tag * 12}"
        folder.mkdir()
        (folder / MANIFEST).write_text(json.dumps({"step": step, "committed_ns": len(commits) + 1}))
        commits.append(step)
        _clean(tmp_path, folder, keep=3)
        return folder
    commits: list[int] = []
    for step, tag in ((800, "a"), (900, "b"), (1000, "c"), (850, "d"), (875, "e"), (890, "f")):
        commit(step, tag)
    left = sorted(int(p.name.split("-")[1]) for p in tmp_path.iterdir())
    assert left == [850, 875, 890], left


def test_clean_spares_a_version_another_save_is_writing_and_the_one_latest_names(tmp_path: Path) -> None:
    """Two jobs given one folder: one's clean-up removed the other's version while it was being written (its
    lock now says so), and a version LATEST names is never removed; an interrupted save's leftover still is."""
    from pipe.checkpoint import WRITING, _clean, _lock
    from pipe.ckpt_format import LATEST, MANIFEST

    def version(step: int, tag: str, complete: bool) -> Path:
        folder = tmp_path / f"step-{step:08d}-{tag * 12}"
        folder.mkdir()
        if complete:
            (folder / MANIFEST).write_text(json.dumps({"step": step, "committed_ns": step}))
        return folder
    theirs = version(5, "a", complete=False)       # the other job is writing it
    fd = _lock(theirs / WRITING)
    leftover = version(6, "b", complete=False)     # a save that died: its lock file, unlocked
    (leftover / WRITING).touch()
    named = version(7, "c", complete=True)         # the other job's LATEST
    (tmp_path / LATEST).write_text(named.name + "\n")
    mine = version(8, "d", complete=True)
    try:
        _clean(tmp_path, mine, keep=1)
        assert theirs.is_dir() and named.is_dir() and mine.is_dir() and not leftover.exists()
    finally:
        os.close(fd)
    _clean(tmp_path, mine, keep=1)                 # its writer gone (unlocked) and no manifest: a leftover
    assert not theirs.exists() and named.is_dir()


def test_extra_state_comes_back_as_given() -> None:
    """Found by review: a tuple in extra= came back a list, and a dict of the user's whose one key was
    "__tensor__" came back as another tensor. Pure: the encoding a manifest holds, through JSON, and back."""
    import json

    from pipe.checkpoint import _decode_extra, _encode_extra
    t = torch.arange(3)
    extra = {"n": {"__tensor__": "extra.0"}, "pair": (1, (2.5, "x")), "t": t, "marks": [{"__tuple__": 1},
             {"__dict__": {"a": 1}}], "plain": {"a": [1, 2]}}
    tensors: dict[str, torch.Tensor] = {}
    back = _decode_extra(json.loads(json.dumps(_encode_extra(extra, tensors))), tensors)
    assert back["n"] == {"__tensor__": "extra.0"} and back["pair"] == (1, (2.5, "x"))
    assert back["marks"] == [{"__tuple__": 1}, {"__dict__": {"a": 1}}] and back["plain"] == {"a": [1, 2]}
    assert torch.equal(back["t"], t) and set(back) == set(extra)


def test_a_schedulers_state_with_keys_other_than_strings_resumes_its_schedule() -> None:
    """Found by review: MultiStepLR's state (milestones, a Counter of ints) was refused in extra=, and the fix the
    error named (string keys) kept the learning rate from ever decaying: 0.1 where 0.01 and 0.001 were due."""
    import collections
    import json

    from pipe.checkpoint import _decode_extra, _encode_extra

    def lrs(sched: Any, opt: Any, n: int) -> list[float]:
        out = []
        for _ in range(n):
            opt.step()
            sched.step()
            out.append(opt.param_groups[0]["lr"])
        return out
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.1)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[4, 6], gamma=0.1)
    lrs(sched, opt, 2)
    tensors: dict[str, torch.Tensor] = {}
    extra = {"sched": sched.state_dict(), "keys": {(1, "a"): 2, 3.5: None, None: [1]}}
    back = _decode_extra(json.loads(json.dumps(_encode_extra(extra, tensors))), tensors)
    assert isinstance(back["sched"]["milestones"], collections.Counter), back["sched"]
    assert back["sched"] == sched.state_dict() and back["keys"] == extra["keys"], back
    p2 = torch.nn.Parameter(torch.zeros(1))
    opt2 = torch.optim.SGD([p2], lr=0.1)
    sched2 = torch.optim.lr_scheduler.MultiStepLR(opt2, milestones=[100], gamma=0.5)
    sched2.load_state_dict(back["sched"])
    opt2.param_groups[0]["lr"] = opt.param_groups[0]["lr"]
    want = lrs(sched, opt, 6)
    assert lrs(sched2, opt2, 6) == want and want[-1] == pytest.approx(0.001), want


def test_a_checkpoint_tying_weights_otherwise_is_refused() -> None:
    """Found by review: an untied model's checkpoint loaded into the model tying its head to the embedding
    dropped the saved head and its optimizer state without a word (the keys are the same, the tying not)."""
    from types import SimpleNamespace

    from pipe.ckpt_format import CheckpointError, check_model
    tied = {"tok_emb.weight": "tok_emb.weight", "lm_head.weight": "tok_emb.weight"}
    untied = {"tok_emb.weight": "tok_emb.weight", "lm_head.weight": "lm_head.weight"}
    for saved, mine in ((untied, tied), (tied, untied)):
        pp = SimpleNamespace(state_key_names=lambda mine=mine: dict(mine))
        with pytest.raises(CheckpointError, match=rf"ties its weights otherwise than this model \(lm_head.weight: "
                           rf"saved as {saved['lm_head.weight']}, read here as {mine['lm_head.weight']}\)"):
            check_model(pp, {"state_keys": saved}, Path("ckpt"))
    check_model(SimpleNamespace(state_key_names=lambda: dict(tied)), {"state_keys": tied}, Path("ckpt"))
