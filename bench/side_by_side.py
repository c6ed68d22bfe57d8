"""Routers side by side over one fleet (issue 33): what two routers placing on the same workers cost against one.

The same real workers (`kvroute worker`, the default model) serve agents whose conversations grow turn by turn; in
mode `one` every turn goes through router A, in mode `two` each turn goes through A or B in turn (so every other turn
is placed by a router whose own jobs did not leave that conversation's slot: its mirror knows it only from the
worker's slot_taken / slot_update). Modes alternate in one run, `--repeats` times each. Per run: turns served,
their mean latency and how much of their prompts was reused, and from the routers' metrics the conflicts (jobs a
worker refused because the other router's job held their slot: `kvroute_slot_conflicts_total`), mirror mismatches
and reuse mispredictions.

    .venv/bin/python -m bench.side_by_side [--workers 2] [--slots 4] [--agents 8] [--turns 6] [--repeats 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.fleet import TwoRouters
from kvroute.client import AsyncClient

METRICS = ("kvroute_slot_conflicts_total", "kvroute_mirror_mismatches_total", "kvroute_reuse_mispredictions_total")


def counter(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


async def metrics(fleet: TwoRouters) -> dict[str, float]:
    got = dict.fromkeys(METRICS, 0.0)
    for ep in fleet.zmq:
        async with AsyncClient(ep, timeout_s=10) as c:
            text = await c.metrics()
        for name in METRICS:
            got[name] += counter(text, name)
    return got


async def run_mode(fleet: TwoRouters, mode: str, args: argparse.Namespace, tag: str) -> dict[str, Any]:
    clients = [AsyncClient(ep, timeout_s=300) for ep in fleet.zmq]
    before = await metrics(fleet)
    system = "You are a careful coding agent working in a large repository. Follow the plan step by step. " * 12
    latencies: list[float] = []
    prompt = cached = 0

    async def agent(n: int) -> None:
        nonlocal prompt, cached
        talk = [{"role": "system", "content": f"{system} Agent {tag}-{n}."}, {"role": "user", "content": "Start."}]
        for t in range(args.turns):
            client = clients[0] if mode == "one" else clients[(n + t) % 2]
            t0 = time.monotonic()
            r = await client.submit(messages=talk, max_tokens=args.max_tokens, temperature=0.0)
            latencies.append(time.monotonic() - t0)
            prompt += r.usage.prompt_tokens
            cached += r.usage.cached_tokens
            talk += [{"role": "assistant", "content": r.text}, {"role": "user", "content": f"Step {t + 1} done. Next?"}]

    t0 = time.monotonic()
    await asyncio.gather(*(agent(n) for n in range(args.agents)))
    wall = time.monotonic() - t0
    after = await metrics(fleet)
    for c in clients:
        await c.close()
    turns = len(latencies)
    out = {
        "mode": mode,
        "turns": turns,
        "wall_s": round(wall, 2),
        "mean_latency_s": round(statistics.fmean(latencies), 3),
        "reused_fraction": round(cached / prompt, 4),
    }
    for name in METRICS:
        out[name.removeprefix("kvroute_").removesuffix("_total")] = int(after[name] - before[name])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, help="write the results here (JSON)")
    args = ap.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="kvroute-side-by-side-"))
    fleet = TwoRouters(logs, workers=args.workers, slots=args.slots, ctx=args.ctx, threads=args.threads)
    runs = []
    try:
        fleet.wait_ready()
        for rep in range(args.repeats):
            for mode in ("one", "two"):
                r = asyncio.run(run_mode(fleet, mode, args, f"{rep}{mode}"))
                print(json.dumps(r), flush=True)
                runs.append(r)
    finally:
        fleet.stop()
    placed = sum(r["turns"] for r in runs if r["mode"] == "two")
    conflicts = sum(r["slot_conflicts"] for r in runs if r["mode"] == "two")
    settings = {**vars(args), "out": str(args.out) if args.out else None}
    summary = {"conflicts_per_turn_two_routers": round(conflicts / max(placed, 1), 4), "runs": runs, "args": settings}
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"logs: {logs}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("KVROUTE_LOG_FORMAT", "json")
    sys.exit(main())
