"""Batch building with plain data, no model: which slots share a llama_decode and the rows of each."""

from __future__ import annotations

from common.slots import EXACT_ROWS, SlotPhase
from protocol import Job, Sampling, pack_tokens
from worker.batching import EXACT_OUTPUTS, PAD_TOKEN, PREFILL_PATIENCE_STEPS, Batcher, prefill_order
from worker.llama import ALONE_ROWS_MIN, alone_rows
from worker.slots import Slot
from worker.task import Task, runnable

Row = tuple[int, int, int, bool]  # token, position, seq id, logits


class Rows:
    """A batch as a list of rows."""

    def __init__(self) -> None:
        self.rows: list[Row] = []

    @property
    def n(self) -> int:
        return len(self.rows)

    def clear(self) -> None:
        self.rows = []

    def add(self, token: int, pos: int, seq: int, logits: bool) -> int:
        self.rows.append((token, pos, seq, logits))
        return len(self.rows) - 1

    def add_run(self, tokens: list[int], pos0: int, seq: int, last_logits: bool) -> int:
        for i, tok in enumerate(tokens):
            self.add(tok, pos0 + i, seq, last_logits and i == len(tokens) - 1)
        return len(self.rows) - 1


def busy(slot_id: int, prompt: int, held: int = 0, generated: int = 0, seed: int | None = None, priority: int = 0) -> Slot:
    """A slot running a task of a `prompt`-token prompt of which it holds `held` tokens (plus `generated` sampled)."""
    tokens = [100 + i for i in range(prompt)]
    sampling = Sampling(temperature=1.0, seed=seed)
    job = Job(id=f"j{slot_id}", slot=slot_id, tokens=pack_tokens(tokens), sampling=sampling, priority=priority)
    task = Task(f"j{slot_id}", job, tokens, sink=lambda m: None, max_gen=100, t_arrival=0.0, deadline=None)
    task.generated = [7] * generated
    slot = Slot(slot_id, tokens=tokens[:held] + task.generated[:-1] if generated else tokens[:held])
    slot.phase, slot.task = SlotPhase.BUSY, task
    return slot


def batcher(slots: list[Slot], n_ctx: int = 4096, **kw) -> tuple[Batcher, Rows]:
    rows = Rows()
    table = sorted(slots, key=lambda s: s.id)
    return Batcher(rows, table, n_ctx, **kw), rows


def test_decode_rows_come_first_then_prompt_chunks_least_left_first_within_the_budget():
    gen = busy(0, 20, held=20, generated=3)
    long_, short = busy(1, 900), busy(2, 50, held=10)
    b, rows = batcher([gen, long_, short])
    (group,) = b.groups([gen, long_, short])
    assert group.slots == [gen, short, long_] and group.budgeted
    plan = b.build(group.slots, 100)
    # the budget goes to the short prompt first (its whole rest), the long one gets what is left; the rows go into
    # the batch in seq id order
    assert [(s.id, n, row) for s, n, row in plan] == [(0, 1, 0), (1, 60, -1), (2, 40, 100)]
    assert rows.rows[0] == (7, 22, 0, True)  # the decode row: the last sampled token, after what the slot holds
    assert rows.rows[1:61] == [(100 + i, i, 1, False) for i in range(60)]  # mid-prompt: no logits
    assert rows.rows[61:] == [(110 + i, 10 + i, 2, i == 39) for i in range(40)]  # its whole rest: logits on its last
    assert rows.n == 101 and b.padding(plan) == []
    assert long_.task.passed_over == short.task.passed_over == 0


def test_rows_go_into_the_batch_in_seq_id_order_whatever_order_the_slots_come_in():
    """llama.cpp puts only increasing, consecutive seq ids in one ubatch of a multi-stream KV: out of order, four
    decode rows take two passes over the weights."""
    slots = [busy(i, 200 + i, held=200 + i, generated=5 - i) for i in range(4)]
    b, rows = batcher(slots)
    order = [slots[1], slots[2], slots[0], slots[3]]  # (a served worker's step had them so: prefill_order)
    plan = b.build(order, 512)
    assert [r[2] for r in rows.rows] == [0, 1, 2, 3] and [row for _, _, row in plan] == [0, 1, 2, 3]
    assert [s.id for s, _, _ in plan] == [0, 1, 2, 3]


