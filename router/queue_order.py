"""Which waiting request takes a freed slot first (`--queue-order`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from router.config import RouterConfig
from router.mirror import Mirror
from router.requests import Req, WorkerConn, WorkerState

SORT_WINDOW = 64  # --queue-order shortest orders the oldest this many waiting requests


def in_order(queue: list[Req], mirror: Mirror, workers: Iterable[WorkerConn], cfg: RouterConfig, now: float) -> list[Req]:
    """The queue in the order requests take freed slots. `fifo`: oldest first. `shortest`: first, oldest first, the
    requests that arrived `queue_bound_ms` ago or more (so nothing starves); then the least prompt left to compute
    after the longest prefix a slot or saved state holds on a worker with an idle slot (a turn whose history is on a
    busy worker lets one whose history is on the freed one go first, instead of taking the freed slot and computing
    its history again), among the SORT_WINDOW oldest (the rest follow in order: a long queue costs no more per
    event). Measured: bench/README.md, "Queue order". The baseline policies ignore prefixes here too: fifo.

    Priority (Submit.priority: 1 interactive, 0 normal, -1 background) comes before either order: a waiting request of
    a higher priority takes a freed slot before any of a lower one (a background request waits while interactive ones
    do, however long it waited), in that order within a priority; all of the same priority: exactly the order above.
    The owners' shares (router/dispatch_queue.py) still apply on top."""
    if any(r.priority for r in queue):
        queue = sorted(queue, key=lambda r: -r.priority)  # (stable: the order within a priority is kept)
    if cfg.queue_order == "fifo" or cfg.policy != "prefix" or len(queue) < 2:
        return list(queue)
    bound = cfg.queue_bound_ms / 1000
    open_ = {w.id for w in workers if w.state is WorkerState.READY and w.load.busy < len(w.slots)}
    head = [(r, mirror.match(r.tokens, r.salt)) for r in queue[:SORT_WINDOW]]

    def key(item: tuple[int, tuple[Req, Any]]) -> tuple[int, int, int, int]:
        i, (req, match) = item
        if now - req.arrived >= bound:
            return (-req.priority, 0, 0, i)
        return (-req.priority, 1, match.length - held_on(match, open_), i)

    ordered = [req for _, (req, _) in sorted(enumerate(head), key=key)]
    return ordered + queue[SORT_WINDOW:]


def held_on(match: Any, workers: set[str]) -> int:
    """The longest prefix of a matched prompt that a slot or saved state of one of `workers` holds."""
    for owners, depth in reversed(match.path):
        if any(o.worker in workers for o in owners):
            return int(depth)
    return 0
