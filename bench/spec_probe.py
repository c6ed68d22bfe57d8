"""Speculative decoding on an agent's edit: the model is shown a file and answers with it again, one request at a
time; and plain generation, 8 requests at once (where guesses rarely hold, so speculation must cost nothing).
kvroute with and without `--spec ngram`, llama-server with and without `--spec-type ngram-simple` and
`ngram-mod`, all interleaved in every round.

    .venv/bin/python -m bench.spec_probe [--rounds 3] [--systems kvroute,kvroute-spec,...]

Prints, per system, decode tokens/s of the edit (tokens after the first / time after the first) and the total
tokens/s of the concurrent batch: the median over rounds, the min-max across rounds, the ratio to llama-server
without speculation, and kvroute's share of guessed tokens taken.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import statistics
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

from bench.systems import Server, Setup
from kvroute.model import resolve_model

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
    "kvroute": ("kvroute", (), ()),
    "kvroute-spec": ("kvroute", ("--spec", "ngram"), ()),
    "kvroute-spec-64": ("kvroute", ("--spec", "ngram", "--spec-max", "64"), ()),
    "llama-server": ("llama-server", (), ()),
    "llama-server-ngram-simple": ("llama-server", (), ("--spec-type", "ngram-simple")),
    "llama-server-ngram-mod": ("llama-server", (), ("--spec-type", "ngram-mod")),
}


def stream(url: str, content: str, max_tokens: int) -> tuple[int, float, float]:
    """(completion tokens, seconds to the first text, seconds from the first text to the end)."""
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    first = None
    tokens = 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                first = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    if first is None:
        raise RuntimeError(f"{url}: no content in the reply")
    return tokens, first - t0, end - first


def spec_counters(url: str) -> tuple[float, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        for name in ("kvroute_worker_spec_proposed_total", "kvroute_worker_spec_accepted_total"):
            if line.startswith(name):
                values[name] = values.get(name, 0.0) + float(line.split()[-1])
    return values.get("kvroute_worker_spec_proposed_total", 0.0), values.get("kvroute_worker_spec_accepted_total", 0.0)


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
        for s in servers.values():
            stream(s.url, "Say hello.", 4)  # warm-up
        pool = stack.enter_context(concurrent.futures.ThreadPoolExecutor(len(TOPICS)))
        for r in range(args.rounds):
            for n, s in servers.items():
                tokens, _, decode_s = stream(s.url, EDIT, args.edit_tokens)
                edit[n].append((tokens - 1) / decode_s)
                t0 = time.perf_counter()
                asks = [f"Round {r}: write a short story about {t}." for t in TOPICS]
                jobs = [pool.submit(stream, s.url, ask, args.batch_tokens) for ask in asks]
                done = sum(j.result()[0] for j in jobs)
                batch[n].append(done / (time.perf_counter() - t0))
                print(f"round {r} {n:28s} edit {edit[n][-1]:6.1f} tok/s ({tokens} tokens)  "
                      f"batch {batch[n][-1]:6.1f} tok/s", flush=True)  # fmt: skip
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
