"""router/handshake.py and router/views.py, directly (no sockets, no model)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from protocol import ErrorCode, Hello, SlotHeld, pack_tokens
from router import handshake, views
from router.mirror import Mirror
from router.requests import WorkerConn, WorkerState


def hello(**fields: Any) -> Hello:
    base: dict[str, Any] = dict(worker_id="w0", incarnation=1, slots=2, ctx_per_slot=64, model_fingerprint="fp", device="cpu")
    return Hello(**(base | fields))


def test_a_worker_is_refused_for_its_identity_its_model_or_its_weights() -> None:
    assert handshake.refusal(b"w0", hello(), "fp", "", "m") is None
    assert handshake.refusal(b"w0", hello(weights_fingerprint="x"), "fp", "", "m") is None  # the router does not check
    bad_id = handshake.refusal(b"other", hello(), "fp", "", "m")
    assert bad_id is not None and bad_id.code == ErrorCode.BAD_REQUEST
    model = handshake.refusal(b"w0", hello(model_fingerprint="zz"), "fp", "", "m")
    assert model is not None and model.code == ErrorCode.MODEL_MISMATCH and "(m)" in model.reason
    weights = handshake.refusal(b"w0", hello(weights_fingerprint="b" * 20), "fp", "a" * 20, "m")
    assert weights is not None and weights.code == ErrorCode.MODEL_MISMATCH and "weights bbbb" in weights.reason


def test_held_slots_are_read_from_the_hello() -> None:
    assert handshake.held(hello()) is None
    got = handshake.held(hello(held=[SlotHeld(slot=1, tokens=pack_tokens([5, 6, 7]), n_exact=2, salt="t", min_keep=1)]))
    assert got is not None and list(got) == [1]
    tokens, n_exact, salt, min_keep, cuts = got[1]
    assert tokens.tolist() == [5, 6, 7] and (n_exact, salt, min_keep, cuts) == (2, "t", 1, [])


def test_status_hides_another_tenants_slot_and_the_line_counts_answers() -> None:
    mirror = Mirror()
    slots = mirror.add_worker("w0", 2)
    mirror.assign(slots[0], "j1", np.arange(4, dtype=np.int32), "tenant-a")
    conn = WorkerConn(hello(), slots)
    (mine,) = views.worker_statuses([conn], {}, {"w0": 3}, "tenant-a")
    (theirs,) = views.worker_statuses([conn], {}, {}, "tenant-b")
    assert mine.restarts == 3 and mine.slots[0].n_tokens == 4 and not mine.slots[0].other_tenant
    assert theirs.slots[0].other_tenant and theirs.slots[0].n_tokens == 0 and theirs.slots[0].busy
    conn.refresh()
    conn.state = WorkerState.DRAINING
    line = views.status_line([conn], Counter(stop=2, length=1, queue_full=4), 5, in_flight=7)
    assert line == "draining, 7 in flight; workers 0 ready/1, slots 1/2 busy, queued 5, served 3, other endings 4"
