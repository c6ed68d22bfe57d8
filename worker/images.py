"""Images encoded off the compute thread (issue 64): the projector's forward (common/projector.py `encode_image`), which
takes seconds for a real projector on a CPU and touches no llama context, runs on a thread of its own, one image at a
time (the projector is not thread-safe: its calls are serialised), while the compute thread goes on stepping the other
slots. A slot whose image is encoding gets no rows (worker/batching.py `_chunk`: an image's rows are decoded on their
own) until its rows are ready; the core then decodes them into its sequence (worker/core.py `_images`): whole where
they attend to each other (Gemma 3's), a part of n_batch rows a step where they are causal (Qwen-VL's: `ImageRows`).

`Encodings` is the compute thread's side: which slot waits for which image, started, taken when done, or dropped when
the job it was for ended meanwhile (cancelled, past its deadline, failed, handed back, forgotten): a dropped image's
rows are freed once its encode ends, on the compute thread, which alone frees them. The thread is a daemon: a worker
that stops does not wait for an encode under way (`close`).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from common import logs
from common.projector import EncodedImage, Projector
from worker.task import Task

log = logs.get(__name__)

# how often a compute thread with nothing to compute but images being encoded looks at its jobs' cancels and deadlines
# (worker/engine.py: an encode that ends wakes it at once)
ENCODE_POLL_S = 0.05
# how long a stopping worker waits for an encode under way before it leaves it (and the model it reads) to the exit
CLOSE_WAIT_S = 0.5


@dataclass
class Encoding:
    """An image of a slot's prompt being encoded: the job it is for, where its rows go, its result when done."""

    task: Task
    start: int
    future: Future[EncodedImage]


@dataclass
class ImageRows:
    """A causal image (Qwen-VL's) part-way through its decode: a part of its rows goes into the slot each step, so
    an image of thousands of rows does not hold the other slots' decodes up for all of it (worker/core.py `_images`)."""

    task: Task
    start: int
    encoded: EncodedImage
    n_pos: int
    done: int = 0  # rows decoded so far


class Encoder:
    """The thread that encodes images, one at a time, in the order they come."""

    def __init__(self, projector: Projector, n_batch: int, wake: Callable[[], None]) -> None:
        self.projector, self.n_batch = projector, n_batch
        self.wake = wake  # called when an encode ends (its thread): the compute thread may be waiting for it
        self.encode = projector.encode_image  # (tests replace it to hold an encode)
        self._queue: queue.SimpleQueue[tuple[bytes, Future[EncodedImage]] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, data: bytes) -> Future[EncodedImage]:
        fut: Future[EncodedImage] = Future()
        if self._thread is None:
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._run, args=(self._queue,), name="kvroute-encode", daemon=True)
            self._thread.start()
        self._queue.put((data, fut))
        return fut

    def close(self, wait_s: float = CLOSE_WAIT_S) -> bool:
        """Stop the thread after the encode under way, waiting `wait_s` at most for it; the queued ones are cancelled
        (a slot still waiting for one starts it again: `Encodings.take`). Whether the thread has ended: if not, an
        encode is still running, and the model and projector it reads must not be freed."""
        thread, self._thread = self._thread, None
        if thread is None:
            return True
        with contextlib.suppress(queue.Empty):
            while (item := self._queue.get_nowait()) is not None:
                item[1].cancel()
        self._queue.put(None)
        thread.join(wait_s)
        return not thread.is_alive()

    def _run(self, q: queue.SimpleQueue[tuple[bytes, Future[EncodedImage]] | None]) -> None:
        while (item := q.get()) is not None:
            data, fut = item
            if not fut.set_running_or_notify_cancel():
                continue  # (dropped before it started)
            try:
                fut.set_result(self.encode(data, self.n_batch))
            except BaseException as exc:  # (any error is the job's, told on the compute thread)
                fut.set_exception(exc)
            self.wake()


class Encodings:
    """Which slot's image is encoding; every method on the compute thread."""

    def __init__(self, encoder: Encoder) -> None:
        self.encoder = encoder
        self.pending: dict[int, Encoding] = {}  # by slot id
        self.parts: dict[int, ImageRows] = {}  # by slot id: images whose rows are being decoded, a part a step
        self._dropped: list[Future[EncodedImage]] = []  # encodes whose job ended: freed once they end

    def start(self, slot: int, task: Task, start: int, data: bytes) -> None:
        self.pending[slot] = Encoding(task, start, self.encoder.submit(data))

    def take(self, slot: int) -> Encoding | None:
        """The slot's encoding, when it has ended (its result or error in its future); None while it runs."""
        enc = self.pending.get(slot)
        if enc is None or not enc.future.done():
            return None
        del self.pending[slot]
        return None if enc.future.cancelled() else enc  # (cancelled by `Encoder.close`: started again next step)

    def drop_ended(self, current: Callable[[int], Task | None]) -> None:
        """Drop the encodings and part-decoded images whose job no longer holds their slot (`current`: the task a slot
        holds now), and free the rows of dropped encodes that have ended."""
        for slot, enc in list(self.pending.items()):
            if current(slot) is not enc.task:
                del self.pending[slot]
                log.info("image_encode_dropped", request_id=enc.task.id, slot=slot, start=enc.start)
                if not enc.future.cancel():  # (not started: never computed)
                    self._dropped.append(enc.future)
        for slot, part in list(self.parts.items()):
            if current(slot) is not part.task:
                del self.parts[slot]
                log.info("image_rows_dropped", request_id=part.task.id, slot=slot, start=part.start, done=part.done)
                part.encoded.free()
        for fut in [f for f in self._dropped if f.done()]:
            self._dropped.remove(fut)
            if fut.exception() is None:
                fut.result().free()

    def waiting_only(self, slots: list[int]) -> bool:
        """Whether every one of `slots` waits for its image (so a step has nothing to compute until one ends)."""
        return bool(self.pending) and all(s in self.pending for s in slots)

    def close(self) -> bool:
        return self.encoder.close()
