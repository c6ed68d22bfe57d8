"""Images turn by turn, kvroute against llama-server on the same model and projector, per API (issue 64).

Each case is a model with a tiny random-weight projector (bench/tiny_mmproj.py; no real one can be downloaded here):
`gemma3` (the default model with the Gemma 3 projector: 16 rows an image, one position a row) and `qwen` (the tiny
Qwen3-VL model of bench/tiny_archs.py with the Qwen2-VL projector: an image of 96 x 64 pixels is 12 x 8 = 96 rows
advancing 12 positions, M-RoPE); `gemma3-wide`: a Gemma 3 projector of the real one's patch grid (224 x 224
pixels, 14-pixel patches, pooled 4 x 4: 16 rows), 8 layers of width 256, for what an encode costs. For each API
(`chat`: an `image_url` data URL; `messages`: Claude Code's shape, the image inside a `tool_result`; `responses`:
an `input_image`) three requests go to each system, one after the other:

1. a question about image A;
2. the same conversation, its reply and a new question appended (image A again): only the new text should be computed;
3. the same as 2 with image B in A's place: computed from B's first row on.

For each request the prompt's tokens, the tokens the server says it reused (`cached_tokens`; Anthropic's
`cache_read_input_tokens`) and so computed, and the time the server says the prompt took (`timings.prompt_ms`, where
it gives one: the image's encode and rows with the text). kvroute's router's predictions are checked on its /metrics
(`kvroute_reuse_mispredictions_total` must not move) and its encodes' time read there
(`kvroute_worker_image_encode_seconds_total`); llama-server's from its log (`-lv 4`: `encode_ms`).

    .venv/bin/python -m bench.images [--cases gemma3,qwen,gemma3-wide] [--apis chat,messages,responses] [--repeats N]
                                     [--out FILE]
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench import tiny_archs
from bench.systems import Server, Setup
from bench.tiny_mmproj import mmproj, png, qwen2vl_mmproj
from chat.template import BUILTIN
from common.model import default_model_path

APIS = ("chat", "messages", "responses")
CASES = ("gemma3", "qwen", "gemma3-wide")
SYSTEMS = ("kvroute", "llama-server")
QUESTION = "What is in this picture? Describe its colours, its shapes and where they are."
FOLLOW_UP = "And what is in its top left corner, next to the edge?"
REPLY_TOKENS = 8
TEMPLATES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "templates"  # llama.cpp's vendored ones


def case_files(case: str, tmp: Path) -> tuple[Path, Path, str, str, tuple[bytes, bytes]]:
    """The model, the projector, the chat template both systems render with (kvroute's built-in of that name,
    given to llama-server as a Jinja file: its legacy path writes a newline before an image), its user turn's start,
    and the two images of a case."""
    if case == "gemma3":
        images = (png(48, 40, seed=1), png(48, 40, seed=2))
        return default_model_path(), mmproj(tmp / "gemma3-mmproj.gguf"), "gemma", "<start_of_turn>user", images
    if case == "gemma3-wide":  # (a projector of real Gemma 3's patch grid, narrower and shallower: an encode's cost)
        proj = mmproj(tmp / "gemma3-wide-mmproj.gguf", image_size=224, patch_size=14, pool=4, n_embd=256, n_layer=8, n_ff=512)
        return default_model_path(), proj, "gemma", "<start_of_turn>user", (png(48, 40, seed=1), png(48, 40, seed=2))
    if case == "qwen":
        model, proj = tiny_archs.model("qwen3vl", stdev=0.5), qwen2vl_mmproj(tmp / "qwen2vl-mmproj.gguf")
        # (Qwen2.5's template: its tool calls rendered alike by both, where the built-in chatml has no tool syntax)
        template = "Qwen-Qwen2.5-7B-Instruct.jinja"
        return model, proj, template, "<|im_start|>user", (png(96, 64, seed=1), png(96, 64, seed=2))
    raise ValueError(f"unknown case {case!r} (known: {', '.join(CASES)})")


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


def body(api: str, image: bytes, reply: str | None) -> tuple[str, dict[str, Any]]:
    """The request of `api` asking about `image`; with `reply`, the conversation after it with the follow-up."""
    if api == "chat":
        picture = {"type": "image_url", "image_url": {"url": data_url(image)}}
        messages: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": QUESTION}, picture]}]
        if reply is not None:
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": FOLLOW_UP}]
        return "/v1/chat/completions", {"messages": messages, "max_tokens": REPLY_TOKENS, "temperature": 0}
    if api == "messages":
        source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(image).decode()}
        messages = [
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"path": "s.png"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "image", "source": source}]},
            ]},
        ]  # fmt: skip
        if reply is not None:
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": FOLLOW_UP}]
        # (no `tools`: the tiny Qwen's vocabulary has no end of sequence for a call grammar; the history's tool_use and
        # tool_result are Claude Code's shape either way)
        return "/v1/messages", {"model": "m", "max_tokens": REPLY_TOKENS, "messages": messages, "temperature": 0}
    if api == "responses":
        asked = [{"type": "input_text", "text": QUESTION}, {"type": "input_image", "image_url": data_url(image)}]
        items: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": asked}]
        if reply is not None:
            items += [
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": reply}]},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": FOLLOW_UP}]},
            ]
        return "/v1/responses", {"input": items, "max_output_tokens": REPLY_TOKENS, "temperature": 0}
    raise ValueError(f"unknown API {api!r}")


def usage(api: str, reply: dict[str, Any]) -> tuple[int, int, str]:
    """(prompt tokens, reused tokens, reply text) of a reply."""
    u = reply.get("usage") or {}
    if api == "chat":
        return (
            u["prompt_tokens"],
            (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
            reply["choices"][0]["message"].get("content") or "",
        )
    if api == "messages":
        cached = u.get("cache_read_input_tokens") or 0
        text = "".join(b.get("text", "") for b in reply.get("content", []) if b.get("type") == "text")
        return u["input_tokens"] + cached + (u.get("cache_creation_input_tokens") or 0), cached, text
    cached = (u.get("input_tokens_details") or {}).get("cached_tokens") or 0
    text = "".join(c.get("text", "") for o in reply.get("output", []) if o.get("type") == "message" for c in o.get("content", []))
    return u["input_tokens"], cached, text


def metric(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def _stamp(line: str) -> float:
    """Seconds since start of a llama-server log line (`M.SS.mmm.uuu I ...`)."""
    m, sec, milli, micro = (int(x) for x in line.split(" ", 1)[0].split("."))
    return 60 * m + sec + milli / 1e3 + micro / 1e6


def encode_ms(log: str) -> list[float]:
    """What each of llama-server's image encodes took: from its "encoding mtmd batch" line to the first "decoding image
    batch" after it (its log says when the encode starts and when the image's rows go in, not the encode's time)."""
    out, began = [], None
    for line in log.splitlines():
        if "encoding mtmd batch" in line:
            began = _stamp(line)
        elif "decoding image batch 1/" in line and began is not None:
            out.append(round(1e3 * (_stamp(line) - began), 2))
            began = None
    return out


