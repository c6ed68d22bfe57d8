"""What speculation costs a batch: one engine, 8 slots writing a short story each at once, speculation on and off in
alternate rounds (the order flipped every round), aggregate decode tokens/s (worker_bench's measure), with the guesses
verified, taken and withheld in each round.

    .venv/bin/python -m bench.spec_batch [--rounds 6] [--tokens 64]

A fresh engine has not yet timed steps with guesses: its first rounds guess on every n-gram match; the later ones
show the pay-or-withhold rule (worker/speculate.py) at work. The rounds with speculation on run as one tenant and the
others as another, so guesses from recent outputs (worker/speculate.py OutputPool) come from earlier rounds' stories,
never from the same stories just written with speculation off.
"""

from __future__ import annotations

import argparse
import statistics

from bench.spec_probe import TOPICS
from bench.worker_bench import decode_rate
from worker.config import WorkerConfig
from worker.engine import Engine


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    engine = Engine(WorkerConfig(slots=len(TOPICS), ctx_per_slot=1024, threads=a.threads, spec="ngram")).start()

    def counts() -> tuple[int, int, int]:
        return engine.call(lambda e: (e.counters.spec_proposed, e.counters.spec_accepted, e.counters.spec_withheld)).result(10)

    rates: dict[bool, list[float]] = {True: [], False: []}
    try:
        for r in range(a.rounds):
            for on in (True, False) if r % 2 == 0 else (False, True):
                engine.call(lambda e, on=on: setattr(e, "spec", on)).result(10)
                turn = "<start_of_turn>user\nRound {r}: write a short story about {t}.<end_of_turn>\n<start_of_turn>model\n"
                prompts = [engine.vocab.tokenize(turn.format(r=r, t=t)) for t in TOPICS]
                before = counts()
                rates[on].append(decode_rate(engine, prompts, a.tokens, None, salt="on" if on else "off"))
                guessed, taken, withheld = (y - x for x, y in zip(before, counts(), strict=True))
                print(f"round {r} spec {'on ' if on else 'off'} {rates[on][-1]:6.1f} tok/s  guessed {guessed} taken {taken} "
                      f"withheld {withheld}", flush=True)  # fmt: skip
    finally:
        engine.stop()
    ratios = [x / y for x, y in zip(rates[True], rates[False], strict=True)]
    print(f"on {statistics.median(rates[True]):.1f} / off {statistics.median(rates[False]):.1f} tok/s; "
          f"on/off per round {', '.join(f'{x:.2f}' for x in ratios)}")  # fmt: skip


if __name__ == "__main__":
    main()
