"""The interface between the pipeline interpreter and memory features: hooks around stages and actions."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx

__all__ = ["MemoryManager"]


class MemoryManager:
    """No memory features: every hook does nothing. Subclasses add recompute, offload and the ledger.

    The interpreter calls, for each compute action `a` (kind "F", "B" or "W", with `a.stage`,
    `a.mb`): `before(a)`, then for F the stage's forward inside `forward(stage, mb)`, then
    `after(a)`; for each memory action of the program (RELOAD) its handler (`reload`); for each
    batch of messages `posted(batch)` once it is issued.
    `wrap_stage` may replace a stage module (e.g. with a recomputing one) before the run.
    """

    def wrap_stage(self, stage: int, module: torch.nn.Module) -> torch.nn.Module:
        return module

    @contextlib.contextmanager
    def forward(self, stage: int, mb: int, inputs: Sequence[Any] = ()) -> Iterator[None]:
        """Around the forward of (stage, mb); `inputs`: its model inputs (and targets)."""
        yield

    def set_weight_order(self, stage: int, nodes: Sequence[str], multi: Sequence[torch.nn.Parameter]) -> None:
        """Zero-bubble: the parameter nodes W differentiates, in order, and the parameters B handles."""

    def fused_backward(self, stage: int) -> bool:
        """True when B of `stage` must compute the weight grads too (its W then does nothing)."""
        return False

    def plain(self, stage: int) -> bool:
        """True when neither recompute nor offload manage what the forward of `stage` keeps."""
        return True

    def before(self, action: Any) -> None:
        pass

    def stream_forward_only(self, stage: int, gm: torch.fx.GraphModule, param_nodes: dict[str, list[str]]) -> None:
        """A forward-only module of `stage` besides its training one, reading the stage's parameters:
        instrumented where they stream (in place); `param_nodes`: node -> the parameters it reads."""

    @contextlib.contextmanager
    def forward_only(self, program: Sequence[Any], modules: dict[int, torch.nn.Module | None]) -> Iterator[None]:
        """Around a forward-only program (evaluate, forward), each stage through `modules[stage]` (None:
        its training module); `before_forward_only(a)` before each of its F actions."""
        yield

    def before_forward_only(self, action: Any) -> None:
        pass

    def count_state_with(self, held: Callable[[int], tuple[int, int]],
                         params: dict[int, list[tuple[str, torch.nn.Parameter]]], extra: float) -> None:
        """Stages whose parameters and grads something else holds (FSDP): held(stage) -> their bytes now."""

    def after(self, action: Any) -> None:
        pass

    def posted(self, batch: Sequence[Any]) -> None:
        """A batch of the program (its communication actions) was issued: its receive buffers exist."""

    def set_program(self, program: Sequence[Any]) -> None:
        """This rank's lowered program as it will run (after its passes: BW for a fused backward,
        RELOAD): compute actions (with .stage, .kind, .mb), memory actions and batches of messages."""

    def reload_stages(self) -> list[int]:
        """Stages whose offloaded activations the program reloads with RELOAD actions (pipe.lower)."""
        return []

    def reload(self, stage: int, mb: int) -> None:
        """The program's RELOAD action for (stage, mb): its activations back on the device."""

    def step_begin(self) -> None:
        pass

    def step_end(self) -> None:
        pass

    def over_measured(self) -> list[str]:
        """What each stage measured over its memory budget, said once per stage (none without a budget)."""
        return []

    def report(self) -> dict[int, dict[str, int]]:
        """Per stage: bytes by kind, current and peak (keys such as 'activations', 'peak_activations')."""
        return {}
