"""Where a cached turn's time to first token goes: kvroute over HTTP and over ZMQ, and llama-server over HTTP, on
the same short cached turn (a 220-token prompt of which about 200 are cached), one request at a time, the
systems interleaved in every round. HTTP is measured twice: with the client's default socket (httpx, like the
OpenAI SDK: Nagle's algorithm on) and with TCP_NODELAY.

    .venv/bin/python -m bench.turn_probe [--rounds 5] [--requests 8]

Prints, per system and client, the median TTFT over the rounds' medians, its min-max across rounds, and the
ratio to llama-server's (default socket).
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

from bench.systems import Server, Setup
from common.model import resolve_model
from kvroute.client import Client

SENTENCE = "The lighthouse keeper's log, autumn. The wind turned north before dawn and the sea rose against the rocks. "
DOC = SENTENCE * 8  # about 200 tokens; --doc-sentences makes it longer


def http_ttft(url: str, question: str, *, nodelay: bool) -> float:
    """Seconds until the first chunk with reply text, on a new connection (as a client without a pool makes)."""
    options = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)] if nodelay else []
    body = {"messages": [{"role": "user", "content": DOC + question}], "max_tokens": 8, "stream": True, "temperature": 0}
    with httpx.Client(transport=httpx.HTTPTransport(socket_options=options)) as client:
        t0 = time.perf_counter()
        with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                compact = line.replace(" ", "")
                if line.startswith("data: {") and '"content":"' in compact and '"content":""' not in compact:
                    return time.perf_counter() - t0
    raise RuntimeError(f"{url}: no content in the reply")


def zmq_ttft(client: Client, question: str) -> float:
    ttft = None
    t0 = time.perf_counter()
    for delta in client.stream(messages=[{"role": "user", "content": DOC + question}], max_tokens=8, temperature=0.0):
        if delta.text and ttft is None:
            ttft = time.perf_counter() - t0  # (then read to the end, so that the next request finds the slot free)
    if ttft is None:
        raise RuntimeError("no content in the reply")
    return ttft


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--requests", type=int, default=8, help="requests per system and client in each round")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--doc-sentences", type=int, default=8, help="sentences of the cached document (8: ~200 tokens)")
    args = p.parse_args()
    global DOC
    DOC = SENTENCE * args.doc_sentences
    ctx = max(2048, -(-(args.doc_sentences * 25 + 256) // 256) * 256)
    setup = Setup(model=str(resolve_model(None)), threads=args.threads, workers=1, slots=4, ctx_per_slot=ctx)
    logs = Path("bench/results/turn-probe-logs")
    with ExitStack() as stack:
        kv = stack.enter_context(Server("kvroute", setup, logs / "kvroute.log"))
        ls = stack.enter_context(Server("llama-server", setup, logs / "llama-server.log"))
        zmq_endpoint = next(a for argv in kv.argvs for i, a in enumerate(argv) if argv[i - 1] == "--zmq")
        zmq = stack.enter_context(Client(zmq_endpoint, timeout_s=60))
        probes = {
            "kvroute http": lambda q: http_ttft(kv.url, q, nodelay=False),
            "kvroute http nodelay": lambda q: http_ttft(kv.url, q, nodelay=True),
            "kvroute zmq": lambda q: zmq_ttft(zmq, q),
            "llama-server http": lambda q: http_ttft(ls.url, q, nodelay=False),
            "llama-server http nodelay": lambda q: http_ttft(ls.url, q, nodelay=True),
        }
        for probe in probes.values():
            probe(" Warm-up question.")
        medians: dict[str, list[float]] = {name: [] for name in probes}
        for r in range(args.rounds):
            for name, probe in probes.items():
                times = [probe(f" Round {r} question {i}: which boat?") for i in range(args.requests)]
                medians[name].append(statistics.median(times))
    base = statistics.median(medians["llama-server http"])
    for name, ms in medians.items():
        m = statistics.median(ms)
        print(f"{name:28s} {m * 1000:6.1f} ms  (rounds {min(ms) * 1000:.1f}-{max(ms) * 1000:.1f})  {m / base:.2f}x llama-server")


if __name__ == "__main__":
    main()
