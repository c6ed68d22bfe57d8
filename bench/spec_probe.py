"""Speculative decoding on an agent's edit: the model is shown a file and answers with it again, one request at a
time; and plain generation, 8 requests at once (where guesses hold less, so speculation must cost nothing).
kvroute with (`--spec auto`, the default) and without (`--spec none`) speculation, llama-server with and without
`--spec-type ngram-simple` and `ngram-mod`, all interleaved in every round.

    .venv/bin/python -m bench.spec_probe [--rounds 3] [--systems kvroute,kvroute-nospec,...]

Prints, per system, decode tokens/s of the edit (tokens after the first / time after the first) and the total
tokens/s of the concurrent batch: the median over rounds, the min-max across rounds, the ratio to llama-server
without speculation, and kvroute's share of guessed tokens taken.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

from bench.client import CompletionClient
from bench.systems import Server, Setup
from common.model import resolve_model

FILE = '''def load_settings(path):
    """Read the settings file and return a dict of its values."""
    settings = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, _, value = line.partition("=")
            settings[key.strip()] = value.strip()
    return settings


def save_settings(path, settings):
    """Write the settings back, one key per line, sorted by key."""
    with open(path, "w") as f:
        for key in sorted(settings):
            f.write(f"{key} = {settings[key]}\\n")
'''
EDIT = f"Here is settings.py:\n```python\n{FILE}```\nRepeat the whole file exactly as it is, in one code block."
TOPICS = ["a lighthouse", "a river", "a market", "a library", "a train", "a garden", "a storm", "a bakery"]

SYSTEMS = {
    "kvroute-nospec": ("kvroute", ("--spec", "none"), ()),
    "kvroute": ("kvroute", (), ()),  # --spec auto: ngram
    "kvroute-spec-64": ("kvroute", ("--spec", "ngram", "--spec-max", "64"), ()),
    "llama-server": ("llama-server", (), ()),
    "llama-server-ngram-simple": ("llama-server", (), ("--spec-type", "ngram-simple")),
    "llama-server-ngram-mod": ("llama-server", (), ("--spec-type", "ngram-mod")),
}


async def edit_rate(client: CompletionClient, max_tokens: int) -> tuple[float, int]:
    """Decode tokens/s of the edit (tokens after the first / time after the first), and its token count."""
    sample = await client.complete(EDIT, max_tokens, session="edit", turn=0, t0=time.perf_counter(), chat=True)
    if sample.error or sample.ttft is None:
        raise RuntimeError(f"the edit failed: {sample.error or 'no text'}")
    return (sample.output_tokens - 1) / (sample.total - sample.ttft), sample.output_tokens


async def batch_rate(client: CompletionClient, round_: int, max_tokens: int) -> float:
    """Total tokens/s of one short story per topic, all at once; a failed request stops the probe."""
    t0 = time.perf_counter()
    asks = [f"Round {round_}: write a short story about {t}." for t in TOPICS]
    samples = await asyncio.gather(
        *(client.complete(ask, max_tokens, session=f"story-{i}", turn=0, t0=t0, chat=True) for i, ask in enumerate(asks))
    )
    failed = [s.error for s in samples if s.error]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(asks)} stories failed: {failed[0]}")
    return sum(s.output_tokens for s in samples) / (time.perf_counter() - t0)


def spec_counters(url: str) -> tuple[float, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        for name in ("kvroute_worker_spec_proposed_total", "kvroute_worker_spec_accepted_total"):
            if line.startswith(name):
                values[name] = values.get(name, 0.0) + float(line.split()[-1])
    return values.get("kvroute_worker_spec_proposed_total", 0.0), values.get("kvroute_worker_spec_accepted_total", 0.0)


async def measure(
    urls: dict[str, str], args: argparse.Namespace, edit: dict[str, list[float]], batch: dict[str, list[float]]
) -> None:
    """The rounds, every system in each (appends to `edit` and `batch`)."""
    clients = {n: CompletionClient(url) for n, url in urls.items()}
    try:
        for c in clients.values():
            await edit_rate(c, 4)  # warm-up
        for r in range(args.rounds):
            for n, c in clients.items():
                rate, tokens = await edit_rate(c, args.edit_tokens)
                edit[n].append(rate)
                batch[n].append(await batch_rate(c, r, args.batch_tokens))
                print(f"round {r} {n:28s} edit {rate:6.1f} tok/s ({tokens} tokens)  batch {batch[n][-1]:6.1f} tok/s", flush=True)
    finally:
        for c in clients.values():
            await c.aclose()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--edit-tokens", type=int, default=260)
    p.add_argument("--batch-tokens", type=int, default=64)
    args = p.parse_args()
    names = args.systems.split(",")
    base = Setup(model=str(resolve_model(None)), threads=args.threads, workers=1, slots=4, ctx_per_slot=2048)
    logs = Path("bench/results/spec-probe-logs")
    edit: dict[str, list[float]] = {n: [] for n in names}
    batch: dict[str, list[float]] = {n: [] for n in names}
    with ExitStack() as stack:
        servers = {}
        for n in names:
            kind, kv_flags, ls_flags = SYSTEMS[n]
            setup = dataclasses.replace(base, kvroute_flags=kv_flags, llama_server_flags=ls_flags)
            servers[n] = stack.enter_context(Server(kind, setup, logs / f"{n}.log"))
        asyncio.run(measure({n: s.url for n, s in servers.items()}, args, edit, batch))
        taken = {n: spec_counters(s.url) for n, s in servers.items() if SYSTEMS[n][0] == "kvroute"}
    ref = "llama-server" if "llama-server" in names else names[0]
    for label, figures in (("edit decode", edit), ("8 at once", batch)):
        b = statistics.median(figures[ref])
        for n, xs in figures.items():
            m = statistics.median(xs)
            print(f"{label:12s} {n:28s} {m:6.1f} tok/s (rounds {min(xs):.1f}-{max(xs):.1f})  {m / b:.2f}x {ref}")
    for n, (proposed, accepted) in taken.items():
        if proposed:
            print(f"{n}: {accepted:.0f} of {proposed:.0f} guessed tokens taken ({accepted / proposed:.0%})")


if __name__ == "__main__":
    main()
