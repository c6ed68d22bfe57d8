"""Agent-loop benchmark (run by hand): do tools cost prefix reuse? One run, interleaved repeats.

    .venv/bin/python -m bench.agent_loop [--steps 20] [--repeats 3] [--tool-tokens 300] [--preamble-tokens 1500]

A session is what a coding agent sends: a system preamble and a task, then `--steps` steps of (the model calls a
tool, the tool answers with a few hundred tokens, the next request resends it all). Each step is a streamed
/v1/chat/completions request with `tools` and `tool_choice: required` (one call, a grammar makes even the small
default model write one). The same session without tools is the comparison: a plain chat whose user turns are
the tool results exactly as the template renders them (so both prefill the same new tokens each step) and whose
replies are the model's own. Tools must cost nothing. Systems: kvroute, and kvroute-cold (`--no-prefix-cache`)
for what caching buys. Figures, over steps 2.. of every session:

- reuse: cached_tokens / (the previous step's prompt + reply tokens), the share of what the slot held that was
  reused (goal: >= 95% at every step); and cached_tokens / prompt_tokens, the share of the prompt;
- p50 time to first streamed chunk with tools / without (goal: <= 1.10), and kvroute / kvroute-cold.

Each repeat uses its own texts (no reuse across sessions) and runs the sessions in the order kvroute-tools,
kvroute-plain, cold-tools, so that machine noise hits every system alike; the spread across repeats is shown.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.client import sse_events
from bench.systems import Server, Setup
from bench.workloads import TextGen, grow, model_tokenizer
from common.model import resolve_model

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the repository",
            "parameters": {"type": "object", "properties": {"path": {"type": "string", "maxLength": 40}}, "required": ["path"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_tests",
            "description": "Run the test suite, or one test file",
            "parameters": {"type": "object", "properties": {"target": {"type": "string", "maxLength": 40}}},
        },
    },
]


@dataclass
class Step:
    step: int
    ttft: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: str


def stream_step(http: httpx.Client, messages: list[dict[str, Any]], tools: bool, max_tokens: int) -> tuple[Step, dict[str, Any]]:
    """One streamed request: its timing and usage, and the assistant message to append to the history."""
    body: dict[str, Any] = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if tools:
        body.update(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    sent = time.perf_counter()
    ttft = None
    content, calls, usage, finish = "", {}, {}, ""
    with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        for event in sse_events(resp):
            if ttft is None and event.get("choices"):
                ttft = time.perf_counter() - sent  # the first chunk goes out with the first token
            for choice in event.get("choices") or ():
                delta = choice.get("delta") or {}
                content += delta.get("content") or ""
                for d in delta.get("tool_calls") or ():
                    c = calls.setdefault(d["index"], {"id": "", "name": "", "arguments": ""})
                    c["id"] += d.get("id") or ""
                    c["name"] += (d.get("function") or {}).get("name") or ""
                    c["arguments"] += (d.get("function") or {}).get("arguments") or ""
                finish = choice.get("finish_reason") or finish
            usage = event.get("usage") or usage
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls.values()
        ]
    elif not content:
        message["content"] = ""
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    step = Step(0, ttft or 0.0, usage.get("prompt_tokens", 0), cached, usage.get("completion_tokens", 0), finish)
    return step, message


def session(url: str, texts: dict[str, Any], tools: bool, max_tokens: int) -> list[Step]:
    """Run one session; the tool results (or, without tools, the user turns) are `texts["results"]`."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": texts["preamble"]},
        {"role": "user", "content": texts["task"]},
    ]
    steps = []
    with httpx.Client(base_url=url, timeout=600) as http:
        for k, result in enumerate(texts["results"]):
            step, message = stream_step(http, messages, tools, max_tokens)
            step.step = k
            steps.append(step)
            messages.append(message)
            if tools:
                if not message.get("tool_calls"):
                    raise RuntimeError(f"step {k}: no tool call ({step.finish_reason}): {message}")
                messages.append({"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": result})
            else:  # the tool result as the generic family renders it into the history (chat/request.py polyfill)
                rendered = {"tool_response": {"name": "read_file", "content": result}}
                messages.append({"role": "user", "content": json.dumps(rendered, ensure_ascii=False)})
    return steps


def make_texts(seed: str, steps: int, preamble_tokens: int, tool_tokens: int, tokenize: Any) -> dict[str, Any]:
    gen = TextGen(seed)
    head = "You are a coding agent. You change the repository with the tools you have. Project notes follow."
    preamble = grow(head, preamble_tokens, gen.statement, tokenize)
    results = [grow(f"Output of step {k + 1}:", tool_tokens, gen.statement, tokenize) for k in range(steps)]
    return {"preamble": preamble, "task": "Find why the test suite fails and fix it.", "results": results}


