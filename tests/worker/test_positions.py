"""Positions after an M-RoPE image (issue 64), with plain data, no model: an image's ids say how many positions it
advances (common/media.py), a slot knows where its tokens' positions lag behind their indexes (worker/slots.py), and
the batch, the trims and the invariant use positions where llama.cpp wants positions."""

from __future__ import annotations

import numpy as np
import pytest
from worker_prefix_fakes import FakeLlama, prefixes_for

from common.media import START_BELOW, digest, image_floor, image_n_pos, image_runs, image_tokens, mrope_spans
from protocol import Job, Sampling, pack_tokens
from worker.batching import Batcher
from worker.slots import SlotTable
from worker.task import Task

# a prompt of 3 text tokens, an image of 6 rows (3 x 2 after the merger: 3 positions), 2 text tokens, an image of 4
# rows (2 x 2: 2 positions), 1 text token
WIDE, SQUARE = image_tokens(digest(b"wide"), 6, 3).tolist(), image_tokens(digest(b"square"), 4, 2).tolist()
PROMPT = [5, 6, 7, *WIDE, 8, 9, *SQUARE, 10]


def test_an_images_ids_carry_the_positions_it_advances() -> None:
    ids = image_tokens(digest(b"x"), 6, 3)
    assert ids[0] < START_BELOW and all(START_BELOW <= t < 0 for t in ids[1:])  # (still one image to image_runs)
    assert image_n_pos(ids, 0, 6) == 3
    assert image_n_pos(image_tokens(digest(b"x"), 6), 0, 6) == 6  # (one position a row: Gemma 3's kind)
    assert image_n_pos(image_tokens(digest(b"x"), 1), 0, 1) == 1
    assert not np.array_equal(ids, image_tokens(digest(b"x"), 6))  # the same file placed otherwise: other ids
    assert np.array_equal(ids, image_tokens(digest(b"x"), 6, 3))
    for bad in (0, 7):
        with pytest.raises(ValueError, match="cannot advance"):
            image_tokens(digest(b"x"), 6, bad)


def test_spans_say_how_far_positions_lag_behind_indexes() -> None:
    assert image_runs(PROMPT) == [(3, 6), (11, 4)]
    assert mrope_spans(PROMPT) == [(3, 9, 3), (11, 15, 5)]
    assert mrope_spans([1, 2, 3]) == [] and mrope_spans([]) == []
    assert image_floor(PROMPT, 5) == 3 and image_floor(PROMPT, 9) == 9


def slot_holding(tokens: list[int], mrope: bool = True):
    slot = SlotTable(1, mrope=mrope)[0]
    slot.hold(list(tokens), 0, [])
    return slot


def test_a_slot_gives_each_boundary_its_position() -> None:
    slot = slot_holding(PROMPT)
    assert [slot.pos(n) for n in (0, 3, 9, 10, 11, 15, 16)] == [0, 3, 6, 7, 8, 10, 11]
    assert slot.pos() == 11 and slot.held_end() == 11
    assert slot_holding(PROMPT, mrope=False).pos() == 16  # (one position a row: the ids' count is not read)

    slot.keep(11)  # (cut before the second image)
    assert slot.spans == [(3, 9, 3)] and slot.pos() == 8
    slot.tokens.extend(SQUARE)
    slot.took_image(11, 4, 2)
    assert slot.spans == mrope_spans(slot.tokens)
    # llama.cpp holds an M-RoPE image's rows at its first row's position: what the invariant expects of it held last
    assert slot.held_end() == 9 and slot.pos() == 10
    slot.keep(0)
    assert slot.spans == [] and slot.pos() == 0 and slot.held_end() == 0


def task_for(prompt: list[int], done: int) -> Task:
    job = Job(id="j", slot=0, tokens=pack_tokens(prompt), sampling=Sampling())
    t = Task("j", job, prompt, sink=lambda m: None, max_gen=10, t_arrival=0.0, deadline=None)
    t.images = {start: None for start, _ in image_runs(prompt)}  # type: ignore[misc]  # (only their starts are read)
    return t


class Rows:
    """The batch calls the batcher makes, recorded: (token, position, seq)."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, int, int]] = []
        self.n = 0

    def clear(self) -> None:
        self.rows, self.n = [], 0

    def add(self, token: int, pos: int, seq: int, logits: bool) -> int:
        self.rows.append((token, pos, seq))
        self.n += 1
        return self.n - 1

    def add_run(self, tokens: list[int], pos0: int, seq: int, last_logits: bool) -> int:
        for i, t in enumerate(tokens):
            self.add(t, pos0 + i, seq, False)
        return self.n - 1


def test_text_after_an_image_is_batched_at_its_position_and_a_reply_after_it() -> None:
    table = SlotTable(1, mrope=True)
    slot = table[0]
    slot.hold(PROMPT[:9], 0, [])  # (the prompt up to the first image's end)
    slot.task = task_for(PROMPT, 9)
    rows = Rows()
    batcher = Batcher(rows, table.slots, n_ctx=64)  # type: ignore[arg-type]
    batcher.build([slot], budget=64)
    assert rows.rows == [(8, 6, 0), (9, 7, 0)]  # up to the next image: positions 6 and 7, not 9 and 10

    slot.hold(list(PROMPT), 0, [])
    slot.task.generated = [42]
    batcher.build([slot], budget=64)
    assert rows.rows == [(42, 11, 0)]  # the reply's next token after all of it: position 11, not 16


def test_trims_cut_llama_cpp_at_positions() -> None:
    llama, table = FakeLlama(1), SlotTable(1, mrope=True)
    prefixes = prefixes_for(llama, table, 64)
    slot = table[0]
    slot.hold(list(PROMPT), 0, [])
    llama.held[0] = slot.held_end()
    prefixes.trim(slot, 10)  # (one text token after the first image kept)
    assert llama.held[0] == 7 and slot.tokens == PROMPT[:10] and slot.held_end() == 7
