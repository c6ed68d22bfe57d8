"""router/queue_order.py directly: which waiting request takes a freed slot first (no sockets, no model)."""

from __future__ import annotations

import dataclasses

import numpy as np

from protocol import Hello, Sampling
from router.config import RouterConfig
from router.mirror import Mirror
from router.queue_order import in_order
from router.requests import Req, WorkerConn

HISTORY = np.arange(100, 400, dtype=np.int32)


def req(rid: str, tokens: np.ndarray, arrived: float) -> Req:
    r = Req(b"c", [], rid, Sampling(), False, None, tokens=tokens)
    r.arrived = arrived
    return r


def setup() -> tuple[Mirror, list[WorkerConn]]:
    """One worker with two slots: slot 0 idle holding HISTORY, slot 1 idle and empty."""
    mirror = Mirror()
    slots = mirror.add_worker("w0", 2)
    mirror.assign(slots[0], "j", HISTORY)
    mirror._idle(slots[0], HISTORY, dirty=False)
    hello = Hello(worker_id="w0", incarnation=1, slots=2, ctx_per_slot=4096, model_fingerprint="fp", device="cpu")
    conn = WorkerConn(hello, slots)
    conn.refresh()
    return mirror, [conn]


def test_shortest_lets_the_turn_whose_history_is_held_go_first_until_the_bound() -> None:
    mirror, workers = setup()
    cold = req("cold", np.arange(5000, 5300, dtype=np.int32), arrived=100.0)
    turn = req("turn", np.concatenate([HISTORY, np.arange(7, 17, dtype=np.int32)]), arrived=101.0)
    cfg = RouterConfig()
    assert [r.rid for r in in_order([cold, turn], mirror, workers, cfg, now=102.0)] == ["turn", "cold"]
    late = 100.0 + cfg.queue_bound_ms / 1000  # the cold one has waited its bound: it goes first again
    assert [r.rid for r in in_order([cold, turn], mirror, workers, cfg, now=late)] == ["cold", "turn"]
    fifo = dataclasses.replace(cfg, queue_order="fifo")
    assert [r.rid for r in in_order([cold, turn], mirror, workers, fifo, now=102.0)] == ["cold", "turn"]
