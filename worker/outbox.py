"""What the worker sends, from the thread that makes it to the I/O thread that owns the sockets (worker/main.py).

The compute thread (worker/engine.py) ends each job's messages in a sink made here: a job's messages go to the router
that sent it, a step's deltas together as one message (`flush_deltas`, after every step: the router's cost is per
message more than per token), a job's deltas always before its end. With routers side by side (worker/links.py), a
job's end first tells every other router what its slot holds now and which saved states changed. A job whose client
reads its output itself (Job.reply_to) has its deltas and its end go to that client's endpoint too
(worker/direct_replies.py). Every message crosses to the I/O thread through an inproc PUSH socket, one per producing
thread, to the PULL socket the I/O thread reads (`endpoint`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import zmq

from protocol import EmbedDone, Error, Job, JobDelta, JobDeltas, JobDone, JobError, Message, SlotUpdate, encode, pack_tokens
from worker.checkpoints import cuts
from worker.links import RouterLink, SlotClaims

if TYPE_CHECKING:
    from worker.engine import Engine

Target = tuple[str, str]  # a client's reply endpoint and its key


class Outbox:
    """The sinks of the jobs of `links`' routers, handing each message to the I/O thread (a PULL socket bound at
    `endpoint` in `ctx`). Its sinks and `flush_deltas` are called on the compute thread, `push_out` on any thread."""

    def __init__(self, ctx: zmq.Context, endpoint: str, links: list[RouterLink], claims: SlotClaims, engine: Engine) -> None:
        self.ctx, self.endpoint, self.links, self.claims, self.engine = ctx, endpoint, links, claims, engine
        self._push = threading.local()
        self.reply_deltas: dict[Target, list[JobDelta]] = {}  # this step's, by reply endpoint
        self._deltas_lock = threading.Lock()

    @property
    def side_by_side(self) -> bool:
        """This worker reports to several routers."""
        return len(self.links) > 1

    def sink_for(self, link: RouterLink) -> Callable[[Message], None]:
        return lambda msg: self.sink(link, msg)

    def sink(self, link: RouterLink, msg: Message) -> None:
        """Called by the compute thread: hand a job's message to the I/O thread, for the router that sent the job.
        Deltas wait for the step's end (`flush_deltas`): the router's cost is per message more than per token. A router
        that did not say it reads `job_deltas` (an older one) gets each delta alone."""
        if isinstance(msg, JobDelta) and link.step_deltas:
            with self._deltas_lock:
                link.deltas.append(msg)
            return
        self.flush_deltas()  # a job's deltas go before its JobDone or JobError
        if isinstance(msg, SlotUpdate) and self.side_by_side:  # (saved states a placing changed: every router's)
            frame = encode(msg)
            for other in self.links:
                if other is not link and other.notices:
                    self.push_out(other, frame)
        if isinstance(msg, EmbedDone):
            link.jobs.discard(msg.id)
        elif isinstance(msg, JobDone | JobError):
            if not (isinstance(msg, JobError) and msg.suspended):  # (a suspended job is still its router's)
                link.jobs.discard(msg.id)
            if self.side_by_side:  # (before its router hears of the end: the slot is free for its next job then)
                self._tell_others(link, msg)
        self.push_out(link, encode(msg))

    def direct_sink(self, link: RouterLink, job: Job) -> Callable[[Message], None]:
        """The sink of a job whose client reads its output itself: the deltas go to the client's endpoint (a step's
        together), the router gets the first one without its text (output began: the prompt is computed, the request
        cannot be placed again) and the JobDone, which the client gets after it; a JobError goes to the router only (it
        places the request again or tells the client), an Error (its router forgot the job) to the client only."""
        target = (job.reply_to, job.reply_key)

        def sink(msg: Message) -> None:
            if isinstance(msg, JobDelta):
                with self._deltas_lock:
                    self.reply_deltas.setdefault(target, []).append(msg)
                if msg.reused_tokens is not None:
                    self.sink(link, JobDelta(id=msg.id, text="", tokens=b"", reused_tokens=msg.reused_tokens))
                return
            self.flush_deltas()
            if isinstance(msg, Error):
                self.push_reply(target, encode(msg))
                return
            # the routers first (other routers' slot_update, then the job's router): the client's next turn may go to
            # any of them at once, and each must know what the slot holds by then
            self.sink(link, msg)
            if isinstance(msg, JobDone):
                self.push_reply(target, encode(msg))

        return sink

    def _tell_others(self, link: RouterLink, end: JobDone | JobError) -> None:
        """A job ended (on the compute thread, so its slot is as the job left it): every other router learns what the
        slot holds and which saved states changed, and the slot is free for any router's jobs."""
        released = self.claims.release(end.id)
        if released is not None:
            update = self.slot_update(*released[:2])
        elif end.cache_added or end.cache_dropped or end.disk_dropped:
            update = SlotUpdate(slot=-1, epoch=0, tokens=b"")  # (only the saved states changed)
        else:
            return
        update.cache_added, update.cache_dropped, update.disk_dropped = end.cache_added, end.cache_dropped, end.disk_dropped
        frame = encode(update)
        for other in self.links:
            if other is not link and other.notices:
                self.push_out(other, frame)

    def slot_update(self, slot_id: int, epoch: int) -> SlotUpdate:
        """What a slot holds now (on the compute thread)."""
        core = self.engine.core
        slot = core.table[slot_id]
        tokens, min_keep = pack_tokens(slot.tokens), core.prefixes.min_keep(slot)
        return SlotUpdate(
            slot=slot_id,
            epoch=epoch,
            tokens=tokens,
            n_exact=slot.n_exact,
            salt=slot.salt,
            min_keep=min_keep,
            cuts=cuts(slot.checkpoints),
        )

    def flush_deltas(self) -> None:
        """The deltas of the step just made, as one message per router and per reply endpoint (one delta: a plain
        JobDelta)."""
        with self._deltas_lock:
            batches = [(link, link.deltas) for link in self.links if link.deltas]
            for link, _ in batches:
                link.deltas = []
            direct, self.reply_deltas = self.reply_deltas, {}
        for link, deltas in batches:
            self.push_out(link, encode(deltas[0] if len(deltas) == 1 else JobDeltas(items=deltas)))
        for target, deltas in direct.items():
            self.push_reply(target, encode(deltas[0] if len(deltas) == 1 else JobDeltas(items=deltas)))

    def push_reply(self, target: Target, frame: bytes) -> None:
        """To the I/O thread, for a client's reply endpoint."""
        self._push_socket().send_multipart([target[0].encode(), target[1].encode(), frame])

    def push_out(self, link: RouterLink, frame: bytes) -> None:
        """To the I/O thread, for a router."""
        self._push_socket().send_multipart([bytes([link.index]), frame])

    def _push_socket(self) -> zmq.Socket:
        sock = getattr(self._push, "sock", None)
        if sock is None:
            sock = self._push.sock = self.ctx.socket(zmq.PUSH)
            sock.connect(self.endpoint)
        return sock
