"""Agent turns on hybrid, recurrent and sliding-window models (issue 48): prompt tokens computed per turn, the memory
of a slot's checkpoints, and time to first token: kvroute against llama-server with its context checkpoints at their
defaults (`--ctx-checkpoints 32 --checkpoint-min-step 8192`) and at their best here (`--ctx-checkpoints 256
--checkpoint-min-step 0`, and `--swa-full` for LFM2's layout, whose attention has a window), both with their
host-RAM prompt caches on (llama-server `--cache-ram` 8 GiB, its default; kvroute `--host-cache-mb` its default), on the
same tiny random-weight models (bench/tiny_archs.py), 2 slots.

Prompts are token ids (the models have no vocabulary), sent to kvroute over ZMQ and to llama-server's /completion,
greedy, `ignore_eos`. A session's next prompt is made from its previous prompt and the reply that system gave:
- `exact`: the prompt and the reply as they were, then a new turn of 24 tokens;
- `diverging`: the reply re-sent otherwise after its second token (a template dropping past reasoning, a client
  re-serializing a tool call), and every other turn the previous prompt's last 3 tokens otherwise (a generation prompt
  or a reminder rendered differently), then a new turn;
- `sessions`: 4 sessions on the 2 slots, exact tails, their turns interleaved (a slot's contents evicted and brought
  back: host RAM).
A system's count per turn is what it says it computed: kvroute's prompt tokens less cached ones, llama-server's
`timings.prompt_n`.

    .venv/bin/python -m bench.hybrid_turns [--archs qwen35,lfm2] [--turns 8] [--ttft-rounds 3]

`--ttft-rounds N` adds time to first token on a deeper model (qwen35's layers 12 times over, 24 layers: `tiny_archs
.model(arch, repeat=12)`), diverging turns on prompts of about 1,500 tokens, the systems one after the other in each
of N rounds (each started afresh): the median per round and system, and kvroute's ratio to each llama-server setting.
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench import tiny_archs
from bench.systems import Server, free_port
from kvroute.client import Client

SLOTS = 2
GEN = 8  # tokens generated per turn
NEW = 24  # tokens of each new turn
CTX = 1024  # a slot's context (and what the models say they were trained for: llama-server caps a slot there)
TTFT_CTX = 4096
LLAMA_DEFAULT = ("--ctx-checkpoints", "32", "--checkpoint-min-step", "8192")
LLAMA_BEST = ("--ctx-checkpoints", "256", "--checkpoint-min-step", "0")
SYSTEMS = ("kvroute", "llama-server", "llama-server-best")
WORKLOADS = ("exact", "diverging", "sessions")
CASES = (*tiny_archs.ARCHS, "gemma3-window")  # gemma3-window: its window cache of the window alone on both


@dataclass
class Turn:
    prompt: int
    computed: int
    ttft_s: float
    tokens: list[int] = field(default_factory=list)


class Launched(Server):
    """A server from argv lists of our own (bench/systems.py starts, waits for and stops it)."""

    def __init__(self, name: str, argvs: list[list[str]], port: int, log_path: Path) -> None:
        self.name, self.workers, self.port = name, 1, port
        self.url = f"http://127.0.0.1:{port}"
        self.argvs, self.log_path, self.ready_timeout_s = argvs, log_path, 300.0
        self._procs = []
        self.startup_s = 0.0
        self.zmq = ""

    def __enter__(self) -> Launched:
        self.start()
        return self

    def _check_template(self, http: httpx.Client) -> None:
        """(No chat template here: token-id prompts.)"""


def launch(system: str, case: str, model: Path, ctx: int, threads: int, logs: Path, trace: bool = False) -> Launched:
    """System `system` on `model`; `trace`: llama-server logs its checkpoints (they are counted from its log)."""
    window = case == "gemma3-window"
    port = free_port()
    log = logs / f"{system}-{case}-{int(time.time() * 1000)}.log"
    if system == "kvroute":
        zmq = f"tcp://127.0.0.1:{free_port()}"
        argv = [
            sys.executable, "-m", "commands.cli", "serve", "--model", str(model), "--workers", "1",
            "--slots", str(SLOTS), "--ctx-per-slot", str(ctx), "--threads", str(threads), "--zmq", zmq,
            "--worker-endpoint", f"tcp://127.0.0.1:{free_port()}", "--http", f"127.0.0.1:{port}",
            *(("--swa-full", "off") if window else ()),
        ]  # fmt: skip
        server = Launched(system, [argv], port, log)
        server.zmq = zmq
        return server
    from bench.llama_server import binary

    argv = [
        str(binary()), "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
        "--parallel", str(SLOTS), "--ctx-size", str(ctx * SLOTS), "--threads", str(threads),
        "--threads-batch", str(threads), "--flash-attn", "auto", "--no-webui",
        *(LLAMA_BEST if system == "llama-server-best" else LLAMA_DEFAULT),
        # Gemma 3 with its window cache at full length as kvroute's; LFM2's at its best with it too
        *(("--swa-full",) if case == "gemma3" or (case == "lfm2" and system == "llama-server-best") else ()),
        *(("--log-verbosity", "4") if trace else ()),
    ]  # fmt: skip
    return Launched(system, [argv], port, log)


def ask(server: Launched, prompt: list[int], http: httpx.Client, zmq: Client | None) -> Turn:
    """One turn, streamed: what it computed, its time to first token, its tokens."""
    t0 = time.perf_counter()
    ttft = 0.0
    if zmq is not None:
        stream = zmq.stream(tokens=prompt, max_tokens=GEN, temperature=0.0, ignore_eos=True)
        for delta in stream:
            ttft = ttft or (time.perf_counter() - t0 if delta.tokens else 0.0)
        result = stream.result
        assert result is not None
        from protocol import unpack_tokens

        usage = result.usage
        return Turn(usage.prompt_tokens, usage.prompt_tokens - usage.cached_tokens, ttft, unpack_tokens(result.tokens))
    body = {"prompt": prompt, "n_predict": GEN, "temperature": 0, "cache_prompt": True, "ignore_eos": True,
            "return_tokens": True, "stream": True}  # fmt: skip
    tokens: list[int] = []
    timings: dict[str, float] = {}
    # (a connection of its own: llama-server may close a kept-alive one between turns, as httpx reuses it)
    with http.stream("POST", f"{server.url}/completion", json=body, timeout=600, headers={"Connection": "close"}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            event = httpx.Response(200, content=line[6:]).json()
            if event.get("tokens"):
                ttft = ttft or time.perf_counter() - t0
                tokens += event["tokens"]
            timings = event.get("timings", timings)
    return Turn(len(prompt), int(timings["prompt_n"]), ttft, tokens)


def sessions_of(workload: str, rnd: random.Random, start: int) -> list[list[int]]:
    n = 4 if workload == "sessions" else 1
    return [[rnd.randrange(128) for _ in range(start + 16 * i)] for i in range(n)]


def follow(workload: str, prompt: list[int], reply: list[int], turn: int, rnd: random.Random) -> list[int]:
    """The session's next prompt, but its new turn."""
    if workload == "diverging":
        if turn % 2:
            return [*prompt[:-3], 120, 121, 122]
        return [*prompt, *reply[:2], 123, 124]
    return prompt + reply


