"""Issue 63's check: Codex CLI (which sends no sampling fields and no output cap) against a default `kvroute serve`
with the default model, nothing rewritten: RUNS conversations of three turns each, each in a fresh home; every turn
must end by itself (exit 0, no error). What each model request got back is printed (its output tokens and how it
ended), so a reply that ran to the cap shows.

    .venv/bin/python tests/agents/codex_runs.py [--runs 3] [--out FILE] [--upstream URL]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from capture import CaptureProxy
from real_agents import API_KEY, CLIENTS, REPO, Conversation

PROMPTS = ["Say hello in one word.", "Now say goodbye in one word.", "What is 2 + 2? Answer with the number."]


def reply_of(record: dict[str, Any]) -> dict[str, Any]:
    """What the proxy read of one model reply: its output tokens, its time, and the start of its text."""
    r = record["response"]
    usage = r.get("usage") or {}
    return {"status": r.get("status"), "output_tokens": usage.get("output_tokens"), "input_tokens": usage.get("input_tokens"),
            "total_s": r.get("total_s"), "text": (r.get("text") or "")[:80]}  # fmt: skip


def run(upstream: str, root: Path, n: int) -> list[dict[str, Any]]:
    client = CLIENTS["codex"]
    proxy = CaptureProxy(upstream, root / f"capture-{n}").start()
    turns = []
    try:
        conv = Conversation(client, proxy.url, API_KEY, "gemma-3-270m-q4_k_m", root, root / f"home-{n}")
        for i, prompt in enumerate(PROMPTS, 1):
            t = conv.turn(min(i, 2), prompt, proxy)  # (2 and on: `codex exec resume --last`)
            model = [r for r in t.requests if r.get("method") == "POST"]
            turns.append({"turn": i, "rc": t.rc, "wall_s": round(t.wall_s, 1), "errors": t.errors,
                          "model_requests": len(model), "replies": [reply_of(r) for r in model]})  # fmt: skip
            print(json.dumps({"run": n, **turns[-1]}), flush=True)
    finally:
        proxy.stop()
    return turns


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--upstream", help="a running kvroute's base URL (default: start `kvroute serve` with no flags)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if why := CLIENTS["codex"].installed():
        print(f"codex: {why}", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="kvcodex-"))
    served = None
    if not args.upstream:
        sys.path[:0] = [str(REPO), str(REPO / "tests" / "frontdoor")]
        from served import Served

        served = Served(api_key=API_KEY, log=root / "serve.log")
        args.upstream = served.url
    t0 = time.monotonic()
    try:
        runs = [run(args.upstream, root, n) for n in range(1, args.runs + 1)]
    finally:
        if served is not None:
            served.stop()
    ok = all(t["rc"] == 0 and not t["errors"] for turns in runs for t in turns)
    report = {"ok": ok, "wall_s": round(time.monotonic() - t0, 1), "runs": runs, "serve_log": str(root / "serve.log")}
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({"ok": ok, "wall_s": report["wall_s"]}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
