"""What the worker process tells its routers of itself (worker/main.py sends it): the hello, until a router accepts it
(who it is: this start's incarnation, its model and weights, its slots and device, and what its slots and saved
states hold), then a heartbeat every second (how it is: its slots, queue, counters and progress).
"""

from __future__ import annotations

import os
import time

from common import logs
from common.weights import GGUFError, weights_fingerprint
from protocol import CacheEntry, Heartbeat, Hello
from worker.config import WorkerConfig
from worker.engine import Engine
from worker.links import RouterLink, SlotClaims

log = logs.get(__name__)

HELD_WAIT_S = 2.0  # a hello waits this long for the compute thread to say what the slots hold, then says "unknown"


class Reports:
    """The hello and the heartbeat of one worker process, to the routers of `links`."""

    def __init__(self, cfg: WorkerConfig, engine: Engine, links: list[RouterLink], claims: SlotClaims) -> None:
        self.cfg, self.engine, self.links, self.claims = cfg, engine, links, claims
        # every process start is a new incarnation, so a router never mistakes it for the process before it
        self.incarnation = cfg.incarnation if cfg.incarnation is not None else time.time_ns() // 1_000_000
        try:
            self.weights = weights_fingerprint(engine.vocab.path)
        except (GGUFError, OSError) as exc:
            log.warning("no_weights_fingerprint", reason=str(exc))
            self.weights = ""

    def hello(self, link: RouterLink) -> Hello:
        """The hello to `link`'s router; it notes on the link whether it said what the slots hold."""
        llama = self.engine.llama
        cached: list[CacheEntry] = []
        try:
            held, cached = self.engine.held().result(timeout=HELD_WAIT_S)
        except TimeoutError:
            held = None
            log.warning("slots_unknown", reason=f"the compute thread did not answer in {HELD_WAIT_S:g} s")
        if held is not None and len(self.links) > 1:  # a slot another router's jobs hold changes: unknown until updated
            claimed = self.claims.claimed()
            held = [h for h in held if h.slot not in claimed]
        link.told_held = held is not None
        return Hello(
            worker_id=self.cfg.worker_id,
            incarnation=self.incarnation,
            slots=self.cfg.slots,
            ctx_per_slot=self.engine.n_ctx,
            model_fingerprint=self.engine.vocab.fingerprint,
            device=llama.device,
            kv_bytes=llama.info.kv_bytes,
            host_cache_bytes=self.engine.host.capacity,
            n_batch=self.cfg.n_batch,
            deterministic=self.cfg.deterministic,
            pid=os.getpid(),
            weights_fingerprint=self.weights,
            held=held,
            cached=cached,
            model=self.cfg.model_name,
        )

    def heartbeat(self, draining: bool) -> Heartbeat:
        """`draining`: this process is draining (a signal), whether or not the engine was told to by a router."""
        e = self.engine
        return Heartbeat(
            worker_id=self.cfg.worker_id,
            incarnation=self.incarnation,
            slots=e.slot_states(),
            queue=e.queue_len,
            draining=e.draining or draining,
            counters=e.figures(),
            progress=e.progress,
        )
