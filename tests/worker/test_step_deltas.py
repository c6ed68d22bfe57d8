"""A worker sends the deltas of one engine step as one message (the router's cost is per message more than per
token), and a job's deltas always before its end."""

from __future__ import annotations

from types import SimpleNamespace

import zmq

from protocol import JobDelta, JobDeltas, JobError, pack_tokens, worker_to_router_decoder
from worker.config import WorkerConfig
from worker.main import WorkerServer


def frames(server: WorkerServer) -> list[object]:
    decoder, got = worker_to_router_decoder(), []
    while server.pull.poll(50):
        _, frame = server.pull.recv_multipart()
        got.append(decoder.decode(frame))
    return got


def delta(rid: str) -> JobDelta:
    return JobDelta(id=rid, text="x", tokens=pack_tokens([7]))


def test_a_steps_deltas_leave_together_after_the_step_and_before_a_jobs_end() -> None:
    engine = SimpleNamespace(vocab=SimpleNamespace(path="/nonexistent.gguf"), after_step=None)
    server = WorkerServer(WorkerConfig(model="/nonexistent.gguf"), engine, zmq.Context())  # type: ignore[arg-type]
    try:
        assert engine.after_step == server.flush_deltas  # the engine calls it after every step
        (link,) = server.links
        sink = server.sink_for(link)
        sink(delta("old"))  # a router that has not said it reads job_deltas: each delta alone, at once
        assert [type(m).__name__ for m in frames(server)] == ["JobDelta"]
        link.step_deltas = True  # (its accept listed "job_deltas")
        sink(delta("a"))
        sink(delta("b"))
        assert frames(server) == []  # held until the step ends
        engine.after_step()
        (step,) = frames(server)
        assert isinstance(step, JobDeltas) and [d.id for d in step.items] == ["a", "b"]
        sink(delta("c"))
        sink(JobError(id="c", code="internal", message="failed"))
        assert [type(m).__name__ for m in frames(server)] == ["JobDelta", "JobError"]  # one delta goes alone
        engine.after_step()
        assert frames(server) == []
    finally:
        server.pull.close(0)
        server.zctx.destroy(linger=0)
