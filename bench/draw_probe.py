"""What a sampled token costs: llama.cpp's sampler chain vs worker/sampling.py's numpy `Draw`, one engine, interleaved
rounds.

    .venv/bin/python -m bench.draw_probe [--rounds 5] [--slots 4] [--tokens 96]

Each round runs `--slots` seeded jobs at temperature 0.8 at once (what OpenAI and Anthropic clients send: no top_k,
top_p or min_p), once with the chain and once with the draw, slots cleared first so that both compute the same. Prints
aggregate decode tokens/s per mode (median, min-max), the ratio draw / chain, the share of step time outside
llama_decode, and whether both picked the same tokens (they should: the draw is the chain's arithmetic).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager

import msgspec

import worker.sampling
from protocol import Job, JobDone, Sampling, pack_tokens
from worker.config import WorkerConfig
from worker.engine import Engine

PROMPT = "<start_of_turn>user\nTell story {i} about a ship and its cook.<end_of_turn>\n<start_of_turn>model\n"


@contextmanager
def chain_only() -> Iterator[None]:
    """Samplers made meanwhile use llama.cpp's chain for every draw."""
    real = worker.sampling.Draw
    worker.sampling.Draw = lambda *a: None  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        worker.sampling.Draw = real  # type: ignore[misc]


def batch(engine: Engine, slots: int, tokens: int, tag: str) -> tuple[float, float, list[bytes]]:
    """(aggregate decode tokens/s, share of step time outside llama_decode, each job's tokens)."""
    for s in range(slots):
        engine.call(lambda e, s=s: e.prefixes.clear(e.table[s])).result()
    c0 = msgspec.structs.replace(engine.counters)
    t = time.perf_counter()
    streams = []
    for i in range(slots):
        prompt = engine.vocab.tokenize(PROMPT.format(i=i))
        sampling = Sampling(temperature=0.8, seed=1000 + i, max_tokens=tokens, ignore_eos=True)
        streams.append(engine.submit(Job(id=f"{tag}-{i}", slot=i, tokens=pack_tokens(prompt), sampling=sampling)))
    dones = [s.result(600) for s in streams]
    wall = time.perf_counter() - t
    assert all(isinstance(d, JobDone) for d in dones), dones
    first = min(d.timings.ttft_ms for d in dones) / 1000
    c1 = engine.counters
    outside = 1 - (c1.decode_s - c0.decode_s) / (c1.step_s - c0.step_s)
    return sum(d.generated_tokens for d in dones) / (wall - first), outside, [d.tokens for d in dones]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--tokens", type=int, default=96)
    a = p.parse_args()
    engine = Engine(WorkerConfig(slots=a.slots, ctx_per_slot=1024, threads=2, spec="none")).start()
    rate: dict[str, list[float]] = {"chain": [], "draw": []}
    outside: dict[str, list[float]] = {"chain": [], "draw": []}
    same = 0
    try:
        for r in range(a.rounds):
            with chain_only():
                tps, out, chain_tokens = batch(engine, a.slots, a.tokens, f"c{r}")
            rate["chain"].append(tps)
            outside["chain"].append(out)
            tps, out, draw_tokens = batch(engine, a.slots, a.tokens, f"d{r}")
            rate["draw"].append(tps)
            outside["draw"].append(out)
            same += chain_tokens == draw_tokens
            print(f"round {r}: chain {rate['chain'][-1]:6.1f} tok/s, draw {tps:6.1f} tok/s, "
                  f"same tokens: {chain_tokens == draw_tokens}", flush=True)  # fmt: skip
    finally:
        engine.stop()
    for m in rate:
        print(f"{m:6s} {statistics.median(rate[m]):6.1f} tok/s ({min(rate[m]):.1f}-{max(rate[m]):.1f}), "
              f"{statistics.median(outside[m]) * 100:.1f}% of step time outside llama_decode")  # fmt: skip
    ratios = [d / c for c, d in zip(rate["chain"], rate["draw"], strict=True)]
    print(f"draw / chain: {statistics.median(rate['draw']) / statistics.median(rate['chain']):.2f}x "
          f"(per round {min(ratios):.2f}-{max(ratios):.2f}); same tokens in {same} of {a.rounds} rounds")  # fmt: skip


if __name__ == "__main__":
    main()
