"""`kvroute http --processes N`: N processes on one port (SO_REUSEPORT), a dead one started again, all ending with
the parent. Real processes and sockets; no router or model is needed for /openapi.json."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from bench.systems import free_port


def listeners(port: int) -> set[int]:
    """The pids holding a listening TCP socket on `port` (from /proc)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # 0A: LISTEN
                    inodes.add(fields[9])
    pids = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        if any(link.startswith("socket:[") and link[8:-1] in inodes for link in links):
            pids.add(int(pid))
    return pids


def until(check: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.fixture
def http_processes() -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    port = free_port()
    cmd = [sys.executable, "-m", "commands.cli", "http", "--router", f"tcp://127.0.0.1:{free_port()}"]
    env = {**os.environ, "KVROUTE_LOG_LEVEL": "warning"}
    proc = subprocess.Popen([*cmd, "--http", f"127.0.0.1:{port}", "--processes", "2"], env=env)
    try:
        until(lambda: len(listeners(port)) == 2, "two processes listening")
        yield proc, port
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def served(port: int, n: int = 20) -> bool:
    """`n` requests, each on a new connection (the kernel spreads connections, not requests), for a route that
    asks the router nothing (/v1/models waits up to 2 s for a router's answer, and here there is no router)."""
    return all(httpx.get(f"http://127.0.0.1:{port}/openapi.json", timeout=10).status_code == 200 for _ in range(n))


def test_processes_share_the_port_and_a_dead_one_is_started_again(http_processes) -> None:
    proc, port = http_processes
    pids = listeners(port)
    assert proc.pid in pids and served(port)
    (child,) = pids - {proc.pid}
    os.kill(child, signal.SIGKILL)
    assert served(port)  # the parent serves meanwhile
    until(lambda: len(listeners(port)) == 2 and child not in listeners(port), "the child started again")
    assert served(port)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) in (0, -signal.SIGTERM)  # (uvicorn raises the signal again once it has shut down)
    until(lambda: not listeners(port), "every process gone after SIGTERM", 10)


def test_children_end_with_a_killed_parent(http_processes) -> None:
    proc, port = http_processes
    proc.kill()
    proc.wait(10)
    until(lambda: not listeners(port), "the child gone with its parent", 10)


def test_processes_out_of_range_is_refused_naming_the_flag() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "commands.cli", "http", "--processes", "0"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode != 0 and "--processes must be between 1 and" in out.stderr


@pytest.mark.model  # (the router loads the default model's vocabulary)
def test_serve_runs_its_http_api_in_as_many_processes_and_stops_them_on_sigterm() -> None:
    port = free_port()
    flags = ["--workers", "0", "--no-workers-grace-s", "0", "--processes", "2", "--http", f"127.0.0.1:{port}"]
    flags += ["--zmq", f"tcp://127.0.0.1:{free_port()}", "--worker-endpoint", f"tcp://127.0.0.1:{free_port()}"]
    proc = subprocess.Popen([sys.executable, "-m", "commands.cli", "serve", *flags], env=os.environ)
    try:
        until(lambda: len(listeners(port)) == 2, "serve's two HTTP processes listening", 120)
        assert proc.pid in listeners(port)
        codes = {httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code for _ in range(20)}
        assert codes == {503}  # both answer for the router: no workers
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        until(lambda: not listeners(port), "serve's HTTP processes gone", 10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.parametrize(
    ("cores", "gpus", "processes"),
    [(2, 0, 1), (64, 0, 1), (16, 1, 3), (16, 4, 1), (64, 8, 8), (128, 8, 8), (8, 1, 1)],
)
def test_serve_takes_http_processes_as_the_machine_allows(cores: int, gpus: int, processes: int) -> None:
    """CPU workers take every core (one HTTP process); GPU workers leave cores: one process per 4 of them, at most 8."""
    from commands.serve import auto_http_processes

    assert auto_http_processes(cores, gpus) == processes


def test_serve_processes_0_is_the_machines_rule_and_a_number_is_kept() -> None:
    import argparse

    from commands.serve import add_arguments, http_config
    from router.config import RouterConfig

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    auto = http_config(parser.parse_args([]), RouterConfig())
    assert auto is not None and auto.processes == 1  # this machine's CPU workers
    assert http_config(parser.parse_args(["--processes", "3"]), RouterConfig()).processes == 3  # type: ignore[union-attr]


def test_serve_passes_its_http_flags_to_the_http_api(monkeypatch: pytest.MonkeyPatch) -> None:
    """`serve --strict-api` (and --alias, --strict-model-name, --tenant-per-key) never reached the HTTP API."""
    import argparse

    from commands.serve import add_arguments, http_config
    from router.config import RouterConfig

    monkeypatch.delenv("KVROUTE_API_KEY", raising=False)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = ["--api-key", "k", "--shared-cache", "--allowed-hosts", "box.lan", "--cors-origins", "http://localhost:3000",
             "--strict-api", "--strict-model-name", "--alias", "small",
             "--image-fetch", "--image-fetch-timeout-s", "3"]  # fmt: skip
    cfg = http_config(parser.parse_args(flags), RouterConfig())
    assert cfg is not None
    assert (cfg.image_fetch, cfg.image_fetch_timeout_s) == (True, 3.0)
    assert (cfg.shared_cache, cfg.allowed_hosts, cfg.cors_origins) == (True, "box.lan", "http://localhost:3000")
    assert (cfg.strict_api, cfg.strict_model_name, cfg.alias) == (True, True, "small")
    with pytest.raises(ValueError, match="--shared-cache"):
        http_config(parser.parse_args([*flags, "--tenant-per-key"]), RouterConfig())
