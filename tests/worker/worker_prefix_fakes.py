"""A llama context's memory calls on plain records, for testing prefix sourcing and admission without a model."""

from __future__ import annotations

import ctypes

from protocol import EngineCounters
from worker.checkpoints import Budget
from worker.prefix import Prefixes
from worker.saved_states import SavedStates
from worker.slots import SlotTable


class FakeLlama:
    """The memory calls prefix sourcing makes, on a plain record of what each sequence holds. `recurrent`: a memory
    that cannot be cut back (seq_rm of a part refused), whose part saved in a checkpoint is a state of `partial` bytes."""

    def __init__(self, slots: int, recurrent: bool = False, partial: int = 10) -> None:
        self.held: dict[int, int] = dict.fromkeys(range(slots), 0)
        self.copies: list[tuple[int, int]] = []
        self.recurrent, self.partial = recurrent, partial
        self.restored: list[tuple[int, int]] = []  # (seq, checkpoint length) of each partial_set

    def seq_pos_min(self, seq: int) -> int:
        if not self.held[seq]:
            return -1
        return self.held[seq] - 1 if self.recurrent else 0

    def min_keep(self, pos_min: int, n: int) -> int:
        return n if self.recurrent else 0

    def seq_rm(self, seq: int, p0: int, p1: int = -1) -> bool:
        if self.recurrent and p0 < self.held[seq]:
            return False
        self.held[seq] = min(self.held[seq], p0)
        return True

    def seq_cp(self, src: int, dst: int) -> None:
        self.copies.append((src, dst))
        self.held[dst] = self.held[src]

    def seq_clear(self, seq: int) -> None:
        self.held[seq] = 0

    def state_size(self, seq: int) -> int:
        return 100

    def state_pos_min(self, seq: int, n: int) -> int:
        return n - 1 if self.recurrent else 0

    def state_get(self, seq: int) -> ctypes.Array[ctypes.c_uint8]:
        data = (ctypes.c_uint8 * 100)()
        ctypes.c_uint32.from_buffer(data).value = self.held[seq]  # (the length it holds, for state_set)
        return data

    def state_set(self, seq: int, data: ctypes.Array[ctypes.c_uint8]) -> bool:
        self.held[seq] = ctypes.c_uint32.from_buffer(data).value
        return True

    def partial_size(self, seq: int) -> int:
        return self.partial

    def partial_get(self, seq: int) -> ctypes.Array[ctypes.c_uint8]:
        data = (ctypes.c_uint8 * self.partial)()
        ctypes.c_uint32.from_buffer(data).value = self.held[seq]
        return data

    def partial_set(self, seq: int, data: ctypes.Array[ctypes.c_uint8]) -> bool:
        n = ctypes.c_uint32.from_buffer(data).value
        self.restored.append((seq, n))
        self.held[seq] = n  # (the attention part is cut there right after: seq_rm)
        return True


def prefixes_for(
    llama: FakeLlama, table: SlotTable, n_ctx: int, host_mb: int = 1, exact: bool = False, budget: Budget | None = None
) -> Prefixes:
    uncut = llama.recurrent
    saved = SavedStates(host_mb << 20, None, llama.min_keep)
    return Prefixes(
        llama,  # type: ignore[arg-type]
        table,
        saved,
        EngineCounters(),
        exact=exact,
        uncut=uncut,
        budget=budget,
        n_ctx=n_ctx,
        n_batch=512,
    )
