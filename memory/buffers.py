"""Communication buffers by stage at each point of a rank's lowered program (pure, no torch).

The rules are the exchange's (pipe.exchange), applied where the program says a buffer is made
and where the action that consumes it ends; the runtime's ledger and the planner's prediction
both follow them through `CommBuffers`, so what is planned is what is counted:
- a receive is posted in its batch: activations of (s, mb) (recv[s] bytes) are held until the
  backward of (s, mb) that frees its activations; the grads of stage s's outputs (send[s]) until
  the B or BW of (s, mb) has read them;
- after F of (s, mb) its outputs (send[s]) are held until the B/BW of (s, mb): sent to another
  rank, the exchange keeps them until their grads are back; when stage s+1 is on this rank it
  also holds its copy as its input (recv[s+1], until its freeing backward);
- after B/BW of (s, mb) the grads of its inputs (recv[s]): handed to stage s-1 on this rank,
  until the B/BW of (s-1, mb); sent to another rank, until this rank has waited on a receive
  from that rank posted in a later batch (a pair's batches complete one at a time in issue
  order, as on NCCL, so the send is done by then), or else until the step ends.
Legend: S stages, s stage, mb microbatch; recv[s], send[s]: bytes stage s receives / sends per
microbatch (recv[0] = send[S-1] = 0).
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

__all__ = ["CommBuffers", "comm_peaks"]

Key = tuple[str, int, int]  # what releases a buffer: ("B" | "free", stage, mb), or ("sent", stage, mb)


class CommBuffers:
    """The buffers one rank holds; `batch`, `after` and `end` return (stage, delta bytes) moves.

    `place[s]`: the rank of stage s; `zero_bubble`: W (not B) frees a microbatch's activations."""

    def __init__(self, place: Sequence[int], rank: int, recv: Sequence[int], send: Sequence[int],
                 zero_bubble: bool) -> None:
        self.place, self.rank, self.recv, self.send = list(place), rank, list(recv), list(send)
        self.S, self.zero_bubble = len(self.place), zero_bubble
        self.held: dict[Key, list[tuple[int, int]]] = {}   # released when the key's action ends
        self.batches = 0
        self.posted: dict[tuple[str, int, int], int] = {}  # (RECV kind, stage, mb) -> its batch
        self.grads_out: dict[int, list[tuple[int, Key]]] = {}  # peer -> (batch, held key) of grads sent

    def _hold(self, until: Key, stage: int, n: int) -> list[tuple[int, int]]:
        if n == 0:
            return []
        self.held.setdefault(until, []).append((stage, n))
        return [(stage, n)]

    def _release(self, key: Key) -> list[tuple[int, int]]:
        return [(st, -n) for st, n in self.held.pop(key, [])]

    def batch(self, actions: Iterable[Any]) -> list[tuple[int, int]]:
        """A batch is issued: its receives' buffers."""
        moves: list[tuple[int, int]] = []
        for a in actions:
            s, mb = a.stage, a.mb
            if a.kind == "RECV_F":
                moves += self._hold(("free", s, mb), s, self.recv[s])
            elif a.kind == "RECV_B":
                moves += self._hold(("B", s, mb), s, self.send[s])
            elif a.kind == "SEND_B":
                self.grads_out.setdefault(self.place[s - 1], []).append((self.batches, ("sent", s, mb)))
            if a.kind in ("RECV_F", "RECV_B"):
                self.posted[(a.kind, s, mb)] = self.batches
        self.batches += 1
        return moves

    def after(self, s: int, kind: str, mb: int) -> list[tuple[int, int]]:
        """A compute action (F, B, W, BW) of (s, mb) ended: what it made is held, then what it consumed
        goes (both exist when it ends)."""
        moves: list[tuple[int, int]] = []
        if kind == "F" and s < self.S - 1:
            moves += self._hold(("B", s, mb), s, self.send[s])
            if self.place[s + 1] == self.rank:
                moves += self._hold(("free", s + 1, mb), s + 1, self.recv[s + 1])
        if kind in ("B", "BW") and s > 0:
            local = self.place[s - 1] == self.rank
            moves += self._hold(("B", s - 1, mb) if local else ("sent", s, mb), s - 1 if local else s, self.recv[s])
        ended = [("B", s, mb)] if kind in ("B", "BW") else []
        if kind == "BW" or kind == ("W" if self.zero_bubble else "B"):
            ended.append(("free", s, mb))
        waited = self._waited(s, kind, mb)
        if waited is not None:  # grads sent to that peer in earlier batches are done
            peer, j = waited
            done = [k for b, k in self.grads_out.get(peer, []) if b < j]
            self.grads_out[peer] = [(b, k) for b, k in self.grads_out.get(peer, []) if b >= j]
            ended += done
        for key in ended:
            moves += self._release(key)
        return moves

    def _waited(self, s: int, kind: str, mb: int) -> tuple[int, int] | None:
        """(peer, batch) of the receive this action waited on, if it came from another rank."""
        if kind == "F" and s > 0 and self.place[s - 1] != self.rank:
            return self.place[s - 1], self.posted[("RECV_F", s, mb)]
        if kind in ("B", "BW") and s < self.S - 1 and self.place[s + 1] != self.rank:
            return self.place[s + 1], self.posted[("RECV_B", s, mb)]
        return None

    def end(self) -> list[tuple[int, int]]:
        """The step ended: every buffer goes (a buffer still held then, other than grads sent, would be a
        defect of the program)."""
        moves = [(st, -n) for held in self.held.values() for st, n in held]
        self.held, self.grads_out, self.posted, self.batches = {}, {}, {}, 0
        return moves


def comm_peaks(programs: Mapping[int, Sequence[Any]], place: Sequence[int], recv: Sequence[int],
               send: Sequence[int], zero_bubble: bool) -> list[int]:
    """Per stage, the most communication bytes it holds at any point of its rank's program (the
    lowered programs of every rank: items are compute actions or batches, tuples of actions)."""
    peak = [0] * len(place)
    for rank, items in programs.items():
        bufs, now = CommBuffers(place, rank, recv, send, zero_bubble), [0] * len(place)
        for x in items:
            if isinstance(x, tuple) and not hasattr(x, "kind"):
                moves = bufs.batch(x)
            elif x.kind in ("F", "B", "W", "BW"):
                moves = bufs.after(x.stage, x.kind, x.mb)
            else:
                continue
            for s, n in moves:
                now[s] += n
                peak[s] = max(peak[s], now[s])
    return peak
