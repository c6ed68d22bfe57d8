"""Batch building: which slots share a llama_decode in one engine step, and the rows of each (decode rows, guessed
rows, prompt chunks, padding). Plain data in, rows out: it writes into anything with the `Rows` methods
(worker/llama.py `Batch`, or a list in the tests) and calls nothing in llama.cpp; guesses come from a callable.

The rules (why: worker/core.py's docstring):
- priority (worker/task.py `runnable`): a step computes only the busy slots of the highest priority among them (Job.priority: 1
  interactive, 0 normal, -1 background); the others are paused, keeping their slots and KV untouched (no decode row,
  no prompt chunk, no guess, not passed over), and go on once no job of higher priority runs. Why: on a small box
  every row beside an interactive job's slows its steps, so a background agent's work waits instead of sharing them;
  with every job at one priority (0 by default) nothing is left out. A job paused PRIORITY_MAX_PAUSE_S in all is
  computed beside them until it ends (`Task.aged`): a client that sends nothing but interactive work delays the
  others' jobs by that much, never stalls them;
- default mode: one llama_decode for every slot but those computing a seeded job's prompt, each of which has its own
  (a starved one first); decode rows first, then prompt chunks up to the step's prefill budget, in `prefill_order`;
  the rows go into the batch in seq id order, a padding row in each slot between that has none (`_write`: llama.cpp's
  ubatches);
- a seeded job's prompt: chunks padded to `alone_rows` (worker/llama.py), its last token alone or beside decode rows
  only (never beside another prompt's rows); then its decode rows beside the others', without guesses;
- deterministic mode: the generating slots together, at most EXACT_OUTPUTS of them a batch, every slot from the
  first to the last padded to the same rows; then each prompt chunk alone, at least EXACT_ROWS tokens;
- a prompt chunk ends where its slot takes a context checkpoint (`Task.checkpoint_at`, worker/checkpoints.py), and
  where an image begins (its rows are decoded on their own: worker/core.py `_images`);
- a memory that cannot be cut back (`uncut`: recurrent, hybrid) gets no padding: in deterministic mode each
  generating slot decodes its row alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from common.slots import EXACT_ROWS
from worker.llama import ALONE_ROWS_MIN, alone_rows
from worker.slots import Slot
from worker.task import Task

PAD_TOKEN = 0  # token of padding rows (deterministic mode's, seeded jobs'; any id: their KV is removed after the decode)
# deterministic mode: most rows with logits in one llama_decode (llama.cpp computes a token's logits otherwise from
# EXACT_ROWS output rows on; a prompt chunk has one, see worker/core.py's docstring)
EXACT_OUTPUTS = EXACT_ROWS - 1
# a prompt that got no prefill budget this many steps in a row takes it before prompts with less left to compute
PREFILL_PATIENCE_STEPS = 4

Planned = tuple[Slot, int, int]  # a slot in the batch, the tokens it adds (decode row and guesses, or its chunk), its
# first sampled row (-1: none, a chunk in the middle of its prompt)
# (task, slot, budget left, decode rows in the step, rows so far) -> the tokens to verify after the slot's decode row;
# decode rows 0: rows that cost nothing (deterministic mode's padding)
Guess = Callable[[Task, Slot, int, int, int], list[int]]


class Rows(Protocol):
    """Where a batch's rows go (worker/llama.py `Batch`)."""

    @property
    def n(self) -> int: ...  # rows so far

    def clear(self) -> None: ...

    def add(self, token: int, pos: int, seq: int, logits: bool) -> int: ...

    def add_run(self, tokens: list[int], pos0: int, seq: int, last_logits: bool) -> int: ...


@dataclass(frozen=True)
class Group:
    """The slots of one llama_decode, in batch order."""

    slots: list[Slot]
    budgeted: bool = True  # its rows take from the step's prefill budget (deterministic mode's decode batch: no)


def prefill_order(slots: list[Slot]) -> list[Slot]:
    """Who gets the step's prefill budget first: the prompt with the least left to compute (an agent's 50-token turn
    does not wait behind a cold 800-token prompt), except that one passed over PREFILL_PATIENCE_STEPS steps in a row
    goes before all of those, so that a stream of short prompts never starves a long one."""

    def key(slot: Slot) -> tuple[bool, int]:
        task: Task = slot.task
        return task.passed_over < PREFILL_PATIENCE_STEPS, len(task.prompt) - slot.n_tokens

    return sorted(slots, key=key)


@dataclass
class Piece:
    """One slot's rows in a batch: its decode row and guesses (`decode`: every row asks for logits), or a prompt chunk
    (logits on its last row when it ends the prompt, `last`) followed by `pad` padding rows, or padding alone (no
    tokens: a slot between two others' rows, `Batcher._gaps`)."""

    slot: Slot
    tokens: list[int]
    pos: int  # the first row's position (its index but after an M-RoPE image: `Slot.pos`)
    decode: bool
    last: bool = False
    pad: int = 0


