"""Warm restart (issue 17): how fast does a conversation resume after its worker restarts, with the disk tier
against without it?

    .venv/bin/python -m bench.warm_restart [--sessions 20] [--turns 2] [--repeats 2]

The router and the HTTP API run as one `kvroute serve --workers 0` process; the worker is its own process,
`kvroute worker --slots 4 --cache-dir DIR ...`, as deploy/ runs them under systemd. A run starts the worker on an
empty DIR and plays `--turns` turns of `--sessions` chat sessions, each with a system prompt of its own (20 histories
do not fit 4 slots: most are in host RAM by the end), 4 sessions at a time. Then, by variant:

- warm: SIGTERM the worker (it drains, writes every slot and host-RAM entry to DIR, exits 0), start a new worker
  process with the same flags, wait until the router reports it ready;
- cold: the same, but DIR is emptied before the new process starts (the same worker with nothing saved);
- live: no restart (the replay restores from the running worker's host RAM: what the disk tier can at best match).

Then the next turn of every session is replayed, one request at a time (so TTFT is no queueing), timing the first
streamed token. Each repeat runs every variant on the same texts, in an order that rotates from repeat to repeat;
a ratio is the median over the repeats of (a repeat's median TTFT of one variant / the other's), with its min-max.
Also reported: each session's TTFT and `cached_tokens` (usage) per variant, the tokens the worker computed and
restored during the replay (the router's /metrics), how long the stop (drain + writes) and the restart took.
After each repeat llama.cpp alone (bench/floor.py, no server) prefills a replayed turn's new tokens after the
history it reused, with the worker's threads, slots and context: no restart makes the turn cheaper, so over the
cold TTFT it is the lowest warm / cold can be on the machine (`--no-floor` skips it). Goal: warm / cold <= 0.1.
The files were just written, so the restart reads them from the OS page cache, as a service restarted in place
would (not after a reboot).

Writes bench/reports/<date>/<time>-warm-restart.json and .md (--out to change the directory), each process's log
in <time>-logs/ beside them.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.agent_loop import stream_step
from bench.client import parse_metrics
from bench.systems import Server, Setup
from bench.workloads import TextGen, grow, model_tokenizer
from common.model import resolve_model
from kvroute.client import Client

GOAL = 0.1  # warm TTFT / cold TTFT after a restart, at most
ALL_VARIANTS = ("warm", "cold", "live")
WORKER_ID = "w0"


@dataclass
class Turn:
    """One streamed request."""

    session: int
    turn: int
    ttft: float | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    error: str | None = None


# --- the texts ---------------------------------------------------------------------------------------------


def make_sessions(seed: str, n: int, turns: int, system_tokens: int, user_tokens: int, tokenize: Any) -> list[dict[str, Any]]:
    """`n` sessions, each a system prompt of its own (~`system_tokens`) and `turns` + 1 user messages (~`user_tokens`
    each): `turns` played before the restart, the last one replayed after it."""
    out = []
    for i in range(n):
        gen = TextGen(f"{seed}:session{i}")
        head = f"You are the assistant of team {i}. You answer in one short sentence. The team's notes follow."
        system = grow(head, system_tokens, gen.statement, tokenize)
        users = [grow(gen.request(), user_tokens, gen.statement, tokenize) for _ in range(turns + 1)]
        out.append({"system": system, "users": users})
    return out


# --- the worker process ------------------------------------------------------------------------------------


class WorkerProcess:
    """One `kvroute worker` process: started in a session of its own, stopped with SIGTERM (as systemd does)."""

    def __init__(self, argv: list[str], log_path: Path) -> None:
        self.argv = argv
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def terminate(self, timeout_s: float) -> tuple[int | None, float]:
        """SIGTERM the process and wait for it: (exit status or None if it had to be killed, seconds)."""
        assert self.proc is not None
        t0 = time.perf_counter()
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc: int | None = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
            self.kill()
        return rc, time.perf_counter() - t0

    def kill(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


class Front(Server):
    """`kvroute serve --workers 0`: the router and the HTTP API, no local worker. Ready once the router answers
    (/health says `loading` until a worker joins)."""

    def _ready(self, http: httpx.Client) -> bool:
        health = http.get(f"{self.url}/health")
        with contextlib.suppress(ValueError):
            return health.status_code == 200 or health.json().get("status") == "loading"
        return False


def endpoint_of(argvs: list[list[str]], flag: str) -> str:
    """The ZMQ endpoint `flag` (--zmq, --worker-endpoint) that a server's command line (`Server.argvs`) binds."""
    argv = argvs[0]
    return argv[max(i for i, x in enumerate(argv) if x == flag) + 1]


