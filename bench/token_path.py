"""The token path: what kvroute's own processes cost per streamed token, the model costing nothing (issue 33).

Scripted workers (this module's `worker` role: a DEALER speaking the worker protocol, as tests/router's FakeWorker
does) answer every job by streaming its max_tokens, one token per delta and one delta per running job per round (a
round's deltas in one JobDeltas message, as a worker sends an engine step's), as fast as they can, then a JobDone
that keeps the router's mirror exact. A real `kvroute router` places the jobs; the clients are a process of their
own: ZMQ clients (kvroute/client.py `AsyncClient`) on the router, or HTTP SSE clients (/v1/completions) on a
`kvroute http` gateway; each either with direct replies (the workers send the output to the client or gateway, the
router sees a job's start and end: PROTOCOL.md 4.4) or with every token through the router (the `-router` paths).
After a warm-up, the CPU time of every process over the measured window is read from /proc, with the tokens the
clients received in it.

    .venv/bin/python -m bench.token_path [--paths zmq,zmq-router,http,http-router] [--workers 2] [--slots 8]
        [--clients 16] [--tokens 200] [--seconds 20] [--warmup-s 3] [--gateway-processes 1,2]

Per path: tokens/s delivered to the clients, and CPU microseconds per delivered token of the router, the gateway,
the workers (together) and the clients.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from bench.systems import free_port
from common.slots import common_prefix
from protocol import (
    Accept,
    Heartbeat,
    Hello,
    Job,
    JobCancel,
    JobDelta,
    JobDeltas,
    JobDone,
    JobStart,
    Refuse,
    SlotState,
    Timings,
    encode,
    pack_tokens,
    router_to_worker_decoder,
    token_hash,
    unpack_tokens,
)

TOKEN = 1_000  # what a scripted worker "generates" (any id of the vocabulary)
HEARTBEAT_S = 0.5
PROMPT = "Tell me a story about the sea and the lighthouse keeper who wrote in his log every night. "


# ---- the scripted worker -------------------------------------------------------------------------


@dataclass
class Running:
    job: Job
    left: int
    generated: int = 0


def worker(endpoint: str, worker_id: str, slots: int, model: str) -> None:
    """Say hello, then stream every job's tokens as fast as the sockets take them."""
    from common.vocab import Vocab

    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, worker_id.encode())
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    dec = router_to_worker_decoder()
    fingerprint = Vocab.load(model).fingerprint
    sock.send(
        encode(
            Hello(worker_id=worker_id, incarnation=1, slots=slots, ctx_per_slot=4096, model_fingerprint=fingerprint, device="cpu")
        )
    )
    held: dict[int, list[int]] = {i: [] for i in range(slots)}
    running: dict[str, Running] = {}
    progress, last_beat = 0, 0.0
    delta_bytes = pack_tokens([TOKEN])
    replies: dict[str, zmq.Socket[bytes]] = {}  # a job's client reads its output itself (Job.reply_to): worker/direct_replies.py

    def reply_socket(endpoint: str) -> zmq.Socket[bytes]:
        if endpoint not in replies:
            replies[endpoint] = zmq.Context.instance().socket(zmq.PUSH)
            replies[endpoint].setsockopt(zmq.SNDHWM, 0)
            replies[endpoint].connect(endpoint)
        return replies[endpoint]

    while True:
        while sock.poll(0 if running else 100):
            msg = dec.decode(sock.recv())
            if isinstance(msg, Job):
                running[msg.id] = Running(msg, msg.sampling.max_tokens or 256)
                if msg.reply_to:
                    reply_socket(msg.reply_to).send(encode(JobStart(id=msg.id)))
            elif isinstance(msg, JobCancel) and msg.id in running:
                running[msg.id].left = 0
            elif isinstance(msg, Refuse):
                raise SystemExit(f"{worker_id}: refused: {msg.reason}")
            elif not isinstance(msg, Accept):
                pass  # drain and the rest: not part of this benchmark
        # a round's deltas in one message per destination, as a worker sends an engine step's (worker/main.py)
        step: dict[str, list[JobDelta]] = {}
        for rid, run in running.items():
            if run.left > 0:
                step.setdefault(run.job.reply_to, []).append(JobDelta(id=rid, text="x", tokens=delta_bytes))
                if run.job.reply_to and run.generated == 0:  # the router hears of the first token only
                    step.setdefault("", []).append(JobDelta(id=rid, text="", tokens=b"", reused_tokens=0))
        for to, deltas in step.items():
            (reply_socket(to) if to else sock).send(encode(deltas[0] if len(deltas) == 1 else JobDeltas(items=deltas)))
        for rid, run in list(running.items()):
            if run.left > 0:
                run.left -= 1
                run.generated += 1
            if run.left == 0:
                del running[rid]
                done = encode(_done(run, held))
                if run.job.reply_to:
                    reply_socket(run.job.reply_to).send(done)
                sock.send(done)
        progress += 1
        now = time.monotonic()
        if now - last_beat > HEARTBEAT_S:
            busy = {r.job.slot: r.job.id for r in running.values()}
            states = [SlotState(slot=i, busy=i in busy, n_tokens=len(t), job_id=busy.get(i)) for i, t in held.items()]
            sock.send(encode(Heartbeat(worker_id=worker_id, incarnation=1, slots=states, queue=0, progress=progress)))
            last_beat = now


