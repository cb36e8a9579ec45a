"""Benchmarks of fxpipe (python -m bench ...; the memory ones under torchrun: bench.memory_*)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["save_json"]


def save_json(folder: str | Path, name: str, data: Any) -> Path:
    """Write `data` as indented JSON to folder/name, making the folder; the path written."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(json.dumps(data, indent=1, default=str))
    return path
