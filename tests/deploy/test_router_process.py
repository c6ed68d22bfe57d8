"""`kvroute router` as systemd runs it (no model weights): READY=1 and STATUS= on NOTIFY_SOCKET, SIGHUP
changes nothing, SIGTERM stops it with STOPPING=1 and status 0; the loopback rule for binds without CURVE."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from bench.systems import free_port
from common.keys import generate

KVROUTE = str(Path(sys.executable).parent / "kvroute")


def recv_until(sock: socket.socket, prefix: str, timeout_s: float = 30) -> list[str]:
    """Every notify line up to and including the first starting with `prefix`."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        lines += sock.recv(65536).decode().splitlines()
        if any(line.startswith(prefix) for line in lines):
            return lines
    raise AssertionError(f"no {prefix} in {timeout_s} s: {lines}")


def test_router_notifies_ready_and_status_survives_sighup_and_stops_on_sigterm(tmp_path: Path) -> None:
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        env = dict(os.environ, NOTIFY_SOCKET=path, KVROUTE_LOG_FORMAT="json")
        cmd = [KVROUTE, "router", "--zmq", f"tcp://127.0.0.1:{free_port()}", "--worker-endpoint", f"tcp://0.0.0.0:{free_port()}"]
        proc = subprocess.Popen([*cmd, "--insecure-bind"], env=env, stderr=subprocess.PIPE, text=True)
        try:
            first = recv_until(sock, "READY=1")
            assert any(line.startswith("STATUS=workers 0 ready/0") for line in first)
            recv_until(sock, "STATUS=")  # and again, every second
            proc.send_signal(signal.SIGHUP)
            recv_until(sock, "STATUS=")
            assert proc.poll() is None  # SIGHUP does not stop it
            proc.send_signal(signal.SIGTERM)
            recv_until(sock, "STOPPING=1")
            assert proc.wait(10) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
        log = proc.stderr.read() if proc.stderr else ""
    assert '"insecure_bind"' in log and "0.0.0.0" in log
    assert '"sighup"' in log and '"router_drained"' in log


def test_non_loopback_bind_without_keys_stops_with_one_line(tmp_path: Path) -> None:
    wep = f"tcp://0.0.0.0:{free_port()}"
    out = subprocess.run([KVROUTE, "router", "--worker-endpoint", wep], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("kvroute router: error: --worker-endpoint tcp://0.0.0.0:") and "--insecure-bind" in last
    assert "Traceback" not in out.stderr
    # keys without an allow-list, or an allow-list without keys, are named too
    key, _ = generate(tmp_path, "router")
    for flags, message in (
        (["--curve-key", str(key)], "--curve-key needs --worker-keys"),
        (["--worker-keys", str(tmp_path)], "need --curve-key"),
        (["--curve-key", str(tmp_path / "none.key"), "--worker-keys", str(tmp_path)], "cannot read key file"),
    ):
        out = subprocess.run([KVROUTE, "router", *flags], capture_output=True, text=True, timeout=60)
        assert out.returncode == 1 and message in out.stderr and "Traceback" not in out.stderr, out.stderr
    # serve says so before it starts a worker (or loads a vocabulary)
    out = subprocess.run([KVROUTE, "serve", "--curve-key", str(tmp_path / "none.key"), "--worker-keys", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 1 and "cannot read key file" in out.stderr and "worker_spawned" not in out.stderr, out.stderr


def test_serve_whose_http_port_is_taken_says_so_and_exits() -> None:
    """The HTTP API runs beside the router in serve: when it cannot listen, serve stops and says why (it once went
    on serving ZMQ clients with no HTTP API and no word of it)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        zmq_port, worker_port = free_port(), free_port()
        flags = ["--workers", "0", "--http", f"127.0.0.1:{port}", "--zmq", f"tcp://127.0.0.1:{zmq_port}"]
        flags += ["--worker-endpoint", f"tcp://127.0.0.1:{worker_port}"]
        out = subprocess.run([KVROUTE, "serve", *flags], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, out.stderr
    assert f"kvroute serve: error: cannot serve HTTP on 127.0.0.1:{port}: Address already in use" in out.stderr
    assert '"router_stopped"' in out.stderr and "Traceback" not in out.stderr
