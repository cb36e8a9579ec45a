"""A Hugging Face checkpoint read under the model's own names, as transformers' `from_pretrained`
reads it: transformers' conversion mapping for the model (pipe.state_dicts uses it only where the
checkpoint's keys are not the model's).

Checkpoints keep older layouts that the model classes have since changed, and transformers 5 writes
them back on `save_pretrained`: GPT-NeoX's head is `embed_out` in the file and `lm_head` in the
model; Mixtral's experts are one tensor each per projection in the file (`experts.3.w1.weight`) and
two stacked tensors in the model (`mlp.experts.gate_up_proj`). A checkpoint of the base model
(`GPT2Model`) loads into one with a head (`GPT2LMHeadModel`) by adding its `base_model_prefix`.
transformers' own mapping (`get_model_conversion_mapping`) and key renaming (`rename_source_key`)
name each file key's tensor in the model; a key its converters merge or split is converted by the
converter's own operations, once on meta tensors for the target's name and shape, then on the
tensors read when the target is copied in (only the targets of a rank's stages are read)."""
from __future__ import annotations

import re
from copy import deepcopy
from typing import Any, Callable

import torch

from pipe.ckpt_format import CheckpointError

__all__ = ["Converted", "converted", "ignored_on_load"]


def ignored_on_load(model: torch.nn.Module, unexpected: set[str]) -> list[str]:
    """The keys of `unexpected` (a checkpoint's keys the model has not) that transformers' from_pretrained
    skips without a word for `model`: those its class lists in `_keys_to_ignore_on_load_unexpected` (regular
    expressions searched in the key, gathered from the submodels), and, where the model has such buffers, the
    rotary frequencies and position ids older checkpoints hold (`rotary_emb.inv_freq` in each layer, now one
    non-persistent buffer; `position_ids`, now non-persistent in most models)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return []
    if not isinstance(model, PreTrainedModel) or not unexpected:
        return []
    patterns = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    buffers = [n for n, _ in model.named_buffers()]
    if any(n.endswith("rotary_emb.inv_freq") for n in buffers):
        patterns.add(r"rotary_emb\.inv_freq")
    if any(n.endswith("position_ids") for n in buffers):
        patterns.add(r"(^|\.)position_ids$")
    if not patterns:
        return []
    found = re.compile("|".join(f"({p})" for p in sorted(patterns)))
    return sorted(k for k in unexpected if found.search(k))


def converted(src: Any, model: torch.nn.Module, model_keys: set[str]) -> "Converted | None":
    """`src` (a pipe.state_dicts source) under `model`'s names, or None when the model is not a
    transformers model or its mapping changes no key of `src`."""
    try:
        from transformers import PreTrainedModel
        from transformers import conversion_mapping, core_model_loading  # noqa: F401 - transformers 5's
    except ImportError:  # no transformers, or one before its conversion mapping (4.x renames on its own)
        return None
    if not isinstance(model, PreTrainedModel):
        return None
    view = Converted(src, model, model_keys)
    return view if view.changed else None


class Converted:
    """The source's tensors by the model's names (the interface pipe.state_dicts reads: keys, shape,
    get, copy_into, batched)."""

    batched = False

    def __init__(self, src: Any, model: Any, model_keys: set[str]) -> None:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (WeightConverter, WeightRenaming, dot_natural_key,
                                                     rename_source_key)
        self.src, self.model, self.path = src, model, src.path
        mapping = get_model_conversion_mapping(model)
        renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
        converters = [t for t in mapping if isinstance(t, WeightConverter)]
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        present = dict.fromkeys(model_keys, True)  # what rename_source_key asks of the model's state dict
        prefix = model.base_model_prefix
        self.renamed: dict[str, str] = {}  # model key -> the file's key
        groups: dict[str, tuple[Any, list[tuple[str, str]]]] = {}  # a converter's first target -> its sources
        for key in sorted(src.keys, key=dot_natural_key):  # experts in their order, as transformers reads them
            new, pattern = rename_source_key(key, renamings, converters, prefix, present)
            if new not in present and key in present:  # as transformers does: the key as it is
                new, pattern = rename_source_key(key, [], [], prefix, present)
            if pattern is None:
                if new in self.renamed:
                    raise CheckpointError(f"{src.path} holds both {self.renamed[new]} and {key}, which "
                                          f"transformers' key mapping for {type(model).__name__} both reads as "
                                          f"{new}; keep one of them")
                self.renamed[new] = key
            else:
                groups.setdefault(new, (by_pattern[pattern], []))[1].append((key, pattern))
        self.groups = groups
        self.made: dict[str, str] = {}  # a converted model key -> its group (the converter's first target)
        self.shapes: dict[str, tuple[int, ...]] = {}
        for first in groups:
            out = self._convert(first, lambda k: torch.empty(src.shape(k), device="meta"))
            for target, t in out.items():
                self.made[target] = first
                self.shapes[target] = tuple(t.shape)
        self.keys = set(self.renamed) | set(self.made)
        self.renames = sum(new != old for new, old in self.renamed.items())
        self.changed = bool(groups) or self.renames > 0
        self._done: dict[str, dict[str, torch.Tensor]] = {}  # a group's targets converted, not yet copied in

    def describe(self) -> str:
        """What was read under other names, for the plan's notes."""
        parts = [f"{self.renames} key{'s' if self.renames != 1 else ''} renamed"] if self.renames else []
        if self.made:
            parts.append(f"{len(self.made)} tensor{'s' if len(self.made) != 1 else ''} converted from "
                         f"{sum(len(s) for _, s in self.groups.values())}")
        return (f"read as transformers' from_pretrained reads it into {type(self.model).__name__} "
                f"({', '.join(parts)})")

    def _convert(self, first: str, read: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
        """The targets of the group `first`: its converter's operations on its sources' tensors."""
        template, sources = self.groups[first]
        conv = deepcopy(template)  # a converter collects its tensors: a fresh one for each conversion
        for key, pattern in sources:
            conv.add_tensor(first, key, pattern, lambda key=key: read(key))
        try:
            out = conv.convert(first, model=self.model, config=getattr(self.model, "config", None))
        except Exception as e:  # noqa: BLE001 - transformers' operation, on this file's tensors
            raise CheckpointError(f"{self.src.path}: transformers' conversion of {[k for k, _ in sources][:3]} into "
                                  f"{first} failed ({type(e).__name__}: {str(e)[:200]}); load the checkpoint with "
                                  f"{type(self.model).__name__}.from_pretrained and pass its state_dict()") from None
        return {k: (v[0] if isinstance(v, list) and len(v) == 1 else v) for k, v in out.items()}

    def shape(self, key: str) -> tuple[int, ...]:
        return self.shapes[key] if key in self.made else self.src.shape(self.renamed[key])

    def get(self, key: str) -> torch.Tensor:
        if key in self.renamed:
            return self.src.get(self.renamed[key])
        first = self.made[key]
        if first not in self._done:
            self._done[first] = self._convert(first, self.src.get)
        return self._done[first][key]

    def copy_into(self, key: str, dst: torch.Tensor) -> None:
        if key in self.renamed:
            self.src.copy_into(self.renamed[key], dst)
            return
        dst.copy_(self.get(key))
        done = self._done[self.made[key]]
        del done[key]  # copied in: its group's other targets are kept until they are
        if not done:
            del self._done[self.made[key]]
