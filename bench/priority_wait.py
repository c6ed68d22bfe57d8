"""An interactive request on a server whose every slot streams background work (issue 65's preemption).

`--background` streams (one per slot by default) take every slot: each a `--bg-words` prompt of its own on
`/v1/completions`, `--bg-tokens` tokens out (`ignore_eos`, greedy), streamed. Once every one of them has begun its
output, `--interactive` requests come one after another (each once the one before has ended), each a short prompt of
its own with `service_tier: "priority"` and `--fg-tokens` out, streamed. A server that honours the tier and preempts
(kvroute's `--preempt`: a job whose output began is suspended, its KV kept, and goes on where it stopped) serves the
interactive request at once; one that does not (llama-server; `kvroute --no-preempt`) makes it wait for a slot.

The figures: the interactive requests' time to first token and latency, and the background streams' latency, longest
wait between two of their tokens, and whether their text is the text they stream (nothing lost or repeated).

    python -m bench.priority_wait --url http://127.0.0.1:8000
    python -m bench.priority_wait --systems kvroute,kvroute-nopreempt,llama-server [--slots 3 --threads 2] [--repeats 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.agent_sessions import words
from bench.trace_replay import served_model


@dataclass
class Stream:
    """One streamed request's figures."""

    name: str
    sent_at: float = 0.0
    first_at: float | None = None
    times: list[float] = field(default_factory=list)  # arrival of each event carrying text
    text: str = ""
    status: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_at is None else self.first_at - self.sent_at

    @property
    def latency(self) -> float:
        return (self.times[-1] if self.times else self.sent_at) - self.sent_at

    @property
    def longest_gap(self) -> float:
        return max((b - a for a, b in zip(self.times, self.times[1:], strict=False)), default=0.0)


@dataclass(frozen=True)
class Traffic:
    background: int = 3
    bg_words: int = 300
    bg_tokens: int = 400
    interactive: int = 3
    fg_words: int = 40
    fg_tokens: int = 16


async def stream(http: httpx.AsyncClient, url: str, model: str, s: Stream, prompt: str, n: int, tier: str | None) -> None:
    """One streamed completion; its events' times and its text kept in `s`."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True}
    body["ignore_eos"] = True
    if tier:
        body["service_tier"] = tier
    s.sent_at = time.monotonic()
    async with http.stream("POST", f"{url}/v1/completions", json=body, timeout=1800) as r:
        s.status = r.status_code
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            text = "".join(str(c.get("text") or "") for c in event.get("choices") or [])
            if text:
                now = time.monotonic()
                s.first_at = s.first_at or now
                s.times.append(now)
                s.text += text


async def run(url: str, model: str, t: Traffic, transport: httpx.AsyncBaseTransport | None = None) -> dict[str, Any]:
    async with httpx.AsyncClient(headers={"Authorization": "Bearer -"}, timeout=1800, transport=transport) as http:
        bgs = [Stream(f"bg-{k}") for k in range(t.background)]
        tasks = [
            asyncio.create_task(stream(http, url, model, s, words(f"{s.name}/prompt", t.bg_words), t.bg_tokens, None))
            for s in bgs
        ]
        while not all(s.first_at for s in bgs):  # (every slot streams)
            if any(task.done() for task in tasks):
                break
            await asyncio.sleep(0.02)
        fgs = []
        for k in range(t.interactive):
            s = Stream(f"fg-{k}")
            fgs.append(s)
            await stream(http, url, model, s, words(f"{s.name}/prompt", t.fg_words), t.fg_tokens, "priority")
        await asyncio.gather(*tasks)
    return {
        "interactive_ttft_s": [round(s.ttft or -1, 2) for s in fgs],
        "interactive_mean_ttft_s": round(statistics.fmean(s.ttft or 0 for s in fgs), 2),
        "interactive_mean_s": round(statistics.fmean(s.latency for s in fgs), 2),
        "background_mean_s": round(statistics.fmean(s.latency for s in bgs), 2),
        "background_longest_gap_s": round(max(s.longest_gap for s in bgs), 2),
        "failed": sum(1 for s in bgs + fgs if s.status != 200),
        "texts": {s.name: s.text for s in bgs + fgs},
    }


HEADER = (
    "| system | interactive TTFT (each) | interactive mean TTFT | interactive mean latency | background mean latency "
    "| background longest gap | failed |\n| --- | --- | --- | --- | --- | --- | --- |"
)


def row(name: str, f: dict[str, Any]) -> str:
    each = ", ".join(f"{x} s" for x in f["interactive_ttft_s"])
    return (
        f"| {name} | {each} | {f['interactive_mean_ttft_s']} s | {f['interactive_mean_s']} s | "
        f"{f['background_mean_s']} s | {f['background_longest_gap_s']} s | {f['failed']} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="the server's base URL (http://HOST:PORT)")
    ap.add_argument("--name", default="server")
    defaults = Traffic()
    for f in ("background", "bg_words", "bg_tokens", "interactive", "fg_words", "fg_tokens"):
        ap.add_argument(f"--{f.replace('_', '-')}", type=int, default=getattr(defaults, f))
    ap.add_argument("--systems", help="comma-separated systems of bench/systems.py to start and run on in turn")
    ap.add_argument("--slots", type=int, default=3, help="slots (one worker); --background defaults to it")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=2048, help="context per slot")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    traffic = Traffic(args.background, args.bg_words, args.bg_tokens, args.interactive, args.fg_words, args.fg_tokens)
    print(HEADER, flush=True)
    results: list[dict[str, Any]] = []
    if not args.systems:
        if not args.url:
            ap.error("--url or --systems is needed")
        url = args.url.rstrip("/")
        results.append({"system": args.name, **asyncio.run(run(url, served_model(url), traffic))})
        print(row(args.name, results[-1]))
    else:
        from bench.systems import Setup, interleaved
        from common.model import default_model_path

        setup = Setup(str(default_model_path()), args.threads, 1, args.slots, args.ctx)

        def measure(url: str) -> dict[str, Any]:
            return asyncio.run(run(url, served_model(url), traffic))

        results = interleaved(args.systems.split(","), setup, args.repeats, measure, row, "kvroute-priority-wait-")
    if args.out:
        args.out.write_text(json.dumps({"traffic": asdict(traffic), "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
