"""Which batch shapes compute a token exactly as a prompt pass does, on this CPU and this llama.cpp build.

Deterministic mode (worker/core.py) rests on these facts; run this after upgrading llama.cpp or on a new CPU. Four
slots hold the same kind of text; a shape decodes, for some slots, their next tokens (a decode row and guesses, every
row with logits) and padding rows. Each real row's logits are compared bit for bit with the same position's logits
from an 8-row prompt chunk, and each slot's KV with a prompt pass's (through the logits of one fixed next token, in
a fixed 8-row shape). Kernels: `deterministic` is the mode's (no weight repacking, no flash attention);
`flash-attn` is that with flash attention on; `repacked` is llama.cpp's default weights with flash attention off.
Then the cost: a decode step of 4 slots x 1 row against the padded 4 x 2 rows deterministic mode needs, default
kernels, interleaved.

    .venv/bin/python -m bench.exact_shapes [--contexts 48,700] [--rounds 10]
    .venv/bin/python -m bench.exact_shapes --alone

`--alone` checks what a seeded job on a default worker rests on (worker/llama.py `alone_rows`): a prompt computed in
chunks of one sequence each alone in its llama_decode, padded to a multiple of ALONE_ROWS_STEP rows and at least
ALONE_ROWS_MIN, gives the same KV however it is cut into chunks, with the default kernels; and what other paddings
and a decode row beside other slots' give.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import llama_cpp
import numpy as np

from common.model import resolve_model
from worker.llama import ALONE_ROWS_MIN, ALONE_ROWS_STEP, Llama

SLOTS = 4
TEXT = "the keeper of the lighthouse wrote in his log that the wind turned north and the sea rose over the rocks. "
# name: {slot: (real rows, padding rows)}
SHAPES: dict[str, dict[int, tuple[int, int]]] = {
    "1 slot x 1": {0: (1, 0)},
    "1 slot x 2 (1 pad)": {0: (1, 1)},
    "1 slot x 2": {0: (2, 0)},
    "1 slot x 4": {0: (4, 0)},
    "1 slot x 8": {0: (8, 0)},
    "1 slot x 8 (5 pad)": {0: (3, 5)},
    "4 slots x 1": {s: (1, 0) for s in range(SLOTS)},
    "4 slots x 2 (1 pad)": {s: (1, 1) for s in range(SLOTS)},
    "4 slots x 2": {s: (2, 0) for s in range(SLOTS)},
    "3 slots x 3": {s: (3, 0) for s in range(3)},
    "2 slots x 4": {s: (4, 0) for s in range(2)},
    "slot 0 x 4 + 3 slots x 1": {0: (4, 0), 1: (1, 0), 2: (1, 0), 3: (1, 0)},
}
FOLLOW = 777  # the fixed next token whose logits read a slot's KV


@contextmanager
def no_repack() -> Iterator[None]:
    """Load weights without repacking (as deterministic mode does) while keeping the other settings asked for."""
    default = llama_cpp.llama_model_default_params

    def params() -> llama_cpp.llama_model_params:
        p = default()
        p.use_extra_bufts = False
        return p

    llama_cpp.llama_model_default_params = params
    try:
        yield
    finally:
        llama_cpp.llama_model_default_params = default


def load(kernels: str, ctx: int) -> Llama:
    model = resolve_model(None)
    if kernels == "deterministic":
        return Llama(model, slots=SLOTS, ctx_per_slot=ctx, n_batch=64, threads=2, deterministic=True)
    if kernels == "flash-attn":
        with no_repack():
            return Llama(model, slots=SLOTS, ctx_per_slot=ctx, n_batch=64, threads=2, flash_attn="on")
    return Llama(model, slots=SLOTS, ctx_per_slot=ctx, n_batch=64, threads=2, flash_attn="off")


class Probe:
    def __init__(self, llama: Llama, context: int) -> None:
        self.llama, self.p = llama, context
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(llama.model))
        self.text = [llama.vocab.tokenize(f"Log {s}: " + TEXT * (context // 16 + 2))[: context + 8] for s in range(SLOTS)]
        self.truth: dict[tuple[int, int], np.ndarray] = {}  # (slot, position) -> its logits from a prompt chunk
        self.kv_truth: dict[tuple[int, int], np.ndarray] = {}  # (slot, tokens held) -> FOLLOW's logits after them
        for s in range(SLOTS):
            for pos in range(context, context + 8):
                self._fill(s, pos - 7)
                self._decode([(s, self.text[s][pos - 7 : pos + 1], pos - 7, True)])
                self.truth[s, pos] = self._logits(self.llama.batch.n - 1)
                self.llama.seq_rm(s, pos + 1, -1)
                self.kv_truth[s, pos + 1] = self._follow(s, pos + 1)
            self._fill(s, context)

    def _logits(self, row: int) -> np.ndarray:
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.llama.ctx, row), shape=(self.n_vocab,)).copy()

    def _decode(self, runs: list[tuple[int, list[int], int, bool]]) -> list[int]:
        """Rows of (slot, tokens, first position, logits on every row); returns each run's first row."""
        batch = self.llama.batch
        batch.clear()
        firsts = []
        for s, tokens, pos0, logits in runs:
            firsts.append(batch.n)
            for i, tok in enumerate(tokens):
                batch.add(tok, pos0 + i, s, logits)
        if self.llama.decode() != 0:
            raise RuntimeError(f"llama_decode failed for {[(s, len(t)) for s, t, _, _ in runs]}")
        return firsts

    def _fill(self, s: int, n: int) -> None:
        """Slot s holds its text's first n tokens, computed in prompt chunks of 32 rows (the last one 8 to 39)."""
        self.llama.seq_rm(s, 0, -1)
        c = 0
        while c < n:
            end = n if n - c < 40 else c + 32
            self._decode([(s, self.text[s][c:end], c, False)])
            c = end

    def _follow(self, s: int, n: int) -> np.ndarray:
        """FOLLOW's logits at position n of slot s (holding n tokens), in one 8-row shape (7 padding rows)."""
        batch = self.llama.batch
        batch.clear()
        batch.add(FOLLOW, n, s, True)
        for i in range(1, 8):
            batch.add(0, n + i, s, False)
        if self.llama.decode() != 0:
            raise RuntimeError("llama_decode failed")
        out = self._logits(0)
        self.llama.seq_rm(s, n, -1)
        return out

    def check(self, shape: dict[int, tuple[int, int]]) -> list[str]:
        """What the shape computes differently from the prompt pass: 'slot s row i' (logits) and 'slot s KV'."""
        p = self.p
        runs = [(s, self.text[s][p : p + real] + [0] * pad, p, True) for s, (real, pad) in sorted(shape.items())]
        firsts = self._decode(runs)
        bad = []
        for (s, (real, _)), first in zip(sorted(shape.items()), firsts, strict=True):
            bad += [f"slot {s} row {i}" for i in range(real) if not np.array_equal(self._logits(first + i), self.truth[s, p + i])]
        for s, (real, _) in sorted(shape.items()):
            self.llama.seq_rm(s, p + real, -1)
            if not np.array_equal(self._follow(s, p + real), self.kv_truth[s, p + real]):
                bad.append(f"slot {s} KV")
            self.llama.seq_rm(s, p, -1)
        return bad


