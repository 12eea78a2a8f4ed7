"""Linked requests admitted by what the runtime's KV pool can hold, so compiled chunks are still there at link time.

SGLang admits a prefill only when its KV fits the pool. A linked prompt reaches the runtime as
two requests, the compile of its pieces and then the link, and nothing holds the compiled chunks
in between: when more linked prompts are in flight than the pool holds, one prompt's compiles
evict another's chunks before its link arrives, the link is refused, compiled again, refused
again. Measured on the steady-state workload (`picrag bench steady`, an 8,192-token pool, 16
clients): 291 relinks in ten minutes, and the policy mix answered fewer requests than
prefix-only.

So the pipeline takes a share of the pool before it compiles a prompt and gives it back in two
steps: the prompt's stored pieces (its head and passages as stored) once the link's first event
has come back (the graft is done: the request's own slots hold their KV), its row (prompt and
new tokens) when its response ends. A piece several prompts in flight share counts once. A
prompt that waits for room waits in arrival order; one larger than the whole pool runs alone,
never refused here (the runtime says what it can serve).

Behind a gateway the pools are the engines' together, and an engine that dies takes its pool
with it: the budget follows the engines the gateway can route to (`resize`, from the frontend's
health probe), or the survivors get the dead engine's share too, their pools overfill and grafts
are skipped (a 30-minute soak with one of two engines killed ran its last engine at 7,968 of
8,192 tokens locked).
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class _Turn:
    row: int
    pieces: dict[str, int]  # content key -> tokens
    ready: asyncio.Future


class KVBudget:
    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"a KV budget needs a positive capacity, not {capacity}")
        self.capacity = capacity
        self.rows = 0  # tokens of the rows of linked requests in flight
        self._pieces: Counter[str] = Counter()  # content key -> holders
        self._piece_tokens: dict[str, int] = {}
        self._waiting: deque[_Turn] = deque()

    def resize(self, capacity: int) -> None:
        """The pool is now `capacity` tokens: prompts admitted already keep their share (a
        smaller pool admits the next only once enough is given back); waiters fit into a larger one."""
        if capacity < 1:
            raise ValueError(f"a KV budget needs a positive capacity, not {capacity}")
        self.capacity = capacity
        self._wake()

    @property
    def used(self) -> int:
        return self.rows + sum(self._piece_tokens.values())

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def _needs(self, row: int, pieces: dict[str, int]) -> int:
        return row + sum(tokens for key, tokens in pieces.items() if key not in self._pieces)

    def _fits(self, turn: _Turn) -> bool:
        # Alone, anything runs: the runtime, not this budget, says what is too large.
        return self.used == 0 or self.used + self._needs(turn.row, turn.pieces) <= self.capacity

    def _grant(self, turn: _Turn) -> None:
        self.rows += turn.row
        for key, tokens in turn.pieces.items():
            self._pieces[key] += 1
            self._piece_tokens[key] = tokens

    def _wake(self) -> None:
        while self._waiting and self._fits(self._waiting[0]):
            turn = self._waiting.popleft()
            if turn.ready.done():  # its waiter went away
                continue
            self._grant(turn)
            turn.ready.set_result(None)

    async def hold(self, row: int, keys: Sequence[str], pieces: Sequence[int]) -> KVHold:
        """Wait for room for a prompt whose row is `row` tokens and whose stored pieces are
        `pieces` tokens under content keys `keys`; hold it until released."""
        turn = _Turn(row, dict(zip(keys, pieces)), asyncio.get_running_loop().create_future())
        if not self._waiting and self._fits(turn):
            self._grant(turn)
        else:
            self._waiting.append(turn)
            try:
                await turn.ready
            except asyncio.CancelledError:
                if turn.ready.done() and not turn.ready.cancelled():
                    self._release_row(turn.row)
                    self._release_pieces(turn.pieces)
                else:
                    turn.ready.cancel()
                    self._waiting.remove(turn)
                    self._wake()
                raise
        return KVHold(self, turn.row, turn.pieces)

    def _release_row(self, row: int) -> None:
        self.rows -= row
        self._wake()

    def _release_pieces(self, pieces: dict[str, int]) -> None:
        for key in pieces:
            self._pieces[key] -= 1
            if self._pieces[key] <= 0:
                del self._pieces[key]
                self._piece_tokens.pop(key, None)
        self._wake()


@dataclass
class KVHold:
    """One prompt's share of the pool: its pieces until the graft, its row until the end."""

    budget: KVBudget
    row: int
    pieces: dict[str, int]
    _pieces_held: bool = field(default=True)
    _row_held: bool = field(default=True)

    def grafted(self) -> None:
        """The link's first event came back: its pieces are in its own slots now."""
        if self._pieces_held:
            self._pieces_held = False
            self.budget._release_pieces(self.pieces)

    def release(self) -> None:
        """The response ended (or never came): everything goes back."""
        self.grafted()
        if self._row_held:
            self._row_held = False
            self.budget._release_row(self.row)


def pool_tokens(server_info: dict) -> Optional[int]:
    """The KV pool of a runtime (every data-parallel rank's together) from its /server_info: one
    scheduler's `max_total_num_tokens` times `dp_size`."""
    pool = server_info.get("max_total_num_tokens")
    return int(pool) * int(server_info.get("dp_size") or 1) if pool else None
