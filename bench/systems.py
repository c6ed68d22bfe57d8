"""The systems compared: each one a server started as a subprocess on a free loopback port, then stopped.

Every system gets the same model, the same thread count and the same context per conversation:
- `kvroute`: `kvroute serve --policy prefix` (the default policy);
- `kvroute-cold`: the same with `--no-prefix-cache` (every request computed from scratch);
- `kvroute-rr`: `--policy round-robin`, only meaningful with more than one worker: a load balancer in front of
  independent servers (each request goes to the next worker as it arrives and waits there, first come first
  served; the worker reuses, copies and restores what it holds itself);
- `kvroute-ll`: `--policy least-loaded` (a freed slot takes the oldest waiting request; among workers with an
  idle slot, the one with the fewest busy slots and queued prefill; prefixes ignored), likewise;
- `kvroute-nospec`: `--spec none` (no speculative decoding, which is on by default);
- `kvroute-noretain`: `--tool-wait-s 0` (no slot kept for a conversation waiting on its tool calls: issue 65);
- `kvroute-nopreempt`: `--no-preempt` (a request of a higher priority that finds every slot taken waits for one);
- `llama-server`: llama.cpp's own server, built from the llama.cpp vendored in the pinned llama-cpp-python sdist
  (bench/llama_server.py), the server kvroute competes with, at its best settings here: one slot per kvroute
  slot (`--parallel`, `--ctx-size` = slots x ctx per slot; its log says `kv_unified = 'false'`: one KV stream per
  slot, as kvroute's), `--swa-full` (Gemma 3's
  sliding-window layers kept whole, so any cached prefix can be reused), `--cache-ram` what kvroute's
  `--host-cache-mb` default gives each of its workers here (evicted prompts kept in host RAM: a quarter of RAM shared
  by the workers, at most llama-server's own default of 8 GiB), flash attention `auto`, and the same chat template
  (`--no-jinja --chat-template gemma`: with Jinja on, as it is by default, llama-server takes the name "gemma" for
  a template's source and renders every conversation as the five characters "gemma"; the start-up check below
  makes sure a conversation is rendered);
- `smg-cache-aware`, `smg-round-robin`: SGLang's model gateway (`smg`, bench/smg.py) with `--policy cache_aware` or
  `round_robin` in front of one llama-server per kvroute worker (each as above, with that worker's slots and
  threads): the multi-server deployment kvroute's router competes with;
- `llama-cpp-python`: `python -m llama_cpp.server`, the OpenAI server a Python user would pick instead. It is
  run with `--interrupt_requests False` (its default cuts off a running stream whenever another request
  arrives, which would leave nothing to measure under concurrency) and `--logits_all False` (its default
  computes logits for every prompt token, ~10x slower prefill): the fairest setup it offers. It keeps one
  sequence and reuses the longest common prefix with the previous prompt; it has no batching.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

SYSTEMS = (
    "kvroute",
    "kvroute-cold",
    "kvroute-rr",
    "kvroute-ll",
    "kvroute-nospec",
    "kvroute-noretain",
    "kvroute-nopreempt",
    "llama-server",
    "smg-cache-aware",
    "smg-round-robin",
    "llama-cpp-python",
)
SMG_POLICIES = {"smg-cache-aware": "cache_aware", "smg-round-robin": "round_robin"}
ROUTING = ("kvroute-rr", "kvroute-ll")  # policies that only differ from kvroute's with more than one worker
DESCRIPTIONS = {
    "kvroute": "kvroute serve --policy prefix",
    "kvroute-cold": "kvroute serve --no-prefix-cache",
    "kvroute-rr": "kvroute serve --policy round-robin",
    "kvroute-ll": "kvroute serve --policy least-loaded",
    "kvroute-nospec": "kvroute serve --spec none",
    "kvroute-noretain": "kvroute serve --tool-wait-s 0",
    "kvroute-nopreempt": "kvroute serve --no-preempt",
    "llama-server": "llama-server --parallel SLOTS --swa-full --cache-ram (kvroute's host tier) -fa auto --no-jinja "
    "--chat-template gemma "
    "(llama.cpp of the pinned sdist)",
    "smg-cache-aware": "smg launch --policy cache_aware over one llama-server (as above) per worker",
    "smg-round-robin": "smg launch --policy round_robin over one llama-server (as above) per worker",
    "llama-cpp-python": "python -m llama_cpp.server (interrupt_requests off, logits_all off)",
}


class SystemError_(Exception):
    """A system that would not start or answer; the message says which and shows the end of its log."""


@dataclass(frozen=True)
class Setup:
    """What every system shares in one run."""

    model: str
    threads: int
    workers: int
    slots: int
    ctx_per_slot: int
    kvroute_flags: tuple[str, ...] = ()  # more `kvroute serve` flags, for every kvroute system
    llama_server_flags: tuple[str, ...] = ()  # more llama-server flags (e.g. --spec-type)
    gpu: int | None = None  # every layer on this GPU (kvroute: `workers` workers on it; llama-server: -ngl all)
    turn_marker: str = "<start_of_turn>user"  # what a user turn starts with in the template the flags give


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A loopback port free now and not handed out before in this process (the benches' and the tests' one helper).
    A port is only taken once its server binds it, so two picks before that (a serve's HTTP and ZMQ ports, or two
    serves started side by side) could get the same one: seen, a serve's HTTP API on its own ZMQ port."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def commands(name: str, setup: Setup, port: int) -> list[list[str]]:
    """The processes (argv each) that make system `name`, serving HTTP on 127.0.0.1:`port`.

    kvroute's ZMQ endpoints get free ports too, so that nothing else on the machine (a test run, a user's
    server) is reached by mistake."""
    if name.startswith("kvroute"):
        place = ["--workers", str(setup.workers)] if setup.gpu is None else ["--gpus", ",".join([str(setup.gpu)] * setup.workers)]
        serve = [
            sys.executable, "-m", "commands.cli", "serve",
            "--model", setup.model,
            *place,
            "--slots", str(setup.slots),
            "--ctx-per-slot", str(setup.ctx_per_slot),
            # the same cores in all: with more workers each gets its share (oversubscribed llama.cpp threads crawl)
            "--threads", str(max(1, setup.threads // setup.workers)),
            "--zmq", f"tcp://127.0.0.1:{free_port()}",
            "--worker-endpoint", f"tcp://127.0.0.1:{free_port()}",
        ]  # fmt: skip
        if name == "kvroute":
            serve += ["--policy", "prefix"]
        elif name == "kvroute-cold":
            serve += ["--policy", "prefix", "--no-prefix-cache"]
        elif name == "kvroute-rr":
            serve += ["--policy", "round-robin"]
        elif name == "kvroute-ll":
            serve += ["--policy", "least-loaded"]
        elif name == "kvroute-nospec":
            serve += ["--policy", "prefix", "--spec", "none"]
        elif name == "kvroute-noretain":
            serve += ["--policy", "prefix", "--tool-wait-s", "0"]
        elif name == "kvroute-nopreempt":
            serve += ["--policy", "prefix", "--no-preempt"]
        else:
            raise ValueError(f"unknown system {name!r} (known: {', '.join(SYSTEMS)})")
        return [[*serve, *setup.kvroute_flags, "--http", f"127.0.0.1:{port}"]]
    if name == "llama-server":
        return [_llama_server(setup, port, setup.workers * setup.slots, setup.threads, servers=1)]
    if name in SMG_POLICIES:
        from bench.smg import binary as smg

        ports = [free_port() for _ in range(setup.workers)]
        threads = max(1, setup.threads // setup.workers)
        servers = [_llama_server(setup, p, setup.slots, threads, servers=len(ports)) for p in ports]
        gateway = [
            str(smg()), "launch",
            "--host", "127.0.0.1",
            "--port", str(port),
            "--policy", SMG_POLICIES[name],
            "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(free_port()),  # (29000 by default: two gateways, or anything else there, collide)
            "--worker-urls", *(f"http://127.0.0.1:{p}" for p in ports),
        ]  # fmt: skip
        return [*servers, gateway]
    if name == "llama-cpp-python":
        argv = [
            sys.executable, "-m", "llama_cpp.server",
            "--model", setup.model,
            "--n_threads", str(setup.threads),
            "--n_threads_batch", str(setup.threads),
            "--n_ctx", str(setup.ctx_per_slot),
            "--host", "127.0.0.1",
            "--port", str(port),
            "--interrupt_requests", "False",
            "--logits_all", "False",
            "--verbose", "False",
        ]  # fmt: skip
        return [argv]
    raise ValueError(f"unknown system {name!r} (known: {', '.join(SYSTEMS)})")


def _llama_server(setup: Setup, port: int, slots: int, threads: int, servers: int) -> list[str]:
    """One llama-server of `slots` slots and `threads` threads at its best settings here (the module docstring), one of
    `servers` sharing the host RAM kvroute's workers would (`--cache-ram`)."""
    from bench.llama_server import binary
    from worker.context_size import host_tier_mb

    return [
        str(binary()),
        "--model", setup.model,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--parallel", str(slots),
        "--ctx-size", str(setup.ctx_per_slot * slots),
        "--threads", str(threads),
        "--threads-batch", str(threads),
        "--swa-full",
        "--cache-ram", str(host_tier_mb(servers)),
        "--flash-attn", "auto",
        "--no-jinja",
        "--chat-template", "gemma",
        "--no-webui",
        *(() if setup.gpu is None else ("--n-gpu-layers", "all", "--split-mode", "none", "--main-gpu", str(setup.gpu))),
        *setup.llama_server_flags,
    ]  # fmt: skip


