"""Worker faults on a real `kvroute serve` (2 CPU workers x 2 slots, the real model): a worker killed with
SIGKILL or stopped with SIGSTOP mid-stream, a compute thread that never returns from its step, a request that
crashes every worker it runs on, and a flood of ten times the queue. Each checks that nothing hangs past a bound,
that the requests the fault did not touch complete, and that the failed worker is replaced."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fault_helpers import BOUND_S, Served, ZmqStream, alive, all_ready, placement, restarts, rss_mb, wait_for, worker_pids

pytestmark = pytest.mark.model

HUNG_AFTER_S = 5.0
HEARTBEAT_TIMEOUT_S = 4.0
QUEUE = 4


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    log = Path(tmp_path_factory.mktemp("faults")) / "serve.log"
    s = Served(
        *("--workers", "2", "--slots", "2", "--ctx-per-slot", "1024", "--threads", "1"),
        *("--queue-size", str(QUEUE), "--hung-after-s", str(HUNG_AFTER_S), "--heartbeat-timeout-s", str(HEARTBEAT_TIMEOUT_S)),
        *("--restart-backoff-s", "0.2", "--restart-backoff-max-s", "1", "--max-restarts", "50"),
        log=log,
        env={"KVROUTE_FAULTS": "crash:poison-,hang:stuck-"},
    )
    yield s
    s.stop()


@pytest.fixture
def ready(served: Served) -> Served:
    """Every test starts with both workers up and idle (the one before may have killed one)."""
    wait_for(lambda: all_ready(served.zmq), BOUND_S, "both workers ready and idle")
    return served


def streaming(endpoint: str, prefix: str, n: int, max_tokens: int) -> list[ZmqStream]:
    """`n` streams, returned once each has produced output (so each is running on a worker)."""
    streams = [ZmqStream(endpoint, f"{prefix}{i}-", max_tokens=max_tokens) for i in range(n)]
    wait_for(lambda: all(s.deltas >= 2 or not s.is_alive() for s in streams), BOUND_S, "every stream producing")
    return streams


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["kill-9", "sigstop"])
def test_a_worker_killed_or_stopped_mid_stream_fails_only_its_own_requests_and_is_replaced(ready, sig):
    served = ready
    before = worker_pids(served.proc.pid)
    streams = streaming(served.zmq, f"{sig.name.lower()}-", 4, max_tokens=160)
    where = placement(served.zmq, [s.rid for s in streams])
    victim = next(iter(where.values()))
    pid = before[victim]
    os.kill(pid, sig)
    t0 = time.monotonic()
    try:
        for s in streams:
            s.ended()
        on_victim = [s for s in streams if where.get(s.rid) == victim]
        innocent = [s for s in streams if where.get(s.rid) not in (None, victim)]
        assert innocent, f"all streams ran on {victim}: {where}"
        for s in innocent:
            assert s.completed, (s.rid, s.result, s.error)
        for s in on_victim:
            assert s.code == "worker_lost" and victim in str(s.error), (s.rid, s.result, s.error)
            assert s.ended_at is not None and s.ended_at - t0 < HEARTBEAT_TIMEOUT_S + 3
        # the old process is gone (a stopped one is killed once silent past --hung-after-s) and a new one serves
        wait_for(lambda: not alive(pid), HEARTBEAT_TIMEOUT_S + HUNG_AFTER_S + 10, f"worker {victim} (pid {pid}) gone")
        wait_for(lambda: all_ready(served.zmq), BOUND_S, "the worker restarted")
        assert worker_pids(served.proc.pid)[victim] != pid
        assert ZmqStream(served.zmq, f"after-{sig.name.lower()}-", max_tokens=4).ended().completed
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_hung_compute_thread_is_found_by_its_progress_and_the_worker_replaced(ready):
    """`stuck-` blocks the compute thread of the worker that decodes it while its I/O thread keeps sending
    heartbeats. Its unstarted requests move; the stuck request, unstarted too, is tried on one more worker
    (alone there), then fails (--max-worker-deaths 2); each hung worker is killed and restarted."""
    served = ready
    pids = worker_pids(served.proc.pid)
    stuck = ZmqStream(served.zmq, "stuck-1-", max_tokens=8)
    first = wait_for(lambda: placement(served.zmq, [stuck.rid]).get(stuck.rid), 10, "stuck request dispatched")
    innocents = [ZmqStream(served.zmq, f"innocent-hung-{i}-", max_tokens=8) for i in range(3)]
    stuck.ended(2 * HUNG_AFTER_S + BOUND_S)
    for s in innocents:
        assert s.ended().completed, (s.rid, s.result, s.error)
    assert stuck.code == "worker_lost" and "--max-worker-deaths 2" in str(stuck.error), stuck.error
    assert "hung" in str(stuck.error)
    wait_for(lambda: not alive(pids[first]), 10, f"hung worker {first} killed")
    wait_for(lambda: all_ready(served.zmq), BOUND_S, "both workers back")


def test_a_poison_request_fails_after_max_worker_deaths_instead_of_taking_down_every_worker(ready):
    served = ready
    before = restarts(served.zmq)
    poison = ZmqStream(served.zmq, "poison-1-", max_tokens=8).ended()
    assert poison.code == "worker_lost", (poison.result, poison.error)
    assert "2 workers died while running this request" in str(poison.error)
    wait_for(lambda: all_ready(served.zmq), BOUND_S, "both workers back")
    after = restarts(served.zmq)
    assert sum(after.values()) - sum(before.values()) == 2, (before, after)  # one death per try, no more
    innocents = [ZmqStream(served.zmq, f"innocent-poison-{i}-", max_tokens=8) for i in range(4)]
    for s in innocents:
        assert s.ended().completed, (s.rid, s.result, s.error)


def test_a_flood_of_ten_times_the_queue_gets_served_or_429_and_memory_stays_bounded(ready):
    served = ready
    rss_before = rss_mb(served.proc.pid)

    async def one(client: httpx.AsyncClient, i: int) -> httpx.Response:
        body = {"messages": [{"role": "user", "content": f"Say hello to visitor {i}."}], "max_tokens": 8}
        return await client.post(f"{served.url}/v1/chat/completions", json=body, timeout=BOUND_S)

    async def flood() -> list[httpx.Response]:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=100)) as client:
            return await asyncio.gather(*(one(client, i) for i in range(10 * QUEUE)))

    t0 = time.monotonic()
    responses = asyncio.run(flood())
    took = time.monotonic() - t0
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429}, codes
    served_n, refused = codes.count(200), [r for r in responses if r.status_code == 429]
    assert served_n >= QUEUE + 4, codes  # the queue and the 4 slots at least
    assert refused, "a flood of 10x the queue refused nothing"
    for r in refused:
        assert int(r.headers["retry-after"]) >= 1 and r.json()["error"]["code"] == "queue_full"
    for r in responses:
        if r.status_code == 200:
            assert r.json()["usage"]["completion_tokens"] > 0
    assert took < BOUND_S
    assert rss_mb(served.proc.pid) - rss_before < 100  # the router and HTTP API hold nothing for refused requests
    wait_for(lambda: all_ready(served.zmq), 30, "the queue drained")
