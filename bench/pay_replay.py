"""Whether the pay-or-withhold rule keeps guesses from slowing a busy batch, counted without the machine's noise.

The worker writes bench.spec_batch's 8 stories for a few rounds once (greedy, no speculation). Each round is then
replayed as the engine drives a batch of 8 generating slots: before every step each job guesses or withholds by
worker/speculate.py's rule (`StepCost.pays`, `Drafter.shadow`), its guess is checked against what it wrote, and the
step's time is taken from a fixed model of this CPU (~18 ms a step, ~8 ms a row). The figure is the modelled time
against the same round without speculation: guessing from the stories' own text, and from the pool of earlier rounds'
stories (`OutputPool`, as a worker that served them holds it).

With `--noise X` the rule learns the step costs as the engine does, from the steps it takes, each timed with noise that
only adds time (exponential, mean X of the step's cost, seeded), in one `StepCost` kept for the whole run. Without it,
the rule knows the model exactly.

    .venv/bin/python -m bench.pay_replay [--rounds 4] [--tokens 64] [--noise 0.3] [--seed 0]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np

from bench.spec_probe import TOPICS
from protocol import Job, JobDone, Sampling, pack_tokens
from worker.config import WorkerConfig
from worker.engine import Engine
from worker.speculate import Drafter, OutputPool, StepCost

TURN = "<start_of_turn>user\nRound {r}: write a short story about {t}.<end_of_turn>\n<start_of_turn>model\n"
NGRAM, SPEC_MAX = 4, 16  # the worker's defaults
Noise = Callable[[float], float] | None  # a step's cost -> the time a noisy machine reports for it


def step_s(rows: int) -> float:
    return 0.018 + 0.008 * (rows - 1)


def write(rounds: int, tokens: int) -> list[list[tuple[list[int], list[int]]]]:
    """Each round's (prompt, story) pairs, greedy, without speculation."""
    engine = Engine(WorkerConfig(slots=len(TOPICS), ctx_per_slot=1024, threads=2, spec="none")).start()
    try:
        out = []
        for r in range(rounds):
            stories = []
            for i, topic in enumerate(TOPICS):
                prompt = engine.vocab.tokenize(TURN.format(r=r, t=topic))
                sampling = Sampling(temperature=0.0, max_tokens=tokens, ignore_eos=True)
                stream = engine.submit(Job(id=f"r{r}-{i}", slot=i, tokens=pack_tokens(prompt), sampling=sampling))
                assert stream is not None
                done = stream.result(600)
                assert isinstance(done, JobDone), done
                stories.append((prompt, np.frombuffer(done.tokens, dtype="<i4").tolist()))
            out.append(stories)
        return out
    finally:
        engine.stop()


def exact_cost() -> StepCost:
    cost = StepCost(kept=128)
    for rows in range(1, 100):
        cost.observe(rows, step_s(rows))
    return cost


def replay(
    stories: list[tuple[list[int], list[int]]], pool: OutputPool | None, spec: bool, cost: StepCost, noise: Noise
) -> tuple[float, int, int]:
    """(modelled seconds, guessed tokens, taken tokens) of one batch."""
    jobs = [(Drafter(p + o[:1], len(p) + len(o), NGRAM, SPEC_MAX, pool.lookup("") if pool else None), o) for p, o in stories]
    at = [1] * len(jobs)
    seconds, guessed, taken = 0.0, 0, 0
    while any(i < len(o) for i, (_, o) in zip(at, jobs, strict=True)):
        live = [j for j, (_, o) in enumerate(jobs) if at[j] < len(o)]
        rows, plan = len(live), []
        for j in live:  # as worker/batching.py and EngineCore._guess decide
            drafter, out = jobs[j]
            limit, guess = len(out) - at[j] - 1, []
            if spec and limit > 0:
                withheld = not cost.pays(drafter.rate, len(live), rows, min(drafter.k, limit)) and drafter.shadow(limit)
                guess = [] if withheld else drafter.propose(limit)
            rows += len(guess)
            plan.append((j, guess))
        seconds += step_s(rows)
        if noise is not None:
            cost.observe(rows, noise(step_s(rows)))
        for j, guess in plan:  # as EngineCore._verify takes them
            drafter, out = jobs[j]
            n = 0
            while n < len(guess) and guess[n] == out[at[j] + n]:
                n += 1
            if guess:
                drafter.verified(len(guess), n)
                guessed, taken = guessed + len(guess), taken + n
            for tok in out[at[j] : at[j] + n + 1]:
                drafter.push(tok)
            at[j] += n + 1
    return seconds, guessed, taken


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--noise", type=float, default=0.0, help="learn step costs timed with this mean added share")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    rng = np.random.default_rng(a.seed)
    noise: Noise = (lambda s: s * (1 + rng.exponential(a.noise))) if a.noise > 0 else None
    cost = StepCost() if noise else exact_cost()  # (the engine's own, learning as it goes)
    rounds = write(a.rounds, a.tokens)
    for r in range(1, a.rounds):
        base, _, _ = replay(rounds[r], None, False, cost, None)
        pool = OutputPool(NGRAM)
        for earlier in rounds[:r]:
            for _, story in earlier:
                pool.add("", story)
        for name, source in (("own text", None), ("with the pool", pool)):
            seconds, guessed, taken = replay(rounds[r], source, True, cost, noise)
            print(f"round {r} {name:14s} {seconds / base:.3f}x the time without speculation  guessed {guessed}, taken {taken}")


if __name__ == "__main__":
    main()