def settled_metrics(http: httpx.Client, wait_s: float = 15.0) -> str:
    """kvroute's /metrics once the workers' counters have come in (with their heartbeats) and stopped moving."""
    last, end = "", time.monotonic() + wait_s
    while time.monotonic() < end:
        text = http.get("/metrics").text
        if metric(text, "kvroute_worker_images_encoded_total") and text == last:
            return text
        last = text
        time.sleep(1.5)
    return last


def turns(http: httpx.Client, api: str, images: tuple[bytes, bytes]) -> list[dict[str, Any]]:
    rows = []
    first_reply = None
    for n, (image, after) in enumerate(((images[0], False), (images[0], True), (images[1], True)), 1):
        path, req = body(api, image, first_reply if after else None)
        r = http.post(path, json=req, timeout=600)
        if r.status_code != 200:
            rows.append({"turn": n, "status": r.status_code, "error": r.text[:300]})
            continue
        reply = r.json()
        prompt, cached, text = usage(api, reply)
        if first_reply is None:
            first_reply = text or "I see."
        prompt_ms = (reply.get("timings") or {}).get("prompt_ms")  # (the image's encode and rows, and the text's)
        row = {"turn": n, "prompt": prompt, "cached": cached, "computed": prompt - cached, "prompt_ms": prompt_ms}
        rows.append(row)
    return rows


