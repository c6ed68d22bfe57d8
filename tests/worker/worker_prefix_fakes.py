"""A llama context's memory calls on plain records, for testing prefix sourcing and admission without a model."""

from __future__ import annotations

import ctypes

from protocol import EngineCounters
from worker.prefix import Prefixes
from worker.saved_states import SavedStates
from worker.slots import SlotTable


class FakeLlama:
    """The memory calls prefix sourcing makes, on a plain record of what each sequence holds."""

    def __init__(self, slots: int) -> None:
        self.held: dict[int, int] = dict.fromkeys(range(slots), 0)
        self.copies: list[tuple[int, int]] = []

    def seq_pos_min(self, seq: int) -> int:
        return 0 if self.held[seq] else -1

    def can_keep(self, pos_min: int, n: int, keep: int) -> bool:
        return True

    def min_keep(self, pos_min: int) -> int:
        return 0

    def seq_cp(self, src: int, dst: int) -> None:
        self.copies.append((src, dst))

    def seq_clear(self, seq: int) -> None:
        self.held[seq] = 0

    def state_size(self, seq: int) -> int:
        return 100

    def state_pos_min(self, seq: int, n: int) -> int:
        return 0

    def state_get(self, seq: int) -> ctypes.Array[ctypes.c_uint8]:
        return (ctypes.c_uint8 * 100)()

    def state_set(self, seq: int, data: object) -> bool:
        return True


def prefixes_for(llama: FakeLlama, table: SlotTable, n_ctx: int, host_mb: int = 1, exact: bool = False) -> Prefixes:
    saved = SavedStates(host_mb << 20, None, llama.min_keep)
    return Prefixes(llama, table, saved, EngineCounters(), exact=exact, snapshots=False, n_ctx=n_ctx)  # type: ignore[arg-type]
