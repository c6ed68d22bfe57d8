"""`python -m bench.run`: run the workloads against each system, in interleaved repeats, and write a report.

For each workload and each repeat, each system is started fresh (same model, threads and context), warmed with
one short request, measured, and stopped; so no system inherits another workload's or repeat's cache. The systems
take turns within a repeat, in an order that rotates from one repeat to the next, so that a slow minute on a
shared machine lands on every system alike; ratios pair the repeats. Output, under --out:
`<timestamp>.json` (setup, every sample, every figure), `<timestamp>.md` (a table per workload, the goals),
`<timestamp>-<workload>.png` plots, and `<timestamp>-logs/` with each server's log.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench import oracle, report
from bench.client import CompletionClient, Sample, Series, metrics_delta, run_workload
from bench.systems import DESCRIPTIONS, ROUTING, SYSTEMS, Server, Setup, SystemError_
from bench.workloads import QUICK, WORKLOADS, Sizes, Workload, build, model_tokenizer
from common.config import add_args, from_args

# A cold system on the long session computes every turn's whole history: hours at 300 turns on 2 cores.
COLD_SKIPPED = {"long-session"}
# scale-out compares kvroute's routing policies on several workers: a server with no router has nothing to show
# there, and the kvroute variants that change something else run only when named with --systems.
SCALE_OUT_ONLY_NAMED = ("kvroute-cold", "kvroute-nospec")
# The workers' counters reach the router's /metrics with their heartbeats, one a second.
BEAT_WAIT_S = 1.5


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.run",
        description="Benchmark kvroute against llama-server, llama-cpp-python's server and itself without prefix caching.",
    )
    known = ", ".join(WORKLOADS)
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated workloads to run (default: all: {known})")
    p.add_argument("--systems", default=None, help=f"comma-separated systems (of {', '.join(SYSTEMS)}); default: all that apply")
    p.add_argument("--model", default=None, help="GGUF path (default: kvroute's default model)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="threads of every system (default: cores)")
    p.add_argument("--workers", type=int, default=1, help="kvroute workers; kvroute-rr/-ll run only when > 1 (default: 1)")
    p.add_argument("--slots", type=int, default=4, help="kvroute slots per worker (default: 4)")
    p.add_argument("--ctx-per-slot", type=int, default=0, help="context per conversation; 0: what each workload needs")
    p.add_argument("--kvroute-flags", default="", help="more `kvroute serve` flags for every kvroute system, e.g. '--hold-ms 0'")
    p.add_argument("--gpu", type=int, default=None, help="run every system with all layers on this GPU (default: CPU)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every workload on every system (default: 3)")
    p.add_argument("--quick", action="store_true", help="tiny sizes and one repeat, to check the harness in a few minutes")
    p.add_argument("--cold-long-session", action="store_true", help="also run kvroute-cold on long-session (very slow)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"), help="folder for the report (default: bench/results)")
    p.add_argument("--request-timeout", type=float, default=900.0, help="seconds before one request is given up (default: 900)")
    g = p.add_argument_group("workload sizes")
    add_args(g, Sizes)  # type: ignore[arg-type]
    if "--quick" in (sys.argv[1:] if argv is None else argv):
        p.set_defaults(**QUICK, repeats=1)  # tiny defaults; size flags given explicitly still win
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, got {args.repeats}")
    return args


def ctx_needed(workload: Workload, tokenize: Any) -> int:
    """Context one conversation of `workload` needs: its longest prompt plus every completion, rounded up."""
    need = 0
    for s in workload.sessions:
        n = 1 + len(tokenize(s.opening)) + sum(len(tokenize(m)) for m in s.messages) + len(s.messages) * s.max_tokens
        need = max(need, n)
    need += 64  # completions re-tokenize a little differently once they are part of the next prompt
    return max(2048, -(-need // 256) * 256)


def machine() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        mem = int(Path("/proc/meminfo").read_text().split()[1]) // (1 << 20)
    try:
        git = ["git", "rev-parse", "--short", "HEAD"]
        commit = subprocess.run(git, capture_output=True, text=True, check=False).stdout.strip()
        status = ["git", "status", "--porcelain", "--untracked-files=no"]
        dirty = subprocess.run(status, capture_output=True, text=True, check=False)
        if dirty.stdout.strip():
            commit += " with uncommitted changes"
    except OSError:
        commit = ""
    import llama_cpp

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": mem,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "llama_cpp_python": llama_cpp.__version__,
        "git_commit": commit,
        "load_average_at_start": round(os.getloadavg()[0], 2),
    }


def _progress(workload: str, system: str) -> Any:
    def show(s: Sample) -> None:
        ttft = "n/a" if s.ttft is None else f"{s.ttft:.3f}s"
        err = f" ERROR {s.error}" if s.error else ""
        print(
            f"  {workload} {system} {s.session} turn {s.turn + 1}: ttft {ttft} total {s.total:.2f}s "
            f"prompt {s.prompt_tokens} cached {s.cached_tokens} out {s.output_tokens}{err}",
            file=sys.stderr,
            flush=True,
        )

    return show


async def measure(
    server: Server, workload: Workload, timeout_s: float, counters: dict[str, Series] | None = None
) -> tuple[list[Sample], float]:
    """Warm the server up, then run the workload. With `counters`, kvroute's /metrics go in it: "delta", what they
    grew by over the workload alone (after the warm-up)."""
    client = CompletionClient(
        server.url,
        timeout_s=timeout_s,
        temperature=workload.temperature,
        seeds=workload.request_seeds,
        full_length=workload.full_length,
    )
    try:
        warm = await client.complete("Hello, world.", 4, session="warmup", turn=0, t0=time.perf_counter())
        if warm.error:
            raise SystemError_(f"{server.name}: the warm-up request failed: {warm.error}")
        before = None
        if counters is not None:
            await asyncio.sleep(BEAT_WAIT_S)  # so that the warm-up's job is in the workers' counters already
            before = await client.metrics()
        measured = await run_workload(client, workload, _progress(workload.name, server.name))
        if before is not None and counters is not None:
            await asyncio.sleep(BEAT_WAIT_S)
            after = await client.metrics()
            if after is not None:
                counters["delta"] = metrics_delta(before, after)
        return measured
    finally:
        await client.aclose()


def systems_for(
    workload: str, chosen: list[str], args: argparse.Namespace, workers: int | None = None
) -> list[tuple[str, str | None]]:
    """(system, reason it is skipped or None) for each chosen system; `workers`: kvroute's on this workload
    (default: --workers)."""
    workers = args.workers if workers is None else workers
    named = bool(getattr(args, "systems", None))
    out: list[tuple[str, str | None]] = []
    for name in chosen:
        reason = None
        if name in ROUTING and workers < 2:
            reason = "a routing policy needs more than one worker (--workers)"
        elif name == "kvroute-cold" and workload in COLD_SKIPPED and not args.cold_long_session:
            reason = "every turn recomputed from scratch would take hours (--cold-long-session to run it)"
        elif workload == "scale-out" and not name.startswith("kvroute"):
            reason = "scale-out compares kvroute's routing across workers; this server has no router"
        elif workload == "scale-out" and name in SCALE_OUT_ONLY_NAMED and not named:
            reason = "scale-out compares routing policies (name it in --systems to run it)"
        out.append((name, reason))
    return out


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM, and SIGINT even when started in the background (where it is ignored), stop the servers cleanly.
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for w in workloads:
        if w not in WORKLOADS:
            print(f"bench: error: unknown workload {w!r} (known: {', '.join(WORKLOADS)})", file=sys.stderr)
            return 2
    if args.systems:
        chosen = [s.strip() for s in args.systems.split(",") if s.strip()]
        for s in chosen:
            if s not in SYSTEMS:
                print(f"bench: error: unknown system {s!r} (known: {', '.join(SYSTEMS)})", file=sys.stderr)
                return 2
    else:
        chosen = list(SYSTEMS)  # the routing policies are skipped on workloads with one worker
    sizes = from_args(Sizes, args)
    if args.model is None:
        from common.model import resolve_model

        args.model = str(resolve_model(None))

    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenize = model_tokenizer(args.model)
    started = time.perf_counter()
    run: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, "-m", "bench.run", *(argv if argv is not None else sys.argv[1:])]),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": machine(),
        "sizes": asdict(sizes),
        "repeats": args.repeats,
        "systems": {s: DESCRIPTIONS[s] for s in chosen},
        "workloads": {},
    }
    json_path = out / f"{stamp}.json"

    try:
        for wname in workloads:
            run_one(wname, run, args, sizes, chosen, tokenize, out, stamp)
    except KeyboardInterrupt:
        run["interrupted"] = True  # the servers are stopped by now; report what was measured
        print("\ninterrupted: writing the report of what was measured", file=sys.stderr)

    run["duration_s"] = time.perf_counter() - started
    run["machine"]["load_average_at_end"] = round(os.getloadavg()[0], 2)
    results = {w: {s: v["figures"] for s, v in e["systems"].items()} for w, e in run["workloads"].items()}
    floor = run["workloads"].get("long-session", {}).get("floor")
    agent_floor = run["workloads"].get("agent-long", {}).get("floor")
    run["goals"] = [asdict(g) for g in report.goals(results, floor, agent_floor=agent_floor)]
    json_path.write_text(json.dumps(run, indent=1))
    md_path = write_markdown(run, out, stamp)
    print(f"\nwrote {json_path} and {md_path} ({run['duration_s'] / 60:.1f} min)")
    for g in run["goals"]:
        print(report.goal_line(report.Goal(**g)))
    return 130 if run.get("interrupted") else 0


def run_one(
    wname: str,
    run: dict[str, Any],
    args: argparse.Namespace,
    sizes: Sizes,
    chosen: list[str],
    tokenize: Any,
    out: Path,
    stamp: str,
) -> None:
    """Run workload `wname` on every chosen system, `--repeats` times, the systems taking turns in each repeat (in
    an order rotated by one each repeat); its entry goes into run["workloads"]."""
    workload = build(wname, sizes, tokenize)
    ctx = args.ctx_per_slot or ctx_needed(workload, tokenize)
    setup = Setup(
        model=args.model,
        threads=args.threads,
        workers=workload.workers or args.workers,
        slots=workload.slots or args.slots,
        ctx_per_slot=ctx,
        kvroute_flags=tuple(shlex.split(args.kvroute_flags)),
        gpu=args.gpu,
    )
    entry: dict[str, Any] = {"description": workload.description, "setup": asdict(setup), "systems": {}, "skipped": {}}
    run["workloads"][wname] = entry
    print(f"== {wname}: {workload.description}; context per conversation {ctx}", file=sys.stderr, flush=True)
    runnable = []
    for name, skip in systems_for(wname, chosen, args, setup.workers):
        if skip:
            entry["skipped"][name] = skip
            print(f"-- {name}: skipped: {skip}", file=sys.stderr, flush=True)
        else:
            runnable.append(name)
    for repeat in range(args.repeats):
        shift = repeat % max(1, len(runnable))
        for name in runnable[shift:] + runnable[:shift]:
            if name in entry["skipped"]:
                continue  # it failed in an earlier repeat
            measured = measure_once(wname, workload, name, setup, args, tokenize, out / f"{stamp}-logs" / f"{wname}-{name}.log")
            if isinstance(measured, str):
                entry["skipped"][name] = measured
                entry["systems"].pop(name, None)
                continue
            system = entry["systems"].setdefault(name, {"repeats": []})
            system["repeats"].append(measured)
            system["samples"] = system["repeats"][0]["samples"]  # the plots and llama.cpp alone read the first repeat
            system["figures"] = report.combine([r["figures"] for r in system["repeats"]])
            (out / f"{stamp}.json").write_text(json.dumps(run, indent=1))  # keep what is done if a later system fails
    if wname in ("long-session", "agent-long") and "kvroute" in entry["systems"]:
        entry["floor"] = measure_floor(wname, entry["systems"]["kvroute"]["samples"], setup)
        (out / f"{stamp}.json").write_text(json.dumps(run, indent=1))


def measure_once(
    wname: str, workload: Workload, name: str, setup: Setup, args: argparse.Namespace, tokenize: Any, log_path: Path
) -> dict[str, Any] | str:
    """One repeat of `workload` on a freshly started system `name`: its samples, figures and the load average
    around it; or why it could not be measured."""
    load_before = round(os.getloadavg()[0], 2)
    counters: dict[str, Series] | None = {} if name.startswith("kvroute") else None
    try:
        with Server(name, setup, log_path) as server:
            print(f"-- {name}: ready in {server.startup_s:.1f}s on {server.url}", file=sys.stderr, flush=True)
            samples, wall = asyncio.run(measure(server, workload, args.request_timeout, counters))
    except SystemError_ as exc:
        print(f"-- {name}: FAILED: {exc}", file=sys.stderr, flush=True)
        return f"failed: {exc}"
    rows = [s.to_json() for s in samples]
    for r in rows:  # servers that report no usage: count the prompt with the model's tokenizer (+BOS)
        if r["prompt_tokens"] is None:
            r["prompt_tokens_source"] = "local tokenizer"
            r["prompt_tokens"] = None if r["error"] else 1 + len(tokenize(prompt_of(workload, r, rows)))
    figures = report.figures(wname, rows, wall)
    if counters and "delta" in counters:
        figures.update(report.router_figures(counters["delta"]))
    if wname == "scale-out":
        requests = oracle_requests(workload, rows, tokenize)
        # a system that left a worker idle paid the shared prompt fewer times: its oracle does too (bench/oracle.py)
        used = sum(1 for jobs in figures.get("jobs_per_worker") or () if jobs > 0) or setup.workers
        figures.update(report.oracle_figures(rows, oracle.oracle(requests, used)))
        # the oracle tokenizes the prompts itself: it must count what the server counted
        counted = {(r["session"], r["turn"]): r["prompt_tokens"] for r in rows if not r["error"]}
        figures["oracle_prompt_mismatches"] = sum(len(q.prompt) != counted[(q.session, q.turn)] for q in requests)
    return {
        "samples": rows,
        "figures": figures,
        "load_average": [load_before, round(os.getloadavg()[0], 2)],
    }


def oracle_requests(workload: Workload, rows: list[dict[str, Any]], tokenize: Any) -> list[oracle.Request]:
    """The run's successful requests as the oracle sees them: the prompt's tokens as the server counts them (BOS
    first) and, after them, the reply's."""
    out = []
    for r in rows:
        if r["error"]:
            continue
        prompt = (oracle.BOS, *tokenize(prompt_of(workload, r, rows)))
        out.append(oracle.Request(r["session"], r["turn"], prompt, (*prompt, *tokenize(r["text"]))))
    return out