def run_case(case: str, apis: list[str], tmp: Path, repeats: int = 1) -> dict[str, list[dict[str, Any]]]:
    """Each system's runs of the case, `repeats` of each, the systems interleaved."""
    model, proj, template, marker, images = case_files(case, tmp)
    jinja = TEMPLATES / template
    if template in BUILTIN:
        jinja = tmp / f"{template}.jinja"
        jinja.write_text(BUILTIN[template])
    setup = Setup(
        model=str(model),
        threads=2,
        workers=1,
        slots=2,
        ctx_per_slot=4096,
        kvroute_flags=("--mmproj", str(proj), "--chat-template", str(jinja)),
        # (-lv 4: its encodes' log lines)
        llama_server_flags=("--mmproj", str(proj), "--jinja", "--chat-template-file", str(jinja), "-lv", "4"),
        turn_marker=marker,
    )
    out: dict[str, list[dict[str, Any]]] = {system: [] for system in SYSTEMS}
    for rep in range(repeats):
        for system in SYSTEMS:
            out[system].append(run_system(system, setup, tmp / f"{case}-{system}-{rep}.log", apis, images))
    return out


def run_system(system: str, setup: Setup, log: Path, apis: list[str], images: tuple[bytes, bytes]) -> dict[str, Any]:
    with Server(system, setup, log) as server, httpx.Client(base_url=server.url) as http:
        before = http.get("/metrics").text if system == "kvroute" else ""
        results = {api: turns(http, api, images) for api in apis}
        after = settled_metrics(http) if system == "kvroute" else ""
    if system != "kvroute":
        ms = encode_ms(log.read_text(errors="replace"))
        return {"apis": results, "images_encoded": len(ms), "encode_ms_each": round(sum(ms) / len(ms), 2) if ms else None}
    encoded, seconds, mis = (
        metric(after, name) - metric(before, name)
        for name in (
            "kvroute_worker_images_encoded_total",
            "kvroute_worker_image_encode_seconds_total",
            "kvroute_reuse_mispredictions_total",
        )
    )
    each = round(1e3 * seconds / encoded, 2) if encoded else None
    return {"apis": results, "images_encoded": encoded, "encode_ms_each": each, "mispredictions": mis}


def table(report: dict[str, Any]) -> str:
    """Tokens from each system's first run (and whether every repeat gave the same), the encode and the chat turns'
    prompt ms of every repeat."""
    lines = [
        "| case | API | turn | prompt tokens, kvroute / llama-server | computed (reused), kvroute | llama-server "
        "| the same in every repeat |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]

    def cell(r: dict[str, Any]) -> str:
        return f"{r['computed']} ({r['cached']})" if "computed" in r else f"HTTP {r['status']}"

    def tokens(run: dict[str, Any]) -> list[Any]:
        return [(r.get("prompt"), r.get("cached")) for rows in run["apis"].values() for r in rows]

    for case, systems in report["cases"].items():
        ours, theirs = systems["kvroute"], systems["llama-server"]
        same = all(tokens(r) == tokens(runs[0]) for runs in (ours, theirs) for r in runs)
        for api in ours[0]["apis"]:
            for a, b in zip(ours[0]["apis"][api], theirs[0]["apis"].get(api, []), strict=False):
                prompts = f"{a.get('prompt', '-')} / {b.get('prompt', '-')}"
                lines.append(f"| {case} | {api} | {a['turn']} | {prompts} | {cell(a)} | {cell(b)} | {'yes' if same else 'no'} |")
        enc = ", ".join(f"{k['encode_ms_each']} / {t['encode_ms_each']}" for k, t in zip(ours, theirs, strict=True))
        lines.append(f"| {case} | encode ms, kvroute / llama-server, each repeat: {enc} | | | | | |")
        for turn in (1, 3):
            ms = ", ".join(f"{_ms(k, turn)} / {_ms(t, turn)}" for k, t in zip(ours, theirs, strict=True) if "chat" in k["apis"])
            lines.append(f"| {case} | chat turn {turn} prompt ms, each repeat: {ms} | | | | | |")
        mis = sum(k["mispredictions"] for k in ours)
        lines.append(f"| {case} | kvroute's reuse mispredicted: {mis:g} | | | | | |")
    return "\n".join(lines)


def _ms(run: dict[str, Any], turn: int) -> str:
    r = run["apis"]["chat"][turn - 1]
    return "-" if r.get("prompt_ms") is None else f"{r['prompt_ms']:.1f}"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--apis", default=",".join(APIS))
    ap.add_argument("--repeats", type=int, default=1, help="runs of each system, interleaved")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    apis = [a for a in args.apis.split(",") if a]
    with tempfile.TemporaryDirectory(prefix="kvimages-") as tmp:
        report = {"cases": {c: run_case(c, apis, Path(tmp), args.repeats) for c in args.cases.split(",") if c}}
    print(table(report))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
