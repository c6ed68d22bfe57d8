"""Rerank throughput (issue 34): documents per second of /v1/rerank, kvroute against llama-server `--reranking` on
the same reranker GGUF, the same threads, in one run, interleaved.

    .venv/bin/python -m bench.rerank [--shape qwen3|bert] [--docs 8] [--doc-tokens 128] [--requests 2] [--repeats 3]

No reranker can be downloaded here, so the model is one of a real reranker's shape with seeded random weights
(bench/tiny_models.py; written once under ~/.cache/kvroute/bench): `qwen3` is Qwen3-Reranker-0.6B's (28 layers,
1024 wide, causal: the score is read at the last token), `bert` bge-reranker-base's (12 layers, 768 wide, a
cross-encoder); f16 weights, a byte-level or letter vocabulary. The time of a step does not depend on the weights.

Each request is a fresh query (only the template before it is shared across requests) and `--docs` documents of
about `--doc-tokens` tokens. llama-server runs with 4 slots (`--parallel 4`: up to four documents in one decode; on a
causal reranker each slot keeps its last document's prompt and reuses its head), its default flash attention and a
batch as large as its context; kvroute's worker computes each document alone and, on a causal reranker, the
template and query every document starts with once. Also checked: both give the same scores (the largest difference
is printed; the probe's scores are in --out).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.llama_server import binary
from bench.procs import interleaved_rates, print_rates, start, stop, wait_ready
from bench.systems import free_port
from bench.tiny_models import BGE_RERANKER_BASE, QWEN3_RERANKER_0_6B, WORDS, bert_reranker, qwen3_reranker

SHAPES = {"qwen3": (qwen3_reranker, QWEN3_RERANKER_0_6B, 8192), "bert": (bert_reranker, BGE_RERANKER_BASE, 512)}


def model_file(shape: str) -> Path:
    make, dims, n_ctx = SHAPES[shape]
    path = Path.home() / ".cache" / "kvroute" / "bench" / f"{shape}-reranker-shaped.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_suffix(".part")
        make(part, n_ctx=n_ctx, dtype=np.float16, **dims)
        part.rename(path)
    return path


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3", choices=sorted(SHAPES))
    ap.add_argument("--docs", type=int, default=8, help="documents a request")
    ap.add_argument("--doc-tokens", type=int, default=128, help="about this many tokens a document")
    ap.add_argument("--requests", type=int, default=2, help="requests a system answers per repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    model = model_file(args.shape)
    words = args.doc_tokens  # (both vocabularies make a token of each of these words)
    tmp = Path(tempfile.mkdtemp(prefix="bench-rerank-"))
    kv_port, ls_port = free_port(), free_port()
    ctx = 4 * SHAPES[args.shape][2] if args.shape == "bert" else 8192
    kv = start(
        [sys.executable, "-m", "commands.cli", "serve", "--http", f"127.0.0.1:{kv_port}", "--model", f"reranker={model}",
         "--slots", "1", "--ctx-per-slot", "512", "--threads", str(args.threads),
         "--zmq", f"ipc://{tmp}/zmq", "--worker-endpoint", f"ipc://{tmp}/workers"],
        tmp / "kvroute.log",
    )  # fmt: skip
    ls = start(
        [str(binary()), "-m", str(model), "--port", str(ls_port), "--reranking", "-c", str(ctx), "-b", str(ctx),
         "-ub", str(min(ctx, 2048)), "-t", str(args.threads), "--parallel", "4"],
        tmp / "llama-server.log",
    )  # fmt: skip
    urls = {"kvroute": f"http://127.0.0.1:{kv_port}", "llama-server": f"http://127.0.0.1:{ls_port}"}
    try:
        for name, proc in (("kvroute", kv), ("llama-server", ls)):
            wait_ready(urls[name], proc, tmp / f"{name}.log", "/v1/rerank", {"query": "a", "documents": ["b"]})
        rng = random.Random(7)

        def body() -> dict[str, Any]:
            return {"query": text(rng, 6), "documents": [text(rng, words) for _ in range(args.docs)]}

        probe = body()
        got = {n: httpx.post(f"{u}/v1/rerank", json=probe, timeout=600).json() for n, u in urls.items()}
        scores = {n: {r["index"]: r["relevance_score"] for r in g["results"]} for n, g in got.items()}
        diff = max(abs(scores["kvroute"][i] - scores["llama-server"][i]) for i in range(args.docs))
        tokens = got["llama-server"]["usage"]["prompt_tokens"]
        cached = got["kvroute"]["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
        rates = interleaved_rates(urls, "/v1/rerank", lambda: [body() for _ in range(args.requests)], args.docs, args.repeats)
        print(
            f"{args.shape}-shaped reranker, {args.docs} documents a request ({tokens} prompt tokens in all, kvroute "
            f"computing {tokens - cached} of them), {args.requests} requests a repeat, {args.threads} threads; largest "
            f"score difference between the two: {diff:.2g}"
        )
        ratios = print_rates(rates, "documents", 2)
        if args.out:
            figures = {
                "args": vars(args),
                "rates": rates,
                "ratios": ratios,
                "score_diff": diff,
                "probe_scores": {n: [sc[i] for i in range(args.docs)] for n, sc in scores.items()},
                "tokens": tokens,
                "cached": cached,
            }
            Path(args.out).write_text(json.dumps(figures, indent=1))
    finally:
        stop(kv, ls)


if __name__ == "__main__":
    main()