def measure_floor(wname: str, samples: list[dict[str, Any]], setup: Setup) -> dict[str, Any]:
    """llama.cpp alone on the turns a goal compares (long-session: around turn 10 and the last turns; agent-long:
    the last 10): the prefill of each turn's new tokens after the history kvroute reused (`bench/floor.py`, in its
    own process). No server can make a turn cheaper than this."""
    turns = sorted((s for s in samples if not s["error"] and s["cached_tokens"] is not None), key=lambda s: s["turn"])
    if wname == "agent-long":
        early, late = [], turns[-10:]
    elif len(turns) <= report.EARLY_TURNS.stop:
        return {"skipped": f"needs more than {report.EARLY_TURNS.stop} turns"}
    else:
        early, late = report.compared_turns(turns)
    if not late:
        return {"skipped": "kvroute served no turn"}
    points = [(s["cached_tokens"], s["prompt_tokens"] - s["cached_tokens"]) for s in early + late]
    argv = [
        sys.executable, "-m", "bench.floor", "--threads", str(setup.threads), "--slots", str(setup.slots),
        "--ctx-per-slot", str(setup.ctx_per_slot), "--model", setup.model,
        *(() if setup.gpu is None else ("--gpu", str(setup.gpu))),
        *(f"--point={h}:{n}" for h, n in points),
    ]  # fmt: skip
    print(f"-- llama.cpp alone: prefill of the new tokens of {len(points)} turns", file=sys.stderr, flush=True)
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return {"skipped": f"bench.floor failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}"}
    measured = [tuple(p) for p in json.loads(proc.stdout.strip().splitlines()[-1])["points"]]
    secs = [t for _, _, t in measured]
    turns_1based = [s["turn"] + 1 for s in early + late]
    if wname == "agent-long":
        return {"points": measured, "turns": turns_1based, "p50_s": statistics.median(secs)}
    turn10, last = statistics.median(secs[: len(early)]), statistics.median(secs[len(early) :])
    return {"points": measured, "turns": turns_1based, "turn10_s": turn10, "last_s": last, "last_over_turn10": last / turn10}


