"""Model switching (issue 34): what a request for a model that is not loaded costs, on a budget of one loaded
model, kvroute against llama-server's router mode.

    .venv/bin/python -m bench.model_switch [--turns 3] [--repeats 3] [--system-tokens 1800] [--user-tokens 100]

Two names, `alpha` and `beta`, for the same GGUF (the default model), one loaded at a time:

- `kvroute`: `kvroute serve --model alpha=M --model beta=M --models-max 1`, no disk tier: a request for the
  unloaded model makes the router stop the other's worker (it drains and exits) and start the requested one's;
- `kvroute-disk`: the same with `--cache-dir DIR` (empty at the start of each round): a stopped worker writes its
  slots to DIR, and a conversation's next turn after its model is loaded again restores its prefix from there;
- `llama-server`: `llama-server --models-dir D --models-max 1` (router mode, the same llama.cpp as bench.systems),
  D holding `alpha.gguf` and `beta.gguf`, symlinks to M; the router passes its other flags (bench.systems'
  llama-server flags) to the server it starts for each model, which it stops when another is wanted.

Each has 2 slots of `--ctx-per-slot` tokens per model (llama-server: `-np 2 -c 2 x ctx`) and `--threads` threads.
A round starts the system, loads `alpha` with a 1-token request, then plays, one request at a time, streamed,
temperature 0, `--max-tokens` tokens:

1. loaded: `--turns` turns of a conversation on `alpha` (loaded, no switch): turn 1 computes its whole prompt,
   the next ones reuse the history in the slot;
2. switch: two conversations, one per model, alternating beta 1, alpha 1, beta 2, alpha 2, ...: every request is
   for the model that is not loaded. The loaded conversation's sizes; alpha and beta get the same texts.

A conversation is a ~`--system-tokens` system prompt (its own per round and conversation) and a
~`--user-tokens` user message per turn. Per request: the time to the first streamed content chunk (TTFT),
whether its model was loaded just before (GET /v1/models), prompt and cached tokens (usage; llama-server's
timings.cache_n where usage has none). From each server's log: per unload, the decision to the old process's exit
(kvroute: its worker's drain and disk writes), per load, the new process's start to its being ready.

The systems take turns within a repeat, never at the same time, in an order that rotates from repeat to repeat.
On a shared machine: a round starts once other processes leave the CPUs (under 0.1 cores over 5 s,
`--quiet-wait-s` at most), and one during which they took over `--max-others` cores (the machine's busy time,
/proc/stat, less this process's and the server's session's) is run again, `--retries` times at most. A case's
figure is the median over all its requests of all repeats, with their min-max and each repeat's median.

Prints the tables; `--out FILE` writes every request as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.client import sse_events
from bench.systems import Server, Setup, SystemError_, commands
from bench.workloads import TextGen, grow, model_tokenizer
from common.model import resolve_model

SYSTEMS = ("kvroute", "kvroute-disk", "llama-server")
MODELS = ("alpha", "beta")
CASES = ("loaded, turn 1", "loaded, turn 2+", "switch, turn 1", "switch, turn 2+")


@dataclass
class Request:
    phase: str  # loaded | switch
    model: str
    turn: int
    was_loaded: bool  # its model's state just before it was sent
    ttft: float | None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None

    @property
    def case(self) -> str:
        return f"{'loaded' if self.was_loaded else 'switch'}, turn {'1' if self.turn == 1 else '2+'}"


# --- the systems ---------------------------------------------------------------------------------------------


class Switching(Server):
    """A bench.systems server whose command line serves `alpha` and `beta` with one loaded at a time."""

    def __init__(self, system: str, setup: Setup, root: Path, log: Path) -> None:
        super().__init__("llama-server" if system == "llama-server" else "kvroute", setup, log)
        argv = commands(self.name, setup, self.port)[0]
        at = argv.index("--model")
        if system == "llama-server":  # one directory of models instead of one model
            models = root / "models"
            models.mkdir(parents=True, exist_ok=True)
            for m in MODELS:
                with contextlib.suppress(FileExistsError):
                    (models / f"{m}.gguf").symlink_to(Path(setup.model).resolve())
            served = ["--models-dir", str(models), "--models-max", "1"]
        else:
            served = [x for m in MODELS for x in ("--model", f"{m}={setup.model}")] + ["--models-max", "1"]
            if system == "kvroute-disk":
                served += ["--cache-dir", str(root / "cache")]
        self.argvs = [argv[:at] + served + argv[at + 2 :]]

    def _check_template(self, http: httpx.Client) -> None:
        """bench.systems' check that llama-server renders a conversation, through the router (loads alpha)."""
        if self.name != "llama-server":
            return
        body = {"model": "alpha", "messages": [{"role": "user", "content": "template probe: say yes"}]}
        prompt = http.post(f"{self.url}/apply-template", json=body, timeout=300).json().get("prompt", "")
        if "template probe" not in prompt or "<start_of_turn>user" not in prompt:
            raise SystemError_(f"llama-server renders a conversation as {prompt!r}: its chat template flags are wrong")