def run(server: Launched, workload: str, turns: int, start: int, seed: int = 1) -> list[Turn]:
    """A workload's turns on a running system (each session's turns after its first)."""
    rnd = random.Random(seed)
    histories = sessions_of(workload, rnd, start)
    out: list[Turn] = []
    with httpx.Client() as http, _zmq(server) as zmq:
        for t in range(turns):
            for s, history in enumerate(histories):
                prompt = history + [rnd.randrange(128) for _ in range(NEW)]
                turn = ask(server, prompt, http, zmq)
                if t > 0:
                    out.append(turn)
                histories[s] = follow(workload, prompt, turn.tokens, t, rnd)
    return out


@contextmanager
def _zmq(server: Launched) -> Iterator[Client | None]:
    if not server.zmq:
        yield None
        return
    with Client(server.zmq, timeout_s=600) as client:
        yield client


def checkpoint_mib(server: Launched) -> float:
    """Host RAM a slot's context checkpoints take at the end, on average: kvroute's gauge; llama-server's log (each
    slot's last "created context checkpoint N of M ... size = X MiB": N of them)."""
    if server.name == "kvroute":
        time.sleep(1.5)  # (the gauge comes with the worker's heartbeat, every second)
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        found = re.findall(r"^kvroute_worker_snapshot_bytes\{[^}]*\} ([0-9.e+]+)$", text, re.M)
        return sum(float(x) for x in found) / 2**20 / SLOTS
    last: dict[str, float] = {}
    for line in server.log_path.read_text(errors="replace").splitlines():
        m = re.search(r"id\s+(\d+) \|.*created context checkpoint (\d+) of \d+ .*size = ([0-9.]+) MiB", line)
        if m:
            last[m.group(1)] = int(m.group(2)) * float(m.group(3))
    return sum(last.values()) / SLOTS