def test_a_prompt_left_without_budget_is_passed_over_and_goes_first_once_it_has_waited_long_enough():
    first, second = busy(0, 300), busy(1, 400)
    b, _ = batcher([first, second])
    plan = b.build(prefill_order([first, second]), 300)
    assert [s.id for s, _, _ in plan] == [0] and second.task.passed_over == 1
    third = busy(2, 10)
    assert prefill_order([first, second, third]) == [third, first, second]  # least left to compute first
    second.task.passed_over = PREFILL_PATIENCE_STEPS
    assert prefill_order([third, first, second]) == [second, third, first]


def test_guesses_follow_a_decode_row_and_take_from_the_prefill_budget():
    seen: list[tuple[str, int, int, int]] = []

    def guess(task: Task, slot: Slot, budget: int, decoding: int, rows: int) -> list[int]:
        seen.append((task.id, budget, decoding, rows))
        return [5, 6, 7]

    gen, other, prompt = busy(0, 10, held=10, generated=1), busy(1, 10, held=10, generated=1), busy(2, 100)
    b, rows = batcher([gen, other, prompt], guess=guess)
    plan = b.build([gen, other, prompt], 50)
    assert seen == [("j0", 50, 2, 2), ("j1", 47, 2, 5)]  # the budget and rows so far shrink with each guess
    assert [(s.id, n) for s, n, _ in plan] == [(0, 4), (1, 4), (2, 44)]
    assert rows.rows[:4] == [(7, 10, 0, True), (5, 11, 0, True), (6, 12, 0, True), (7, 13, 0, True)]


def test_a_seeded_prompt_has_llama_decodes_of_its_own_in_padded_chunks_and_its_decode_rows_take_no_guesses():
    plain, seeded, seeded_gen = busy(0, 30), busy(1, 200, seed=5), busy(2, 40, held=40, generated=2, seed=6)
    b, rows = batcher([plain, seeded, seeded_gen], guess=lambda *a: [9])
    groups = b.groups([plain, seeded, seeded_gen])
    assert [g.slots for g in groups] == [[seeded_gen, plain], [seeded]] and all(g.budgeted for g in groups)

    plan = b.build([seeded], 512)
    assert [(s.id, n, row) for s, n, row in plan] == [(1, 199, -1)]  # all but the last prompt token
    assert rows.n == alone_rows(199) == 208 and rows.rows[199:] == [(PAD_TOKEN, p, 1, False) for p in range(199, 208)]
    assert seeded.task.exact_chunk and b.padding(plan) == [(1, 199)]  # (before the commit: the slot holds 0)
    seeded.tokens = seeded.task.prompt[:199]
    plan = b.build([seeded], 512)
    assert [(s.id, n, row) for s, n, row in plan] == [(1, 1, 0)] and rows.rows == [(299, 199, 1, True)]
    assert not seeded.task.exact_chunk and b.padding(plan) == []

    plan = b.build([seeded_gen, plain], 512)
    assert [(s.id, n, row) for s, n, row in plan] == [(0, 30, 29), (2, 1, 30)]  # (in seq id order; no padding in
    # slot 1 between them, which reads a seeded prompt)
    assert rows.rows[30] == (7, 41, 2, True) and seeded_gen.task.draft == []  # its decode row, no guess


