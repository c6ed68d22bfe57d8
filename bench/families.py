"""The families people run for agents, side by side: `kvroute serve` and llama-server (the same llama.cpp) on tiny
random-weight GGUFs that carry each family's template and markers (bench/tiny_chat.py). For each family, over Chat
Completions: a forced tool call (tool_choice required, streamed), whether it comes back as a call, in how many
argument pieces, and how much of turn 1 (its prompt and reply) turn 2's prompt reuses (the tool result sent back).

    .venv/bin/python -m bench.families [FAMILY ...]      # prints a markdown table

The models say noise; the grammar makes them write a call. Thinking is switched off (`enable_thinking` false, and
`thinking_budget` 0 for a template that opens it anyway), so the call is the whole reply.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.llama_server import binary as llama_server_binary
from bench.tiny_chat import FAMILIES, chat_model

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["paris", "rome", "oslo"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"]}}}]  # fmt: skip
KWARGS = {"enable_thinking": False, "thinking": False, "thinking_budget": 0}
USER = [{"role": "user", "content": "weather in paris?"}]
CTX = 8192


def forced_call(url: str, model: str) -> dict[str, Any]:
    """One forced call, streamed, then turn 2; what came back and what turn 2 reused."""
    body = {"model": model, "messages": USER, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
            "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 200, "temperature": 0,
            "chat_template_kwargs": KWARGS}  # fmt: skip
    pieces: list[dict[str, Any]] = []
    usage: dict[str, Any] = {}
    finish = None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            d = json.loads(line[6:])
            usage = d.get("usage") or usage
            for c in d.get("choices") or []:
                pieces += [tc for tc in c["delta"].get("tool_calls") or [] if tc.get("index", 0) == 0]
                finish = c.get("finish_reason") or finish
    name = next((p["function"].get("name") for p in pieces if p.get("function", {}).get("name")), None)
    args = "".join(p.get("function", {}).get("arguments") or "" for p in pieces)
    out: dict[str, Any] = {"finish": finish, "name": name, "pieces": len(pieces), "args": args}
    try:
        json.loads(args)
        out["call"] = name == "get_weather"
    except ValueError:
        out["call"] = False
    if not out["call"]:
        return out
    call_id = next(p["id"] for p in pieces if p.get("id"))
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "sunny, 21 C"}]  # fmt: skip
    r2 = httpx.post(f"{url}/v1/chat/completions", json={"model": model, "messages": history, "tools": TOOLS,
                    "max_tokens": 2, "temperature": 0, "chat_template_kwargs": KWARGS}, timeout=300).json()  # fmt: skip
    turn1 = usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0)
    out.update(turn1=turn1, prompt1=usage.get("prompt_tokens", 0), reused=r2.get("timings", {}).get("cache_n"))
    if isinstance(r2.get("error"), dict):  # (llama-server answers 500 to a turn 2 whose noise its parser cannot read)
        out["turn2_error"] = str(r2["error"].get("message"))[:70]
    return out


def kvroute_rows(paths: dict[str, Path], log: Path) -> dict[str, dict[str, Any]]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "frontdoor"))
    from served import Served

    flags = [f for name, p in paths.items() for f in ("--model", f"{name}={p}")]
    s = Served(*flags, "--ctx-per-slot", str(CTX), "--slots", "2", "--threads", "1", log=log)
    try:
        return {name: forced_call(s.url, name) for name in paths}
    finally:
        s.stop()


def llama_server_rows(paths: dict[str, Path]) -> dict[str, dict[str, Any]]:
    binary = llama_server_binary()
    rows = {}
    for name, path in paths.items():
        port = 18190
        proc = subprocess.Popen([str(binary), "-m", str(path), "--jinja", "--port", str(port), "-c", str(CTX), "-np", "1",
                                 "-t", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            rows[name] = forced_call(url, name)
        except Exception as exc:  # (a row that says what failed, not a lost table)
            rows[name] = {"call": False, "error": repr(exc)[:80]}
        finally:
            proc.terminate()
            proc.wait(10)
    return rows


def cell(row: dict[str, Any]) -> list[str]:
    if not row.get("call"):
        return ["no (" + (row.get("error") or f"finish {row.get('finish')}") + ")", "-", "-"]
    reuse = f"{row['reused']} of {row['turn1']} (prompt {row['prompt1']})" if row.get("reused") is not None else "?"
    if row.get("turn2_error"):
        reuse = f"? (turn 2: {row['turn2_error']})"
    return ["yes", str(max(row["pieces"] - 1, 0)), reuse]


def main(names: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        # (a context as long as both servers are given: llama-server caps a slot at the model's own)
        paths = {n: chat_model(Path(tmp) / f"{n}.gguf", FAMILIES[n], n_ctx=CTX) for n in names}
        ours = kvroute_rows(paths, Path(tmp) / "serve.log")
        theirs = llama_server_rows(paths)
    head = ["family", "kvroute: call", "arg pieces", "turn 2 reused", "llama-server: call", "arg pieces", "turn 2 reused"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for n in names:
        print("| " + " | ".join([n, *cell(ours[n]), *cell(theirs[n])]) + " |")


if __name__ == "__main__":
    main(sys.argv[1:] or list(FAMILIES))
