"""The queue: the requests waiting for a slot, and where each goes when one is free.

Requests are looked at by priority, then in `--queue-order` (router/queue_order.py); each goes to the slot
router/select.py picks among the ready workers that can hold it (`--policy round-robin`: the one worker it was pinned
to), or waits for a busy slot that holds its prefix, or waits for a worker with an idle slot. Another choice of a
request with n > 1 goes beside its first choice, on the same worker (which copies the computed prompt instead of
computing it again).
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from common import logs
from protocol import Job, Sampling, pack_tokens
from router.config import RouterConfig
from router.metrics import Metrics
from router.mirror import Mirror
from router.queue_order import in_order
from router.requests import Req, ReqState, WorkerConn, WorkerState
from router.select import Dispatch, Params, Wait, WorkerLoad, coldest_for, expected_reuse, select
from router.workers import WorkerTable

log = logs.get(__name__)

MAX_WAITING_SCAN = 64  # queued requests examined per event beyond those dispatched


@dataclass
class RunningShares:
    """Who runs how many choices now (`running`, by owner), and the owners with requests waiting: an owner that holds
    `share` slots waits while another owner's request does (--queue-share covers the slots too)."""

    share: int
    running: Counter[str]
    waiting: set[str]

    def over(self, owner: str) -> bool:
        if not owner or self.running[owner] < self.share:
            return False
        return any(o != owner for o in self.waiting)


class DispatchQueue:
    """The waiting requests, oldest first (a requeued one at the front), and the placement decisions for them."""

    def __init__(self, cfg: RouterConfig, mirror: Mirror, metrics: Metrics, workers: WorkerTable) -> None:
        self.cfg, self.mirror, self.metrics, self.workers = cfg, mirror, metrics, workers
        self.params = Params.from_config(cfg)
        self.seeded_params = dataclasses.replace(self.params, seeded=True)  # (a seeded request's reuse rule)
        self._reqs: list[Req] = []
        self._rotation = 0  # dispatches so far: select's tie-break turns with it
        self._arrivals = 0  # --policy round-robin's turn

    def __len__(self) -> int:
        return len(self._reqs)

    def __iter__(self) -> Iterator[Req]:
        return iter(self._reqs)

    def __contains__(self, req: object) -> bool:
        return req in self._reqs

    def push(self, req: Req, front: bool = False) -> None:
        if front:
            self._reqs.insert(0, req)
        else:
            self._reqs.append(req)

    def remove(self, req: Req) -> None:
        if req in self._reqs:
            self._reqs.remove(req)

    def params_of(self, req: Req) -> Params:
        """The cost model's settings for `req`: its reuse rule (seeded or not), its conversation (a slot it awaits is
        no last resort for it)."""
        params = self.seeded_params if req.sampling.seed is not None else self.params
        return params if req.conv is None else dataclasses.replace(params, conversation=req.conv)

    def pin(self, req: Req, conns: list[WorkerConn] | None = None) -> None:
        """--policy round-robin: unless it is pinned to one of the workers it may go to already (`conns`, found
        when not given), the next worker in turn becomes the only one the request may go to, as a load balancer in
        front of independent servers sends a request on when it arrives (and again when that worker has left)."""
        ids = [w.id for w in (self.workers.loads_for(req) if conns is None else conns)]
        if ids and req.pinned not in ids:
            req.pinned = ids[self._arrivals % len(ids)]
            self._arrivals += 1

    def _loads(self, req: Req) -> list[WorkerLoad]:
        """The loads of the workers this request may go to (router/workers.py `loads_for`); under --policy
        round-robin, the one it is pinned to."""
        conns = self.workers.loads_for(req)
        if req.suspended is not None:  # (its job waits on that worker to go on)
            return [w.load for w in conns if w.id == req.suspended.worker]
        if self.cfg.policy == "round-robin":
            self.pin(req, conns)
            conns = [w for w in conns if w.id == req.pinned]
        return [w.load for w in conns]

    def placements(self) -> Iterator[tuple[Req, Dispatch]]:
        """The queued requests to dispatch now, each with its slot, in `queue_order.in_order`, while idle slots remain.
        The caller dispatches each before asking for the next: the mirror and the loads then show it."""
        if not self._reqs or not self.workers.idle_slot():
            return  # (before ordering the queue: a new request or a tick while every slot is busy costs nothing)
        now = time.monotonic()
        waiting = 0
        shares = self.running_shares()
        for req in in_order(self._reqs, self.mirror, self.workers, self.cfg, now):
            if not self.workers.idle_slot() or waiting >= MAX_WAITING_SCAN:
                break  # (the scan is bounded per event when many requests wait for particular slots)
            if shares is not None and shares.over(req.owner):
                continue  # (its owner holds its share of the slots, and another owner's request waits)
            d = self._place(req, now)
            if d is None:
                waiting += 1
                continue
            self._rotation += 1
            if shares is not None:
                shares.running[req.owner] += 1
            yield req, d

    def running_shares(self) -> RunningShares | None:
        """The owners' running requests against their share of the slots, when several owners' requests wait (one
        owner alone may take every slot)."""
        if self.cfg.queue_share >= 1:
            return None
        owners = {r.owner for r in self._reqs}
        if len(owners) < 2:
            return None
        running: Counter[str] = Counter(r.owner for w in self.workers for r in w.jobs.values() if r.owner)
        return RunningShares(self.workers.running_share(), running, owners)

    def _place(self, req: Req, now: float) -> Dispatch | None:
        """Where `req` goes now; None while it waits (for a slot it wants, or for any worker it may go to)."""
        loads = self._loads(req)
        if not any(w.busy < len(w.slots) for w in loads):
            return None  # none of the workers it may go to has an idle slot
        t0 = time.perf_counter()
        match = self.mirror.match(req.place_tokens, req.salt)  # afresh: a dispatch just before may have changed the mirror
        if req.index > 0:  # another choice of a request: beside its first choice, which computes the prompt
            lead = req.choices[0]
            if lead.state in (ReqState.QUEUED, ReqState.TOKENIZING):
                return None
            beside = self._beside(lead, match, self.params_of(req))
            if beside is not None:
                return beside
        waited = 0.0 if req.wait_since is None else (now - req.wait_since) * 1000
        decision = select(match, loads, self.params_of(req), now, self._rotation, waited)
        self.metrics.decision_ms.observe((time.perf_counter() - t0) * 1000)
        if isinstance(decision, Wait):
            if req.wait_since is None:
                req.wait_since = now
                self.metrics.decisions["wait"] += 1
                w = decision
                log.info(
                    "waiting_for_slot", request_id=req.rid, worker=w.slot.worker, slot=w.slot.index, reuse=w.reuse, saved=w.saved
                )
            return None
        return decision if isinstance(decision, Dispatch) else None

    def _beside(self, lead: Req, match: Any, params: Params) -> Dispatch | None:
        """An idle slot on the worker running `lead` (that worker copies the prompt's KV from lead's slot once it is
        computed, instead of computing it again); None when that worker has no idle slot."""
        conn = self.workers.get(lead.worker)
        if conn is None or conn.state is not WorkerState.READY:
            return None
        slot = coldest_for(conn.load, self.params.evict_half_life_s, params.conversation, time.monotonic())
        if slot is None:
            return None
        reuse, restore = expected_reuse(match, slot, params, conn.load.saved)
        return Dispatch(slot, reuse, 0.0, False, restore=restore)


