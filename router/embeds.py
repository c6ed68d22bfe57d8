"""Embed and rerank requests (PROTOCOL.md `embed`, `rerank`): tokenized by the shell, computed by a worker in a
context of its own (worker/embedder.py), answered to the client. They take no slot and leave the mirror alone: a
worker's slots wait while it embeds, as llama-server's do, so an embed job goes to the ready worker with the least
work (busy slots and prefill still to compute, then embed jobs already there). With no ready worker (a model loading
on demand) a request waits, as a queued `submit` does, and fails when that would. A worker that dies with one ends it
with `worker_lost`."""

from __future__ import annotations

import itertools
import struct
import time
from collections import deque
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
    rerank: bool = False  # answered with the scores (`ranked`), not the vectors
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

    def start(self, conn: WorkerConn, client: bytes, envelope: tuple[bytes, ...], rid: str, inputs: list[list[int]], pooling: str,
              normalize: bool) -> EmbedJob:  # fmt: skip
        """The job for a request's inputs; `rank` pooling: a rerank request's (query, document) inputs."""
        job = f"{rid[:100]}.{self.router_id[:8]}.e{next(self._ids)}"
        self.running[job] = EmbedReq(client, envelope, rid, conn.id, sum(map(len, inputs)), rerank=pooling == "rank")
        return EmbedJob(id=job, inputs=[pack_tokens(t) for t in inputs], pooling=pooling, normalize=normalize)  # type: ignore[arg-type]

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

    def client_gone(self, client: bytes) -> None:
        """Its answers are not sent (the worker's work is not stopped: it is short); its waiting requests go."""
        for r in self.running.values():
            if r.client == client:
                r.client = b""
        self.waiting = deque(w for w in self.waiting if w.client != client)