class Server:
    """A running system. Use as a context manager: starts its processes, waits until it answers (every
    kvroute worker ready), and stops them: each process group, so kvroute's workers go too."""

    def __init__(self, name: str, setup: Setup, log_path: Path, *, ready_timeout_s: float = 300.0) -> None:
        self.name, self.setup = name, setup
        self.workers = setup.workers if name.startswith("kvroute") or name in SMG_POLICIES else 1
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argvs = commands(name, setup, self.port)
        self.log_path = log_path  # every process of the system writes here
        self.ready_timeout_s = ready_timeout_s
        self._procs: list[subprocess.Popen[bytes]] = []
        self.startup_s = 0.0

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def command_line(self) -> str:
        return " & ".join(" ".join(argv) for argv in self.argvs)

    def _log_tail(self, n: int = 20) -> str:
        with contextlib.suppress(OSError):
            lines = self.log_path.read_text(errors="replace").splitlines()
            return "\n".join(lines[-n:])
        return ""

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        t0 = time.perf_counter()
        try:
            with self.log_path.open("ab") as log:
                for i, argv in enumerate(self.argvs):
                    if self.name in SMG_POLICIES and i == len(self.argvs) - 1:
                        self._wait_backends()  # (the gateway takes the workers that answer when it starts)
                    # Its own session, so that stop() ends this process and every child it spawned, and nothing else.
                    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
                    self._procs.append(proc)
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - t0

    def _wait_backends(self) -> None:
        """Every llama-server behind the gateway answers /health."""
        urls = [f"http://127.0.0.1:{argv[argv.index('--port') + 1]}/health" for argv in self.argvs[:-1]]
        deadline = time.monotonic() + self.ready_timeout_s
        with httpx.Client(timeout=5.0) as http:
            while urls and time.monotonic() < deadline:
                for proc in self._procs:
                    if proc.poll() is not None:
                        tail = self._log_tail()
                        raise SystemError_(f"{self.name}: a llama-server exited with status {proc.returncode}\n{tail}")
                with contextlib.suppress(httpx.HTTPError):
                    urls = [u for u in urls if http.get(u).status_code != 200]
                time.sleep(0.5)
        if urls:
            raise SystemError_(f"{self.name}: {urls} not ready after {self.ready_timeout_s:.0f} s\n{self._log_tail()}")

    def _ready(self, http: httpx.Client) -> bool:
        if self.name in SMG_POLICIES:  # (its /health says OK with no worker registered yet)
            return len(http.get(f"{self.url}/workers").json().get("workers", [])) >= self.workers
        # kvroute answers /health 503 until a worker is ready, then {"workers": n}; llama-cpp-python has no /health.
        health = http.get(f"{self.url}/health")
        with contextlib.suppress(ValueError):
            body = health.json()
            if isinstance(body, dict) and body.get("failed"):  # a worker given up at start: waiting would not help
                raise SystemError_(f"{self.name}: workers failed at start: {body['failed']}\n{self._log_tail()}")
        if health.status_code == 200:
            with contextlib.suppress(ValueError, AttributeError):
                return int(health.json().get("workers", self.workers)) >= self.workers
            return True
        return health.status_code == 404 and http.get(f"{self.url}/v1/models").status_code == 200

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        with httpx.Client(timeout=5.0) as http:
            while time.monotonic() < deadline:
                for proc in self._procs:
                    if proc.poll() is not None:
                        raise SystemError_(
                            f"{self.name} exited with status {proc.returncode} before it was ready; "
                            f"command: {' '.join(str(a) for a in proc.args)}\n{self._log_tail()}"  # type: ignore[union-attr]
                        )
                with contextlib.suppress(httpx.HTTPError):
                    if self._ready(http):
                        self._check_template(http)
                        return
                time.sleep(0.5)
        raise SystemError_(f"{self.name} was not ready after {self.ready_timeout_s:.0f} s\n{self._log_tail()}")

    def _check_template(self, http: httpx.Client) -> None:
        """llama-server must render a conversation with the model's turns: a wrong template flag is not an error
        there, it silently sends the model something else (see `--no-jinja` above)."""
        if self.name != "llama-server":
            return
        probe = "template probe: say yes"
        body = {"messages": [{"role": "user", "content": probe}]}
        prompt = http.post(f"{self.url}/apply-template", json=body).json().get("prompt", "")
        if probe not in prompt or self.setup.turn_marker not in prompt:
            raise SystemError_(f"{self.name} renders a conversation as {prompt!r}: its chat template flags are wrong")

    def stop(self) -> None:
        procs, self._procs = self._procs, []
        for proc in reversed(procs):  # the HTTP front first, then the server behind it
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=20)
            # Whatever is left of the group (workers of a server that died or hung) goes too.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)


def interleaved(
    names: Sequence[str],
    setup: Setup,
    repeats: int,
    measure: Callable[[str], dict[str, Any]],
    show: Callable[[str, dict[str, Any]], str],
    prefix: str = "kvroute-bench-",
) -> list[dict[str, Any]]:
    """Each system started in turn, `repeats` times with the systems interleaved (machines drift): `measure(url)` its
    figures, each printed as `show(name, figures)` as it comes; every server's log in a new folder (printed)."""
    logs = Path(tempfile.mkdtemp(prefix=prefix))
    results: list[dict[str, Any]] = []
    for rep in range(repeats):
        for name in names:
            with Server(name, setup, logs / f"{name}-{rep}.log") as server:
                results.append({"system": name, "repeat": rep, "command": server.command_line, **measure(server.url)})
            print(show(name, results[-1]), flush=True)
    print(f"(logs in {logs})")
    return results