def step_cost(rounds: int) -> None:
    llama = Llama(resolve_model(None), slots=SLOTS, ctx_per_slot=1024, n_batch=320, threads=2)  # the default kernels
    p = 300
    for s in range(SLOTS):
        llama.batch.clear()
        llama.batch.add_run([100 + (7 * i + s) % 5000 for i in range(p)], 0, s, False)
        assert llama.decode() == 0
    times: dict[int, list[float]] = {1: [], 2: []}
    for _ in range(rounds):
        for rows in times:
            t0 = time.perf_counter()
            for step in range(8):
                llama.batch.clear()
                for s in range(SLOTS):
                    llama.batch.add(500 + step, p + step, s, True)
                    for i in range(1, rows):
                        llama.batch.add(0, p + step + i, s, False)
                assert llama.decode() == 0
                for s in range(SLOTS):
                    llama.seq_rm(s, p + step + 1, -1)
            for s in range(SLOTS):
                llama.seq_rm(s, p, -1)
            times[rows].append((time.perf_counter() - t0) / 8 * 1000)
    ratios = [b / a for a, b in zip(times[1], times[2], strict=True)]
    print(f"\ndecode step, default kernels, {rounds} interleaved rounds of 8 steps: 4 slots x 1 row "
          f"{statistics.median(times[1]):.1f} ms, 4 x 2 rows (1 padding) {statistics.median(times[2]):.1f} ms: "
          f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})")  # fmt: skip
    llama.close()


