"""The load and unload decisions of a router serving several models (router/models.py), with stand-in cores."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from router import models as models_module
from router.models import LoadState, ModelCore, Models, ServedModel
from router.requests import WorkerState


class FakeTable:
    def __init__(self) -> None:
        self.starting_for: float | None = None

    def starting(self, within_s: float) -> None:
        self.starting_for = within_s


class FakeCore:
    """What Models reads of a model's core: its workers, requests, embed jobs, queue, and why none can come."""

    def __init__(self, fingerprint: str = "fp") -> None:
        self.workers: dict[str, Any] = {}
        self.requests: dict[Any, Any] = {}
        self.embeds = SimpleNamespace(running={}, waiting=[])
        self.queue: list[Any] = []
        self.table = FakeTable()
        self.fingerprint, self.weights = fingerprint, ""
        self.failed_reason: str | None = None

    def none_can_come(self) -> str | None:
        return self.failed_reason


def model(name: str, **spec: Any) -> ModelCore:
    return ModelCore(ServedModel(name=name, path=f"/m/{name}.gguf", **spec), None, None, None, FakeCore())  # type: ignore[arg-type]


class Fleet:
    """The supervisor's side: loads start a ready worker at once; unloads stop it when `exit` is called."""

    def __init__(self, ms: Models, kv_mb: dict[str, float] | None = None) -> None:
        self.ms, self.log = ms, []  # type: ignore[var-annotated]
        self.kv_mb = kv_mb or {}  # what a model's worker says its KV takes
        ms.on_load, ms.on_unload = self.load, self.unload

    def load(self, name: str) -> bool:
        self.log.append(("load", name))
        hello = SimpleNamespace(kv_bytes=int(self.kv_mb.get(name, 0) * 2**20))
        self.ms.by_name[name].core.workers[f"{name}-w"] = SimpleNamespace(state=WorkerState.READY, hello=hello)
        return True

    def unload(self, name: str) -> None:
        self.log.append(("unload", name))
        for w in self.ms.by_name[name].core.workers.values():
            w.state = WorkerState.DRAINING

    def exit(self, name: str) -> None:
        self.ms.by_name[name].core.workers.clear()


def loaded(ms: Models) -> list[str]:
    return [m.name for m in ms if m.state() is LoadState.LOADED]


def test_names_aliases_and_the_default() -> None:
    a, b = model("a", aliases=("claude-haiku-4-5",)), model("b")
    ms = Models([a, b], default=None)
    assert ms.find("claude-haiku-4-5") is a and ms.find("b") is b
    assert ms.find("gpt-7") is None and "'gpt-7' is not served here; served: 'a' (aliases claude-haiku-4-5), 'b'" in ms.unknown(
        "gpt-7"
    )
    assert ms.find(None) is a and ms.find("") is a  # no name: the first (no default set)
    assert Models([a, b], default="b").find("gpt-7") is b
    single = model("only")
    assert Models([single], default=None).find("anything") is single  # one model: any name is it
    with pytest.raises(ValueError, match="'a' is given twice"):
        Models([a, model("x", aliases=("a",))], default=None)
    with pytest.raises(ValueError, match="--default-model 'c'"):
        Models([a, b], default="c")


def test_a_hello_goes_to_the_model_it_names_else_the_one_with_its_vocabulary() -> None:
    a, b = model("a"), model("b")
    b.core.fingerprint = "other"
    ms = Models([a, b], default=None)
    assert ms.for_hello("b", "fp", "") is b and ms.for_hello("", "other", "") is b and ms.for_hello("", "fp", "") is a
    assert ms.for_hello("", "unknown", "") is a  # (its core refuses it: model_mismatch)


def test_past_the_budget_the_least_recently_used_idle_model_makes_room_first() -> None:
    a, b, c = model("a"), model("b"), model("c")
    ms = Models([a, b, c], default=None, models_max=2)
    fleet = Fleet(ms)
    ms.used(a, None)
    ms.used(b, None)
    assert loaded(ms) == ["a", "b"]
    a.last_used -= 10  # a is the least recently used
    ms.used(c, None)
    assert fleet.log[-1] == ("unload", "a") and c.load_wanted and not c.core.workers
    assert c.core.table.starting_for == models_module.LOAD_WAIT_S  # c's requests wait instead of failing
    ms.tick(0)
    assert not c.core.workers  # a still stopping: c waits for its room
    fleet.exit("a")
    ms.tick(0)
    assert loaded(ms) == ["b", "c"] and ms.loads == {"a": 1, "b": 1, "c": 1} and ms.unloads == {"a": 1}


def test_a_model_loads_where_its_devices_have_room_unloading_there_first() -> None:
    a, b = model("a", devices=("cpu",), memory_mb=600), model("b", devices=("cpu",), memory_mb=600)
    g = model("g", devices=("gpu0", "gpu1"), memory_mb=900)  # two workers, one on each GPU
    ms = Models([a, b, g], default=None, memory_mb=1000)
    fleet = Fleet(ms)
    ms.used(a, None)
    ms.used(g, None)  # other devices: no room needed from a
    assert loaded(ms) == ["a", "g"]
    ms.used(b, None)  # 600 + 600 > 1000 on the CPU: a (there, least recently used) goes first; g stays
    assert fleet.log[-1] == ("unload", "a") and not b.core.workers
    fleet.exit("a")
    ms.tick(0)
    assert loaded(ms) == ["b", "g"]


