"""How many verify steps speculation needs on an agent's edit, counted without the machine's noise.

The worker generates bench.spec_probe's edit (the model shown a file and asked for it back) once, greedily and without
speculation. Each drafter is then replayed over that output as the engine drives it (a guess before every step, the
longest agreeing prefix taken plus one token, the guess length adapting): the steps it needs and the logits rows it
computes are what decode time is made of on this CPU (a step ~18 ms, a row ~8 ms more). Drafters: kvroute's
(worker/speculate.py, which follows the place the output copies) and the one before it (guesses from the latest
earlier occurrence of the last n tokens, kept here as the baseline); and kvroute's when the same request was
answered before (the earlier answer in its OutputPool, as when an agent asks for the file again).

    .venv/bin/python -m bench.drafter_replay [--tokens 260] [--ngram 4] [--spec-max 16]
"""

from __future__ import annotations

import argparse
from typing import Protocol

import numpy as np

from bench.spec_probe import EDIT
from protocol import Job, JobDone, Sampling, pack_tokens
from worker.config import WorkerConfig
from worker.engine import Engine
from worker.speculate import START, Drafter, OutputPool


class Guesser(Protocol):
    k: int

    def push(self, token: int) -> None: ...
    def propose(self, limit: int) -> list[int]: ...
    def verified(self, proposed: int, accepted: int) -> None: ...


class LatestOccurrence:
    """The baseline: what followed the latest earlier occurrence of the last n tokens."""

    def __init__(self, history: list[int], n: int, k_max: int) -> None:
        self.h, self.n, self.k_max, self.k = list(history), n, k_max, min(START, k_max)

    def push(self, token: int) -> None:
        self.h.append(token)

    def propose(self, limit: int) -> list[int]:
        n, h, k = self.n, self.h, min(self.k, limit)
        if k <= 0 or len(h) <= n:
            return []
        for e in range(len(h) - 2, n - 2, -1):  # e: where an earlier occurrence ends
            if h[e - n + 1 : e + 1] == h[-n:]:
                return h[e + 1 : e + 1 + k]
        return []

    def verified(self, proposed: int, accepted: int) -> None:
        self.k = min(self.k * 2, self.k_max) if accepted == proposed else max(1, min(accepted, self.k_max))


def replay(guesser: Guesser, output: list[int]) -> tuple[int, int]:
    """(steps, logits rows) to produce `output` after its first token (which the prompt pass gives)."""
    guesser.push(output[0])
    i, steps, rows = 1, 0, 0
    while i < len(output):
        guess = guesser.propose(len(output) - i - 1)
        taken = 0
        while taken < len(guess) and guess[taken] == output[i + taken]:
            taken += 1
        if guess:
            guesser.verified(len(guess), taken)
        for tok in output[i : i + taken + 1]:
            guesser.push(tok)
        i, steps, rows = i + taken + 1, steps + 1, rows + len(guess) + 1
    return steps, rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=260)
    p.add_argument("--ngram", type=int, default=4)
    p.add_argument("--spec-max", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    engine = Engine(WorkerConfig(slots=1, ctx_per_slot=2048, threads=a.threads, spec="none")).start()
    try:
        prompt = engine.vocab.tokenize(f"<start_of_turn>user\n{EDIT}<end_of_turn>\n<start_of_turn>model\n")  # Gemma's turns
        job = Job(id="edit", tokens=pack_tokens(prompt), sampling=Sampling(temperature=0.0, max_tokens=a.tokens))
        done = engine.submit(job).result(600)
    finally:
        engine.stop()
    assert isinstance(done, JobDone), done
    output = np.frombuffer(done.tokens, dtype="<i4").tolist()
    print(f"edit: {len(prompt)} prompt tokens, {len(output)} generated (greedy, no speculation)")
    base = replay(LatestOccurrence(prompt, a.ngram, a.spec_max), output)
    ours = replay(Drafter(prompt, len(prompt) + len(output), a.ngram, a.spec_max), output)
    pool = OutputPool(a.ngram)
    pool.add("", output)
    again = replay(Drafter(prompt, len(prompt) + len(output), a.ngram, a.spec_max, pool.lookup("")), output)
    for name, (steps, rows) in (
        ("latest occurrence (before)", base),
        ("kvroute (follows the place)", ours),
        ("kvroute, asked again", again),
    ):
        print(f"{name:28s} {steps:4d} steps  {rows:4d} logits rows  {(len(output) - 1) / steps:.2f} tokens per step")
    print(f"steps {ours[0] / base[0]:.2f}x, rows {ours[1] / base[1]:.2f}x the baseline's")


if __name__ == "__main__":
    main()
