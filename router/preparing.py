"""The router's preparing threads, shared fairly between the clients that send work to them.

Every request that costs preparation (a submit's template, grammar and tokens; tokenize, detokenize, embed and rerank
inputs; a large frame's decoding) is a `Work` queued here under its owner: the API key an HTTP front names
(`owner` on the message), else the ZMQ client that sent it. The threads take work in turn across owners (the owner
whose last piece started longest ago goes first), so an owner that floods preparation waits behind its own work, not
behind others'.

One thread more takes only small work (a frame of SMALL_BYTES or less whose texts llama.cpp tokenizes in SMALL_COST_S,
by router/prompt_tokens.py's estimate): a one-line chat is never stuck behind the 60 kB tokenizes of the same owner
(without API keys every HTTP client is one owner), nor behind those of anyone else.

Admission: an owner may have PER_OWNER pieces here (waiting or running), all owners MAX_WAITING pieces of
MAX_WAITING_BYTES together; more are refused at once with `queue_full`. A piece's deadline (`--prepare-timeout-s`)
runs from its arrival, not from when a thread takes it: a piece that waited past it is answered `queue_full` without
being started, and one whose wait left it too little time (its deadline passed while it ran, or its own estimate said
it would) is answered `queue_full` too: the client may try again later, where a piece refused with its whole time
before it is the request's own problem (a 400 naming the field).

Owned by the router's event loop: `submit` and the threads' completions run there; only `Work.run` runs on a thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from chat.limits import Deadline, DeadlinePassed
from common import logs
from protocol import ErrorCode, Refusal
from router.admission import RETRY_AFTER_MS, Busy
from router.metrics import Metrics
from router.prepare import OutOfTime

log = logs.get(__name__)

# threads taking any work: half the CPUs this process may use, 1 to 4 (llama_tokenize releases the GIL, so they run side
# by side; on 2 cores a second one took the worker's CPU: a one-token chat beside a flood of long tokenizes took 2.0-2.1x
# its time with two, 1.1-1.7x with one)
THREADS = max(1, min(4, len(os.sched_getaffinity(0)) // 2 if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2) // 2))
SMALL_THREADS = 1  # take small work only
SMALL_BYTES = 16 * 1024  # a frame this small may be cheap to prepare (a chat turn, a tokenize of a line) ...
SMALL_COST_S = 0.05  # ... when its texts' tokenizing takes no longer (15 kB of `<` takes seconds)
PER_OWNER = 256  # pieces of one owner here at once, waiting or running (as many as the default queue holds)
MAX_WAITING = 4096  # pieces of all owners waiting
MAX_WAITING_BYTES = 512 << 20  # the frames they came in, together
WAITED_SHARE = 0.1  # a piece that waited this share of its deadline and then ran out of time is the server's load's


@dataclass(eq=False)
class Work:
    """One piece of preparation: `run(deadline)` on a thread, then `then(its result, or the exception it raised)` on
    the loop."""

    owner: Hashable
    kind: str  # what it prepares, for the counters: submit, tokenize, embed, rerank, decode ...
    size: int  # bytes of the frame it came in
    small: bool  # cheap: the small-work thread may take it
    run: Callable[[Deadline], Any]
    then: Callable[[Any], None]
    deadline: Deadline
    arrived: float = field(default_factory=time.monotonic)


class Preparing:
    """The queue in front of the preparing threads. `submit` queues work (or refuses it); `after` is called on the
    loop once a piece's `then` has run (the router sends what it produced)."""

    def __init__(self, timeout_s: float, metrics: Metrics, after: Callable[[], None] = lambda: None) -> None:
        self.timeout_s, self.metrics, self.after = timeout_s, metrics, after
        # (not at a lower priority: a thread holding the GIL, and preempted for it, stalled the loop 100+ ms)
        self._pool = concurrent.futures.ThreadPoolExecutor(THREADS + SMALL_THREADS, "kvroute-prepare")
        self._waiting: dict[Hashable, deque[Work]] = {}  # by owner, in arrival order
        self._held: dict[Hashable, int] = {}  # owner -> its pieces here, waiting or running
        self._last_turn: dict[Hashable, int] = {}  # owner with pieces here -> when a piece of its last started
        self._turns = 0
        self._waiting_bytes = 0
        self._running = {False: 0, True: 0}  # pieces running on the threads for any work (False), for small work (True)

    def admit(self, owner: Hashable, kind: str, size: int = 0) -> Refusal | None:
        """Why `owner` cannot queue one more piece of `size` bytes now, or None."""
        if self.metrics.prepare_waiting >= MAX_WAITING or self._waiting_bytes + size > MAX_WAITING_BYTES:
            text = f"{self.metrics.prepare_waiting} requests ({self._waiting_bytes >> 20} MiB) are already waiting to be prepared"
        elif self._held.get(owner, 0) >= PER_OWNER:
            text = f"this client already has {PER_OWNER} requests being prepared or waiting to be"
        else:
            return None
        self.metrics.prepare_refused[kind] += 1
        return Refusal(ErrorCode.QUEUE_FULL, text, retry_after_ms=RETRY_AFTER_MS)

    def submit(
        self,
        owner: Hashable,
        kind: str,
        size: int,
        run: Callable[[Deadline], Any],
        then: Callable[[Any], None],
        small: bool = False,
    ) -> None:
        """Queue `run` for `owner` (`size` bytes of frame; `small`: cheap, see the module's docstring); `then` gets its
        result, its exception, or Busy when it is refused (at once, or when its deadline passed while it waited)."""
        refusal = self.admit(owner, kind, size)
        if refusal is not None:
            self._settle(then, Busy(refusal))
            return
        self.metrics.preparations[kind] += 1
        work = Work(owner, kind, size, small and size <= SMALL_BYTES, run, then, Deadline(self.timeout_s))
        self._held[owner] = self._held.get(owner, 0) + 1
        self._waiting.setdefault(owner, deque()).append(work)
        self.metrics.prepare_waiting += 1
        self._waiting_bytes += size
        self._start()

    def expire(self, now: float) -> None:
        """Answer the waiting pieces whose deadline passed (on the router's tick: a client is not kept waiting for a
        thread past it). An owner's pieces wait in arrival order, and all have the same timeout."""
        for owner in list(self._waiting):
            queue = self._waiting[owner]
            while queue and _late(queue[0], now):
                self._expired(self._take(queue.popleft()))
            if not queue:
                del self._waiting[owner]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- the threads ----

    def _start(self) -> None:
        """Give each free thread its next piece: the owner next in turn with waiting work (for the small threads: with
        small work waiting), its oldest such piece. A piece already past its deadline is answered, not started."""
        for small, threads in ((False, THREADS), (True, SMALL_THREADS)):
            while self._running[small] < threads and (work := self._next(small_only=small)) is not None:
                if _late(work, time.monotonic()):
                    self._expired(work)
                    continue
                self._running[small] += 1
                self._launch(work, small_thread=small)

    def _next(self, small_only: bool) -> Work | None:
        """The oldest (small) piece of the owner whose turn it is: of those with such work waiting, the one whose last
        piece started longest ago (an owner new here first)."""
        best: tuple[int, Hashable, Work] | None = None
        for owner, queue in self._waiting.items():
            work = next((w for w in queue if w.small), None) if small_only else queue[0]
            turn = self._last_turn.get(owner, -1)
            if work is not None and (best is None or turn < best[0]):
                best = (turn, owner, work)
        if best is None:
            return None
        _, owner, work = best
        queue = self._waiting[owner]
        queue.remove(work)
        if not queue:
            del self._waiting[owner]
        self._turns += 1
        self._last_turn[owner] = self._turns
        return self._take(work)

    def _take(self, work: Work) -> Work:
        """`work` leaves the waiting queue."""
        self.metrics.prepare_waiting -= 1
        self._waiting_bytes -= work.size
        self.metrics.prepare_wait_ms.observe((time.monotonic() - work.arrived) * 1000)
        return work

    def _launch(self, work: Work, small_thread: bool) -> None:
        waited = time.monotonic() - work.arrived

        def done(fut: asyncio.Future[Any]) -> None:
            if fut.cancelled():
                return  # (the router is stopping)
            self._running[small_thread] -= 1
            outcome = fut.exception() or fut.result()
            if isinstance(outcome, DeadlinePassed | OutOfTime) and waited > WAITED_SHARE * self.timeout_s:
                self._expired(work, waited, str(outcome))  # (its wait, not its own cost, left it too little time)
            else:
                self._release(work.owner)
                self._settle(work.then, outcome)
            self._start()

        loop = asyncio.get_running_loop()
        loop.run_in_executor(self._pool, work.run, work.deadline).add_done_callback(done)

    def _expired(self, work: Work, waited: float | None = None, why: str = "") -> None:
        """Answer `work` queue_full: it waited past its deadline, or `waited` so long that what was left of its
        deadline was too little (`why`: what its own check said)."""
        self._release(work.owner)
        self.metrics.prepare_refused[work.kind] += 1
        waited = time.monotonic() - work.arrived if waited is None else waited
        log.info("prepare_expired", kind=work.kind, waited_s=round(waited, 2), timeout_s=self.timeout_s)
        what = f"what was left of the {self.timeout_s:g} s" if why else f"the {self.timeout_s:g} s"
        text = (
            f"this request waited {waited:.1f} s for a preparing thread (the router is busy preparing other requests), "
            f"and {what} a request's preparation may take (--prepare-timeout-s) was too little" + (f": {why}" if why else "")
        )
        self._settle(work.then, Busy(Refusal(ErrorCode.QUEUE_FULL, text, retry_after_ms=RETRY_AFTER_MS)))

    def _release(self, owner: Hashable) -> None:
        left = self._held.get(owner, 0) - 1
        if left > 0:
            self._held[owner] = left
        else:  # (nothing of its here: forgotten, so that the tables hold only the owners with work)
            self._held.pop(owner, None)
            self._last_turn.pop(owner, None)

    def _settle(self, then: Callable[[Any], None], outcome: Any) -> None:
        try:
            then(outcome)
        except Exception as exc:  # (`then` settles its request itself; this is its last resort)
            log.error("prepared_crashed", error=repr(exc), exc_info=exc)
        self.after()


def _late(work: Work, now: float) -> bool:
    return work.deadline.at is not None and now > work.deadline.at