def test_a_slot_between_two_in_the_batch_gets_a_padding_row_where_it_has_room_and_it_is_removed_after():
    """Decode rows of slots 0 and 3 alone would take two ubatches; with a padding row in slots 1 and 2, one."""
    first, last = busy(0, 20, held=20, generated=2), busy(3, 30, held=30, generated=2)
    idle, full = Slot(1, tokens=[5] * 40), Slot(2, tokens=[6] * 64)
    b, rows = batcher([first, idle, full, last], n_ctx=64)
    plan = b.build([last, first], 512)
    assert [(s.id, n, row) for s, n, row in plan] == [(0, 1, 0), (3, 1, 2)]  # the padding is not planned
    assert rows.rows == [(7, 21, 0, True), (PAD_TOKEN, 40, 1, False), (7, 31, 3, True)]  # slot 2 is full: no room
    assert b.padding(plan) == [(0, 22), (1, 40), (2, 64), (3, 32)]
    assert b.build([first], 512) and b.padding(b.build([first], 512)) == []  # one slot: nothing between
    uncut, _ = batcher([first, idle, full, last], n_ctx=64, uncut=True)
    assert len(uncut.build([first, last], 512)) == 2 and uncut.rows.n == 2  # no padding where KV cannot be trimmed


def test_a_seeded_job_with_only_its_last_prompt_token_left_computes_it_beside_decode_rows_but_not_beside_a_prompt():
    gen = busy(0, 40, held=40, generated=2)
    first, second = busy(1, 200, held=199, seed=5), busy(2, 300, held=299, seed=6)
    b, rows = batcher([gen, first, second])
    groups = b.groups([gen, first, second])
    assert [g.slots for g in groups] == [[gen, first], [second]]  # one joins the decode rows; the other stays alone
    plan = b.build(groups[0].slots, 512)
    assert [(s.id, n, row) for s, n, row in plan] == [(0, 1, 0), (1, 1, 1)] and rows.rows[1] == (299, 199, 1, True)
    assert b.padding(plan) == []
    prompt = busy(3, 50)  # an unseeded prompt in the shared batch: the last token keeps a llama_decode of its own
    assert [g.slots for g in b.groups([gen, first, prompt])] == [[gen, prompt], [first]]
    assert [g.slots for g in b.groups([first])] == [[], [first]]  # (no decode rows: alone as before)


def test_a_seeded_chunk_is_at_least_the_padded_minimum_and_unpadded_where_the_context_has_no_room():
    small = busy(0, 20, seed=1)
    b, rows = batcher([small])
    b.build([small], 512)
    assert rows.n == ALONE_ROWS_MIN and sum(1 for r in rows.rows if r[0] == PAD_TOKEN) == ALONE_ROWS_MIN - 19

    near_end = busy(0, 1000, held=990, seed=1)
    b, rows = batcher([near_end], n_ctx=1024)  # 990 + 64 rows would pass the slot's 1,024 cells
    plan = b.build([near_end], 512)
    assert [(n, row) for _, n, row in plan] == [(9, -1)] and rows.n == 9 and not near_end.task.exact_chunk

    starved = busy(0, 500, seed=1)
    b, rows = batcher([starved])
    assert b.build([starved], 40) == [] and starved.task.passed_over == 1  # 40 of 499: not worth a padded chunk
    plan = b.build([starved], 499)
    assert [n for _, n, _ in plan] == [499]


