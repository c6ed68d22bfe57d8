"""Driving the router's core (router/scheduler.py) with plain calls: a worker's hello, a submit, a job's deltas
and end, as the shell would feed them."""

from __future__ import annotations

from typing import Any

import numpy as np

from chat.output import OutputSpec
from protocol import Hello, Job, JobDelta, JobDone, Sampling, Submit, Timings, pack_tokens, token_hash, unpack_tokens
from router.config import RouterConfig
from router.prepare import Prepared
from router.requests import ReqState
from router.scheduler import Out, Scheduler

CLIENT = b"client-1"
PROMPT = np.arange(100, 140, dtype=np.int32)


def core(**cfg: Any) -> Scheduler:
    cfg.setdefault("busy_wait_ms", 0)
    return Scheduler(RouterConfig(**cfg), fingerprint="fp", model="m", router_id="r1")


def hello(s: Scheduler, worker: str = "w0", slots: int = 2, incarnation: int = 1, **fields: Any) -> list[Out]:
    """A worker says hello (`fields`: more of Hello's, e.g. ctx_per_slot, held); what the core sends back."""
    fields.setdefault("ctx_per_slot", 4096)
    msg = Hello(worker_id=worker, incarnation=incarnation, slots=slots, model_fingerprint="fp", device="cpu", **fields)
    s.hello(worker.encode(), msg)
    return s.take()


def submit(s: Scheduler, rid: str = "a", tokens: np.ndarray = PROMPT, **kw: Any) -> list[Out]:
    sampling = kw.pop("sampling", Sampling(max_tokens=8, temperature=0.0))
    req = s.accept(CLIENT, (), Submit(id=rid, tokens=pack_tokens(tokens.tolist()), sampling=sampling, **kw))
    if req is not None:
        assert req.state is ReqState.TOKENIZING and s.requests[req.key] is req
        s.prepared(req, Prepared(tokens, None, OutputSpec()))
    return s.take()


def jobs(out: list[Out]) -> list[Job]:
    return [o.msg for o in out if isinstance(o.msg, Job)]


def to_client(out: list[Out], kind: type) -> list[Any]:
    return [o.msg for o in out if not o.worker and isinstance(o.msg, kind)]


def done(s: Scheduler, job: Job, generated: list[int], *, worker: str = "w0", finish: str = "length") -> list[Out]:
    prompt = unpack_tokens(job.tokens)
    kept = (prompt + generated)[:-1]
    s.worker_message(
        worker.encode(),
        JobDone(
            id=job.id,
            slot=job.slot,
            finish_reason=finish,
            text="x" * len(generated),
            tokens=pack_tokens(generated),
            prompt_tokens=len(prompt),
            reused_tokens=job.predicted_reuse,
            prefilled_tokens=len(prompt) - job.predicted_reuse,
            generated_tokens=len(generated),
            slot_tokens=len(kept),
            slot_hash=token_hash(kept),
            timings=Timings(),
        ),
    )
    return s.take()


def delta(s: Scheduler, job: Job, tokens: list[int], worker: str = "w0") -> list[Out]:
    s.worker_message(worker.encode(), JobDelta(id=job.id, text="x", tokens=pack_tokens(tokens), reused_tokens=0))
    return s.take()