def prompt_of(workload: Workload, row: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The prompt a sample was sent, rebuilt from its session and the completions of that session's earlier turns."""
    session = next(s for s in workload.sessions if s.name == row["session"])
    earlier = sorted((r for r in rows if r["session"] == row["session"] and r["turn"] < row["turn"]), key=lambda r: r["turn"])
    return session.prompt(row["turn"], [r["text"] for r in earlier])


def scale_out_lines(figs: dict[str, dict[str, Any]], setup: dict[str, Any]) -> str:
    """What the oracle is and what the router counted, under the scale-out table."""
    out = []
    for name, f in figs.items():
        keys = ("oracle_workers", "oracle_shared_tokens", "oracle_reuse", "oracle_prefilled_tokens", "reuse_of_oracle",
                "reuse_of_oracle_first_turns", "reuse_of_oracle_later_turns", "oracle_prompt_mismatches",
                "history_reuse")  # fmt: skip
        n = {k: report.fmt(k, f.get(k)) for k in keys}
        if f.get("oracle_reuse") is not None:
            out.append(
                f"- `{name}`: the oracle (bench/oracle.py: each session on one worker, on the {n['oracle_workers']} of "
                f"{setup['workers']} workers {name} ran jobs on, the {n['oracle_shared_tokens']} tokens every prompt "
                f"shares computed once on each) reuses {n['oracle_reuse']} of the same prompts and computes "
                f"{n['oracle_prefilled_tokens']} of their tokens; {name} reached {n['reuse_of_oracle']} of its "
                f"reuse (first turns {n['reuse_of_oracle_first_turns']}, later turns "
                f"{n['reuse_of_oracle_later_turns']}); of the later turns' own histories (after the shared prompt) "
                f"{name} reused {report.fmt('reuse', f.get('history_reuse'))}; prompts the oracle counted otherwise "
                f"than the server: {n['oracle_prompt_mismatches']}"
            )
        if f.get("router_reused_tokens") is not None:
            out.append("- " + report.router_line(name, f))
    return "\n".join(out)


def write_markdown(run: dict[str, Any], out: Path, stamp: str) -> Path:
    m = run["machine"]
    lines = [
        f"# kvroute benchmark, {run['started']}",
        "",
        f"Command: `{run['command']}` (git {m['git_commit']}), {run.get('duration_s', 0) / 60:.1f} min.",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, {m['platform']}, Python {m['python']}, "
        f"llama-cpp-python {m['llama_cpp_python']}.",
        "",
        f"Load average (1 min) at the start {m['load_average_at_start']}, at the end {m.get('load_average_at_end')} "
        "(a load well above the benchmark's own means other processes shared the cores).",
        "",
        *(["**Interrupted**: only what was measured before Ctrl-C is here.", ""] if run.get("interrupted") else []),
        "Systems: " + "; ".join(f"`{k}` = {v}" for k, v in run["systems"].items()) + ".",
        "",
        "TTFT is measured by the client from sending the request to the first streamed text; reuse is cached tokens / "
        "prompt tokens as the server reports them (n/a where it does not). Ratios are the headline figure over kvroute's.",
        "",
        f"Every figure is the median of {run.get('repeats', 1)} interleaved repeat(s), the headline's min-max in brackets; "
        "a goal's ratio is the median of the ratios of the same repeat, with their min-max.",
        "",
    ]
    for wname, entry in run["workloads"].items():
        setup = entry["setup"]
        lines += [
            f"## {wname}",
            "",
            f"{entry['description']}. Threads {setup['threads']}, kvroute {setup['workers']} worker(s) x {setup['slots']} "
            f"slots, context per conversation {setup['ctx_per_slot']}"
            + (f", kvroute flags `{' '.join(setup['kvroute_flags'])}`." if setup.get("kvroute_flags") else "."),
            "",
        ]
        figs = {s: v["figures"] for s, v in entry["systems"].items()}
        if figs:
            lines += [report.table(wname, figs), ""]
        if figs:
            loads = "; ".join(
                f"{s} " + ", ".join(f"{r['load_average'][0]} -> {r['load_average'][1]}" for r in v["repeats"])
                for s, v in entry["systems"].items()
            )
            lines += [f"Load average (1 min) before -> after each repeat: {loads}.", ""]
        if entry.get("floor"):
            lines += [report.floor_line(entry["floor"]) + ".", ""]
        if wname == "scale-out" and figs:
            lines += [scale_out_lines(figs, setup), ""]
        for s, why in entry["skipped"].items():
            lines += [f"- `{s}` not measured: {why.splitlines()[0]}"]
        if entry["skipped"]:
            lines.append("")
        png = None
        if figs and wname in ("agent-long", "long-session"):
            png = out / f"{stamp}-{wname}.png"
            report.plot_turns(wname, figs, png, entry.get("floor"))
        elif figs and wname in ("multi-agent", "many-agents", "scale-out"):
            png = out / f"{stamp}-{wname}.png"
            report.plot_distribution(wname, {s: v["samples"] for s, v in entry["systems"].items()}, png)
        if png:
            lines += [f"![{wname}]({png.name})", ""]
    lines += ["## Goals", ""]
    for g in run["goals"]:
        lines.append("- " + report.goal_line(report.Goal(**g)))
    lines.append("")
    md_path = out / f"{stamp}.md"
    md_path.write_text("\n".join(lines))
    return md_path


if __name__ == "__main__":
    sys.exit(main())