def job_message(
    req: Req, d: Dispatch, job: str, prefix_cache: bool, now: float, sampling: Sampling | None = None, awaited: str = ""
) -> Job:
    """The Job that dispatches `req` as `job` to the slot `d` names (logged, with its session and what its placing did
    to an awaited slot: `awaited`, router/mirror.py `Sessions.placed`); `sampling`: the request's as this slot runs it
    (its open output cap bounded), else `req.sampling`."""
    slot, tokens = d.slot, req.place_tokens
    more: dict[str, object] = {}
    if req.session:
        more["session"] = req.session[:16]
    if req.parent_session:
        more["parent"] = req.parent_session[:16]
    if req.priority:
        more["priority"] = req.priority
    if awaited:
        more["awaited"] = awaited
    if req.suspended is not None:
        more["resumed"] = len(tokens) - len(req.tokens)
    log.info(
        "slot_assigned",
        request_id=req.rid,
        job=job,
        worker=slot.worker,
        slot=slot.index,
        predicted_reuse=d.reuse,
        prefill=len(tokens) - d.reuse,
        cost=round(d.cost, 1),
        affinity=d.affinity,
        restore=d.restore,
        **more,
    )
    return Job(
        id=job,
        slot=slot.index,
        tokens=pack_tokens(tokens),
        sampling=sampling or req.sampling,
        deadline_ms=None if req.deadline is None else max(1, int((req.deadline - now) * 1000)),
        predicted_reuse=d.reuse,
        prefix_cache=prefix_cache,
        constraint=req.constraint,
        cache_salt=req.salt,
        reply_to=req.direct,
        reply_key=req.direct_key,
        images=list(req.images),
        priority=req.priority,
        resume=req.suspended is not None,
    )