def _done(run: Running, held: dict[int, list[int]]) -> JobDone:
    """The end of a job as a correct worker reports it: the slot keeps prompt + generated but the last token."""
    job = run.job
    prompt, generated = unpack_tokens(job.tokens), [TOKEN] * run.generated
    lcp = min(common_prefix(held[job.slot], prompt), len(prompt) - 1) if job.prefix_cache else 0
    kept = (prompt + generated)[: len(prompt) + len(generated) - 1]
    held[job.slot] = kept
    return JobDone(
        id=job.id,
        slot=job.slot,
        finish_reason="length",
        text="x" * len(generated),
        tokens=pack_tokens(generated),
        prompt_tokens=len(prompt),
        reused_tokens=lcp,
        prefilled_tokens=len(prompt) - lcp,
        generated_tokens=len(generated),
        slot_tokens=len(kept),
        slot_hash=token_hash(kept),
        timings=Timings(),
    )


# ---- the clients ---------------------------------------------------------------------------------


async def _zmq_clients(target: str, clients: int, tokens: int, until: float, counts: list[int], direct: bool) -> None:
    from kvroute.client import AsyncClient, Delta

    client = AsyncClient(target, reply_endpoint="auto" if direct else "off")

    async def one(i: int) -> None:
        n = 0
        while time.monotonic() < until:
            n += 1
            async for item in client.stream(prompt=f"{PROMPT}{i}.{n}", max_tokens=tokens, temperature=0.0):
                if isinstance(item, Delta):
                    counts[0] += 1

    await asyncio.gather(*(one(i) for i in range(clients)))
    await client.close()


async def _http_clients(target: str, clients: int, tokens: int, until: float, counts: list[int], direct: bool) -> None:
    import httpx

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=60.0, limits=limits) as http:

        async def one(i: int) -> None:
            n = 0
            while time.monotonic() < until:
                n += 1
                body = {"prompt": f"{PROMPT}{i}.{n}", "max_tokens": tokens, "temperature": 0.0, "stream": True}
                async with http.stream("POST", f"{target}/v1/completions", json=body) as resp:
                    async for line in resp.aiter_lines():
                        if line.startswith("data:") and '"text"' in line:
                            counts[0] += 1

        await asyncio.gather(*(one(i) for i in range(clients)))


def clients(path: str, target: str, n: int, tokens: int, seconds: float, out: str) -> None:
    """Run `n` clients for `seconds`; write (time, tokens received so far) samples to `out`."""
    counts = [0]
    samples: list[tuple[float, int]] = []

    async def main() -> None:
        until = time.monotonic() + seconds
        run = _zmq_clients if path.startswith("zmq") else _http_clients
        task = asyncio.create_task(run(target, n, tokens, until, counts, not path.endswith("-router")))
        while not task.done():
            samples.append((time.time(), counts[0]))
            await asyncio.sleep(0.1)
        await task
        samples.append((time.time(), counts[0]))

    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())
    Path(out).write_text(json.dumps(samples))


# ---- the run -------------------------------------------------------------------------------------


def cpu_s(pid: int) -> float:
    """CPU seconds of `pid` and of the processes it started (`kvroute http --processes N`'s children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    children: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        children.update(int(c) for c in (task / "children").read_text().split())
    return own + sum(cpu_s(c) for c in children if Path(f"/proc/{c}").exists())


def tokens_at(samples: list[tuple[float, int]], t: float) -> float:
    """Tokens received by time `t`, interpolated between the client's samples."""
    for (t0, c0), (t1, c1) in itertools.pairwise(samples):
        if t0 <= t <= t1:
            return c0 + (c1 - c0) * ((t - t0) / (t1 - t0) if t1 > t0 else 0.0)
    return float(samples[-1][1] if t > samples[-1][0] else samples[0][1])


