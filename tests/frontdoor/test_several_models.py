"""Several models behind one real `kvroute serve` (issue 34): each request is served by its own model's workers, a
prefix is never shared across models, replicas keep their conversations, an unknown model is a 404 naming the
served ones; with a budget of one loaded model, models load on demand and the least recently used one is unloaded,
its conversation coming back from the disk tier. The two models are the default GGUF under two names: same tokens,
same weights, so only the router's bookkeeping keeps them apart."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from served import Served

from common.model import default_model_path
from kvroute.client import Client, KvrouteError
from protocol import Result, StatusReply

SYSTEM = "You are a careful assistant. " + " ".join(f"Rule {i}: answer briefly and check every fact twice." for i in range(30))


def turn(c: Client, model: str | None, *users: str, system: str = SYSTEM, **extra: object) -> Result:
    """A conversation's next request: the system prompt, then its user messages (answers left out: the prefix is
    what matters)."""
    messages = [{"role": "system", "content": system}, *({"role": "user", "content": u} for u in users)]
    return c.submit(messages=messages, model=model, max_tokens=4, temperature=0, **extra)


def wait_for(check: Callable[[], bool], what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise TimeoutError(f"never: {what}")


def states(c: Client) -> dict[str, str]:
    status = c.status()
    assert isinstance(status, StatusReply)
    return {m.name: m.state for m in status.models}


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = Path(tmp_path_factory.mktemp("models"))
    models = tmp / "models.toml"
    models.write_text(
        f'[models.alpha]\npath = "{default_model_path()}"\naliases = ["claude-haiku-4-5"]\nworkers = 2\nslots = 2\n\n'
        f'[models.beta]\npath = "{default_model_path()}"\nslots = 2\n'
    )
    s = Served("--models", str(models), "--ctx-per-slot", "2048", "--threads", "1", log=tmp / "serve.log")
    with Client(s.zmq, timeout_s=60) as c:
        wait_for(lambda: states(c) == {"alpha": "loaded", "beta": "loaded"}, "both models loaded")
        wait_for(lambda: len(c.status().workers) == 3, "three workers")
    yield s
    s.stop()


def test_v1_models_lists_every_model_and_alias(two: Served) -> None:
    got = httpx.get(f"{two.url}/v1/models", timeout=10).json()
    assert {m["id"]: m["status"]["value"] for m in got["data"]} == {
        "alpha": "loaded",
        "claude-haiku-4-5": "loaded",
        "beta": "loaded",
    }
    with Client(two.zmq, timeout_s=60) as c:
        assert sorted(w.worker for w in c.status().workers) == ["alpha-cpu0", "alpha-cpu1", "beta-cpu0"]


def test_each_model_is_served_by_its_own_workers_and_never_shares_a_prefix(two: Served) -> None:
    with Client(two.zmq, timeout_s=60) as c:
        system = "A prompt only this test sends. " + SYSTEM
        a = turn(c, "alpha", "Name a colour.", system=system)
        b = turn(c, "beta", "Name a colour.", system=system)
        assert a.worker.startswith("alpha-") and b.worker == "beta-cpu0"
        assert b.usage.cached_tokens == 0  # alpha's workers hold it; beta's never computed it
        assert b.tokens == a.tokens  # the same weights: the same greedy answer
        again = turn(c, "beta", "Name a colour.", system=system)
        assert again.worker == "beta-cpu0" and again.usage.cached_tokens >= b.usage.prompt_tokens - 8
        alias = turn(c, "claude-haiku-4-5", "Name a colour.", system=system)
        assert alias.worker.startswith("alpha-") and alias.usage.cached_tokens >= a.usage.prompt_tokens - 8


def test_replicas_keep_their_conversations(two: Served) -> None:
    with Client(two.zmq, timeout_s=60) as c:
        systems = [f"Conversation {k}. " + SYSTEM for k in ("one", "two")]
        first = [turn(c, "alpha", "Hello.", system=s) for s in systems]
        assert {r.worker for r in first} == {"alpha-cpu0", "alpha-cpu1"}  # load spread over the replicas
        for _ in range(2):
            for s, r in zip(systems, first, strict=True):
                nxt = turn(c, "alpha", "Hello.", "And then?", system=s)
                assert nxt.worker == r.worker and nxt.usage.cached_tokens >= r.usage.prompt_tokens - 8


def test_an_unknown_model_is_a_404_naming_the_served_ones(two: Served) -> None:
    r = httpx.post(
        f"{two.url}/v1/chat/completions",
        json={"model": "gpt-7", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        timeout=30,
    )
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert error["param"] == "model" and "'gpt-7'" in error["message"]
    assert "'alpha'" in error["message"] and "'beta'" in error["message"] and "claude-haiku-4-5" in error["message"]
    with Client(two.zmq, timeout_s=60) as c, pytest.raises(KvrouteError) as info:
        turn(c, "gpt-7", "hi")
    assert info.value.code == "not_found"
    ok = httpx.post(
        f"{two.url}/v1/chat/completions",
        json={"model": "beta", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        timeout=60,
    )
    assert ok.status_code == 200 and ok.json()["model"] == "beta"  # the others are served on


def test_metrics_say_where_each_model_is_loaded(two: Served) -> None:
    text = httpx.get(f"{two.url}/metrics", timeout=10).text
    assert 'kvroute_model_loaded{model="alpha"} 1.0' in text and 'kvroute_model_loaded{model="beta"} 1.0' in text
    assert 'kvroute_model_workers{model="alpha"} 2.0' in text


def test_one_loaded_model_at_a_time_loads_on_demand_and_comes_back_warm_from_disk(tmp_path: Path) -> None:
    path = default_model_path()
    s = Served(
        *("--model", f"alpha={path}", "--model", f"beta={path}", "--models-max", "1"),
        *("--cache-dir", str(tmp_path / "cache"), "--slots", "2", "--ctx-per-slot", "2048", "--threads", "2"),
        log=tmp_path / "serve.log",
    )
    try:
        with Client(s.zmq, timeout_s=120) as c:
            wait_for(lambda: states(c) == {"alpha": "loaded", "beta": "unloaded"}, "alpha alone loaded")
            first = turn(c, "alpha", "What is a lighthouse?")
            assert first.usage.cached_tokens == 0
            b = turn(c, "beta", "What is a harbour?")  # beta loads; alpha, idle, is unloaded to make room
            assert b.worker == "beta-cpu0"
            assert states(c) == {"alpha": "unloaded", "beta": "loaded"}
            back = turn(c, "alpha", "What is a lighthouse?", "And who keeps it?")  # alpha again, beta unloaded
            assert back.worker == "alpha-cpu0"
            # its first turn's prompt came back from the disk tier that alpha's worker wrote when it stopped
            assert back.usage.cached_tokens >= first.usage.prompt_tokens - 8, back.usage
            assert states(c) == {"alpha": "loaded", "beta": "unloaded"}
            turn(c, "beta", "Bye.", keep_alive_s=0)  # Ollama's keep_alive 0: unloaded once idle
            wait_for(lambda: states(c)["beta"] == "unloaded", "beta unloaded after keep_alive 0", timeout_s=30)
        text = httpx.get(f"{s.url}/metrics", timeout=10).text
        assert 'kvroute_model_loads_total{model="alpha"} 2.0' in text  # at start, and on demand
        assert 'kvroute_model_unloads_total{model="alpha"} 2.0' in text  # twice, for beta
        assert 'kvroute_model_unloads_total{model="beta"} 2.0' in text  # for alpha, then keep_alive 0
    finally:
        assert s.stop() == 0


def test_a_memory_budget_keeps_what_fits_loaded(tmp_path: Path) -> None:
    """Each worker of the default model takes ~290 MiB (its 253 MiB file, 2 slots x 1024 tokens of KV): a budget of
    450 MiB holds one at a time, so beta's request unloads alpha first; gamma, which its operator says takes 100 MiB,
    fits beside either."""
    path = default_model_path()
    models = tmp_path / "models.toml"
    models.write_text(
        f'[models.alpha]\npath = "{path}"\n\n[models.beta]\npath = "{path}"\n\n'
        f'[models.gamma]\npath = "{path}"\nmemory_mb = 100\n'  # (an operator's figure: it fits beside either)
    )
    flags = ("--models", str(models), "--models-memory-mb", "450", "--slots", "2", "--ctx-per-slot", "1024")
    s = Served(*flags, "--threads", "1", log=tmp_path / "serve.log")
    try:
        with Client(s.zmq, timeout_s=120) as c:
            wait_for(lambda: states(c) == {"alpha": "loaded", "beta": "unloaded", "gamma": "loaded"}, "alpha and gamma")
            assert turn(c, "beta", "What is a harbour?").worker == "beta-cpu0"  # beta waits for alpha's room
            assert states(c) == {"alpha": "unloaded", "beta": "loaded", "gamma": "loaded"}
            assert turn(c, "gamma", "Hi.").worker == "gamma-cpu0"
            memory = {m.name: m.memory_mb for m in c.status().models}  # (kvroute status shows it)
            assert memory["gamma"] == 100 and 260 < memory["alpha"] < 330 and 260 < memory["beta"] < 330, memory
        assert 'kvroute_model_worker_memory_mib{model="gamma"} 100.0' in httpx.get(f"{s.url}/metrics", timeout=10).text
    finally:
        assert s.stop() == 0
    log = (tmp_path / "serve.log").read_text()
    assert '"model": "alpha", "reason": "room for beta"' in log


def test_a_model_that_fails_to_load_says_why_once_and_the_others_are_served_on(tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(default_model_path().read_bytes())
    models = tmp_path / "models.toml"
    models.write_text(
        f'[models.alpha]\npath = "{default_model_path()}"\n\n[models.broken]\npath = "{broken}"\nload = "on_demand"\n'
    )
    log = tmp_path / "serve.log"
    s = Served("--models", str(models), "--slots", "1", "--ctx-per-slot", "1024", "--threads", "2", log=log)
    try:
        with broken.open("r+b") as f:  # the file goes bad after start (the router read its vocabulary already)
            f.truncate(30_000_000)
        with Client(s.zmq, timeout_s=120) as c:
            for _ in range(2):  # the second request gets the reason at once: no new start
                with pytest.raises(KvrouteError) as info:
                    turn(c, "broken", "hi")
                assert info.value.code == "no_workers" and "could not load the model" in info.value.message
            status = c.status()
            (listed,) = [m for m in status.models if m.name == "broken"]
            assert listed.state == "failed" and "could not load the model" in listed.reason
            assert turn(c, "alpha", "hi").worker == "alpha-cpu0"
        spawned = [line for line in log.read_text().splitlines() if '"worker_spawned"' in line and "broken-cpu0" in line]
        assert len(spawned) == 1, spawned  # started once, not restarted in a loop
    finally:
        assert s.stop() == 0


def test_a_router_alone_serves_several_models_to_workers_started_elsewhere(tmp_path: Path) -> None:
    """`kvroute router --model NAME=PATH ...` and `kvroute worker`s as on other hosts: a worker says which model it
    serves (`--model-name`), or is matched by its vocabulary (the first model with it)."""
    from served import free_port

    path = str(default_model_path())
    zmq_ep, worker_ep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    cli = [sys.executable, "-m", "commands.cli"]
    common = ["--connect", worker_ep, "--slots", "1", "--ctx-per-slot", "1024", "--threads", "1"]
    procs = [
        subprocess.Popen([*cli, "router", "--model", f"alpha={path}", "--model", f"beta={path}", "--zmq", zmq_ep,
                          "--worker-endpoint", worker_ep], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
        subprocess.Popen([*cli, "worker", "--model", path, "--worker-id", "host-b", "--model-name", "beta", *common],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
        subprocess.Popen([*cli, "worker", "--model", path, "--worker-id", "host-a", *common],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
    ]  # fmt: skip
    try:
        with Client(zmq_ep, timeout_s=60) as c:
            wait_for(lambda: states(c) == {"alpha": "loaded", "beta": "loaded"}, "both models' workers")
            assert turn(c, "beta", "hi").worker == "host-b" and turn(c, "alpha", "hi").worker == "host-a"
            assert turn(c, None, "hi").worker == "host-a"  # (no model named: the first)
            with pytest.raises(KvrouteError) as info:
                turn(c, "gamma", "hi")
            assert info.value.code == "not_found"
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=60)
