"""The longest silence a client hears while the model writes a long tool call, on each API (issue 47: 57 s on Chat
Completions and 55 s on Responses before calls streamed). A forced call to `write_file` whose `content` the model
writes for up to `--tokens` tokens; the time between two reads of the stream's bytes, after the first, is a silence.

    .venv/bin/python -m bench.silence --model PATH [--source DIR] [--tokens 800] [--repeats 3]

`--source` runs `kvroute serve` from another checkout (a commit before, for a baseline), with this environment. A
model that never closes the string writes the whole `--tokens`: a random-weight one from bench/tiny_chat.py (its
shape sets its speed: `chat_model(path, "Qwen3-Coder", n_embd=512, n_layer=12, n_ff=2048, n_head=8, n_head_kv=4,
head_dim=64)` decodes at tens of tokens a second on 2 cores, as a real model does on a GPU-less box).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
PARAMS = {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
          "required": ["path", "content"]}  # fmt: skip
ASK = "Write a long essay (at least 3000 words) about the history of rivers into the file essay.md, with the tool."


def bodies(tokens: int) -> dict[str, tuple[str, dict[str, object]]]:
    chat_tools = [{"type": "function", "function": {"name": "write_file", "parameters": PARAMS}}]
    user = [{"role": "user", "content": ASK}]
    return {
        "chat": ("/v1/chat/completions", {"messages": user, "tools": chat_tools, "stream": True, "max_tokens": tokens,
                 "tool_choice": {"type": "function", "function": {"name": "write_file"}}, "temperature": 0.7, "seed": 1}),
        "responses": ("/v1/responses", {"input": user, "tool_choice": {"type": "function", "name": "write_file"},
                      "tools": [{"type": "function", "name": "write_file", "parameters": PARAMS}], "stream": True,
                      "max_output_tokens": tokens, "temperature": 0.7}),
        "messages": ("/v1/messages", {"messages": user, "tools": [{"name": "write_file", "input_schema": PARAMS}],
                     "tool_choice": {"type": "tool", "name": "write_file"}, "stream": True, "max_tokens": tokens,
                     "temperature": 0.7}),
    }  # fmt: skip


KEEP_ALIVES = (b": keep-alive", b"event: keepalive", b"event: ping")


def silence(url: str, path: str, body: dict[str, object]) -> tuple[float, float, float, int]:
    """(longest gap between reads after the first, longest gap between reads that carry more than keep-alives, the
    whole stream's time, bytes read)."""
    t0 = time.monotonic()
    reads: list[float] = []
    content: list[float] = []
    size = 0
    headers = {"anthropic-version": "2023-06-01"}
    with httpx.stream("POST", url + path, json=body, timeout=900, headers=headers) as r:
        for chunk in r.iter_raw():
            now = time.monotonic()
            reads.append(now)
            events = [e for e in chunk.split(b"\n\n") if e.strip()]
            if any(not e.startswith(KEEP_ALIVES) for e in events):
                content.append(now)
            size += len(chunk)
    gaps = [b - a for a, b in itertools.pairwise(reads)]
    held = [b - a for a, b in itertools.pairwise(content)]
    return max(gaps or [0.0]), max(held or [0.0]), reads[-1] - t0 if reads else 0.0, size


def span(values: tuple[float, ...]) -> str:
    """Median [min-max] of the repeats."""
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def serve(source: Path, model: str, port: int, log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "commands.cli", "serve", "--http", f"127.0.0.1:{port}", "--threads", "2", "--slots", "1",
           "--zmq", f"tcp://127.0.0.1:{port + 1}", "--worker-endpoint", f"tcp://127.0.0.1:{port + 2}",
           "--ctx-per-slot", "4096"]  # fmt: skip
    if model:
        cmd += ["--model", model]
    env = {**os.environ, "PYTHONPATH": str(source)}
    proc = subprocess.Popen(cmd, cwd=source, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"kvroute serve from {source} did not come up; see {log}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", type=Path, default=ROOT)
    ap.add_argument("--model", default="")
    ap.add_argument("--tokens", type=int, default=800)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--port", type=int, default=18300)
    a = ap.parse_args()
    proc = serve(a.source.resolve(), a.model, a.port, Path(f"/tmp/kvroute-silence-{a.port}.log"))
    try:
        url = f"http://127.0.0.1:{a.port}"
        results: dict[str, list[tuple[float, float, float, int]]] = {k: [] for k in bodies(a.tokens)}
        for _ in range(a.repeats):  # (the APIs interleaved, each repeat)
            for api, (path, body) in bodies(a.tokens).items():
                results[api].append(silence(url, path, body))
        print(f"source {a.source} model {a.model or 'default'} tokens {a.tokens} repeats {a.repeats}")
        print("| API | longest silence (s) | longest without a keep-alive (s) | stream (s) | bytes |\n|---|---|---|---|---|")
        for api, rows in results.items():
            gaps, held, totals, sizes = zip(*rows, strict=True)
            print(f"| {api} | {span(gaps)} | {span(held)} | {statistics.median(totals):.1f} | {int(statistics.median(sizes))} |")
        print(json.dumps({api: rows for api, rows in results.items()}))
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
