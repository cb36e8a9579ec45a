"""Tests for partition/workload.py: loading workloads by spec, errors, command-line overrides."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from partition.workload import (
    BUNDLED,
    Workload,
    WorkloadError,
    WorkloadTypeError,
    load,
    parse_overrides,
)

FORMS = ("package.module:factory", "path/file.py:factory")

FACTORY_FILE = textwrap.dedent(
    """
    import torch
    from partition.workload import Workload

    def tiny(*, width: int = 3) -> Workload:
        model = torch.nn.Linear(width, 2)
        def make_batch(batch_size: int, step: int):
            gen = torch.Generator().manual_seed(step)
            return (torch.randn(batch_size, width, generator=gen),), torch.zeros(batch_size, 2)
        return Workload(
            name="tiny",
            model=model,
            example_args=make_batch(4, 0)[0],
            loss_fn=torch.nn.functional.mse_loss,
            make_batch=make_batch,
            microbatch_size=4,
        )

    def not_a_workload() -> dict:
        return {"model": None}

    def broken(**kwargs) -> Workload:
        raise RuntimeError("factory exploded")

    NOT_CALLABLE = 3
    """
)


@pytest.fixture
def factory_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A factory file inside a subfolder of the working directory; returns its relative path."""
    folder = tmp_path / "some"
    folder.mkdir()
    (folder / "tmp_factories.py").write_text(FACTORY_FILE)
    monkeypatch.chdir(tmp_path)
    return os.path.join("some", "tmp_factories.py")


def test_load_bundled_name() -> None:
    w = load("gpt", n_layer=1, d_model=16, n_head=2, seq_len=8, vocab=32)
    assert isinstance(w, Workload) and w.name == "gpt"
    assert w.tokens_per_sample == 8 and w.layer_prefixes == ("blocks.0",)
    assert w.model(*w.example_args).shape == (w.microbatch_size, 8, 32)


def test_every_bundled_name_resolves() -> None:
    import bench.models

    assert all(callable(getattr(bench.models, name)) for name in BUNDLED)


def test_load_module_spec_with_kwargs() -> None:
    w = load("bench.models:mlp", depth=2)
    assert w.name == "mlp" and w.layer_prefixes == ("layers.0", "layers.1")


def test_load_file_spec(factory_file: str) -> None:
    w = load(f"{factory_file}:tiny", width=5)
    assert w.name == "tiny" and isinstance(w.model, torch.nn.Linear)
    assert w.model.in_features == 5
    assert load(f"{factory_file}:tiny").model.in_features == 3


def _check_error(spec: str, *words: str) -> str:
    with pytest.raises(WorkloadError) as info:
        load(spec)
    message = str(info.value)
    for word in (*words, *FORMS, "gpt"):
        assert word in message, f"{word!r} missing from: {message}"
    return message


def test_missing_module_names_module_and_forms() -> None:
    _check_error("nosuchmodule:f", "'nosuchmodule'", "ModuleNotFoundError")


def test_missing_attribute_names_attribute_and_forms() -> None:
    message = _check_error("bench.models:nosuch", "'bench.models'", "'nosuch'")
    assert "gpt_text" in message  # lists what the module does offer


def test_missing_file_names_path_and_forms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    _check_error("missing.py:f", "'missing.py'", "not found", str(tmp_path))


def test_too_many_colons_and_empty_spec() -> None:
    _check_error("gpt:too:many", "'gpt:too:many'", "exactly one ':'")
    _check_error("", "empty")
    _check_error("nosuchname", "not a bundled name")
    _check_error(":f", "exactly one ':'")


def test_not_callable_and_failing_factories(factory_file: str) -> None:
    _check_error(f"{factory_file}:NOT_CALLABLE", "'NOT_CALLABLE'", "not a callable")
    with pytest.raises(WorkloadError, match=r"calling broken\(\) .*RuntimeError: factory exploded"):
        load(f"{factory_file}:broken")
    with pytest.raises(WorkloadError, match=r"mlp\(no_such_arg=1\).*unexpected keyword"):
        load("bench.models:mlp", no_such_arg=1)


def test_file_that_fails_to_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.py").write_text("raise ImportError('needs a missing library')\n")
    _check_error("bad.py:f", "'bad.py'", "needs a missing library")


def test_factory_returning_non_workload_is_type_error(factory_file: str) -> None:
    with pytest.raises(TypeError, match="returned dict") as info:
        load(f"{factory_file}:not_a_workload")
    assert isinstance(info.value, WorkloadError)  # one except clause catches every failure
    assert isinstance(info.value, WorkloadTypeError)
    assert factory_file in str(info.value)


def test_workload_validates_its_fields() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    common: dict[str, Any] = dict(
        name="w",
        model=model,
        loss_fn=torch.nn.functional.mse_loss,
        make_batch=lambda b, s: ((torch.zeros(b, 2),), torch.zeros(b, 2)),
        microbatch_size=1,
    )
    w = Workload(example_args=(torch.zeros(1, 2),), layer_prefixes=("0",), **common)
    assert w.example_kwargs == {} and w.tokens_per_sample == 1
    with pytest.raises(TypeError, match="tuple"):
        Workload(example_args=torch.zeros(1, 2), **common)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not modules"):
        Workload(example_args=(torch.zeros(1, 2),), layer_prefixes=("layers.0",), **common)
    with pytest.raises(ValueError, match="microbatch_size"):
        Workload(example_args=(torch.zeros(1, 2),), **{**common, "microbatch_size": 0})


def test_parse_overrides_types() -> None:
    parsed = parse_overrides(
        ["n_layer=4", "vocab=1000", "tie=false", "bias=True", "lr=1e-3", "p=0.5", "act=gelu",
         "path=a=b", "neg=-2", "empty="]
    )
    assert parsed == {
        "n_layer": 4, "vocab": 1000, "tie": False, "bias": True, "lr": 1e-3, "p": 0.5,
        "act": "gelu", "path": "a=b", "neg": -2, "empty": "",
    }
    assert type(parsed["n_layer"]) is int and type(parsed["tie"]) is bool
    assert type(parsed["lr"]) is float
    assert parse_overrides([]) == {}


@pytest.mark.parametrize("item", ["n_layer", "=4", "n layer=4", "1x=2"])
def test_parse_overrides_rejects_malformed(item: str) -> None:
    with pytest.raises(WorkloadError, match="key=value"):
        parse_overrides([item])


def test_parse_overrides_rejects_duplicates() -> None:
    with pytest.raises(WorkloadError, match="twice"):
        parse_overrides(["a=1", "a=2"])
