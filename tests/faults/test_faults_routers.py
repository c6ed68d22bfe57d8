"""A client given two routers (kvroute/client.py `AsyncClient("A,B")`; `kvroute http --router A,B` takes the same)
moves to the other one when the router in use dies: a request whose output had begun goes on while its worker streams
it to the client directly, and ends with `router_lost` when that worker died too; one still waiting for its first reply
is sent to the other router and completes, and new requests go there. First with
two separate fleets (`kvroute serve` A and B, each with its own worker), then with routers side by side over one
fleet (`kvroute router` A and B, two `kvroute worker --connect A,B`): traffic through both, each router's mirror
exact (a conversation's next turn through the other router reuses its cache), and after router A is killed with
SIGKILL under load, the story it was streaming completes (its worker sends the output to the client, not A) and the
next turns through B are served from the cache A's turns left."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from fault_helpers import BOUND_S, all_ready, free_port, status, wait_for
from served import Served

from kvroute import direct
from kvroute.client import AsyncClient, KvrouteError
from protocol import Delta, Result

pytestmark = pytest.mark.model

FLAGS = ("--workers", "1", "--slots", "1", "--ctx-per-slot", "1024", "--threads", "1", "--spec", "none")


async def long_story(client: AsyncClient, max_tokens: int, begun: asyncio.Event) -> str:
    """Stream a story; `begun` is set at its first delta. How it ended: "completed", or the error's code."""
    try:
        async for msg in client.stream(prompt="Tell me a long story.", max_tokens=max_tokens, ignore_eos=True):
            if isinstance(msg, Delta):
                begun.set()
        return "completed"
    except KvrouteError as exc:
        return exc.code


async def scenario(a: Served, b: Served) -> tuple[str, Result, Result]:
    client = AsyncClient(f"{a.zmq},{b.zmq}", timeout_s=BOUND_S)
    begun = asyncio.Event()
    running = asyncio.create_task(long_story(client, 600, begun))
    await asyncio.wait_for(begun.wait(), BOUND_S)
    waiting = asyncio.create_task(client.submit(prompt="Name a river.", max_tokens=8, ignore_eos=True))
    await asyncio.sleep(1.0)  # it reached router A, which holds it for A's one slot (busy with the story)
    os.killpg(a.proc.pid, signal.SIGKILL)  # router A and its worker
    code = await asyncio.wait_for(running, BOUND_S)
    moved = await asyncio.wait_for(waiting, BOUND_S)
    after = await asyncio.wait_for(client.submit(prompt="Name a sea.", max_tokens=8, ignore_eos=True), BOUND_S)
    await client.close()
    return code, moved, after


def two_serves(tmp_path: Path) -> tuple[Served, Served]:
    """`kvroute serve` A and B, started side by side."""
    a = Served(*FLAGS, log=tmp_path / "a.log", wait_ready=False)
    b = Served(*FLAGS, log=tmp_path / "b.log", wait_ready=False)
    try:
        a.wait_health(200)
        b.wait_health(200)
    except BaseException:
        a.stop()
        b.stop()
        raise
    return a, b


def test_requests_move_to_the_other_router_when_the_one_in_use_dies(tmp_path, monkeypatch) -> None:
    # A's worker died with A: the story's end is known once it has been silent ORPHAN_STALL_S (10 s), 2 s here (no
    # delta is late by that much while A lives: the limit applies only once A is gone)
    monkeypatch.setattr(direct, "ORPHAN_STALL_S", 2.0)
    a, b = two_serves(tmp_path)
    try:
        code, moved, after = asyncio.run(scenario(a, b))
        # its output had begun at A, whose worker died with it: not sent again, the reason named (with direct replies,
        # once the worker has sent nothing for kvroute/direct.py ORPHAN_STALL_S)
        assert code == "router_lost"
        assert moved.usage.completion_tokens == 8  # it had not begun: B served it
        assert after.usage.completion_tokens == 8
    finally:
        if a.proc.poll() is None:
            os.killpg(a.proc.pid, signal.SIGKILL)
        a.proc.wait(30)
        b.stop()


async def drain_scenario(a: Served, b: Served) -> tuple[str, Result]:
    client = AsyncClient(f"{a.zmq},{b.zmq}", timeout_s=BOUND_S)
    begun = asyncio.Event()

    async def story() -> str:
        async for msg in client.stream(prompt="Tell me a story.", max_tokens=64, ignore_eos=True):
            if isinstance(msg, Delta):
                begun.set()
            elif isinstance(msg, Result):
                return f"completed at {msg.worker}"
        return "no result"

    running = asyncio.create_task(story())
    await asyncio.wait_for(begun.wait(), BOUND_S)
    os.kill(a.proc.pid, signal.SIGTERM)  # `kvroute serve` A drains: no new request, the running one finishes
    await asyncio.sleep(0.5)
    after = await asyncio.wait_for(client.submit(prompt="Name a sea.", max_tokens=8, ignore_eos=True), BOUND_S)
    ended = await asyncio.wait_for(running, BOUND_S)
    await client.close()
    return ended, after


