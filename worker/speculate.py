"""Prompt-lookup speculation: guess a job's next tokens from its own history, without a draft model.

Agents re-emit text they were just shown (an edited file, quoted tool output). When the last `n` tokens of a
conversation occurred earlier in it, the tokens that followed that occurrence are a cheap guess of what comes
next. The engine verifies a guess in the same `llama_decode` as the other slots' rows: every guessed token gets
a logits row, the job's own sampler picks a token from each row in turn, and the guess is kept up to the first
token the sampler did not pick (the KV of the rest is removed with `llama_memory_seq_rm`). The sampler sees
exactly the rows it would have seen one token at a time, so the output is what it would have been without
speculation; only the number of `llama_decode` calls changes.

A guess costs a logits row per token (on CPU about as much as a decode row: the output layer dominates), so the
length adapts: it starts at START tokens, doubles while guesses are taken whole and falls back to what was
taken when one is cut short.
"""

from __future__ import annotations

import numpy as np

START = 4  # tokens in a job's first guess


class Drafter:
    """One job's guesser over everything its conversation holds (prompt, then each generated token)."""

    def __init__(self, history: list[int], capacity: int, n: int, k_max: int) -> None:
        self.n = n
        self.k_max = k_max
        self.k = min(START, k_max)
        self._buf = np.zeros(max(capacity, len(history)) + 1, dtype=np.int32)
        self._len = len(history)
        self._buf[: self._len] = history

    def push(self, token: int) -> None:
        """A token the job produced (every one, drafted or not)."""
        if self._len == len(self._buf):
            self._buf = np.concatenate([self._buf, np.zeros_like(self._buf)])
        self._buf[self._len] = token
        self._len += 1

    def propose(self, limit: int) -> list[int]:
        """Up to min(k, limit) tokens that followed the latest earlier occurrence of the last n tokens."""
        n, end = self.n, self._len
        k = min(self.k, limit)
        if k <= 0 or end <= n:
            return []
        h = self._buf[:end]
        tail = h[end - n :]
        # e: where an earlier occurrence ends (it must be followed by at least one token, so e < end - 1)
        ends = np.flatnonzero(h[n - 1 : end - 1] == tail[-1]) + (n - 1)
        for back in range(1, n):
            if not ends.size:
                return []
            ends = ends[h[ends - back] == tail[-1 - back]]
        if not ends.size:
            return []
        start = int(ends[-1]) + 1
        return h[start : start + k].tolist()

    def verified(self, proposed: int, accepted: int) -> None:
        """How the last guess went: a guess taken whole grows the next one, a guess cut short shrinks it."""
        self.k = min(self.k * 2, self.k_max) if accepted == proposed else max(1, min(accepted, self.k_max))
