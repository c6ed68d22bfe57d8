"""The real router and a real worker process over ZMQ, on tiny random-weight models of the hybrid, recurrent and
sliding-window architectures (issue 48: bench/tiny_archs.py): agents' turns with exact and diverging tails, more
conversations than slots (host RAM), copies between slots, a graceful restart that brings the conversations back from
the disk tier, a SIGKILL; the router predicts every reuse exactly (no misprediction, no mirror mismatch), and a turn
served from the cache gives the tokens a cold run of it gives (another tenant: nothing shared)."""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from router_client import RawClient
from router_helpers import RouterThread, endpoints

from bench import tiny_archs
from commands.serve import LocalWorkers, serve
from protocol import Error, Result, Sampling, Submit, pack_tokens, unpack_tokens
from router.config import RouterConfig
from router.supervisor import SupervisorConfig

pytestmark = pytest.mark.model

CASES = ("qwen35", "nemotron_h", "lfm2", "mamba2", "gemma3-window")


@pytest.fixture(params=CASES)
def system(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[RouterThread, str]]:
    arch, swa = (request.param, "auto") if request.param != "gemma3-window" else ("gemma3", "off")
    cep, wep = endpoints()
    cfg = RouterConfig(client_endpoint=cep, worker_endpoint=wep, busy_wait_ms=0, model=str(tiny_archs.model(arch)))
    local = LocalWorkers(
        cpu_workers=1,
        slots=2,
        ctx_per_slot=256,
        threads=1,
        n_batch=64,
        host_cache_mb=64,
        cache_dir=str(tmp_path / "disk"),
        swa_full=swa,
        spec="none",
    )

    def started(router: Any, sup: Any) -> None:
        rt.extra.update(router=router, sup=sup)

    async def main(rt: RouterThread) -> None:
        await serve(cfg, local, SupervisorConfig(restart_backoff_s=0.2), signals=False, started=started)

    rt = RouterThread(main)
    rt.thread.start()
    rt.router = wait(lambda: rt.extra.get("router") if ready(rt.extra.get("router")) else None, "the worker up")
    yield rt, cep
    rt.stop()


def ready(router: Any) -> bool:
    return router is not None and any(w.state.value == "ready" for w in router.workers.values())


def wait(check: Any, what: str, timeout_s: float = 120) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"{what}: not within {timeout_s} s")


def ask(c: RawClient, rid: str, prompt: list[int], salt: str | None = None) -> Result:
    c.send(Submit(id=rid, tokens=pack_tokens(prompt), sampling=Sampling(max_tokens=5, temperature=0.0), cache_salt=salt))
    _, end = c.recv_until_end(rid)
    assert isinstance(end, Result), end
    return end


def test_agent_turns_are_predicted_exactly_and_come_back_after_a_restart(system):
    rt, cep = system
    router = rt.router
    c = RawClient(cep)
    rnd = random.Random(7)
    sessions = {s: [rnd.randrange(128) for _ in range(30 + 5 * s)] for s in range(3)}  # 3 conversations, 2 slots
    cached = 0
    for t in range(4):
        for s, history in sessions.items():
            prompt = history + [rnd.randrange(128) for _ in range(8)]
            warm = ask(c, f"s{s}t{t}", prompt)
            cold = ask(c, f"s{s}t{t}-cold", prompt, salt=f"cold-{s}-{t}")  # another tenant: computed in full
            assert unpack_tokens(warm.tokens) == unpack_tokens(cold.tokens), (s, t)
            assert cold.usage.cached_tokens == 0
            cached += warm.usage.cached_tokens
            out = unpack_tokens(warm.tokens)
            sessions[s] = [prompt + out, [*prompt, *out[:1], 101, 102], [*prompt[:-2], 103]][(s + t) % 3]
    m = router.metrics
    assert m.reuse_mispredictions == 0 and m.mirror_mismatches == 0
    assert cached > 0

    sup = rt.extra["sup"]
    (wid,) = list(router.workers)
    pid = sup.pid(wid)
    os.kill(pid, signal.SIGTERM)  # a graceful restart: the worker writes its slots and host RAM to its disk tier
    wait(lambda: sup.pid(wid) not in (None, pid) and ready(router), "the worker back")
    restored = 0
    for s, history in sessions.items():
        prompt = history + [rnd.randrange(128) for _ in range(8)]
        warm = ask(c, f"s{s}-after", prompt)
        restored += warm.usage.cached_tokens
        sessions[s] = prompt + unpack_tokens(warm.tokens)
    assert restored > 0  # (from the disk tier, listed in the new worker's hello)
    assert m.reuse_mispredictions == 0 and m.mirror_mismatches == 0

    pid = sup.pid(wid)
    os.kill(pid, signal.SIGKILL)  # no time to write anything: what the disk tier held stays restorable
    wait(lambda: sup.pid(wid) not in (None, pid) and ready(router), "the worker back after SIGKILL")
    for s, history in sessions.items():
        end = ask(c, f"s{s}-killed", [*history, 1, 2, 3])
        assert not isinstance(end, Error)
    assert m.reuse_mispredictions == 0 and m.mirror_mismatches == 0
    c.close()