def counts(cases: list[str], turns: int, threads: int, logs: Path) -> None:
    print(f"prompt tokens computed per turn (mean over {turns - 1} turns after the first; token-id prompts, {SLOTS} "
          f"slots, {GEN} tokens generated a turn, {NEW} new a turn); checkpoints' MiB per slot at the end")  # fmt: skip
    print(f"{'model':14s} {'workload':10s}" + "".join(f" {s:>24s}" for s in SYSTEMS) + "  kvroute / default, / best")
    for case in cases:
        model = tiny_archs.model("gemma3" if case == "gemma3-window" else case, n_ctx=CTX)
        for workload in WORKLOADS:
            per: dict[str, tuple[float, float]] = {}
            for system in SYSTEMS:
                with launch(system, case, model, CTX, threads, logs, trace=True) as server:
                    done = run(server, workload, turns, start=40)
                    per[system] = (statistics.mean(t.computed for t in done), checkpoint_mib(server))
            cells = "".join(f" {per[s][0]:13.1f} ({per[s][1]:6.2f} MiB)" for s in SYSTEMS)
            ratios = [per["kvroute"][0] / per[s][0] if per[s][0] else float("nan") for s in SYSTEMS[1:]]
            print(f"{case:14s} {workload:10s}{cells}  " + ", ".join(f"{r:.2f}" for r in ratios), flush=True)


def ttft(rounds: int, threads: int, logs: Path, tokens: int) -> None:
    model = tiny_archs.model("qwen35", repeat=12, n_ctx=TTFT_CTX)
    print(f"\ntime to first token, diverging turns of about {tokens} tokens, qwen35 x12 layers ({model.stat().st_size >> 20} "
          f"MiB): median per round, s; {rounds} rounds, systems in turn, each started afresh")  # fmt: skip
    medians: dict[str, list[float]] = {s: [] for s in SYSTEMS}
    for r in range(rounds):
        for system in SYSTEMS:
            with launch(system, "qwen35", model, TTFT_CTX, threads, logs) as server:
                done = run(server, "diverging", 6, start=tokens, seed=10 + r)
                medians[system].append(statistics.median(t.ttft_s for t in done))
        print(f"round {r + 1}: " + ", ".join(f"{s} {medians[s][-1]:.3f}" for s in SYSTEMS), flush=True)
    for other in SYSTEMS[1:]:
        ratios = [k / o for k, o in zip(medians["kvroute"], medians[other], strict=True)]
        print(f"kvroute / {other}: median {statistics.median(ratios):.2f} (rounds {min(ratios):.2f}-{max(ratios):.2f})")


def main(argv: list[str] | None = None, out: Callable[[str], None] = print) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--archs", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ttft-rounds", type=int, default=0)
    p.add_argument("--ttft-tokens", type=int, default=1500, help="tokens of a TTFT session's first prompt")
    p.add_argument("--logs", default="bench/results/hybrid_turns_logs")
    args = p.parse_args(argv)
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    cases = [c for c in args.archs.split(",") if c]
    if unknown := [c for c in cases if c not in CASES]:
        raise SystemExit(f"unknown --archs {unknown}; known: {', '.join(CASES)}")
    if cases:
        counts(cases, args.turns, args.threads, logs)
    if args.ttft_rounds:
        ttft(args.ttft_rounds, args.threads, logs, args.ttft_tokens)


if __name__ == "__main__":
    main()