def wait_for(check: Any, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except Exception:
            pass
        time.sleep(0.2)
    raise SystemExit(f"timed out waiting for {what}")


def run_path(path: str, args: argparse.Namespace, model: str, gateways: int = 1) -> dict[str, float]:
    me = [sys.executable, "-m", "bench.token_path"]
    env = {**os.environ, "KVROUTE_LOG_LEVEL": "warning"}
    cli = [sys.executable, "-m", "commands.cli"]
    zmq_ep, worker_ep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        procs["router"] = subprocess.Popen(
            [*cli, "router", "--model", model, "--zmq", zmq_ep, "--worker-endpoint", worker_ep], env=env
        )
        for i in range(args.workers):
            procs[f"worker{i}"] = subprocess.Popen(
                [*me, "worker", "--endpoint", worker_ep, "--id", f"w{i}", "--slots", str(args.slots), "--model", model],
                env=env,
            )

        def joined() -> bool:
            from kvroute.client import Client

            with Client(zmq_ep, timeout_s=2.0) as c:
                return len(c.status().workers) == args.workers

        wait_for(joined, "the scripted workers to join the router")
        target = zmq_ep
        if path.startswith("http"):
            port = free_port()
            gateway = [*cli, "http", "--router", zmq_ep, "--http", f"127.0.0.1:{port}", "--processes", str(gateways)]
            gateway += ["--reply-endpoint", "off" if path.endswith("-router") else "auto"]
            procs["gateway"] = subprocess.Popen(gateway, env=env)
            target = f"http://127.0.0.1:{port}"
            import httpx

            wait_for(lambda: httpx.get(f"{target}/v1/models", timeout=2.0).status_code == 200, "the gateway")
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            out = f.name
        total_s = args.warmup_s + args.seconds + 1.0
        procs["clients"] = subprocess.Popen(
            [*me, "clients", "--path", path, "--target", target, "--clients", str(args.clients), "--tokens",
             str(args.tokens), "--seconds", str(total_s), "--out", out],
            env=env,
        )  # fmt: skip
        time.sleep(args.warmup_s)
        t0, cpu0 = time.time(), {name: cpu_s(p.pid) for name, p in procs.items()}
        time.sleep(args.seconds)
        t1, cpu1 = time.time(), {name: cpu_s(p.pid) for name, p in procs.items()}
        if procs["clients"].wait(timeout=120) != 0:
            raise SystemExit("the client process failed")
        samples = json.loads(Path(out).read_text())
        os.unlink(out)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
        for p in procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
    tokens = tokens_at(samples, t1) - tokens_at(samples, t0)
    if tokens <= 0:
        raise SystemExit(f"{path}: no tokens delivered in the measured window")
    used = {name: cpu1[name] - cpu0[name] for name in cpu1}
    per = lambda names: sum(used[n] for n in names) / tokens * 1e6  # noqa: E731
    workers = [n for n in used if n.startswith("worker")]
    return {
        "tokens_per_s": tokens / (t1 - t0),
        "router_us": per(["router"]),
        "gateway_us": per(["gateway"]) if "gateway" in used else float("nan"),
        "workers_us": per(workers),
        "clients_us": per(["clients"]),
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("worker", "clients"):
        role = argparse.ArgumentParser()
        if sys.argv[1] == "worker":
            for flag in ("--endpoint", "--id", "--model"):
                role.add_argument(flag, required=True)
            role.add_argument("--slots", type=int, required=True)
            a = role.parse_args(sys.argv[2:])
            worker(a.endpoint, a.id, a.slots, a.model)
        else:
            for flag in ("--path", "--target", "--out"):
                role.add_argument(flag, required=True)
            for flag in ("--clients", "--tokens"):
                role.add_argument(flag, type=int, required=True)
            role.add_argument("--seconds", type=float, required=True)
            a = role.parse_args(sys.argv[2:])
            clients(a.path, a.target, a.clients, a.tokens, a.seconds, a.out)
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--paths",
        default="zmq,zmq-router,http,http-router",
        help="comma-separated: zmq (ZMQ clients; output straight from the workers), http (the same through the gateway);"
        " with -router: every token through the router (--reply-endpoint off)",
    )
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=200, help="max_tokens of every request")
    ap.add_argument("--seconds", type=float, default=20.0, help="the measured window")
    ap.add_argument("--warmup-s", type=float, default=3.0)
    ap.add_argument("--gateway-processes", default="1", help="comma-separated: the http path once per `kvroute http --processes`")
    ap.add_argument("--model", default=None, help="GGUF whose vocabulary the router loads (default: the default model)")
    args = ap.parse_args()
    from common.model import resolve_model
    from worker.config import WorkerConfig

    model = str(resolve_model(args.model or WorkerConfig().model))
    print(
        f"{args.workers} scripted workers x {args.slots} slots, {args.clients} clients, {args.tokens} tokens a request, "
        f"{args.seconds:g} s measured after {args.warmup_s:g} s; {os.cpu_count()} cores"
    )
    print("| path | delivered tokens/s | router CPU µs/token | gateway CPU µs/token | workers | clients |")
    print("| --- | --- | --- | --- | --- | --- |")
    runs = [
        (p, n)
        for p in args.paths.split(",")
        for n in ([int(g) for g in args.gateway_processes.split(",")] if p.startswith("http") else [0])
    ]
    for path, gateways in runs:
        r = run_path(path, args, model, gateways)
        gateway = "—" if r["gateway_us"] != r["gateway_us"] else f"{r['gateway_us']:.0f}"
        name = f"{path}, {gateways} gateway process{'es' if gateways > 1 else ''}" if path.startswith("http") else path
        print(
            f"| {name} | {r['tokens_per_s']:,.0f} | {r['router_us']:.0f} | {gateway} | {r['workers_us']:.0f} | "
            f"{r['clients_us']:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
