"""Router test helpers: a router running in a background thread, and a scripted fake worker (a real
DEALER socket speaking the protocol) for unit tests of the server logic."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from bench.systems import free_port
from common.vocab import Vocab
from protocol import (
    Heartbeat,
    Hello,
    Invalid,
    JobDelta,
    JobDone,
    SlotState,
    Timings,
    encode,
    pack_tokens,
    router_to_worker_decoder,
    token_hash,
    unpack_tokens,
)
from router.config import RouterConfig
from router.server import Router


def endpoints() -> tuple[str, str]:
    return f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"


class RouterThread:
    """Runs `make(loop)` -> coroutine in a thread's own event loop; the router object is `self.router`."""

    def __init__(self, start: Callable[[RouterThread], Any]) -> None:
        self.router: Router | None = None
        self.extra: dict[str, Any] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self._start = start
        self._error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        try:
            self.loop = asyncio.new_event_loop()
            self.loop.run_until_complete(self._start(self))
        except BaseException as exc:  # surfaced by start()/stop()
            self._error = exc

    def start(self, timeout_s: float = 30) -> RouterThread:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while (self.router is None or not self.router.ready.is_set()) and time.monotonic() < deadline:
            if self._error:
                raise self._error
            time.sleep(0.01)
        assert self.router is not None and self.router.ready.is_set(), "router did not start"
        return self

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn on the router's loop and return its result (state is owned by that loop)."""
        assert self.loop is not None
        fut = asyncio.run_coroutine_threadsafe(_acall(fn), self.loop)
        return fut.result(timeout=10)

    def stop(self) -> None:
        if self.router is not None and self.loop is not None and self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.router.stop)
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "router thread did not stop"
        if self._error:
            raise self._error


async def _acall(fn: Callable[[], Any]) -> Any:
    return fn()


def start_router(cfg: RouterConfig, vocab: Vocab) -> RouterThread:
    async def main(rt: RouterThread) -> None:
        rt.router = Router(cfg, vocab)
        await rt.router.run()

    return RouterThread(main).start()


class FakeWorker:
    """A scripted worker: the test decides when it answers and what it reports."""

    def __init__(self, endpoint: str, worker_id: str, vocab: Vocab, *, slots: int = 2, incarnation: int = 1, ctx: int = 4096):
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, worker_id.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.id, self.slots, self.incarnation = worker_id, slots, incarnation
        self.fingerprint, self.ctx_per_slot = vocab.fingerprint, ctx
        self.dec = router_to_worker_decoder()
        self.held: dict[int, list[int]] = {i: [] for i in range(slots)}

    def send(self, msg: Any) -> None:
        self.sock.send(encode(msg))

    def recv(self, timeout_s: float = 5.0) -> Any:
        assert self.sock.poll(int(timeout_s * 1000)), f"{self.id}: nothing from the router in {timeout_s} s"
        msg = self.dec.decode(self.sock.recv())
        assert not isinstance(msg, Invalid), msg
        return msg

    def hello(self, fingerprint: str | None = None) -> Any:
        self.send(
            Hello(
                worker_id=self.id,
                incarnation=self.incarnation,
                slots=self.slots,
                ctx_per_slot=self.ctx_per_slot,
                model_fingerprint=fingerprint or self.fingerprint,
                device="cpu",
            )
        )
        return self.recv()

    def heartbeat(self) -> None:
        states = [SlotState(slot=i, busy=False, n_tokens=len(t)) for i, t in self.held.items()]
        self.send(Heartbeat(worker_id=self.id, incarnation=self.incarnation, slots=states, queue=0))

    def delta(self, job: Any, tokens: list[int], text: str = "x") -> None:
        self.send(JobDelta(id=job.id, text=text, tokens=pack_tokens(tokens)))

    def done(self, job: Any, generated: list[int], *, slot_hash: str | None = None, reused: int | None = None) -> None:
        """Finish `job` as a correct worker would (prompt + generated - 1 kept), unless told otherwise."""
        prompt = unpack_tokens(job.tokens)
        old = self.held[job.slot] if job.prefix_cache else []
        lcp = 0
        while lcp < min(len(old), len(prompt)) and old[lcp] == prompt[lcp]:
            lcp += 1
        lcp = min(lcp, len(prompt) - 1)
        kept = (prompt + generated)[: len(prompt) + len(generated) - 1]
        self.held[job.slot] = kept
        self.send(
            JobDone(
                id=job.id,
                slot=job.slot,
                finish_reason="length",
                text="x" * len(generated),
                tokens=pack_tokens(generated),
                prompt_tokens=len(prompt),
                reused_tokens=lcp if reused is None else reused,
                prefilled_tokens=len(prompt) - lcp,
                generated_tokens=len(generated),
                slot_tokens=len(kept),
                slot_hash=slot_hash or token_hash(kept),
                timings=Timings(),
            )
        )

    def close(self) -> None:
        self.sock.close(0)
