"""Embed jobs (PROTOCOL.md `embed_job`, a `rerank`'s too): the worker's queue of them, computed a chunk of one input at
a time between two engine steps (worker/engine.py's loop), so that the slots' jobs wait for one chunk at most, never
for a whole request of many long inputs. While slots generate beside them, a chunk is as many tokens as take about
STEP_S at the embedder's measured speed; with nothing else to run, a whole ubatch. A chunk computed is engine progress:
a long request is not a hang.

Jobs take turns an input at a time, in arrival order (a small request waits for one input of a large one, not for all
of it), each input decoded alone in the embedder of its pooling (worker/embedder.py, made at its
first use, which pools an input over its chunks): its vector does not depend on what runs beside it. An embedder is
made on a thread of its own (with `wake`): a new context allocates its memory, which took seconds on a loaded 2-core
machine, and the slots' steps go on meanwhile; its jobs wait for it. A job's end goes
to its sink: EmbedDone, or JobError (an input over the embedding context `bad_request`, a failure `internal`,
`cancelled` by its router, `draining` when handed back). Owned by the compute thread.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Collection
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from common import logs
from protocol import EmbedDone, EmbedJob, ErrorCode, JobError, Refusal, unpack_tokens
from worker.embedder import EmbedInput, InputTooLong, normalized

log = logs.get(__name__)

STEP_S = 0.25  # embedding work between two steps while slots generate: what their next token waits for it, at most
FIRST_CHUNK = 16  # tokens of a chunk beside generating slots before the embedder's speed is known (~STEP_S here: the
# default model's embedding context computes its logits for every token too, ~65 tokens/s on one of these cores)

EmbedSink = Callable[[EmbedDone | JobError], None]


class EmbedderLike(Protocol):
    """What a job needs of an embedder (worker/embedder.py's `Embedder`; tests give a fake)."""

    dims: int
    reused_tokens: int

    def check(self, lengths: list[int]) -> None: ...
    def begin(self, toks: list[int]) -> EmbedInput: ...
    def advance(self, inp: EmbedInput, most: int) -> np.ndarray | None: ...
    def close(self) -> None: ...


@dataclass(eq=False)
class EmbedRun:
    """One embed job in the queue, and its vectors so far."""

    job: EmbedJob
    sink: EmbedSink
    t0: float = field(default_factory=time.monotonic)
    vectors: list[bytes] = field(default_factory=list)
    reused: int = 0  # input tokens whose KV was kept from the input before (the embedder's docstring)
    current: EmbedInput | None = None  # the input being computed

    @property
    def so_far(self) -> str:
        return f"{len(self.vectors)} of {len(self.job.inputs)} inputs"


class EmbedJobs:
    """The embed jobs waiting or running, the one whose turn it is first; `run_one` computes the next chunk of its
    input."""

    def __init__(self, make: Callable[[str], EmbedderLike], wake: Callable[[], None] | None = None) -> None:
        self.make = make  # an embedder for a pooling kind
        self.wake = wake  # given: embedders are made on a thread, which calls it when one is ready; else made inline
        self.embedders: dict[str, EmbedderLike] = {}  # by pooling, made at first use
        self.making: dict[str, tuple[Future[EmbedderLike], threading.Thread]] = {}  # by pooling, on their threads
        self.queue: deque[EmbedRun] = deque()
        self.computed = 0  # chunks computed (or failed) so far: part of the engine's progress
        self.tokens_per_s = 0.0  # the embedders' speed, measured (a moving average over chunks)

    def __len__(self) -> int:
        return len(self.queue)

    def add(self, job: EmbedJob, sink: EmbedSink) -> None:
        self.queue.append(EmbedRun(job, sink))

    def run_one(self, beside: bool = False) -> None:
        """The next chunk of the first job's input (one decode): `beside` slots that generate, about STEP_S of work;
        else a whole ubatch. After its last input, or a failure, the job's end to its sink."""
        if not self.queue:
            return
        run = self.queue[0]
        end: EmbedDone | JobError | None
        try:
            embedder = self._embedder(run.job.pooling)  # (raises when its context could not be made: this job fails)
            if embedder is None:
                return  # (being made on its thread: the slots step on; it wakes the engine when it is ready)
            end = self._next(run, embedder, self.chunk() if beside else 1 << 30)
        except InputTooLong as exc:
            end = Refusal(ErrorCode.BAD_REQUEST, str(exc)).job_error(run.job.id)
        except Exception as exc:  # a failure of this job's, not the worker's: its router gets the reason
            error_id = uuid.uuid4().hex[:12]
            log.exception("embed_failed", job=run.job.id, error_id=error_id)
            end = JobError(id=run.job.id, code=ErrorCode.INTERNAL, message=f"embeddings failed: {exc}", error_id=error_id)
        self.computed += 1
        if end is not None:
            self.queue.popleft()
            _send(run, end)
        elif run.current is None:  # (an input done: the next job's turn; one input at a time, the context holds one)
            self.queue.rotate(-1)

    def chunk(self) -> int:
        """Tokens of a chunk beside generating slots: about STEP_S of work at the measured speed."""
        return max(1, int(self.tokens_per_s * STEP_S)) if self.tokens_per_s else FIRST_CHUNK

    def waiting_for_embedder(self) -> bool:
        """Whether the job whose turn it is waits for its embedder to be made (nothing to compute for it until then)."""
        if not self.queue:
            return False
        making = self.making.get(self.queue[0].job.pooling)
        return making is not None and not making[0].done()

    def _embedder(self, pooling: str) -> EmbedderLike | None:
        """The embedder of `pooling`, or None while its thread makes it (started here at its first use). One that could
        not be made raises here, for the job whose turn it is; the next job of that pooling tries again."""
        embedder = self.embedders.get(pooling)
        if embedder is not None:
            return embedder
        if self.wake is None:
            embedder = self.embedders[pooling] = self.make(pooling)
            return embedder
        making = self.making.get(pooling)
        if making is None:
            self.making[pooling] = self._start_making(pooling)
            return None
        if not making[0].done():
            return None
        del self.making[pooling]
        embedder = self.embedders[pooling] = making[0].result()
        return embedder

    def _start_making(self, pooling: str) -> tuple[Future[EmbedderLike], threading.Thread]:
        fut: Future[EmbedderLike] = Future()
        wake = self.wake
        assert wake is not None

        def make() -> None:
            try:
                fut.set_result(self.make(pooling))
            except BaseException as exc:  # (told to the job whose turn it is, on the compute thread)
                fut.set_exception(exc)
            wake()

        thread = threading.Thread(target=make, name=f"kvroute-embedder-{pooling}", daemon=True)
        thread.start()
        return fut, thread

    def _next(self, run: EmbedRun, embedder: EmbedderLike, most: int) -> EmbedDone | None:
        job = run.job
        if run.current is None:
            if not run.vectors:  # refused whole before any work
                embedder.check([len(t) // 4 for t in job.inputs])  # (4 bytes a token id)
            before = embedder.reused_tokens
            run.current = embedder.begin(unpack_tokens(job.inputs[len(run.vectors)]))
            run.reused += embedder.reused_tokens - before
        inp, pos, t0 = run.current, run.current.pos, time.perf_counter()
        vector = embedder.advance(inp, most)
        self._timed(inp.pos - pos, time.perf_counter() - t0)
        if vector is None:
            return None
        run.current = None
        run.vectors.append((normalized(vector) if job.normalize else vector).astype("<f4").tobytes())
        if len(run.vectors) < len(job.inputs):
            return None
        ms = (time.monotonic() - run.t0) * 1000
        return EmbedDone(id=job.id, vectors=run.vectors, dims=embedder.dims, ms=ms, reused_tokens=run.reused)

    def _timed(self, tokens: int, seconds: float) -> None:
        if tokens >= FIRST_CHUNK and seconds > 0:  # (a few tokens' time is mostly the decode's fixed cost)
            rate = tokens / seconds
            self.tokens_per_s = rate if not self.tokens_per_s else 0.7 * self.tokens_per_s + 0.3 * rate

    def cancel(self, job_id: str) -> bool:
        """Drop a job's inputs still to compute; it ends with JobError `cancelled`. False: no such job here."""
        run = next((r for r in self.queue if r.job.id == job_id), None)
        if run is None:
            return False
        self.queue.remove(run)
        _send(run, JobError(id=job_id, code=ErrorCode.CANCELLED, message=f"cancelled after {run.so_far}"))
        return True

    def take(self, only: Collection[str] | None = None) -> list[EmbedRun]:
        """Every job (or those `only` names) out of the queue, without a word (the others stay, in their order)."""
        taken = [r for r in self.queue if only is None or r.job.id in only]
        self.queue = deque(r for r in self.queue if r not in taken)
        return taken

    def hand_back(self) -> int:
        """End every job with JobError `draining` (the worker is stopping); how many."""
        runs = self.take()
        for run in runs:
            message = f"the worker is shutting down; these embeddings stopped after {run.so_far}"
            _send(run, JobError(id=run.job.id, code=ErrorCode.DRAINING, message=message))
        return len(runs)

    def close(self) -> None:
        """Free every embedder, those being made once their thread ends (they read the model, freed after this)."""
        for fut, thread in self.making.values():
            thread.join()
            if fut.exception() is None:
                fut.result().close()
        self.making.clear()
        for embedder in self.embedders.values():
            embedder.close()
        self.embedders.clear()


def _send(run: EmbedRun, end: EmbedDone | JobError) -> None:
    """A job's end to its sink; a sink that fails is logged (the compute thread goes on)."""
    try:
        run.sink(end)
    except Exception:
        log.exception("sink_failed", job=run.job.id, message=type(end).__name__)