def test_the_need_is_what_a_worker_said_it_took_unless_the_operator_gave_it() -> None:
    # estimated 300 MB each (250 of weights), but a's worker says its KV takes 600 MB: 850 + 300 > 1000
    spec = {"devices": ("cpu",), "memory_mb": 300.0, "weights_mb": 250.0}
    a, b = model("a", **spec), model("b", **spec)
    ms = Models([a, b], default=None, memory_mb=1000)
    fleet = Fleet(ms, kv_mb={"a": 600})
    ms.used(a, None)
    ms.tick(0)
    assert a.need_mb() == 850
    ms.used(b, None)
    assert fleet.log[-1] == ("unload", "a")
    given = model("c", **{**spec, "memory_given": True})  # the operator's figure stands
    ms = Models([given, model("d", **spec)], default=None, memory_mb=1000)
    fleet = Fleet(ms, kv_mb={"c": 600})
    ms.used(given, None)
    ms.tick(0)
    ms.used(ms.by_name["d"], None)
    assert given.need_mb() == 300 and loaded(ms) == ["c", "d"]


def test_a_model_bigger_than_its_device_loads_alone() -> None:
    a, big = model("a", devices=("cpu",), memory_mb=400), model("big", devices=("cpu",), memory_mb=2000)
    ms = Models([a, big], default=None, memory_mb=1000)
    fleet = Fleet(ms)
    ms.used(a, None)
    ms.used(big, None)  # a goes, then big loads alone (llama.cpp says whether it fits)
    assert fleet.log[-1] == ("unload", "a")
    fleet.exit("a")
    ms.tick(0)
    assert loaded(ms) == ["big"]


def test_pinned_and_busy_models_are_not_unloaded_the_load_waits_for_one_to_be_idle() -> None:
    a, b, c = model("a", pinned=True), model("b"), model("c")
    ms = Models([a, b, c], default=None, models_max=2)
    fleet = Fleet(ms)
    ms.used(a, None)
    ms.used(b, None)
    b.core.requests["r"] = object()  # b is serving a request
    a.last_used -= 100
    ms.used(c, None)
    assert ("unload", "a") not in fleet.log and ("unload", "b") not in fleet.log and c.load_wanted
    b.core.requests.clear()
    ms.tick(0)  # b is idle now: it makes room
    assert fleet.log[-1] == ("unload", "b")
    fleet.exit("b")
    ms.tick(0)
    assert loaded(ms) == ["a", "c"]


def test_keep_alive_per_model_and_per_request() -> None:
    a, b = model("a", keep_alive_s=30.0), model("b")
    ms = Models([a, b], default=None)
    fleet = Fleet(ms)
    ms.used(a, None)
    ms.used(b, None)
    now = a.last_used
    ms.tick(now + 10)
    assert fleet.log == [("load", "a"), ("load", "b")]
    ms.tick(now + 31)
    assert fleet.log[-1] == ("unload", "a")  # b has no keep-alive: kept
    ms.used(b, 0.0)  # a request's keep_alive 0: unloaded once idle
    ms.tick(b.last_used + 0.01)
    assert fleet.log[-1] == ("unload", "b")


def test_a_model_that_failed_to_load_is_not_started_again_for_a_while(monkeypatch: pytest.MonkeyPatch) -> None:
    a = model("a")
    ms = Models([a, model("b")], default=None)
    starts = []
    ms.on_load, ms.on_unload = lambda name: starts.append(name) or True, lambda name: None
    ms.used(a, None)
    a.core.failed_reason = "worker a-cpu0: out of memory"
    ms.failed(a)
    assert a.state() is LoadState.FAILED
    for _ in range(5):
        ms.used(a, None)
        ms.tick(0)
    assert starts == ["a"]  # no loop: its requests get the reason (the core's none_can_come)
    a.failed_at -= models_module.RETRY_FAILED_S + 1  # type: ignore[operator]
    ms.used(a, None)
    assert starts == ["a", "a"]


def test_a_load_starved_by_steady_traffic_unloads_a_busy_model_after_a_while() -> None:
    a, b = model("a"), model("b")
    ms = Models([a, b], default=None, models_max=1)
    fleet = Fleet(ms)
    ms.used(a, None)
    a.core.requests["r"] = object()  # a never idles
    ms.used(b, None)
    ms.tick(0)
    assert ("unload", "a") not in fleet.log and b.load_wanted
    b.wanted_since -= models_module.STARVE_S
    ms.tick(0)
    assert fleet.log[-1] == ("unload", "a")  # its running jobs finish; b loads once a's worker is gone
    fleet.exit("a")
    ms.tick(0)
    assert loaded(ms) == ["b"]
