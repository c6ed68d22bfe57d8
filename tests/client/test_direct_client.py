"""A client's end of direct replies (kvroute/direct.py): the workers' raw messages become the deltas and the result
the router would have sent, whichever of the two paths is first; a broken path ends its request with a reason."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from chat.families import Hermes
from chat.output import OutputSpec
from kvroute import direct
from kvroute.client import reply_endpoint_of
from kvroute.direct import DirectReplies
from protocol import (
    Delta,
    Error,
    ErrorCode,
    JobDelta,
    JobDone,
    JobStart,
    Placed,
    Result,
    Timings,
    pack_tokens,
)

JOB = "a.r1.1"


@pytest.fixture
def replies(tmp_path: Path) -> Any:
    got: list[Any] = []
    cancelled: list[str] = []
    d = DirectReplies(f"ipc://{tmp_path}/reply", got.append, cancelled.append)
    d.expect("a")
    yield d, got, cancelled
    d.close()


def placed(job: str = JOB, spec: OutputSpec | None = None, worker: str = "w0") -> Placed:
    fmt = (spec or OutputSpec()).wire()
    return Placed(id="a", job=job, worker=worker, slot=1, format=fmt, prompt_tokens=10, queue_ms=5.0)


def job_done(text: str, tokens: list[int], job: str = JOB) -> JobDone:
    return JobDone(
        id=job,
        slot=1,
        finish_reason="stop",
        text=text,
        tokens=pack_tokens(tokens),
        prompt_tokens=10,
        reused_tokens=4,
        prefilled_tokens=6,
        generated_tokens=len(tokens),
        slot_tokens=10 + len(tokens) - 1,
        slot_hash="",
        timings=Timings(queue_ms=1.0, prefill_ms=2.0, decode_ms=3.0, ttft_ms=3.0),
    )


def test_the_workers_messages_become_the_routers_replies(replies: Any) -> None:
    d, got, _ = replies
    d.placed(placed())
    d._take(JobStart(id=JOB))
    d._take(JobDelta(id=JOB, text="Hel", tokens=pack_tokens([1]), reused_tokens=4))
    d._take(JobDelta(id=JOB, text="lo", tokens=pack_tokens([2])))
    d._take(job_done("Hello", [1, 2]))
    first, second, result = got
    assert isinstance(first, Delta) and (first.id, first.text, first.usage.cached_tokens) == ("a", "Hel", 4)
    assert isinstance(second, Delta) and second.text == "lo" and second.usage is None
    assert isinstance(result, Result) and (result.text, result.worker, result.slot) == ("Hello", "w0", 1)
    assert (result.usage.prompt_tokens, result.usage.cached_tokens, result.usage.completion_tokens) == (10, 4, 2)
    assert result.timings.queue_ms == 6.0 and result.timings.ttft_ms == 8.0  # the router's wait added
    assert not d.began("a") and "a" not in d.current


def test_messages_that_come_before_placed_wait_for_it(replies: Any) -> None:
    d, got, _ = replies
    d._take(JobStart(id=JOB))
    d._take(JobDelta(id=JOB, text="Hi", tokens=pack_tokens([1]), reused_tokens=0))
    assert not got
    d.placed(placed())
    assert [type(m).__name__ for m in got] == ["Delta"] and got[0].text == "Hi"


def test_tool_calls_are_read_as_the_router_reads_them(replies: Any) -> None:
    d, got, _ = replies
    d.placed(placed(spec=OutputSpec(family=Hermes(), tool_names=frozenset({"get_weather"}))))
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    d._take(JobDelta(id=JOB, text=text, tokens=pack_tokens([1]), reused_tokens=0))
    d._take(job_done(text, [1]))
    result = got[-1]
    assert isinstance(result, Result) and result.finish_reason == "tool_calls" and result.text == ""
    assert [(c.name, c.arguments) for c in result.tool_calls] == [("get_weather", '{"city": "Paris"}')]


def test_placed_again_after_output_began_fails_with_worker_lost(replies: Any) -> None:
    d, got, cancelled = replies
    d.placed(placed())
    d._take(JobDelta(id=JOB, text="Hi", tokens=pack_tokens([1]), reused_tokens=0))
    d.placed(placed(job="a.r1.2", worker="w1"))  # its worker died before the router heard of the first token
    error = got[-1]
    assert isinstance(error, Error) and error.code == ErrorCode.WORKER_LOST and "w0" in error.message
    assert cancelled == ["a"]


def test_placed_again_before_output_reads_the_new_job_only(replies: Any) -> None:
    d, got, _ = replies
    d.placed(placed())
    d.placed(placed(job="a.r1.2", worker="w1"))
    d._take(JobDelta(id=JOB, text="stale", tokens=pack_tokens([1]), reused_tokens=0))  # (kept aside, never read)
    d._take(JobDelta(id="a.r1.2", text="Hi", tokens=pack_tokens([1]), reused_tokens=0))
    assert [m.text for m in got] == ["Hi"]


def test_a_worker_that_never_reaches_the_endpoint_ends_the_request_with_the_fix(replies: Any) -> None:
    d, got, cancelled = replies
    d.placed(placed())
    d.check(d.jobs[JOB].at + direct.START_S + 1)
    (error,) = got
    assert error.code == ErrorCode.REPLY_UNREACHABLE and "--reply-endpoint" in error.message
    assert cancelled == ["a"] and d.broken


def test_a_request_the_worker_cannot_reach_is_sent_again_when_it_can_be(tmp_path: Path) -> None:
    got: list[Any] = []
    resent: list[str] = []
    d = DirectReplies(f"ipc://{tmp_path}/reply", got.append, lambda rid: None, resend=lambda rid: not resent.append(rid))
    try:
        d.expect("a")
        d.placed(placed())
        d.check(d.jobs[JOB].at + direct.START_S + 1)
        assert resent == ["a"] and not got and d.broken and "a" not in d.current  # (its reader sees nothing of it)
    finally:
        d.close()


def test_a_started_job_is_not_timed_out(replies: Any) -> None:
    d, got, _ = replies
    d.placed(placed())
    d._take(JobStart(id=JOB))
    d.check(d.jobs[JOB].at + direct.START_S + 1)
    assert not got and not d.broken


def test_a_request_whose_router_died_lives_while_its_worker_streams(replies: Any) -> None:
    d, got, _ = replies
    d.placed(placed())
    d._take(JobDelta(id=JOB, text="Hi", tokens=pack_tokens([1]), reused_tokens=0))
    assert d.began("a")
    d.orphan("a", "tcp://router-a:5555")
    job = d.jobs[JOB]
    d.check(job.heard + direct.ORPHAN_STALL_S - 1)
    d._take(JobDelta(id=JOB, text="!", tokens=pack_tokens([2])))  # still streaming
    d.check(job.heard + direct.ORPHAN_STALL_S - 1)
    assert [type(m).__name__ for m in got] == ["Delta", "Delta"]
    d.check(job.heard + direct.ORPHAN_STALL_S + 1)  # silent since: its worker died with the router
    assert got[-1].code == ErrorCode.ROUTER_LOST and "tcp://router-a:5555" in got[-1].message


def test_the_routers_restart_reaches_the_request(replies: Any) -> None:
    d, got, _ = replies
    d.placed(placed())
    d._take(Error(id=JOB, code=ErrorCode.ROUTER_LOST, message="the router restarted"))
    (error,) = got
    assert error.id == "a" and error.code == ErrorCode.ROUTER_LOST


def test_reply_endpoints() -> None:
    assert reply_endpoint_of("off", "tcp://10.0.0.1:5555") is None
    assert reply_endpoint_of("auto", "tcp://127.0.0.1:5555") == "tcp://127.0.0.1:*"
    assert reply_endpoint_of(
        "auto",
        "ipc:///run/kvroute/client.sock",
    ).startswith("ipc://")
    assert reply_endpoint_of("auto", "tcp://10.0.0.1:5555") is None  # (the workers' way here is not known)
    assert reply_endpoint_of("tcp://10.0.0.2:*", "tcp://10.0.0.1:5555") == "tcp://10.0.0.2:*"
    for bad in ("tcp://0.0.0.0:5600", "tcp://*:5600", "udp://x"):
        with pytest.raises(ValueError, match="reply endpoint"):
            reply_endpoint_of(bad, "tcp://10.0.0.1:5555")


def test_what_waits_for_a_placed_is_bounded_and_dropped_in_time(replies: Any, monkeypatch: Any) -> None:
    d, got, _ = replies
    monkeypatch.setattr(direct, "EARLY_MAX", 3)
    for i in range(5):  # (a cancelled request's last deltas, or a job placed by a router that died)
        d._take(JobDelta(id=f"gone.{i % 2}", text="x", tokens=pack_tokens([1])))
    assert d.early_kept == 3 and not got
    d.check(max(d.early_at.values()) + direct.EARLY_S + 1)
    assert d.early_kept == 0 and not d.early