def test_deterministic_mode_decodes_the_generating_slots_padded_and_each_prompt_chunk_alone():
    gens = [busy(i, 12, held=12, generated=1) for i in range(9)]
    prompt = busy(9, 100)
    b, rows = batcher([*gens, prompt], exact=True)
    groups = b.groups([prompt, *gens])
    assert [[s.id for s in g.slots] for g in groups] == [list(range(EXACT_OUTPUTS)), [7, 8], [9]]
    assert [g.budgeted for g in groups] == [False, False, True]

    plan = b.build([gens[0], gens[2]], 512)  # slots 0 and 2: slot 1 between them is padded too
    assert [(s.id, n, row) for s, n, row in plan] == [(0, 1, 0), (2, 1, 6)]
    pad = -(-EXACT_ROWS // 3)
    assert rows.n == 3 * pad and [r[2] for r in rows.rows] == [0] * pad + [1] * pad + [2] * pad
    assert b.padding(plan) == [(0, 13), (1, 12), (2, 13)]  # after each decode row; slot 1 after what it holds

    plan = b.build([prompt], 95)  # 95 of 100 would leave 5: fewer than EXACT_ROWS, so the chunk leaves 8
    assert [n for _, n, _ in plan] == [100 - EXACT_ROWS]


def test_a_prompt_chunk_ends_where_its_slot_takes_a_checkpoint_and_an_uncut_memory_is_not_padded():
    """Checkpoints at 10, 46 and 50 (worker/checkpoints.py): the chunks end there, whatever the budget; a seeded job's
    prompt on a memory that cannot be cut is not padded either (its padding could not be removed)."""
    prompt = busy(0, 50, seed=3)
    prompt.task.checkpoint_at = [0, 10, 46, 50]
    b, rows = batcher([prompt], uncut=True)
    taken = []
    while prompt.n_tokens < 49:
        plan = b.build([prompt], 512)
        taken.append(plan[0][1])
        prompt.tokens += prompt.task.prompt[prompt.n_tokens : prompt.n_tokens + plan[0][1]]
        assert not prompt.task.exact_chunk and rows.n == plan[0][1]
    assert taken == [10, 36, 3]  # (the seeded job's last token alone after: 49 of 50)


def test_deterministic_mode_decodes_each_generating_slot_of_an_uncut_memory_alone():
    gens = [busy(i, 12, held=12, generated=1) for i in range(3)]
    b, rows = batcher(gens, exact=True, uncut=True)
    assert [[s.id for s in g.slots] for g in b.groups(gens)] == [[0], [1], [2]]  # one row each: no padding needed
    plan = b.build([gens[1]], 512)
    assert [(s.id, n, row) for s, n, row in plan] == [(1, 1, 0)] and rows.n == 1


def test_a_step_runs_only_the_jobs_of_the_highest_priority_and_all_of_them_when_they_have_one():
    normal = [busy(0, 30), busy(1, 20, held=20, generated=2), busy(2, 40, held=10)]
    assert runnable(normal) == normal  # (the default: nobody is left out, in the order given)
    background, interactive = busy(3, 50, held=50, generated=4, priority=-1), busy(4, 60, priority=1)
    assert runnable([*normal, background]) == normal  # below normal: paused while any normal job runs
    assert runnable([background, *normal, interactive]) == [interactive]
    other = busy(5, 10, held=10, generated=1, priority=1)
    assert runnable([other, normal[0], interactive]) == [other, interactive]  # equal priority: batched as before
    assert runnable([background]) == [background] and runnable([]) == []
    ended = Slot(6)  # (a slot whose job ended during the step has no task)
    assert runnable([ended, background]) == [background]
    background.task.aged = True  # paused PRIORITY_MAX_PAUSE_S already: it runs beside the interactive job from now on
    assert runnable([background, *normal, interactive]) == [background, interactive]


def test_paused_slots_get_no_rows_no_budget_and_are_not_passed_over():
    low_prompt, low_gen = busy(0, 300, priority=-1), busy(1, 20, held=20, generated=2, priority=-1)
    high = busy(2, 1000, priority=1)
    slots = [low_prompt, low_gen, high]
    b, rows = batcher(slots)
    for _ in range(PREFILL_PATIENCE_STEPS + 2):
        groups = b.groups(runnable(slots))
        assert [g.slots for g in groups] == [[high]]
        plan = b.build(groups[0].slots, 100)
        assert [(s.id, n) for s, n, _ in plan] == [(2, 100)] and {r[2] for r in rows.rows} == {2}
        high.tokens += high.task.prompt[high.n_tokens : high.n_tokens + 100]
    assert low_prompt.task.passed_over == 0 and low_prompt.n_tokens == 0  # it waits; it is not starved
    assert low_gen.n_tokens == 21 and low_gen.task.draft == []  # (20 prompt tokens and its first sampled one)
    high.phase, high.task = SlotPhase.IDLE, None  # the interactive job ended: the others go on as before
    groups = b.groups(runnable(slots))
    assert [g.slots for g in groups] == [[low_gen, low_prompt]]
    plan = b.build(groups[0].slots, 100)
    assert [(s.id, n) for s, n, _ in plan] == [(0, 100), (1, 1)]