@dataclass
class Batcher:
    rows: Rows
    slots: list[Slot]  # every slot, by seq id
    n_ctx: int  # a slot's context
    exact: bool = False  # deterministic mode
    uncut: bool = False  # the memory cannot be cut back (recurrent): nothing is padded
    guess: Guess | None = None  # speculation on

    def groups(self, busy: list[Slot]) -> list[Group]:
        """The step's llama_decodes, in order; `busy` the busy slots."""
        busy = prefill_order(busy)
        if not self.exact:  # a seeded prompt alone (its decode rows join the others')
            alone = [s for s in busy if s.task.seeded and not s.task.generated]
            shared = [s for s in busy if s not in alone]
            if shared and all(s.task.generated for s in shared):
                # one seeded job with only its last prompt token left computes it beside decode rows alone: its
                # first token may then differ as its later ones do beside generating jobs (worker/core.py), and a
                # llama_decode of its own would cost a pass over the weights (the rows share one ubatch: `_write`)
                last = next((s for s in alone if s.n_tokens == len(s.task.prompt) - 1), None)
                if last is not None:
                    alone.remove(last)
                    shared.append(last)
            starved = [s for s in alone if s.task.passed_over >= PREFILL_PATIENCE_STEPS]
            rest = [s for s in alone if s not in starved]
            return [*(Group([s]) for s in starved), Group(shared), *(Group([s]) for s in rest)]
        generating = sorted((s for s in busy if s.task.generated), key=lambda s: s.id)
        per = 1 if self.uncut else EXACT_OUTPUTS  # (a row alone is computed one way, always: no padding needed)
        decodes = [Group(generating[i : i + per], False) for i in range(0, len(generating), per)]
        return decodes + [Group([s]) for s in busy if not s.task.generated]

    def build(self, group: list[Slot], budget: int) -> list[Planned]:
        """Fill the batch for one group: decode rows first, then prefill chunks within `budget` prompt tokens (in
        `prefill_order`); the rows then go into the batch in seq id order (`_write`)."""
        self.rows.clear()
        if self.exact and not self.uncut and group and group[0].task.generated:  # (a decode group: see `groups`)
            return self._build_padded(group)
        pieces: list[Piece] = []
        prefilling: list[Slot] = []
        decoding = sum(1 for slot in group if slot.task.generated)
        rows = decoding  # decode rows and the guesses taken so far: a guess's cost depends on the step it joins
        for slot in group:
            task: Task = slot.task
            if not task.generated:
                prefilling.append(slot)
                continue
            # (a seeded job takes no guesses here: rows verified together compute other numbers than one row alone)
            task.draft = self.guess(task, slot, budget, decoding, rows) if self.guess and not task.seeded else []
            budget -= len(task.draft)
            rows += len(task.draft)
            pieces.append(Piece(slot, [task.generated[-1], *task.draft], slot.pos(), True))
        for slot in prefilling:  # (in prefill order)
            task = slot.task
            task.passed_over += 1  # (back to 0 below when it gets a chunk)
            piece = self._chunk(slot, task, budget) if budget > 0 else None
            if piece is not None:
                task.passed_over = 0
                budget -= len(piece.tokens)
                pieces.append(piece)
        return self._write(pieces)

    def _chunk(self, slot: Slot, task: Task, budget: int) -> Piece | None:
        """The slot's next prompt chunk, at most `budget` tokens; None when none fits this step."""
        start, end = slot.n_tokens, len(task.prompt)
        if start in task.images or (start < end and task.prompt[start] < 0):
            return None  # (an image's rows, or the rest of them, are decoded on their own: worker/core.py `_images`)
        stop = next((p for p in task.checkpoint_at if p > start), end)  # (a checkpoint is taken there)
        stop = min([stop, *(p for p in task.images if p > start)])  # (and an image begins there)
        take = min(stop - start, budget)
        if self.exact and 0 < stop - start - take < EXACT_ROWS:
            take = stop - start - EXACT_ROWS  # never leave a remainder too small to compute exactly
            if take < EXACT_ROWS:
                return None  # not enough budget left this step for an exact chunk
        alone = task.seeded and not self.exact  # (its batch has no other slot's rows while it reads its prompt: `groups`)
        if alone and start < end - 1:
            # stop one short of the end: a seeded job's last prompt token is then computed on its own or beside
            # decode rows (`groups`), as it is when the rest of its prompt was cached
            take = min(take, end - 1 - start)
            if take < min(stop - start, end - 1 - start, ALONE_ROWS_MIN):
                return None  # too little budget left this step to be worth a padded chunk
        last = start + take == end
        # a seeded job's chunk, padded: its KV is then what every such chunk computes (worker/llama.py); not at the
        # end of the slot's context, where the padding has no room
        padded = alone_rows(take)
        task.exact_chunk = alone and not last and not self.uncut and start + padded <= self.n_ctx
        pad = padded - take if task.exact_chunk else 0
        return Piece(slot, task.prompt[start : start + take], slot.pos(start), False, last, pad)

    def _write(self, pieces: list[Piece]) -> list[Planned]:
        """Put the pieces' rows into the batch in seq id order, and a padding row into every slot between them that
        has none (its KV is removed again after the decode: `padding`). With one KV stream per slot, llama.cpp puts
        only increasing, consecutive seq ids in one ubatch (llama-batch.cpp `split_equal`, "sequential"), and each
        ubatch is a pass over all the weights (`python -m bench.ubatch_order`, bench/README.md "Rows in slot order"):
        four decode rows in the order of slots 1, 2, 0, 3 took 58 ms, in slot order 37 ms; decode rows of slots 0 and
        2 took 48 ms, with a padding row in slot 1 between them 31 ms."""
        plan: list[Planned] = []
        batch = self.rows
        for p in sorted(pieces + self._gaps(pieces), key=lambda p: p.slot.id):
            if p.decode:
                row = batch.add(p.tokens[0], p.pos, p.slot.id, True)
                for i, tok in enumerate(p.tokens[1:], 1):
                    batch.add(tok, p.pos + i, p.slot.id, True)
            elif p.tokens:
                row = batch.add_run(p.tokens, p.pos, p.slot.id, p.last)
                if not p.last:
                    row = -1
            for pos in range(p.pos + len(p.tokens), p.pos + len(p.tokens) + p.pad):
                batch.add(PAD_TOKEN, pos, p.slot.id, False)
            if p.tokens:  # (a gap's padding is not planned: nothing to commit or sample)
                plan.append((p.slot, len(p.tokens), row))
        return plan

    def _gaps(self, pieces: list[Piece]) -> list[Piece]:
        """A padding row for each slot between the first and the last piece's that has no rows in this batch (idle,
        or a prompt left without budget), where it has room; none where the memory cannot be trimmed, nor in a slot
        reading a seeded prompt (its KV is only ever computed in llama_decodes of its own)."""
        if self.uncut or not pieces:
            return []
        ids = {p.slot.id for p in pieces}

        def pads(slot: Slot) -> bool:
            reading_seeded = slot.task is not None and slot.task.seeded and not slot.task.generated
            return slot.id not in ids and slot.n_tokens < self.n_ctx and not reading_seeded

        return [Piece(s, [], s.pos(), False, pad=1) for s in self.slots[min(ids) + 1 : max(ids)] if pads(s)]

    def _build_padded(self, generating: list[Slot]) -> list[Planned]:
        """Deterministic mode's decode batch: the slots from the first generating one to the last, in seq id order
        (llama.cpp puts only consecutive seq ids in one ubatch), have `pad` rows each: a generating slot its decode row,
        then guesses, then padding; any other slot padding after the tokens it holds."""
        batch = self.rows
        plan: list[Planned] = []
        mine = {s.id for s in generating}
        span = self.slots[min(mine) : max(mine) + 1]
        pad = max(2, -(-EXACT_ROWS // len(span)))
        guesses = EXACT_OUTPUTS - len(mine)  # rows with logits the batch has left for guesses
        for slot in span:
            pos, rows = slot.pos(), 0
            if slot.id in mine:
                task: Task = slot.task
                row = batch.add(task.generated[-1], pos, slot.id, True)
                task.draft = self.guess(task, slot, min(pad - 1, guesses), 0, 0) if self.guess and guesses > 0 else []
                guesses -= len(task.draft)
                for i, tok in enumerate(task.draft, 1):
                    batch.add(tok, pos + i, slot.id, True)
                rows = 1 + len(task.draft)
                plan.append((slot, rows, row))
            for i in range(rows, pad):
                batch.add(PAD_TOKEN, pos + i, slot.id, False)
        return plan

    def padding(self, plan: list[Planned]) -> list[tuple[int, int]]:
        """Where the batch's padding rows are, to remove their KV after the decode: (seq id, first padding position)
        for every slot from the plan's first to its last (`_build_padded` and `_gaps` pad the ones between too); none when
        the batch has no padding."""
        if self.rows.n == sum(n for _, n, _ in plan):
            return []
        rows = {slot.id: n for slot, n, _ in plan}
        return [(s.id, s.pos() + rows.get(s.id, 0)) for s in self.slots[min(rows) : max(rows) + 1]]