def wait_worker_ready(zmq_endpoint: str, worker: WorkerProcess, seen: set[int], timeout_s: float) -> dict[str, Any]:
    """Wait until the router reports `WORKER_ID` ready in an incarnation not in `seen` (a new process, not the
    one that was stopped); returns what the router says of it."""
    deadline = time.monotonic() + timeout_s
    with Client(zmq_endpoint, timeout_s=5.0) as client:
        while time.monotonic() < deadline:
            if worker.exited() is not None:
                tail = worker.log_path.read_text(errors="replace").splitlines()[-20:]
                raise RuntimeError(f"the worker exited with status {worker.exited()}:\n" + "\n".join(tail))
            with contextlib.suppress(TimeoutError):
                for w in client.status().workers:
                    if w.worker == WORKER_ID and w.state == "ready" and w.incarnation not in seen:
                        seen.add(w.incarnation)
                        return {"incarnation": w.incarnation, "ctx_per_slot": w.ctx_per_slot, "slots": len(w.slots)}
            time.sleep(0.2)
    raise RuntimeError(f"the router did not report a new {WORKER_ID} ready within {timeout_s:.0f} s")


# --- one run -------------------------------------------------------------------------------------------------


def request(
    http: httpx.Client, messages: list[dict[str, Any]], session: int, turn: int, max_tokens: int
) -> tuple[Turn, dict[str, Any]]:
    """One streamed chat turn (bench.agent_loop's request), its failure recorded instead of raised."""
    try:
        step, reply = stream_step(http, messages, False, max_tokens)
    except (RuntimeError, httpx.HTTPError, ValueError) as exc:
        return Turn(session, turn, None, 0, 0, 0, f"{type(exc).__name__}: {exc}"[:300]), {}
    turn_ = Turn(session, turn, step.ttft or None, step.prompt_tokens, step.cached_tokens, step.completion_tokens)
    return turn_, reply


def play(
    url: str, sessions: list[dict[str, Any]], turns: int, max_tokens: int, concurrency: int
) -> tuple[list[list[dict[str, Any]]], list[Turn]]:
    """The first `turns` turns of every session, `concurrency` sessions at a time; returns each session's history
    (the messages sent and the replies) and the turns."""

    def one(i: int) -> tuple[list[dict[str, Any]], list[Turn]]:
        messages: list[dict[str, Any]] = [{"role": "system", "content": sessions[i]["system"]}]
        done = []
        with httpx.Client(base_url=url, timeout=600) as http:
            for k in range(turns):
                messages.append({"role": "user", "content": sessions[i]["users"][k]})
                t, reply = request(http, messages, i, k, max_tokens)
                done.append(t)
                if t.error:
                    raise RuntimeError(f"session {i} turn {k + 1} failed before the restart: {t.error}")
                messages.append({"role": "assistant", "content": reply.get("content") or ""})
        return messages, done

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, range(len(sessions))))
    return [m for m, _ in results], [t for _, ts in results for t in ts]


def replay(
    url: str, sessions: list[dict[str, Any]], histories: list[list[dict[str, Any]]], turns: int, max_tokens: int
) -> list[Turn]:
    """The next turn of every session, one request at a time."""
    out = []
    with httpx.Client(base_url=url, timeout=600) as http:
        for i, history in enumerate(histories):
            messages = [*history, {"role": "user", "content": sessions[i]["users"][turns]}]
            out.append(request(http, messages, i, turns, max_tokens)[0])
    return out