def summary(runs: list[list[Step]]) -> dict[str, float]:
    """Over steps 2.. (index 1 on) of every session: p50 TTFT, reuse of what the slot held, share of the prompt."""
    later = [s for run in runs for s in run[1:]]
    held = [
        cur.cached_tokens / (prev.prompt_tokens + prev.completion_tokens) for run in runs for prev, cur in itertools.pairwise(run)
    ]
    share = [s.cached_tokens / s.prompt_tokens for s in later if s.prompt_tokens]
    return {
        "p50_ttft_s": statistics.median(s.ttft for s in later),
        "min_reuse": min(held),
        "mean_reuse": statistics.fmean(held),
        "mean_prompt_share": statistics.fmean(share),
        "mean_prompt_tokens": statistics.fmean(s.prompt_tokens for s in later),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tool-tokens", type=int, default=300, help="tokens of each tool result")
    ap.add_argument("--preamble-tokens", type=int, default=1500)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--ctx-per-slot", type=int, default=16384)
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    model = str(resolve_model(None))
    tokenize = model_tokenizer(model)
    setup = Setup(model=model, threads=a.threads, workers=1, slots=a.slots, ctx_per_slot=a.ctx_per_slot)
    out = Path(a.out)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    runs: dict[str, list[list[Step]]] = {"kvroute tools": [], "kvroute plain": [], "kvroute-cold tools": []}
    with (
        Server("kvroute", setup, out / f"{stamp}-logs" / "agent-loop-kvroute.log") as warm,
        Server("kvroute-cold", setup, out / f"{stamp}-logs" / "agent-loop-kvroute-cold.log") as cold,
    ):
        for r in range(a.repeats):
            for name, url, tools in (("kvroute tools", warm.url, True), ("kvroute plain", warm.url, False),
                                     ("kvroute-cold tools", cold.url, True)):  # fmt: skip
                texts = make_texts(f"agent-loop:{r}:{name}", a.steps, a.preamble_tokens, a.tool_tokens, tokenize)
                steps = session(url, texts, tools, a.max_tokens)
                runs[name].append(steps)
                s = summary([steps])
                print(f"repeat {r + 1} {name:20s} p50 TTFT {s['p50_ttft_s']:.3f} s, reuse min {s['min_reuse']:.3f}")
    per_repeat = [
        summary([runs["kvroute tools"][r]])["p50_ttft_s"] / summary([runs["kvroute plain"][r]])["p50_ttft_s"]
        for r in range(a.repeats)
    ]
    cold_ratio = [
        summary([runs["kvroute tools"][r]])["p50_ttft_s"] / summary([runs["kvroute-cold tools"][r]])["p50_ttft_s"]
        for r in range(a.repeats)
    ]
    figures = {name: summary(rs) for name, rs in runs.items()}
    report = {
        "args": vars(a),
        "figures": figures,
        "tools_over_plain_p50_ttft": per_repeat,
        "warm_over_cold_p50_ttft": cold_ratio,
        "steps": {name: [[asdict(s) for s in run] for run in rs] for name, rs in runs.items()},
    }
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stamp}-agent-loop.json"
    path.write_text(json.dumps(report, indent=1))
    print()
    for name, f in figures.items():
        print(
            f"{name:20s} p50 TTFT {f['p50_ttft_s']:.3f} s   reuse of the history min {f['min_reuse'] * 100:.1f}% "
            f"mean {f['mean_reuse'] * 100:.1f}%   cached share of the prompt {f['mean_prompt_share'] * 100:.1f}%"
            f"   prompt {f['mean_prompt_tokens']:.0f} tokens"
        )
    reuse = figures["kvroute tools"]["min_reuse"]
    ratio = statistics.median(per_repeat)
    spread = ", ".join(f"{x:.3f}" for x in per_repeat)
    print(f"reuse from step 2 on, with tools: min {reuse * 100:.1f}% (goal >= 95%): {'MET' if reuse >= 0.95 else 'MISSED'}")
    print(
        f"p50 TTFT with tools / without: {ratio:.3f} (per repeat {spread}; goal <= 1.10): {'MET' if ratio <= 1.10 else 'MISSED'}"
    )
    spread = ", ".join(f"{x:.3f}" for x in cold_ratio)
    print(f"p50 TTFT kvroute / kvroute-cold: {statistics.median(cold_ratio):.3f} (per repeat {spread})")
    print(f"report: {path}")


if __name__ == "__main__":
    main()