class AloneProbe:
    """One prompt's last-token logits after its other tokens were computed in chunks cut at `cuts`, each chunk alone
    in a llama_decode padded to `rows(n)` rows; default kernels, one slot beside two others."""

    def __init__(self) -> None:
        self.llama = Llama(resolve_model(None), slots=3, ctx_per_slot=1024, n_batch=720, threads=2)
        vocab = llama_cpp.llama_model_get_vocab(self.llama.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
        self.text = self.llama.vocab.tokenize("Log: " + TEXT * 80)[:700]
        self.other = self.llama.vocab.tokenize("Other: bread salt rope " * 200)[:300]

    def _logits(self, row: int) -> np.ndarray:
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.llama.ctx, row), shape=(self.n_vocab,)).copy()

    def prompt(self, cuts: list[int], rows: Callable[[int], int]) -> np.ndarray:
        llama, n = self.llama, len(self.text) - 1
        llama.seq_rm(0, 0, -1)
        start = 0
        for end in [*cuts, n]:
            llama.batch.clear()
            llama.batch.add_run(self.text[start:end], start, 0, False)
            for pos in range(end, start + rows(end - start)):
                llama.batch.add(0, pos, 0, False)
            assert llama.decode() == 0
            llama.seq_rm(0, end, -1)
            start = end
        llama.batch.clear()
        llama.batch.add(self.text[n], n, 0, True)
        assert llama.decode() == 0
        return self._logits(0)

    def decode_row(self, held: int, beside: int) -> np.ndarray:
        """Slot 0 holding `held` tokens decodes its next one, leading a batch with one row of `beside` other slots."""
        llama = self.llama
        for s in range(3):
            llama.seq_rm(s, 0, -1)
        for s, text, n in ((0, self.text, held), *((s, self.other, 200) for s in range(1, 1 + beside))):
            llama.batch.clear()
            llama.batch.add_run(text[:n], 0, s, False)
            assert llama.decode() == 0
        llama.batch.clear()
        llama.batch.add(self.text[held], held, 0, True)
        for s in range(1, 1 + beside):
            llama.batch.add(self.other[200], 200, s, True)
        assert llama.decode() == 0
        return self._logits(0)


def alone(with_cuts: dict[str, list[int]]) -> None:
    probe = AloneProbe()

    def padded(least: int, step: int) -> Callable[[int], int]:
        return lambda n: max(least, -(-n // step) * step)

    rules = {
        f"multiple of {ALONE_ROWS_STEP}, at least {ALONE_ROWS_MIN} (worker/llama.py)": padded(ALONE_ROWS_MIN, ALONE_ROWS_STEP),
        "multiple of 4, at least 64": padded(64, 4),
        "multiple of 4, at least 60": padded(60, 4),
        "multiple of 2, at least 64": padded(64, 2),
        "no padding": padded(1, 1),
    }
    print(f"\na prompt of {len(probe.text)} tokens, its chunks each alone in a llama_decode, padded; the last token's logits "
          "compared with those after one chunk of the whole prompt, padded the same way (default kernels):")  # fmt: skip
    for name, rows in rules.items():
        truth = probe.prompt([], rows)
        differ = [c for c, cuts in with_cuts.items() if not np.array_equal(probe.prompt(cuts, rows), truth)]
        print(f"  {name:44s} {'exact for every cut' if not differ else 'differs when cut ' + '; '.join(differ)}")
    print("\na decode row leading a batch with one row of each of N other slots, against the same row alone:")
    for held in (191, 300):
        alone_row = probe.decode_row(held, 0)
        same = [n for n in (1, 2) if np.array_equal(probe.decode_row(held, n), alone_row)]
        print(f"  holding {held} tokens: {'the same' if len(same) == 2 else 'differs'} (beside 1 and 2 other slots)")
    probe.llama.close()


CUTS = {"at 300": [300], "at 64, 128, ...": list(range(64, 699, 64)), "at 7, 77, 150, 333, 335, 600": [7, 77, 150, 333, 335, 600],
        "after tokens 1 to 5, then at 64, 640": [1, 2, 3, 4, 5, 64, 640], "at 640": [640], "at 690": [690]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="48,700", help="tokens each slot holds before the decoded rows")
    ap.add_argument("--rounds", type=int, default=10, help="interleaved rounds of the step-cost comparison")
    ap.add_argument("--alone", action="store_true", help="check the padded chunks of seeded jobs (see above) only")
    a = ap.parse_args()
    if a.alone:
        alone(CUTS)
        return
    for context in (int(c) for c in a.contexts.split(",")):
        for kernels in ("deterministic", "flash-attn", "repacked"):
            llama = load(kernels, 1024)
            probe = Probe(llama, context)
            print(f"\n{kernels}, {context} tokens held:")
            for name, shape in SHAPES.items():
                bad = probe.check(shape)
                print(f"  {name:26s} {'exact' if not bad else 'differs: ' + ', '.join(bad)}")
            llama.close()
    step_cost(a.rounds)


if __name__ == "__main__":
    main()
