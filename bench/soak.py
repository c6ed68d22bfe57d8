"""The soak (issue 33): agent sessions for an hour through two routers side by side and the HTTP front, one router
restarted every 10 minutes. Nothing may be lost or hang, and every process's memory must stay bounded.

Two `kvroute router` (A, B), workers that report to both (`--connect A,B`), one `kvroute http --router A,B`. Each
agent session streams chat turns (/v1/chat/completions) on a conversation that grows until it nears the slot's
context, then starts a new one. Every `--restart-every-min` minutes a router is restarted, A and B in turn, by SIGTERM
(a drain, as `systemctl restart` does) and by SIGKILL alternately; the gateway moves to the other router. Each request
must end within `--request-timeout-s`: completed, or refused with a status and a message naming the cause (503/529
`router_lost` for one whose output had begun at a router that died). The resident memory of every process is sampled
every 30 s.

    .venv/bin/python -m bench.soak [--minutes 60] [--restart-every-min 10] [--agents 12] [--out FILE]

The report (JSON): requests by outcome and status, the error messages seen, hung requests (none allowed), restarts,
and per process the memory at the start of the second interval, the end, and its maximum.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.fleet import TwoRouters

TURN_WORDS = ("Read the file.", "Now fix the failing test.", "Explain the change.", "Run the linter.", "Continue.")


class Tally:
    def __init__(self) -> None:
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.messages: collections.Counter[str] = collections.Counter()
        self.hung = 0
        self.latencies: list[float] = []


async def agent(n: int, http: httpx.AsyncClient, args: argparse.Namespace, tally: Tally, stop_at: float) -> None:
    system = f"You are coding agent {n}. You work in a large repository; answer briefly and precisely. " * 10
    talk: list[dict[str, str]] = []
    turn = 0
    while time.monotonic() < stop_at:
        if not talk or sum(len(m["content"]) for m in talk) > args.ctx * 3:  # (a new one before it outgrows the slot)
            talk = [{"role": "system", "content": system}]
        talk.append({"role": "user", "content": f"{TURN_WORDS[turn % len(TURN_WORDS)]} (turn {turn})"})
        body = {"model": "kvroute", "messages": talk, "max_tokens": args.max_tokens, "stream": True, "temperature": 0.7}
        t0 = time.monotonic()
        text, status, error = "", 0, ""
        try:
            async with asyncio.timeout(args.request_timeout_s):
                async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                    status = r.status_code
                    if status != 200:
                        error = (await r.aread()).decode("utf-8", "replace")[:200]
                    else:
                        async for line in r.aiter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            event = json.loads(line[6:])
                            if "error" in event:
                                error = json.dumps(event["error"])[:200]
                            for c in event.get("choices", []):
                                text += c.get("delta", {}).get("content") or ""
        except TimeoutError:
            tally.hung += 1
            tally.outcomes["hung"] += 1
            talk.pop()
            continue
        except httpx.HTTPError as exc:
            error = f"{type(exc).__name__}: {exc}"[:200]
        tally.latencies.append(time.monotonic() - t0)
        if status == 200 and not error:
            tally.outcomes["completed"] += 1
            talk.append({"role": "assistant", "content": text})
        else:
            tally.outcomes[f"error {status}"] += 1
            tally.messages[error] += 1
            talk.pop()
            # the conversation outgrew its slot: a new one, as an agent compacts
            if "maximum context length" in error or "context_length_exceeded" in error:
                talk = []
        turn += 1


async def soak(fleet: TwoRouters, args: argparse.Namespace) -> dict[str, Any]:
    tally = Tally()
    memory: list[dict[str, Any]] = []
    restarts: list[dict[str, Any]] = []
    t_start = time.monotonic()
    stop_at = t_start + args.minutes * 60
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{fleet.http_port}", timeout=None) as http:
        agents = [asyncio.create_task(agent(n, http, args, tally, stop_at)) for n in range(args.agents)]
        next_restart = t_start + args.restart_every_min * 60
        k = 0
        while time.monotonic() < stop_at:
            await asyncio.sleep(30)
            now = time.monotonic()
            memory.append({"t_min": round((now - t_start) / 60, 1), **{k2: round(v, 1) for k2, v in fleet.rss_mb().items()}})
            if now >= next_restart and now < stop_at - 60:
                sig = signal.SIGTERM if k % 2 == 0 else signal.SIGKILL
                i = k % 2
                stopped = await asyncio.to_thread(fleet.restart_router, i, sig)
                restarts.append(
                    {"t_min": round((now - t_start) / 60, 1), "router": i, "signal": sig.name, "stop_s": round(stopped, 2)}
                )
                print(json.dumps(restarts[-1]), flush=True)
                next_restart += args.restart_every_min * 60
                k += 1
            print(json.dumps({"t_min": memory[-1]["t_min"], **tally.outcomes}), flush=True)
        await asyncio.gather(*agents)
    names = [n for n in memory[-1] if n != "t_min"]
    second = next((m for m in memory if m["t_min"] >= args.restart_every_min), memory[0])
    mem = {
        n: {"at_interval_2_mb": second.get(n), "end_mb": memory[-1].get(n), "max_mb": max(m.get(n, 0) for m in memory)}
        for n in names
    }
    lat = sorted(tally.latencies)
    return {
        "minutes": args.minutes,
        "requests": sum(tally.outcomes.values()),
        "outcomes": dict(tally.outcomes),
        "hung": tally.hung,
        "error_messages": dict(tally.messages.most_common(20)),
        "latency_p50_s": round(lat[len(lat) // 2], 3) if lat else None,
        "latency_p99_s": round(lat[int(len(lat) * 0.99)], 3) if lat else None,
        "restarts": restarts,
        "memory_mb": mem,
        "memory_samples": memory,
        "args": {k: v for k, v in vars(args).items() if k != "out"},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=60)
    ap.add_argument("--restart-every-min", type=float, default=10)
    ap.add_argument("--agents", type=int, default=12)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--request-timeout-s", type=float, default=300)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="kvroute-soak-"))
    os.environ.setdefault("KVROUTE_LOG_FORMAT", "json")
    fleet = TwoRouters(logs, workers=args.workers, slots=args.slots, ctx=args.ctx, threads=args.threads, http=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{fleet.http_port}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        report = asyncio.run(soak(fleet, args))
    finally:
        fleet.stop()
    report["logs"] = str(logs)
    print(json.dumps({k: v for k, v in report.items() if k != "memory_samples"}, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0 if report["hung"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