def test_a_router_that_drains_sends_new_requests_to_the_other_and_finishes_its_own(tmp_path) -> None:
    a, b = two_serves(tmp_path)
    try:
        ended, after = asyncio.run(drain_scenario(a, b))
        assert ended.startswith("completed")  # the request A was streaming finished there
        assert after.usage.completion_tokens == 8  # refused by A (draining), served by B: the client never saw it
    finally:
        a.stop()
        b.stop()


# ---- routers side by side over one fleet ------------------------------------------------------------------------


class Fleet:
    """`kvroute router` A and B, and workers w0 and w1 that report to both (`--connect A,B`)."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.zmq = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
        self.worker_eps = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
        self.routers = [
            self._spawn(f"router{i}", "router", "--zmq", self.zmq[i], "--worker-endpoint", self.worker_eps[i]) for i in range(2)
        ]
        self.workers = [
            self._spawn(w, "worker", "--connect", ",".join(self.worker_eps), "--worker-id", w, "--slots", "2",
                        "--ctx-per-slot", "1024", "--threads", "1", "--spec", "none")
            for w in ("w0", "w1")
        ]  # fmt: skip

    def _spawn(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        with open(self.logs / f"{name}.log", "ab") as out:
            return subprocess.Popen(
                [sys.executable, "-m", "commands.cli", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "KVROUTE_LOG_FORMAT": "json"},
                start_new_session=True,
            )

    def stop(self) -> None:
        procs = [*self.routers, *self.workers]
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def slot_lengths(endpoint: str) -> dict[tuple[str, int], int]:
    return {(w.worker, s.slot): s.n_tokens for w in status(endpoint).workers for s in w.slots}


def counter(metrics: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", metrics, re.M))


async def two_routers_one_fleet(fleet: Fleet) -> dict[str, object]:
    za, zb = fleet.zmq
    a, b = AsyncClient(za, timeout_s=BOUND_S), AsyncClient(zb, timeout_s=BOUND_S)
    system = {"role": "system", "content": "You are a terse assistant for a crew of sailors on a long voyage. " * 6}
    talks = [[system, {"role": "user", "content": f"Crew member {i}: name a knot."}] for i in range(2)]

    async def turn(client: AsyncClient, i: int) -> Result:
        r = await client.submit(messages=talks[i], max_tokens=8, temperature=0.0)
        talks[i] += [{"role": "assistant", "content": r.text}, {"role": "user", "content": "And another?"}]
        return r

    # traffic through both routers at once: conversation 0 through A, 1 through B (two of the four slots)
    first = await asyncio.gather(turn(a, 0), turn(b, 1))
    # each conversation's next turn through the other router: its mirror learned the slots the other one's jobs left
    second = await asyncio.gather(turn(b, 0), turn(a, 1))
    wait_for(lambda: all_ready(za) and all_ready(zb), BOUND_S, "every slot idle, seen by both routers")
    mirrors = (slot_lengths(za), slot_lengths(zb))

    # router A killed under load (a long story streaming through it, in a slot no conversation holds); then both
    # conversations' next turns through B: conversation 1's turn before went through A
    moving = AsyncClient(f"{za},{zb}", timeout_s=BOUND_S)
    begun = asyncio.Event()
    story = asyncio.create_task(long_story(moving, 160, begun))  # (streaming for seconds after A dies)
    await asyncio.wait_for(begun.wait(), BOUND_S)
    os.kill(fleet.routers[0].pid, signal.SIGKILL)
    story_end = await asyncio.wait_for(story, BOUND_S)
    third = [await turn(moving, 0), await turn(moving, 1)]  # (the client moved to B)
    metrics_b = await b.metrics()
    for c in (a, b, moving):
        await c.close()
    return {"first": first, "second": second, "mirrors": mirrors, "story": story_end, "third": third, "metrics_b": metrics_b}


def test_two_routers_over_one_fleet_keep_exact_mirrors_and_survive_one_killed(tmp_path) -> None:
    fleet = Fleet(tmp_path)
    try:
        wait_for(lambda: all_ready(fleet.zmq[0]) and all_ready(fleet.zmq[1]), 180, "both workers ready at both routers")
        got = asyncio.run(two_routers_one_fleet(fleet))
        first, second, third = got["first"], got["second"], got["third"]
        for f, s in zip(first, second, strict=True):  # the turn before went through the other router
            assert s.usage.cached_tokens >= f.usage.prompt_tokens, (f.usage, s.usage)
        mirror_a, mirror_b = got["mirrors"]
        assert mirror_a == mirror_b and any(mirror_a.values())  # both routers see exactly what every slot holds
        assert got["story"] == "completed"  # its worker streamed it to the client directly: A's death did not touch it
        for before, after in zip(second, third, strict=True):
            assert after.usage.cached_tokens >= before.usage.prompt_tokens, (before.usage, after.usage)
        metrics = got["metrics_b"]
        assert counter(metrics, "kvroute_mirror_mismatches_total") == 0
        assert counter(metrics, "kvroute_reuse_mispredictions_total") == 0
        assert all(w.poll() is None for w in fleet.workers)  # the workers served on
    finally:
        fleet.stop()
