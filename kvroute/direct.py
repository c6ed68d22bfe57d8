"""Direct replies: a client's end of a token path that skips the router (PROTOCOL.md 4.4).

The client binds a PULL socket and names it in each submit (`reply_to`). The router places the request and answers
`placed` (the job, its worker, how to read the output); the worker sends the job's output straight here: `job_start`
when it takes the job, each step's `job_delta`s, then `job_done`. This module turns them into the `delta`s and the
`result` the router would have sent (chat/reply_messages.py builds both, for the router too), so that a client's readers see
no difference, and the router spends nothing per token.

The two paths are not ordered: a job's first messages may come before its `placed`, and wait for it (up to EARLY_MAX
messages, EARLY_S). A `placed` whose worker says nothing here in START_S means that worker cannot reach this endpoint
(an address only this host can reach, a firewall): the request is sent again with its replies through the router
(`resend`; else it ends with `reply_unreachable`), the log says what to set, and this client's later requests take
their replies through the router (`broken`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from chat import reply_messages
from chat.output import OutputSpec
from chat.output_parser import OutputParser
from common import logs
from common.files import runtime_dir
from common.inbox import Inbox
from protocol import (
    Error,
    ErrorCode,
    Invalid,
    JobDelta,
    JobDeltas,
    JobDone,
    JobStart,
    Placed,
    TokenLogprob,
    Usage,
    direct_reply_decoder,
)
from protocol.common import Timings

log = logs.get(__name__)

START_S = 10.0  # a placed job's worker has this long to reach the reply endpoint
ORPHAN_STALL_S = 10.0  # a job whose router is gone ends when its worker says nothing for this long
EARLY_S = 30.0  # a job's messages that came before its `placed` wait this long
EARLY_MAX = 4096  # ... and at most this many, over all jobs
CHECK_S = 1.0


def auto_endpoint(router_endpoint: str) -> str | None:
    """Where workers can reach this client when nothing says: the router is on this host (ipc, loopback), so are
    its local workers. None elsewhere (give the endpoint: `--reply-endpoint tcp://THIS_HOST:PORT`)."""
    if router_endpoint.startswith("ipc://"):
        try:  # (a directory only this user enters: no other user's process connects to it)
            return f"ipc://{runtime_dir()}/reply-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        except OSError as exc:
            log.warning("reply_endpoint_off", reason=str(exc), effect="replies come through the router")
            return None
    for host in ("tcp://127.0.0.1:", "tcp://localhost:", "tcp://[::1]:"):
        if router_endpoint.startswith(host):
            return "tcp://127.0.0.1:*"
    return None


@dataclass(eq=False)
class DirectJob:
    """A placed job whose output is read here."""

    rid: str
    placed: Placed
    parser: OutputParser
    at: float  # when it was placed (monotonic)
    started: bool = False  # its worker reached this endpoint (job_start)
    began: bool = False  # a delta of it was handed out: the request cannot run anywhere else now
    heard: float = 0.0  # when its worker's last message came (monotonic)
    orphan: str = ""  # its router is gone (this names it): only its worker's messages tell it is alive
    logprobs: list[TokenLogprob] = field(default_factory=list)


class DirectReplies:
    """The reply endpoint of one client. `on_reply(msg)` takes each Delta, Result and Error made for a request;
    `cancel(rid)` asks the router to stop one (its output broke here)."""

    def __init__(
        self,
        endpoint: str,
        on_reply: Callable[[Any], None],
        cancel: Callable[[str], None],
        *,
        curve: bool = False,
        resend: Callable[[str], bool] | None = None,
    ) -> None:
        self.on_reply, self.cancel = on_reply, cancel
        self.resend = resend  # a request whose worker cannot reach this endpoint, sent again through the router (True)
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()  # its own: a ZAP handler here (kvroute serve's) is not ours
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.key = ""
        if curve:  # an ephemeral key pair: workers get its public key with each job, through the router
            public, secret = zmq.curve_keypair()
            self.sock.setsockopt(zmq.CURVE_SERVER, 1)
            self.sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
            self.key = public.decode()
        self.sock.bind(endpoint)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if "0.0.0.0" in self.endpoint or "://*" in self.endpoint or "[::]" in self.endpoint:
            self.close()
            raise ValueError(f"reply endpoint {endpoint}: workers need an address to reach, not a wildcard host")
        self.path = endpoint[len("ipc://") :] if endpoint.startswith("ipc://") else None
        self.decoder = direct_reply_decoder()
        self.jobs: dict[str, DirectJob] = {}  # by job id
        self.current: dict[str, str] = {}  # request id -> its job now
        self.sent_at: dict[str, float] = {}  # request id -> when it was submitted
        self.early: dict[str, list[Any]] = {}  # job id -> messages that came before its `placed`
        self.early_at: dict[str, float] = {}
        self.early_kept = 0  # messages in `early`
        self.broken = False  # a worker could not reach this endpoint: later requests' replies come through the router
        self._checker: asyncio.Task[None] | None = None
        self._inbox: Inbox | None = None

    def start(self) -> None:
        """Read from this loop on (once)."""
        if self._inbox is None:
            self._inbox = Inbox(self.sock, self._frames, lambda: None)
            self._checker = asyncio.get_running_loop().create_task(self._check_loop())

    def close(self) -> None:
        if self._checker is not None:
            self._checker.cancel()
        if self._inbox is not None:
            self._inbox.close()
        self._inbox = self._checker = None
        self.sock.close(0)
        self.ctx.term()
        if self.path:
            with contextlib.suppress(OSError):
                os.unlink(self.path)

    # ---- the requests ---------------------------------------------------------------------------

    def expect(self, rid: str) -> None:
        """A request submitted with reply_to this endpoint."""
        self.sent_at[rid] = time.monotonic()

    def forget(self, rid: str) -> None:
        """The request ended (its result or error is out, or its reader left)."""
        self.sent_at.pop(rid, None)
        job = self.current.pop(rid, None)
        if job is not None:
            self.jobs.pop(job, None)

    def began(self, rid: str) -> bool:
        """Whether the request's output began here (it runs on a worker; its router is no longer needed for it)."""
        job = self.jobs.get(self.current.get(rid, ""))
        return job is not None and job.began

    def orphan(self, rid: str, router: str) -> None:
        """The request's router is gone; its worker goes on streaming here, and while it does the request lives."""
        job = self.jobs.get(self.current.get(rid, ""))
        if job is not None:
            job.orphan, job.heard = router, time.monotonic()

    def placed(self, msg: Placed) -> None:
        """The router placed a request (again): its job's output is read from now on."""
        rid = msg.id
        if rid not in self.sent_at:
            return  # (ended meanwhile)
        before = self.jobs.pop(self.current.get(rid, ""), None)
        if before is not None and before.began:  # its worker died after output began here, before the router knew
            message = f"worker {before.placed.worker} stopped after this request's output began; it was not run again"
            self._fail(rid, Error(id=rid, code=ErrorCode.WORKER_LOST, message=message))
            return
        try:
            spec = OutputSpec.from_wire(msg.format)
        except ValueError as exc:
            self._fail(rid, Error(id=rid, code=ErrorCode.INTERNAL, message=f"placed: {exc}"))
            return
        self.jobs[msg.job] = DirectJob(rid, msg, spec.parser(), time.monotonic())
        self.current[rid] = msg.job
        self.early_at.pop(msg.job, None)
        early = self.early.pop(msg.job, [])
        self.early_kept -= len(early)
        for m in early:
            self._take(m)

    def _fail(self, rid: str, error: Error) -> None:
        self.forget(rid)
        self.cancel(rid)
        self.on_reply(error)

    # ---- the workers' messages ------------------------------------------------------------------

    def _frames(self, frames: list[bytes]) -> None:
        msg = self.decoder.decode(frames[-1])
        try:
            if isinstance(msg, Invalid):
                log.warning("unreadable_direct_reply", code=msg.code, reason=msg.reason)
            elif isinstance(msg, JobDeltas):
                for delta in msg.items:
                    self._take(delta)
            else:
                self._take(msg)
        except Exception:  # (a bug here must not stop the reading of everyone else's output)
            log.exception("direct_reply_failed", message=type(msg).__name__)

    def _take(self, msg: JobStart | JobDelta | JobDone | Error) -> None:
        job_id = msg.id or ""
        job = self.jobs.get(job_id)
        if job is None:
            self._keep_early(job_id, msg)
            return
        job.heard = time.monotonic()
        if isinstance(msg, JobDelta):
            job.started = job.began = True
            piece = job.parser.feed(msg.text, len(msg.tokens) // 4)  # (int32 ids: PROTOCOL.md 2)
            job.logprobs.extend(msg.logprobs)
            delta = reply_messages.delta_of(job.rid, 0, piece, msg.tokens, msg.logprobs)
            if msg.reused_tokens is not None:  # the job's first token: what the prompt cost is known now
                delta.usage = Usage(prompt_tokens=job.placed.prompt_tokens, cached_tokens=msg.reused_tokens, completion_tokens=0)
            self.on_reply(delta)
        elif isinstance(msg, JobStart):
            job.started = True
        elif isinstance(msg, JobDone):
            self._done(job, msg)
        else:  # an Error: its router forgot the job (it restarted)
            self.forget(job.rid)
            self.on_reply(Error(id=job.rid, code=msg.code, message=msg.message))

    def _done(self, job: DirectJob, msg: JobDone) -> None:
        tail = job.parser.finish()
        if tail.content or tail.reasoning or tail.calls:
            self.on_reply(reply_messages.delta_of(job.rid, 0, tail, b"", []))
        placed = job.placed
        choice = reply_messages.choice_of(0, job.parser, msg, job.logprobs)
        usage = Usage(
            prompt_tokens=msg.prompt_tokens,
            cached_tokens=msg.reused_tokens,
            completion_tokens=msg.generated_tokens,
            reasoning_tokens=job.parser.reasoning_tokens,
        )
        t = msg.timings
        timings = Timings(
            queue_ms=placed.queue_ms + t.queue_ms,
            prefill_ms=t.prefill_ms,
            decode_ms=t.decode_ms,
            ttft_ms=t.ttft_ms + placed.queue_ms,
            total_ms=(time.monotonic() - self.sent_at.get(job.rid, job.at)) * 1000,
        )
        result = reply_messages.result_of(job.rid, [choice], usage, timings, placed.worker, msg.slot)
        result.dropped_messages, result.dropped_tokens = placed.dropped_messages, placed.dropped_tokens
        self.forget(job.rid)
        self.on_reply(result)

    def _keep_early(self, job_id: str, msg: Any) -> None:
        """A message of a job not placed here yet (the worker's path was faster than the router's), or of one that
        ended (a cancelled request's last deltas): kept a while in case it is the first."""
        if self.early_kept >= EARLY_MAX:
            return
        self.early_kept += 1
        self.early.setdefault(job_id, []).append(msg)
        self.early_at.setdefault(job_id, time.monotonic())

    # ---- liveness -------------------------------------------------------------------------------

    async def _check_loop(self) -> None:
        while True:
            await asyncio.sleep(CHECK_S)
            try:
                self.check(time.monotonic())
            except Exception:  # (the next look must still come)
                log.exception("direct_reply_check_failed")

    def check(self, now: float) -> None:
        """Fail the requests whose worker has not reached this endpoint in START_S; drop stale early messages."""
        for job_id in [j for j, at in self.early_at.items() if now - at > EARLY_S]:
            self.early_at.pop(job_id, None)
            self.early_kept -= len(self.early.pop(job_id, []))
        for job in [j for j in self.jobs.values() if j.orphan and now - j.heard > ORPHAN_STALL_S]:
            message = (
                f"the router at {job.orphan} stopped answering after this request's output began, and its worker"
                f" {job.placed.worker} has sent nothing for {ORPHAN_STALL_S:g} s; it was not sent again"
            )
            self._fail(job.rid, Error(id=job.rid, code=ErrorCode.ROUTER_LOST, message=message))
        for job in [j for j in self.jobs.values() if not j.started and now - j.at > START_S]:
            worker = job.placed.worker
            message = (
                f"worker {worker} did not reach this client's reply endpoint {self.endpoint} in {START_S:g} s; this client"
                " now takes replies through the router. Give an address the workers can reach (kvroute http/serve"
                " --reply-endpoint tcp://HOST:PORT), or turn direct replies off (--reply-endpoint off)"
            )
            if not self.broken:
                log.error("reply_unreachable", worker=worker, endpoint=self.endpoint, waited_s=START_S, advice=message)
            self.broken = True
            self.forget(job.rid)
            if self.resend is None or not self.resend(job.rid):  # (nothing of it was read: it can run again)
                self.cancel(job.rid)
                self.on_reply(Error(id=job.rid, code=ErrorCode.REPLY_UNREACHABLE, message=message))