def worker_counters(url: str) -> dict[str, float]:
    """The worker's token counters from the router's /metrics: tokens computed (`prefill`), reused (`reused`) and, of
    those, copied in from another slot (`restored_slot`) or from host RAM or the disk tier (`restored_host`)."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    series = parse_metrics(text)
    out = {}
    for key, name in (("prefill", "kvroute_worker_prefill_tokens"), ("reused", "kvroute_worker_reused_tokens")):
        values = series.get(name) or series.get(f"{name}_total") or {}
        if values:
            out[key] = sum(values.values())
    for labels, v in (series.get("kvroute_worker_restored_tokens_total") or {}).items():
        out[f"restored_{dict(labels).get('source', '?')}"] = v
    return out


def log_events(path: Path, since: int, names: tuple[str, ...]) -> list[dict[str, Any]]:
    """The worker log's JSON lines whose event is one of `names`, after byte offset `since`."""
    out = []
    for line in path.read_bytes()[since:].decode(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            if isinstance(event, dict) and event.get("event") in names:
                out.append({k: v for k, v in event.items() if k not in ("process", "level")})
    return out


def one_run(
    variant: str,
    front: Server,
    worker_argv: list[str],
    cache_dir: Path,
    logs: Path,
    sessions: list[dict[str, Any]],
    a: argparse.Namespace,
) -> dict[str, Any]:
    """Start a worker on an empty `cache_dir` and play; then (warm, cold) SIGTERM it, (cold) empty `cache_dir`, start
    it again; then replay. `live` replays on the worker that played (its host RAM), with no restart."""
    zmq_endpoint = endpoint_of(front.argvs, "--zmq")
    shutil.rmtree(cache_dir, ignore_errors=True)
    cache_dir.mkdir(parents=True)
    log_path = logs / f"worker-{variant}.log"
    seen: set[int] = set()
    out: dict[str, Any] = {"variant": variant, "load_average": [round(os.getloadavg()[0], 2)]}
    worker = WorkerProcess(worker_argv, log_path)
    worker.start()
    try:
        out["worker"] = wait_worker_ready(zmq_endpoint, worker, seen, a.ready_timeout_s)
        context = log_events(log_path, 0, ("slot_context",))
        out["ctx_per_slot"] = context[-1].get("ctx_per_slot") if context else None
        t0 = time.perf_counter()
        histories, before = play(front.url, sessions, a.turns, a.max_tokens, a.concurrency)
        out["play_s"] = time.perf_counter() - t0
        if variant != "live":
            offset = log_path.stat().st_size
            rc, out["stop_s"] = worker.terminate(a.stop_timeout_s)
            if rc != 0:
                raise RuntimeError(f"the worker's graceful stop ended with status {rc} (None: killed after {a.stop_timeout_s} s)")
            out["stop_log"] = log_events(log_path, offset, ("persisting", "persisted", "persist_timeout", "persist_failed"))
            saved = sorted(cache_dir.glob("*.kvs"))
            out["saved_files"], out["saved_bytes"] = len(saved), sum(p.stat().st_size for p in saved)
            if variant == "cold":
                shutil.rmtree(cache_dir)
                cache_dir.mkdir()
            offset = log_path.stat().st_size
            t0 = time.perf_counter()
            worker = WorkerProcess(worker_argv, log_path)
            worker.start()
            out["worker"] = wait_worker_ready(zmq_endpoint, worker, seen, a.ready_timeout_s)
            out["restart_s"] = time.perf_counter() - t0
            out["start_log"] = log_events(log_path, offset, ("disk_tier", "disk_cache_loaded"))
        time.sleep(a.settle_s)
        # a restarted worker's counters start at 0 (the router shows the running process's): only live needs a base
        first = worker_counters(front.url) if variant == "live" else {}
        after = replay(front.url, sessions, histories, a.turns, a.max_tokens)
        time.sleep(1.5)  # the worker's counters reach the router's /metrics with its heartbeat, one a second
        last = worker_counters(front.url)
        out["replay_counters"] = {k: v - first.get(k, 0.0) for k, v in last.items()}
        worker.terminate(a.stop_timeout_s)
    finally:
        worker.kill()
    out["load_average"].append(round(os.getloadavg()[0], 2))
    out["before"] = [asdict(t) for t in before]
    out["replay"] = [asdict(t) for t in after]
    return out


# --- figures -------------------------------------------------------------------------------------------------


def median_ttft(turns: list[dict[str, Any]]) -> float | None:
    ttfts = [t["ttft"] for t in turns if not t["error"] and t["ttft"] is not None]
    return statistics.median(ttfts) if ttfts else None


def repeat_ratio(num: list[dict[str, Any]], den: list[dict[str, Any]]) -> float | None:
    """A repeat's figure: the median TTFT of one variant's replayed turns over another's."""
    n, d = median_ttft(num), median_ttft(den)
    return None if n is None or not d else n / d


def spread(values: list[float | None]) -> dict[str, Any]:
    """The median of the known values, their min and max, and the values themselves (None where unknown)."""
    known = [x for x in values if x is not None]
    if not known:
        return {"median": None, "min": None, "max": None, "per_repeat": values}
    return {"median": statistics.median(known), "min": min(known), "max": max(known), "per_repeat": values}


def summarize(repeats: list[dict[str, Any]], goal: float = GOAL) -> dict[str, Any]:
    """Figures over the repeats (each {variant: run} for the variants run): each variant's median TTFT and the reuse
    of its replayed turns; the ratios warm / cold (the goal's), live / cold and warm / live, each the median of the
    repeats' ratios with their min-max; failed requests; whether the goal was met."""
    variants = [v for v in ALL_VARIANTS if all(v in r for r in repeats)]
    failed = sum(1 for r in repeats for v in variants for t in r[v]["before"] + r[v]["replay"] if t["error"])
    out: dict[str, Any] = {"variants": variants, "failed_requests": failed, "goal": goal}
    for v in variants:
        replayed = [t for r in repeats for t in r[v]["replay"] if not t["error"]]
        prompt = sum(t["prompt_tokens"] for t in replayed)
        out[v] = {
            "ttft_s": spread([median_ttft(r[v]["replay"]) for r in repeats]),
            "cached_share": sum(t["cached_tokens"] for t in replayed) / prompt if prompt else None,
            "turns_with_nothing_cached": sum(1 for t in replayed if t["cached_tokens"] == 0),
            "mean_prompt_tokens": statistics.fmean(t["prompt_tokens"] for t in replayed) if replayed else None,
        }
    for num, den in (("warm", "cold"), ("live", "cold"), ("warm", "live")):
        if num in variants and den in variants:
            out[f"{num}/{den}"] = spread([repeat_ratio(r[num]["replay"], r[den]["replay"]) for r in repeats])
    ratio: dict[str, Any] = out.get("warm/cold") or {"median": None, "per_repeat": [None]}
    complete = None not in ratio["per_repeat"]
    out["met"] = bool(complete and failed == 0 and ratio["median"] <= goal)
    return out


def measure_floor(model: str, a: argparse.Namespace, warm: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp alone (bench/floor.py, in its own process, with the worker's threads, slots and context), right after
    a repeat's variants (this machine's speed drifts over minutes): the prefill of a replayed turn's new tokens after
    the history it reused, at the medians of that repeat's warm replays. No restart makes a turn cheaper than that:
    over the cold TTFT it is the floor of the goal's ratio on this machine."""
    replayed = [t for t in warm["replay"] if not t["error"]]
    ctx = warm.get("ctx_per_slot") or a.ctx_per_slot
    if not replayed or not ctx:
        return {"skipped": "no warm replay, or the worker's context unknown"}
    history = int(statistics.median(t["cached_tokens"] for t in replayed))
    new = int(statistics.median(t["prompt_tokens"] - t["cached_tokens"] for t in replayed))
    argv = [
        sys.executable, "-m", "bench.floor", "--model", model, "--threads", str(a.threads), "--slots", str(a.slots),
        "--ctx-per-slot", str(ctx), "--repeat", "5", f"--point={history}:{new}",
    ]  # fmt: skip
    print(f"  llama.cpp alone: {new} new tokens after {history} ...", file=sys.stderr, flush=True)
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return {"skipped": f"bench.floor failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}"}
    seconds = float(json.loads(proc.stdout.strip().splitlines()[-1])["points"][0][2])
    return {"history": history, "new": new, "s": seconds}


def floor_figures(repeats: list[dict[str, Any]]) -> dict[str, Any] | None:
    """llama.cpp alone over the repeats that measured it: its time, warm / it and it / cold (each repeat's own)."""
    measured = [r for r in repeats if "s" in r.get("floor", {})]
    if not measured:
        skipped = next((r["floor"]["skipped"] for r in repeats if "floor" in r), None)
        return {"skipped": skipped} if skipped else None
    out: dict[str, Any] = {"s": spread([r["floor"]["s"] for r in measured])}
    out["new"], out["history"] = measured[0]["floor"]["new"], measured[0]["floor"]["history"]
    warm = [median_ttft(r["warm"]["replay"]) for r in measured]
    cold = [median_ttft(r["cold"]["replay"]) if "cold" in r else None for r in measured]
    out["warm/floor"] = spread([w / r["floor"]["s"] if w else None for w, r in zip(warm, measured, strict=True)])
    out["floor/cold"] = spread([r["floor"]["s"] / c if c else None for c, r in zip(cold, measured, strict=True)])
    return out


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1000:.0f} ms"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 100:.1f}%"


def _x(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def markdown(result: dict[str, Any]) -> str:
    """The tables: the figures, one line per variant and repeat, then one line per session."""
    s, repeats = result["summary"], result["repeats"]
    variants = s["variants"]
    lines = ["| figure | median | min-max over repeats |", "| --- | --- | --- |"]
    for v in variants:
        t = s[v]["ttft_s"]
        lines.append(f"| {v}: median TTFT of the replayed turns | {_ms(t['median'])} | {_ms(t['min'])} - {_ms(t['max'])} |")
    for key in ("warm/cold", "live/cold", "warm/live"):
        if key in s:
            r = s[key]
            lines.append(f"| {key} | **{_x(r['median'])}** | {_x(r['min'])} - {_x(r['max'])} |")
    f = floor_figures(repeats)
    if f is not None and "s" in f:
        t, wf, fc = f["s"], f["warm/floor"], f["floor/cold"]
        lines += [
            f"| llama.cpp alone: {f['new']} new tokens after a {f['history']}-token history, after each repeat"
            f" | {_ms(t['median'])} | {_ms(t['min'])} - {_ms(t['max'])} |",
            f"| warm / llama.cpp alone | **{_x(wf['median'])}** | {_x(wf['min'])} - {_x(wf['max'])} |",
            f"| llama.cpp alone / cold (the lowest warm / cold can be here) | **{_x(fc['median'])}** | {_x(fc['min'])}"
            f" - {_x(fc['max'])} |",
        ]
    elif f is not None:
        lines.append(f"| llama.cpp alone | {f['skipped']} | - |")
    lines += [
        "",
        "| repeat | variant | replay median TTFT | cached share | stop (drain + writes) | files saved | restart to ready"
        " | tokens computed / restored from host RAM or disk / from a slot (/metrics) | load avg |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for k, r in enumerate(repeats):
        for v in r["order"]:
            run = r[v]
            replayed = [t for t in run["replay"] if not t["error"]]
            prompt = sum(t["prompt_tokens"] for t in replayed)
            share = sum(t["cached_tokens"] for t in replayed) / prompt if prompt else None
            stop = f"{run['stop_s']:.1f} s" if "stop_s" in run else "-"
            saved = f"{run['saved_files']} ({run['saved_bytes'] / 2**20:.0f} MiB)" if "saved_files" in run else "-"
            restart = f"{run['restart_s']:.1f} s" if "restart_s" in run else "-"
            c = run["replay_counters"]
            restored = (
                "n/a"
                if not c
                else f"{c.get('prefill', 0):.0f} / {c.get('restored_host', 0):.0f} / {c.get('restored_slot', 0):.0f}"
            )
            load = "-".join(str(x) for x in run["load_average"])
            lines.append(
                f"| {k + 1} | {v} | {_ms(median_ttft(run['replay']))} | {_pct(share)} | {stop} | {saved} | {restart}"
                f" | {restored} | {load} |"
            )
    head = " | ".join(f"{v} TTFT | {v} cached" for v in variants)
    lines += [
        "",
        f"| session | prompt tokens | {head} | warm / cold |",
        "| --- | --- |" + " --- | --- |" * len(variants) + " --- |",
    ]
    for i in range(len(repeats[0][variants[0]]["replay"])):
        per = {v: [r[v]["replay"][i] for r in repeats] for v in variants}
        ttft = {v: median_ttft(per[v]) for v in variants}
        cells = " | ".join(f"{_ms(ttft[v])} | {'/'.join(str(t['cached_tokens']) for t in per[v])}" for v in variants)
        w, c = ttft.get("warm"), ttft.get("cold")
        ratio = w / c if w is not None and c else None
        prompts = "/".join(str(t["prompt_tokens"]) for t in per[variants[0]])
        lines.append(f"| {i + 1} | {prompts} | {cells} | {_x(ratio)} |")
    return "\n".join(lines)


def goal_line(s: dict[str, Any]) -> str:
    r = s.get("warm/cold")
    if r is None or r["median"] is None:
        return f"warm restart: TTFT warm / cold: n/a (goal <= {s['goal']}): NOT EVALUATED"
    verdict = "MET" if s["met"] else "MISSED"
    extra = f", {s['failed_requests']} failed requests" if s["failed_requests"] else ""
    return (
        f"warm restart: TTFT of the next turn after a restart, disk tier / none: {r['median']:.3f} "
        f"(repeats {r['min']:.3f}-{r['max']:.3f}; goal <= {s['goal']}){extra}: {verdict}"
    )


# --- main ----------------------------------------------------------------------------------------------------


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module's docstring as written, and each flag's default."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.warm_restart", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--sessions", type=int, default=20, help="chat sessions, each with its own system prompt")
    p.add_argument("--turns", type=int, default=2, help="turns of each session before the restart (the next one is replayed)")
    # the sizes of bench.run's multi-agent workload: an 800-token system prompt, 50-token messages, 32-token replies
    p.add_argument("--system-tokens", type=int, default=800, help="tokens of each session's system prompt")
    p.add_argument("--user-tokens", type=int, default=50, help="tokens of each user message")
    p.add_argument("--max-tokens", type=int, default=32, help="max_tokens of each turn")
    p.add_argument("--repeats", type=int, default=2, help="runs of each variant (their order rotates from repeat to repeat)")
    p.add_argument(
        "--variants",
        default="warm,cold,live",
        help="warm: restart on what the stopped worker saved; cold: restart on an empty --cache-dir; live: no restart,"
        " the replay restores from the worker's host RAM (what the disk tier could at best match)",
    )
    p.add_argument("--slots", type=int, default=4, help="slots of the worker")
    p.add_argument("--ctx-per-slot", type=int, default=0, help="context of each slot (0: the worker's default, auto)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="the worker's CPU threads")
    p.add_argument("--concurrency", type=int, default=4, help="sessions played at once before the restart")
    p.add_argument("--deterministic", action="store_true", help="run the worker with --deterministic")
    p.add_argument("--worker-flags", default="", help="more `kvroute worker` flags, e.g. '--host-cache-mb 64'")
    p.add_argument("--seed", default="warm-restart", help="seed of the texts (a repeat adds its number)")
    p.add_argument("--cache-root", default=None, help="where the workers' --cache-dir go (default: a temporary directory)")
    p.add_argument(
        "--settle-s", type=float, default=0.0, help="seconds to wait after the restarted worker is ready, before the replay"
    )
    p.add_argument("--ready-timeout-s", type=float, default=300.0, help="longest wait for a started worker to be ready")
    p.add_argument("--stop-timeout-s", type=float, default=120.0, help="longest wait for a SIGTERMed worker to exit")
    p.add_argument("--no-floor", action="store_true", help="skip llama.cpp alone on the replayed turn (bench/floor.py)")
    p.add_argument("--out", default=None, help="report directory (default: bench/reports/<today>)")
    a = p.parse_args(argv)
    a.variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    if not a.variants or any(v not in ALL_VARIANTS for v in a.variants) or len(set(a.variants)) < len(a.variants):
        p.error(f"--variants takes some of {', '.join(ALL_VARIANTS)}, each once")
    if a.sessions < 1 or a.turns < 1 or a.repeats < 1 or a.concurrency < 1:
        p.error("--sessions, --turns, --repeats and --concurrency must be at least 1")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    model = str(resolve_model(None))
    tokenize = model_tokenizer(model)
    out = Path(a.out or f"bench/reports/{time.strftime('%Y-%m-%d')}")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    logs = out / f"{stamp}-logs"
    setup = Setup(
        model=model, threads=a.threads, workers=1, slots=a.slots, ctx_per_slot=a.ctx_per_slot, kvroute_flags=("--workers", "0")
    )
    front = Front("kvroute", setup, logs / "router-http.log")
    worker_endpoint = endpoint_of(front.argvs, "--worker-endpoint")
    root = Path(a.cache_root) if a.cache_root else Path(tempfile.mkdtemp(prefix="kvroute-warm-restart-"))
    cache_dir = root / WORKER_ID
    worker_argv = [
        sys.executable, "-m", "commands.cli", "worker",
        "--model", model,
        "--connect", worker_endpoint,
        "--worker-id", WORKER_ID,
        "--slots", str(a.slots),
        "--ctx-per-slot", str(a.ctx_per_slot),
        "--threads", str(a.threads),
        "--cache-dir", str(cache_dir),
        *(["--deterministic"] if a.deterministic else []),
        *shlex.split(a.worker_flags),
    ]  # fmt: skip
    started = time.time()
    load_start = os.getloadavg()
    repeats: list[dict[str, Any]] = []
    try:
        with front:
            for r in range(a.repeats):
                sessions = make_sessions(f"{a.seed}:{r}", a.sessions, a.turns, a.system_tokens, a.user_tokens, tokenize)
                order = a.variants[r % len(a.variants) :] + a.variants[: r % len(a.variants)]
                runs: dict[str, Any] = {"order": list(order)}
                for variant in order:
                    print(f"repeat {r + 1}/{a.repeats}: {variant} ...", file=sys.stderr, flush=True)
                    run = one_run(variant, front, worker_argv, cache_dir, logs / f"repeat{r + 1}", sessions, a)
                    runs[variant] = run
                    ttft = median_ttft(run["replay"])
                    cached = sum(t["cached_tokens"] for t in run["replay"])
                    prompt = sum(t["prompt_tokens"] for t in run["replay"])
                    restart = (
                        f"; stop {run['stop_s']:.1f} s ({run['saved_files']} files), restart {run['restart_s']:.1f} s"
                        if "stop_s" in run
                        else ""
                    )
                    print(
                        f"  {variant}: replay median TTFT {_ms(ttft)}, cached {cached}/{prompt} tokens{restart}",
                        file=sys.stderr,
                        flush=True,
                    )
                if not a.no_floor and "warm" in runs:
                    runs["floor"] = measure_floor(model, a, runs["warm"])
                repeats.append(runs)
    finally:
        if not a.cache_root:
            shutil.rmtree(root, ignore_errors=True)
    summary = summarize(repeats)
    summary["floor"] = floor_figures(repeats)
    result: dict[str, Any] = {
        "bench": "warm-restart",
        "command": " ".join(["python -m bench.warm_restart", *(argv if argv is not None else sys.argv[1:])]),
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
        "duration_s": round(time.time() - started, 1),
        "load_average_start": [round(x, 2) for x in load_start],
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
        "cores": os.cpu_count(),
        "args": vars(a),
        "router_command": front.command_line,
        "worker_command": " ".join(worker_argv),
        "summary": summary,
        "repeats": repeats,
    }
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stamp}-warm-restart.json"
    path.write_text(json.dumps(result, indent=1))
    table = markdown(result)
    head = (
        f"# Warm restart, {result['started']} ({result['duration_s']:.0f} s, load average {result['load_average_start'][0]}"
        f" at the start, {result['load_average_end'][0]} at the end, {result['cores']} cores)\n\n"
        f"`{result['command']}`: {a.sessions} sessions x {a.turns} turns ({a.system_tokens}-token system prompts,"
        f" {a.user_tokens}-token user messages, max_tokens {a.max_tokens}) on 1 worker x {a.slots} slots; SIGTERM,"
        " restart, the next turn of every session one at a time. Variants: warm = restarted on the saved states, cold ="
        " restarted on an empty --cache-dir, live = no restart (host RAM).\n\n"
    )
    (out / f"{stamp}-warm-restart.md").write_text(head + table + "\n\n" + goal_line(summary) + "\n")
    print(table)
    print()
    print(goal_line(summary))
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
