"""Embeddings throughput (issue 34): inputs per second of /v1/embeddings, kvroute against llama-server `--embedding`
on the same model and pooling, the same threads, in one run, interleaved.

    .venv/bin/python -m bench.embeddings [--tokens 512] [--batch 32] [--requests 4] [--repeats 3] [--pooling mean]

llama-server runs with 4 slots (`--parallel 4`: up to four inputs in one decode, its best here) and a batch as large
as its context; kvroute's worker computes each input alone (worker/embedder.py says why). Each request carries
`--batch` inputs of `--tokens` token ids (distinct, so that no system can reuse anything); per
repeat, each system answers `--requests` such requests one after another; the figure is inputs/s. Also checked: both
give the same vector for the same input (cosine), so the comparison is of the same work.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from pathlib import Path

import httpx
import numpy as np

from bench.llama_server import binary
from bench.procs import interleaved_rates, print_rates, start, stop, wait_ready
from bench.systems import free_port


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pooling", default="mean", choices=["mean", "last", "cls"])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    from common.model import resolve_model

    model = str(resolve_model(None))
    tmp = Path(tempfile.mkdtemp(prefix="bench-embeddings-"))
    kv_port, ls_port = free_port(), free_port()
    ctx = max(8192, args.tokens)
    kv = start(
        [sys.executable, "-m", "commands.cli", "serve", "--http", f"127.0.0.1:{kv_port}", "--workers", "1", "--slots", "1",
         "--ctx-per-slot", "1024", "--threads", str(args.threads), "--pooling", args.pooling,
         "--zmq", f"ipc://{tmp}/zmq", "--worker-endpoint", f"ipc://{tmp}/workers"],
        tmp / "kvroute.log",
    )  # fmt: skip
    ls = start(
        [str(binary()), "-m", model, "--port", str(ls_port), "--embedding", "--pooling", args.pooling, "-c", str(ctx),
         "-b", str(ctx), "-ub", str(ctx), "-t", str(args.threads), "--parallel", "4"],
        tmp / "llama-server.log",
    )  # fmt: skip
    urls = {"kvroute": f"http://127.0.0.1:{kv_port}", "llama-server": f"http://127.0.0.1:{ls_port}"}
    try:
        for name, proc in (("kvroute", kv), ("llama-server", ls)):
            wait_ready(urls[name], proc, tmp / f"{name}.log", "/v1/embeddings", {"input": [[2, 100, 200]]})
        rng = random.Random(7)

        def body() -> dict[str, object]:
            return {"input": [[2, *(rng.randrange(1000, 200000) for _ in range(args.tokens - 1))] for _ in range(args.batch)]}

        probe = body()
        vecs = {
            n: np.asarray(httpx.post(f"{u}/v1/embeddings", json=probe, timeout=600).json()["data"][0]["embedding"])
            for n, u in urls.items()
        }
        a, b = vecs["kvroute"], vecs["llama-server"]
        cos = float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))
        rates = interleaved_rates(
            urls, "/v1/embeddings", lambda: [body() for _ in range(args.requests)], args.batch, args.repeats
        )
        print(
            f"{args.batch} inputs x {args.tokens} tokens a request, {args.requests} requests a repeat, {args.pooling} "
            f"pooling, {args.threads} threads; cosine of the same input's vectors: {cos:.6f}"
        )
        ratios = print_rates(rates, "inputs", 1)
        if args.out:
            Path(args.out).write_text(json.dumps({"args": vars(args), "rates": rates, "ratios": ratios, "cosine": cos}, indent=1))
    finally:
        stop(kv, ls)


if __name__ == "__main__":
    main()
