"""What `status` and systemd's STATUS= line show of the router's workers, slots and requests (read only)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

from protocol import SlotStatus, WorkerStatus
from router.requests import Req, WorkerConn, WorkerState

SERVED = ("stop", "length", "tool_calls")  # request outcomes that are answers


def worker_statuses(
    workers: Iterable[WorkerConn], jobs: Mapping[str, Req], restarts: Mapping[str, int], salt: str
) -> list[WorkerStatus]:
    """Every worker and slot; a slot holding another tenant's prompt than `salt`'s shows only whether it is busy."""
    now = time.monotonic()
    return [
        WorkerStatus(
            worker=c.id,
            incarnation=c.hello.incarnation,
            device=c.hello.device,
            state=c.state.value,
            queue=c.queue,
            restarts=restarts.get(c.id, 0),
            ctx_per_slot=c.hello.ctx_per_slot,
            kv_bytes_per_slot=c.hello.kv_bytes // max(1, c.hello.slots),
            slots=[
                SlotStatus(slot=s.index, busy=s.busy, n_tokens=0, other_tenant=True)
                if s.salt and s.salt != salt
                else SlotStatus(
                    slot=s.index,
                    busy=s.busy,
                    n_tokens=len(s.tokens),
                    request_id=(jobs[s.job].rid if s.job is not None and s.job in jobs else None),
                    reused_total=s.reused_total,
                    last_used_s=round(now - s.last_used, 3),
                    session=s.session,
                    awaited_s=round(s.awaited_s(now), 3),
                )
                for s in c.slots
            ],
        )
        for c in workers
    ]


def status_line(workers: Iterable[WorkerConn], outcomes: Mapping[str, int], queued: int, in_flight: int | None) -> str:
    """Workers, busy slots, queue, requests served; `in_flight` is given while draining."""
    workers = list(workers)
    ready = sum(w.state is WorkerState.READY for w in workers)
    slots = sum(len(w.slots) for w in workers)
    busy = sum(w.load.busy for w in workers)
    served = sum(outcomes.get(k, 0) for k in SERVED)
    other = sum(outcomes.values()) - served
    head = f"draining, {in_flight} in flight; " if in_flight is not None else ""
    return (
        f"{head}workers {ready} ready/{len(workers)}, slots {busy}/{slots} busy, queued {queued},"
        f" served {served}, other endings {other}"
    )
