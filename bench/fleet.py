"""Two `kvroute router` side by side, real workers that report to both (`--connect A,B`) and, when asked, a
`kvroute http --router A,B` in front: the fleet of bench.side_by_side and bench.soak. Logs go to `logs/NAME.log`."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.systems import free_port
from kvroute.client import Client


class TwoRouters:
    def __init__(self, logs: Path, *, workers: int, slots: int, ctx: int, threads: int, http: bool = False) -> None:
        self.logs = logs
        self.zmq = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
        self.worker_eps = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
        self.http_port = free_port()
        self.n_workers = workers
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        for i in range(2):
            self.start_router(i)
        for w in range(workers):
            self.spawn(
                f"w{w}", "worker", "--connect", ",".join(self.worker_eps), "--worker-id", f"w{w}", "--slots", str(slots),
                "--ctx-per-slot", str(ctx), "--threads", str(threads),
            )  # fmt: skip
        if http:
            self.spawn("http", "http", "--router", ",".join(self.zmq), "--http", f"127.0.0.1:{self.http_port}")

    def spawn(self, name: str, *argv: str) -> None:
        with open(self.logs / f"{name}.log", "ab") as out:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "commands.cli", *argv], stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def start_router(self, i: int) -> None:
        self.spawn(f"router{i}", "router", "--zmq", self.zmq[i], "--worker-endpoint", self.worker_eps[i])

    def wait_ready(self, timeout_s: float = 300) -> None:
        """Until both routers see every worker ready."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ready = 0
            for ep in self.zmq:
                try:
                    with Client(ep, timeout_s=5) as c:
                        ready += sum(w.state == "ready" for w in c.status().workers) == self.n_workers
                except Exception:
                    pass
            if ready == 2:
                return
            time.sleep(1)
        raise TimeoutError(f"the fleet did not come up in {timeout_s:g} s (logs in {self.logs})")

    def restart_router(self, i: int, sig: signal.Signals) -> float:
        """Stop router i with `sig` and start it again; the seconds it took to stop."""
        p = self.procs[f"router{i}"]
        t0 = time.monotonic()
        p.send_signal(sig)
        p.wait(120)
        stopped = time.monotonic() - t0
        self.start_router(i)
        return stopped

    def rss_mb(self) -> dict[str, float]:
        """Every process's resident memory."""
        out = {}
        for name, p in self.procs.items():
            try:
                for line in Path(f"/proc/{p.pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        out[name] = int(line.split()[1]) / 1024
            except OSError:
                pass
        return out

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
