"""Embed and rerank requests (PROTOCOL.md `embed`, `rerank`): tokenized by the shell, computed by a worker in a
context of its own (worker/embedder.py), answered to the client. They take no slot and leave the mirror alone: a
worker computes one input between two steps of its slots (worker/embed_jobs.py), so an embed job goes to the ready
worker with the least work (busy slots and prefill still to compute, then embed jobs already there). With no ready
worker (a model loading on demand) a request waits, as a queued `submit` does, counted in the queue's figures, and
fails when that would. A worker that dies with one ends it with `worker_lost`.

A request stopped while its job runs (cancelled, its client gone, its deadline passed: `stop`) is answered at once
and its job cancelled on its worker; it stays in `running`, part of that worker's work, until the job's end comes
(`job_error` `cancelled`, or its vectors if they were done first), which then answers nobody."""

from __future__ import annotations

import itertools
import struct
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from protocol import Embeddings, EmbedDone, EmbedJob, Error, ErrorCode, Ranked, pack_tokens
from router.requests import WorkerConn, WorkerState


@dataclass(eq=False)
class EmbedReq:
    client: bytes
    envelope: tuple[bytes, ...]
    rid: str
    worker: str
    prompt_tokens: int
    job: str = ""
    rerank: bool = False  # answered with the scores (`ranked`), not the vectors
    deadline: float | None = None  # (monotonic)
    stopped: bool = False  # answered already; its job is cancelled on its worker, whose end answers nobody
    arrived: float = field(default_factory=time.monotonic)


@dataclass(eq=False)
class EmbedWait:
    """A request no ready worker could take yet."""

    client: bytes
    envelope: tuple[bytes, ...]
    rid: str
    inputs: list[list[int]]
    pooling: str
    normalize: bool
    owner: str = ""  # whose share of the queue it counts against
    deadline: float | None = None  # (monotonic)


class Embeds:
    """The embed jobs in flight, by job id, and the requests waiting for a worker, in arrival order."""

    def __init__(self, router_id: str) -> None:
        self.router_id = router_id
        self.running: dict[str, EmbedReq] = {}
        self.waiting: deque[EmbedWait] = deque()
        self._ids = itertools.count(1)

    def place(self, workers: list[WorkerConn]) -> WorkerConn | None:
        ready = [c for c in workers if c.state is WorkerState.READY]
        if not ready:
            return None
        on = {c.id: 0 for c in ready}
        for r in self.running.values():
            if r.worker in on:
                on[r.worker] += 1
        return min(ready, key=lambda c: (c.load.busy + on[c.id], c.load.queued_prefill, c.id))

    def start(self, conn: WorkerConn, w: EmbedWait) -> EmbedJob:
        """The job for a waiting request's inputs; `rank` pooling: a rerank request's (query, document) inputs."""
        job = f"{w.rid[:100]}.{self.router_id[:8]}.e{next(self._ids)}"
        tokens = sum(map(len, w.inputs))
        self.running[job] = EmbedReq(
            w.client, w.envelope, w.rid, conn.id, tokens, job, rerank=w.pooling == "rank", deadline=w.deadline
        )
        return EmbedJob(id=job, inputs=[pack_tokens(t) for t in w.inputs], pooling=w.pooling, normalize=w.normalize)  # type: ignore[arg-type]

    def done(self, msg: EmbedDone) -> tuple[EmbedReq, Embeddings | Ranked] | None:
        req = self.running.pop(msg.id, None)
        if req is None:
            return None
        if req.rerank:  # each input's score is its rank output's first value, as llama-server reads it
            scores = [struct.unpack_from("<f", v)[0] for v in msg.vectors]
            return req, Ranked(
                id=req.rid, scores=scores, prompt_tokens=req.prompt_tokens, worker=req.worker, cached_tokens=msg.reused_tokens
            )
        return req, Embeddings(
            id=req.rid,
            vectors=msg.vectors,
            dims=msg.dims,
            prompt_tokens=req.prompt_tokens,
            worker=req.worker,
            cached_tokens=msg.reused_tokens,
        )

    def failed(self, job: str, code: str, message: str, error_id: str | None) -> tuple[EmbedReq, Error] | None:
        req = self.running.pop(job, None)
        if req is None:
            return None
        return req, Error(id=req.rid, code=code, message=message, error_id=error_id)

    def lost(self, worker: str, reason: str) -> list[tuple[EmbedReq, Error]]:
        """The embed jobs of a worker that died, each with its error."""
        out = []
        for job in [j for j, r in self.running.items() if r.worker == worker]:
            req = self.running.pop(job)
            what = "scores" if req.rerank else "embeddings"
            message = f"worker {worker} died ({reason}) while computing these {what}"
            out.append((req, Error(id=req.rid, code=ErrorCode.WORKER_LOST, message=message)))
        return out

    def fail_waiting(self, code: str, message: str) -> list[tuple[EmbedWait, Error]]:
        """Every waiting request, each with its error."""
        out = [(w, Error(id=w.rid, code=code, message=message)) for w in self.waiting]
        self.waiting.clear()
        return out

    def stop(self, which: Callable[[EmbedReq | EmbedWait], bool]) -> list[EmbedReq | EmbedWait]:
        """The requests `which` picks, stopped (the caller answers them): waiting ones leave the queue; running ones are
        marked, their jobs to be cancelled (the module's docstring)."""
        waiting = [w for w in self.waiting if which(w)]
        self.waiting = deque(w for w in self.waiting if w not in waiting)
        running = [r for r in self.running.values() if not r.stopped and which(r)]
        for r in running:
            r.stopped = True
        return [*waiting, *running]

    def owned(self, owner: str) -> int:
        """The waiting requests of `owner` (its share of the queue counts them)."""
        return sum(w.owner == owner for w in self.waiting)