# Each request on a connection of its own: llama-server's router can close a kept-alive one after a proxied stream
# (the next request on it then fails with "Server disconnected without sending a response").


def loaded_models(url: str) -> set[str]:
    models = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    return {m["id"] for m in models if (m.get("status") or {}).get("value") == "loaded"}


def stream(url: str, model: str, messages: list[dict[str, str]], max_tokens: int) -> tuple[float | None, str, int, int]:
    """One streamed chat request: seconds to the first content chunk, the reply, prompt and cached tokens (usage, or
    llama-server's timings)."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    ttft, text = None, ""
    usage: dict[str, Any] = {}
    timings: dict[str, Any] = {}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as resp:
        for event in sse_events(resp):
            for choice in event.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content")
                if piece and ttft is None:
                    ttft = time.perf_counter() - sent
                text += piece or ""
            usage = event.get("usage") or usage
            timings = event.get("timings") or timings
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is None:
        cached = timings.get("cache_n", 0)
    return ttft, text, usage.get("prompt_tokens", 0), cached


# --- one round -----------------------------------------------------------------------------------------------


def conversation(seed: str, turns: int, system_tokens: int, user_tokens: int, tokenize: Any) -> dict[str, Any]:
    gen = TextGen(seed)
    head = "You are the assistant of a small team. You answer in one short sentence. The team's notes follow."
    return {
        "system": grow(head, system_tokens, gen.statement, tokenize),
        "users": [grow(gen.request(), user_tokens, gen.statement, tokenize) for _ in range(turns)],
    }


def one_round(system: str, setup: Setup, texts: dict[str, Any], log: Path, a: argparse.Namespace) -> dict[str, Any]:
    """Start `system`, load alpha, play the loaded then the switch phase, stop it."""
    plan = [("loaded", "alpha", "ref", t) for t in range(a.turns)]
    plan += [("switch", m, "switch", t) for t in range(a.turns) for m in ("beta", "alpha")]
    talks = {(c, m): [{"role": "system", "content": texts[c]["system"]}] for _, m, c, _ in plan}
    requests: list[Request] = []
    quiet = wait_quiet(a.quiet_wait_s)
    t0, busy0, self0 = time.monotonic(), busy_s(), self_s()
    with tempfile.TemporaryDirectory(prefix="bench-model-switch-") as tmp:
        server = Switching(system, setup, Path(tmp), log)
        with server:
            stream(server.url, "alpha", [{"role": "user", "content": "Hello."}], 1)  # alpha loaded, the process warm
            for phase, model, conv, t in plan:
                messages = talks[conv, model]
                messages.append({"role": "user", "content": texts[conv]["users"][t]})
                was_loaded = model in loaded_models(server.url)
                try:
                    ttft, reply, prompt, cached = stream(server.url, model, messages, a.max_tokens)
                    requests.append(Request(phase, model, t + 1, was_loaded, ttft, prompt, cached))
                except (RuntimeError, httpx.HTTPError, ValueError) as exc:
                    reply = ""
                    requests.append(Request(phase, model, t + 1, was_loaded, None, error=f"{type(exc).__name__}: {exc}"[:300]))
                messages.append({"role": "assistant", "content": reply})
                r = requests[-1]
                print(f"    {phase} {model} turn {t + 1}: {'loaded' if was_loaded else 'SWITCH'}, TTFT {_ms(r.ttft)} ms,"
                      f" cached {r.cached_tokens}/{r.prompt_tokens} {r.error or ''}", file=sys.stderr, flush=True)  # fmt: skip
            # the cores that other processes than this one and the server's took meanwhile (a shared machine)
            mine = session_s(server._procs[0].pid) + self_s() - self0
            others = (busy_s() - busy0 - mine) / (time.monotonic() - t0)
    return {
        "system": system,
        "command": server.command_line,
        "startup_s": round(server.startup_s, 2),
        "others_before": quiet,
        "others_during": round(others, 2),
        "requests": [asdict(r) | {"case": r.case} for r in requests],
        "switches": switch_times(system, log),
    }


def switch_times(system: str, log: Path) -> dict[str, list[float]]:
    """From the server's log, per unload: the decision to the old server's exit (kvroute: model_unloading to
    worker_stopped, its worker's drain and disk writes included; llama-server: `evicting idle LRU` to `instance
    ... exited`); per load after the first: the start of the new one to its being ready (kvroute: model_loaded's load_s, spawn to
    hello; llama-server: `loading queued model` to the first `proxying request`)."""
    out: dict[str, list[float]] = {"unload_s": [], "load_s": []}
    since: dict[str, float] = {}
    for line in log.read_text(errors="replace").splitlines():
        if system.startswith("kvroute"):
            with contextlib.suppress(ValueError, KeyError, TypeError):
                e = json.loads(line)
                stamp = e["timestamp"]
                ts = time.mktime(time.strptime(stamp[:19], "%Y-%m-%dT%H:%M:%S")) + float("0" + stamp[19:])
                if e["event"] == "model_unloading":
                    since["unload"] = ts
                elif e["event"] == "worker_stopped" and "unload" in since:
                    out["unload_s"].append(round(ts - since.pop("unload"), 3))
                elif e["event"] == "model_loaded":
                    out["load_s"].append(e["load_s"])
        elif not line.startswith("[") and (m := re.match(r"(\d+)\.(\d+)\.(\d+)\.(\d+) ", line)):
            ts = int(m[1]) * 60 + int(m[2]) + int(m[3]) / 1e3 + int(m[4]) / 1e6
            if "evicting idle LRU" in line:
                since["unload"] = ts
            elif "exited with status" in line and "unload" in since:
                out["unload_s"].append(round(ts - since.pop("unload"), 3))
            elif "loading queued model" in line:
                since["load"] = ts
            elif "proxying request" in line and "load" in since:
                out["load_s"].append(round(ts - since.pop("load"), 3))
    out["load_s"] = out["load_s"][1:]  # the first is alpha's at the start, not a switch's
    return out


def busy_s() -> float:
    """CPU seconds the whole machine has been busy (/proc/stat), all cores."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def session_s(sid: int) -> float:
    """CPU seconds of the live processes of session `sid` (a server started in a session of its own) and of the
    children they reaped (kvroute's stopped workers, llama-server's stopped model servers)."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid:  # fields from the state on: state ppid pgrp session ... utime stime cutime cstime
                total += sum(int(x) for x in fields[11:15])
    return total / os.sysconf("SC_CLK_TCK")


def self_s() -> float:
    t = os.times()
    return t.user + t.system


def wait_quiet(max_s: float, cores: float = 0.1, window_s: float = 5.0) -> float:
    """Wait (up to `max_s`) until other processes use less than `cores` cores over `window_s`; returns their use."""
    deadline = time.monotonic() + max_s
    while True:
        b, o = busy_s(), self_s()
        time.sleep(window_s)
        others = (busy_s() - b - (self_s() - o)) / window_s
        if others < cores or time.monotonic() > deadline:
            return round(others, 2)
        print(f"  other processes use {others:.1f} cores: waiting", file=sys.stderr, flush=True)


# --- figures -------------------------------------------------------------------------------------------------


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1000:.0f}"


def figures(rounds: list[dict[str, Any]], systems: list[str]) -> str:
    lines = [
        "TTFT in ms: median over every request of the case and repeat [min-max] (each repeat's median); cached: median"
        " cached / prompt tokens.",
        "",
        "| case | " + " | ".join(systems) + " |",
        "| --- |" + " --- |" * len(systems),
    ]
    for case in CASES:
        cells = []
        for s in systems:
            mine = [r for r in rounds if r["system"] == s]
            reqs = [q for r in mine for q in r["requests"] if q["case"] == case and q["ttft"] is not None]
            if not reqs:
                cells.append("-")
                continue
            ttfts = [q["ttft"] for q in reqs]
            per = [
                statistics.median(x)
                for r in mine
                if (x := [q["ttft"] for q in r["requests"] if q["case"] == case and q["ttft"] is not None])
            ]
            cached = statistics.median(q["cached_tokens"] for q in reqs)
            prompt = statistics.median(q["prompt_tokens"] for q in reqs)
            cells.append(
                f"**{_ms(statistics.median(ttfts))}** [{_ms(min(ttfts))}-{_ms(max(ttfts))}] ({', '.join(_ms(p) for p in per)});"
                f" n={len(reqs)}; cached {cached:.0f}/{prompt:.0f}"
            )
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    errors = sum(1 for r in rounds for q in r["requests"] if q["error"])
    lines += ["", f"failed requests: {errors}", ""]
    for s in systems:
        sw = [r["switches"] for r in rounds if r["system"] == s and "switches" in r]
        if sw:
            parts = []
            for key in ("unload_s", "load_s"):
                xs = [x for d in sw for x in d[key]]
                if xs:
                    parts.append(f"{key} median {statistics.median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}] (n={len(xs)})")
            lines.append(f"{s}, from its log: " + "; ".join(parts))
    return "\n".join(lines)


def per_request(rounds: list[dict[str, Any]]) -> str:
    """Every request: one line per round, the TTFT (ms) and cached tokens of each request in order."""
    names = [f"{q['phase'][0]}:{q['model'][0]}{q['turn']}" for q in rounds[0]["requests"]]
    lines = ["| repeat | system | " + " | ".join(names) + " | others' cores before / during |"]
    lines.append("| --- | --- |" + " --- |" * (len(names) + 1))
    for r in rounds:
        cells = [f"{_ms(q['ttft'])}{'' if q['was_loaded'] else '*'} ({q['cached_tokens']})" for q in r["requests"]]
        lines.append(
            f"| {r['repeat']} | {r['system']} | " + " | ".join(cells) + f" | {r['others_before']} / {r['others_during']} |"
        )
    return "\n".join(lines)


# --- main ----------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.model_switch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--turns", type=int, default=3, help="turns of each conversation")
    p.add_argument("--repeats", type=int, default=3, help="rounds of every system")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="some of " + ", ".join(SYSTEMS))
    p.add_argument("--system-tokens", type=int, default=1800, help="tokens of each conversation's system prompt")
    p.add_argument("--user-tokens", type=int, default=100, help="tokens of each user message")
    p.add_argument("--max-tokens", type=int, default=8, help="max_tokens of each request")
    p.add_argument("--slots", type=int, default=2, help="slots per model (llama-server: -np)")
    p.add_argument("--ctx-per-slot", type=int, default=4096, help="context of each slot (llama-server: -c slots x this)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="CPU threads of each model's server")
    p.add_argument("--seed", default="model-switch", help="seed of the texts (a repeat adds its number)")
    p.add_argument(
        "--quiet-wait-s", type=float, default=300, help="longest wait, before a round, for other processes to leave the CPUs"
    )
    p.add_argument("--max-others", type=float, default=0.1, help="cores other processes may take during a round")
    p.add_argument("--retries", type=int, default=2, help="times a round is run again when they took more")
    p.add_argument("--out", type=Path, default=None, help="write every request as JSON here")
    a = p.parse_args(argv)
    systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    if not systems or any(s not in SYSTEMS for s in systems):
        p.error(f"--systems takes some of {', '.join(SYSTEMS)}")
    os.environ.setdefault("KVROUTE_LOG_FORMAT", "json")  # switch_times reads the log
    model = str(resolve_model(None))
    tokenize = model_tokenizer(model)
    setup = Setup(model=model, threads=a.threads, workers=1, slots=a.slots, ctx_per_slot=a.ctx_per_slot)
    logs = Path(tempfile.mkdtemp(prefix="bench-model-switch-logs-"))
    started = time.time()
    rounds: list[dict[str, Any]] = []
    discarded: list[dict[str, Any]] = []  # rounds run again: other processes took too much of the CPUs
    for rep in range(a.repeats):
        texts = {
            k: conversation(f"{a.seed}:{rep}:{k}", a.turns, a.system_tokens, a.user_tokens, tokenize) for k in ("ref", "switch")
        }
        for system in systems[rep % len(systems) :] + systems[: rep % len(systems)]:
            for attempt in range(1 + a.retries):
                print(f"repeat {rep + 1}/{a.repeats}: {system} ...", file=sys.stderr, flush=True)
                log = logs / f"repeat{rep + 1}-{system}-{attempt + 1}.log"
                run = one_round(system, setup, texts, log, a) | {"repeat": rep + 1}
                if run["others_during"] <= a.max_others or attempt == a.retries:
                    break
                print(f"  other processes took {run['others_during']} cores: again", file=sys.stderr, flush=True)
                discarded.append(run)
            rounds.append(run)
    table = figures(rounds, systems)
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("model name")), "?"
    )
    head = (
        f"`python -m bench.model_switch {' '.join(argv if argv is not None else sys.argv[1:])}`: {len(rounds)} rounds"
        f" ({len(discarded)} more run again: other processes took over {a.max_others} cores) in"
        f" {time.time() - started:.0f} s on {os.cpu_count()} cores ({cpu}); {a.turns} turns, {a.system_tokens}-token system"
        f" prompts, {a.user_tokens}-token user messages, max_tokens {a.max_tokens}, {a.slots} slots x {a.ctx_per_slot}"
        f" tokens, {a.threads} threads."
    )
    print(head + "\n\n" + table + "\n\nEvery request, TTFT ms (* = its model was not loaded) and (cached tokens),"
          " l: loaded phase, s: switch phase, a/b: alpha/beta + turn:\n\n" + per_request(rounds))  # fmt: skip
    print(f"logs: {logs}", file=sys.stderr)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(
            json.dumps({"head": head, "args": {**vars(a), "out": str(a.out)}, "rounds": rounds, "discarded": discarded}, indent=1)
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
