"""The exchange keeps a sent tensor exactly as long as the buffer rules of memory.buffers say (pure: a
transport that records, no processes), so the ledger's message buffers are the exchange's."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Sequence

import pytest
import torch

from memory.buffers import CommBuffers
from partition.plan import Value
from pipe.exchange import Exchange
from pipe.lower import lower
from pipe.schedules import Action, build

SHAPE = [2, 3]


class _Done:
    def wait(self) -> None:
        pass


class _Recorder:
    """A transport whose operations are complete at once (the peer's side is not simulated)."""

    def batch(self, ops: Sequence[tuple[str, torch.Tensor, int]]) -> list[Any]:
        return [_Done() for _ in ops]


@pytest.mark.parametrize("M", [2, 8])
def test_the_exchange_holds_sends_as_long_as_the_ledger_counts_them(M: int) -> None:
    S, place = 2, [0, 1]
    plan: Any = SimpleNamespace(stages=[SimpleNamespace(recv=[]),
                                        SimpleNamespace(recv=[Value("x", SHAPE, "float32", [3, 1])])])
    program = lower(build("1f1b", S, M), S, M, place)
    nbytes = 2 * 3 * 4
    for rank in (0, 1):
        ex = Exchange(_Recorder(), plan, place, rank, torch.device("cpu"), dynamic=False)  # type: ignore[arg-type]
        bufs = CommBuffers(place, rank, [0, nbytes], [nbytes, 0], zero_bubble=False)
        for x in program[rank]:
            if not isinstance(x, Action):
                ex.issue(x)
                bufs.batch(x)
                continue
            s, mb = x.stage, x.mb
            if x.kind == "F" and s == 0:
                ex.send_activations(0, mb, [torch.randn(*SHAPE)])
            elif x.kind == "F":
                ex.recv_activations(1, mb)
            elif x.kind == "B" and s == 0:
                ex.recv_grads(0, mb, [torch.randn(*SHAPE)])
            else:
                ex.send_grads(1, mb, [torch.randn(*SHAPE)])
            bufs.after(s, x.kind, mb)
            # what the exchange keeps of what it sends (in its outbox, then in flight), against the rules
            outputs = sum(len(v) for v in ex.sent_outputs.values()) + sum(
                len(v) for k, v in ex.outbox.items() if k[0] == "SEND_F")
            grads = sum(len(v) for v in ex.sent_grads.values()) + sum(
                len(v) for k, v in ex.outbox.items() if k[0] == "SEND_B")
            held_outputs = sum(1 for k in bufs.held if k[0] == "B" and k[1] == 0 and rank == 0)
            held_grads = sum(1 for k in bufs.held if k[0] == "sent")
            # rank 0's ("B", 0, mb) keys hold the outputs and, once posted, the grad buffer: count the outputs
            assert outputs == held_outputs and grads == held_grads, (rank, x, outputs, held_outputs, grads,
                                                                    held_grads)
        assert grads <= 2 and outputs == 0  # sent grads wait at most for the next receive from their peer
        ex.finish()
        assert not ex.sent_grads and not ex.sent_outputs


def test_a_value_crosses_the_wire_in_its_producers_dim_order() -> None:
    """The q of a fused qkv projection is a slice (not dense): it arrives densely in its own dim order, so
    attention lays its output out as unsplit and the transpose and flatten after it stay a view (on a
    contiguous q they copy, and the next layer saves the copy: 128 KiB a microbatch more than planned on
    tests.test_memory_parity's GPT). A transposed dense value keeps its strides; a broadcast one goes
    contiguous."""
    from pipe.comm import alloc_layout, to_layout
    B, T, H, D = 2, 8, 4, 16
    qkv = torch.randn(B, T, 3 * H * D)
    q, k, v = qkv.unflatten(-1, (3, H, D)).permute(2, 0, 3, 1, 4)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    assert sdpa(q, k, v).transpose(1, 2).is_contiguous()  # unsplit: a view
    assert not sdpa(q.contiguous(), k.contiguous(), v.contiguous()).transpose(1, 2).is_contiguous()
    got = []
    for t in (q, k, v):
        buf, wire = alloc_layout(t.shape, t.dtype, torch.device("cpu"), ref_shape=t.shape, ref_stride=t.stride())
        wire.copy_(to_layout(t, t.shape, t.stride()))  # what the transport moves
        assert torch.equal(buf, t) and buf.stride() == (T * H * D, D, H * D, 1)  # dense, in q's dim order
        got.append(buf)
    out = sdpa(*got)
    assert out.transpose(1, 2).is_contiguous() and torch.allclose(out, sdpa(q, k, v))
    x = torch.randn(3, 5).t()  # dense, transposed: the same strides
    buf, wire = alloc_layout(x.shape, x.dtype, torch.device("cpu"), ref_shape=x.shape, ref_stride=x.stride())
    wire.copy_(to_layout(x, x.shape, x.stride()))
    assert buf.stride() == x.stride() and torch.equal(buf, x)
    b = torch.randn(5).expand(3, 5)  # broadcast: contiguous
    buf, wire = alloc_layout(b.shape, b.dtype, torch.device("cpu"), ref_shape=b.shape, ref_stride=b.stride())
    wire.copy_(to_layout(b, b.shape, b.stride()))
    assert buf.is_contiguous() and torch.equal(buf, b)


def test_a_value_of_another_dtype_than_expected_is_refused_on_the_sender() -> None:
    """Without headers a receive buffer has the expected dtype (the plan's, or one learned under an autocast):
    a value of another dtype would land in it as garbage, so the sender refuses it, naming both; with the
    dtypes learned, the same value is expected and sent; a learning exchange records what it sends."""
    from partition.plan import PlanError
    place = [0, 1]
    plan: Any = SimpleNamespace(stages=[SimpleNamespace(recv=[]),
                                        SimpleNamespace(recv=[Value("x", SHAPE, "float32", [3, 1])])])
    half = torch.randn(*SHAPE, dtype=torch.bfloat16)
    ex = Exchange(_Recorder(), plan, place, 0, torch.device("cpu"), dynamic=False)  # type: ignore[arg-type]
    with pytest.raises(PlanError, match=r"stage 0 produced x as torch.bfloat16 but stage 1 expects torch.float32"):
        ex.send_activations(0, 0, [half])
    known = Exchange(_Recorder(), plan, place, 0, torch.device("cpu"), dynamic=False,  # type: ignore[arg-type]
                     dtypes={(1, 0): torch.bfloat16})
    known.send_activations(0, 0, [half])
    learning = Exchange(_Recorder(), plan, place, 0, torch.device("cpu"), dynamic=False,  # type: ignore[arg-type]
                        learn=True)
    learning.send_activations(0, 0, [half])
    assert learning.learned == {(1, 0): torch.bfloat16}
