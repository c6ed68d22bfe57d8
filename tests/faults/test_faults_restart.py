"""A router and its workers as separate processes (as systemd runs them), with the real model: a router
restarted while its workers stay up keeps their caches; workers with different slot sizes only get what their
slots hold; a worker whose weights differ from the router's model is refused at hello; a worker's systemd
watchdog pings stop when its compute thread hangs."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from fault_helpers import BOUND_S, all_ready, free_port, wait_for

from common.model import resolve_model
from common.weights import tensor_data_starts
from kvroute.client import Client, ContextOverflow
from protocol import Cancel, ChatMessage, Submit, encode

pytestmark = pytest.mark.model

SMALL_CTX, BIG_CTX = 512, 2048


class Cluster:
    """`kvroute router` and two `kvroute worker` processes: `small` (--ctx-per-slot 512) and `big` (2048)."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.zmq = f"tcp://127.0.0.1:{free_port()}"
        self.worker_ep = f"tcp://127.0.0.1:{free_port()}"
        self.router = self.start_router()
        self.workers = [self.start_worker("small", SMALL_CTX), self.start_worker("big", BIG_CTX)]

    def _spawn(self, name: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        with open(self.logs / f"{name}.log", "ab") as out:
            return subprocess.Popen(
                [sys.executable, "-m", "commands.cli", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "KVROUTE_LOG_FORMAT": "json", **(env or {})},
                start_new_session=True,
            )

    def start_router(self) -> subprocess.Popen[bytes]:
        return self._spawn("router", "router", "--zmq", self.zmq, "--worker-endpoint", self.worker_ep, "--busy-wait-ms", "0")

    def start_worker(self, worker_id: str, ctx: int, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        return self._spawn(
            worker_id, "worker", "--connect", self.worker_ep, "--worker-id", worker_id,
            "--slots", "2", "--ctx-per-slot", str(ctx), "--threads", "1", *extra, env=env,
        )  # fmt: skip

    def stop(self) -> None:
        for p in [self.router, *self.workers]:
            if p.poll() is None:
                p.terminate()
        for p in [self.router, *self.workers]:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(Path(tmp_path_factory.mktemp("cluster")))
    try:
        wait_for(lambda: _ready(c), 180, "router and both workers up")
        yield c
    finally:
        c.stop()


def _ready(c: Cluster) -> bool:
    if c.router.poll() is not None:
        raise AssertionError(f"the router exited with {c.router.returncode}; logs in {c.logs}")
    try:
        return all_ready(c.zmq) is not None
    except TimeoutError:
        return False


def chat(endpoint: str, messages: list[dict[str, str]], max_tokens: int = 8):
    with Client(endpoint, timeout_s=BOUND_S) as client:
        return client.submit(messages=messages, max_tokens=max_tokens, temperature=0.0)


def test_a_restarted_router_rebuilds_its_mirror_from_the_workers_and_the_next_turn_is_cached(cluster):
    system = {"role": "system", "content": "You are a terse assistant for a team of sailors. " * 8}
    history = [system, {"role": "user", "content": "Name a knot."}]
    first = chat(cluster.zmq, history)
    history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And another?"}]

    cluster.router.send_signal(signal.SIGTERM)  # systemctl restart kvroute-router: the workers stay up
    assert cluster.router.wait(30) == 0
    cluster.router = cluster.start_router()
    wait_for(lambda: _ready(cluster), BOUND_S, "both workers registered with the new router")
    assert all(w.poll() is None for w in cluster.workers)

    second = chat(cluster.zmq, history)
    assert second.worker == first.worker
    assert second.usage.cached_tokens >= first.usage.prompt_tokens, (first.usage, second.usage)


def test_requests_go_only_to_workers_whose_slots_hold_them(cluster):
    long_text = "The harbour wall is old and grey. " * 70  # about 600 tokens: over the small worker's 512
    for i in range(3):
        r = chat(cluster.zmq, [{"role": "user", "content": f"{i}: {long_text}"}], max_tokens=4)
        assert r.worker == "big" and r.usage.prompt_tokens > SMALL_CTX, (r.worker, r.usage)
    with pytest.raises(ContextOverflow, match=f"does not fit a slot of {BIG_CTX} tokens"):
        chat(cluster.zmq, [{"role": "user", "content": long_text * 4}], max_tokens=4)


def test_a_worker_with_the_same_vocabulary_but_other_weights_is_refused(cluster, tmp_path):
    model = Path(resolve_model(None))
    other = tmp_path / "other-weights.gguf"
    shutil.copyfile(model, other)
    with open(other, "r+b") as f:  # another fine-tune, in effect: the last tensor's first bytes differ
        start = tensor_data_starts(other)[-1]
        f.seek(start)
        data = f.read(64)
        f.seek(start)
        f.write(bytes(b ^ 0x01 for b in data))
    worker = cluster.start_worker("other", SMALL_CTX, "--model", str(other))
    try:
        assert worker.wait(BOUND_S) == 3  # refused: not restarted by a supervisor either
    finally:
        if worker.poll() is None:
            worker.kill()
    assert "differ from the router's" in (cluster.logs / "other.log").read_text()
    assert {w.worker for w in _status_workers(cluster.zmq)} == {"small", "big"}


def _status_workers(endpoint: str):
    with Client(endpoint, timeout_s=10) as client:
        return client.status().workers


def test_a_workers_watchdog_pings_stop_when_its_compute_thread_hangs(cluster, tmp_path):
    """Under systemd (NOTIFY_SOCKET, WATCHDOG_USEC) a worker pings while idle or stepping; a `stuck-` job blocks
    its compute thread (worker/faults.py) while its I/O thread goes on, and the pings stop: systemd would kill it."""
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        notify.bind(path)
        env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "400000", "KVROUTE_FAULTS": "hang:stuck-"}
        worker = cluster.start_worker("watched", 4 * BIG_CTX, env=env)  # the only one a long prompt fits
        client = None
        try:
            notify.settimeout(BOUND_S)
            while b"READY=1" not in notify.recv(4096):  # (a timeout raises: never ready)
                pass
            assert _pings(notify, 1.0) >= 2  # idle: pinging (every 0.2 s: half the watchdog's 0.4 s)

            client = zmq.Context.instance().socket(zmq.DEALER)
            client.setsockopt(zmq.LINGER, 0)
            client.connect(cluster.zmq)
            long_text = "The harbour wall is old and grey. " * 300  # over 2048 tokens: only `watched` holds it
            client.send(encode(Submit(id="stuck-watch", messages=[ChatMessage(role="user", content=long_text)])))
            wait_for(lambda: "fault_injected" in (cluster.logs / "watched.log").read_text(), 30, "the compute thread hung")
            _pings(notify, 0.5)  # (one may have been on its way)
            assert _pings(notify, 1.0) == 0  # (systemd kills after 0.4 s without one)
            assert "watchdog_withheld" in (cluster.logs / "watched.log").read_text()
        finally:
            worker.kill()
            worker.wait()
            if client is not None:
                client.send(encode(Cancel(id="stuck-watch")))
                client.close()


def _pings(notify: socket.socket, seconds: float) -> int:
    """WATCHDOG=1 datagrams received within `seconds`."""
    n, deadline = 0, time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        notify.settimeout(left)
        try:
            n += b"WATCHDOG=1" in notify.recv(4096)
        except TimeoutError:
            break
    return n


def test_a_worker_restarted_with_a_disk_tier_restores_the_conversations_it_had(tmp_path):
    """systemctl restart of a worker with --cache-dir: on SIGTERM it writes what its slots and host RAM hold to disk,
    the new process reports it in its hello, and a conversation's next turn is restored, not recomputed: the same
    answer (deterministic mode) as before the restart."""
    logs = tmp_path / "logs"
    logs.mkdir()
    solo = Cluster.__new__(Cluster)  # a router and one worker of its own (the module's cluster has two without a disk)
    solo.logs, solo.zmq, solo.worker_ep = logs, f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    disk = ("--cache-dir", str(tmp_path / "cache"), "--deterministic")
    solo.router = solo.start_router()
    solo.workers = [solo.start_worker("disky", SMALL_CTX, *disk)]
    try:
        wait_for(lambda: _one_ready(solo), 120, "router and worker up")
        system = {"role": "system", "content": "You keep the lighthouse log; answer in five words. " * 6}
        history = [system, {"role": "user", "content": "What happened tonight?"}]
        first = chat(solo.zmq, history)
        history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And the boats?"}]
        before = chat(solo.zmq, history)
        assert before.usage.cached_tokens >= first.usage.prompt_tokens  # (the slot's own prefix, before the restart)

        solo.workers[0].send_signal(signal.SIGTERM)  # graceful stop: drains, writes the disk tier, exits 0
        assert solo.workers[0].wait(60) == 0
        assert "persisted" in (logs / "disky.log").read_text()
        solo.workers = [solo.start_worker("disky", SMALL_CTX, *disk)]
        wait_for(lambda: _one_ready(solo), 120, "the worker back")

        after = chat(solo.zmq, history)
        assert after.usage.cached_tokens >= before.usage.cached_tokens, (before.usage, after.usage)
        assert after.text == before.text
    finally:
        solo.stop()


def _one_ready(c: Cluster) -> bool:
    try:
        return all_ready(c.zmq, workers=1) is not None
    except TimeoutError:
        return False
