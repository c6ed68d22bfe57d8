"""A worker's engine counters cross as a typed struct: the router reads them by field, and a newer worker's extra
names are ignored (no sockets, no model)."""

from __future__ import annotations

import msgspec

from protocol import EngineCounters, Heartbeat, Hello
from router.exposition import figure
from router.mirror import Mirror
from router.requests import WorkerConn


def test_counters_decode_from_a_map_by_name_and_give_rates() -> None:
    wire = msgspec.msgpack.encode(
        {"type": "heartbeat", "v": 1, "worker_id": "w0", "incarnation": 1, "slots": [], "queue": 0,
         "counters": {"generated_tokens": 100, "host_restore_bytes": 4e6, "host_restore_s": 0.5, "from_a_newer_worker": 1}}
    )  # fmt: skip
    beat = msgspec.msgpack.decode(wire, type=Heartbeat)
    assert beat.counters.generated_tokens == 100 and beat.counters.steps == 0
    hello = Hello(worker_id="w0", incarnation=1, slots=1, ctx_per_slot=64, model_fingerprint="fp", device="cpu")
    conn = WorkerConn(hello, Mirror().add_worker("w0", 1))
    assert figure(conn, "generated_tokens") == 0.0  # before its first heartbeat
    conn.prefill_tps = 1000.0
    conn.counted(beat.counters, now=10.0)
    conn.counted(msgspec.structs.replace(beat.counters, generated_tokens=300), now=12.0)
    assert conn.rates["generated_tokens"] == 100.0 and figure(conn, "generated_tokens") == 300.0
    assert conn.load.restore_cost == 1000.0 / (4e6 / 0.5)  # prompt tokens per byte restored, from the counters
    assert EngineCounters().host_cache_bytes == 0


def test_a_worker_says_when_its_first_job_should_end_and_what_an_overwrite_costs() -> None:
    """`frees_at`: from each running job's prompt left to compute and max_tokens left to generate, at the worker's
    measured speeds (its share of the decode rate); `evict_share`: 1 without host RAM, the restore of a token's bytes
    with it (no sockets, no model)."""
    import time

    import numpy as np

    from chat.output import OutputSpec
    from protocol import Sampling
    from router.requests import Attempt, Req

    hello = Hello(worker_id="w0", incarnation=1, slots=2, ctx_per_slot=64, model_fingerprint="fp", device="cpu")
    slots = Mirror().add_worker("w0", 2)
    conn = WorkerConn(hello, slots)
    assert conn.load.evict_share == 1.0
    keeping = WorkerConn(msgspec.structs.replace(hello, kv_bytes=2 * 64 * 1000, host_cache_bytes=1 << 30), slots)
    assert keeping.load.evict_share == 1000 * keeping.load.restore_cost  # (bytes of a token x cost of a byte)
    for i, (pending, streamed) in enumerate(((100, 0), (0, 40))):
        r = Req(b"c", [], f"r{i}", Sampling(max_tokens=50), False, None, tokens=np.zeros(8, np.int32), output=OutputSpec())
        r.attempt = Attempt(f"j{i}", "w0", slots[i], 0, pending, OutputSpec().parser(), streamed=[1] * streamed)
        conn.jobs[r.attempt.job] = r
    conn.refresh()
    assert conn.load.frees_at is None  # (speeds not measured yet)
    conn.prefill_tps, conn.rates = 500.0, {"generated_tokens": 20.0}  # 10 tokens/s each
    t0 = time.monotonic()
    conn.refresh()
    assert conn.load.frees_at is not None
    assert abs(conn.load.frees_at - t0 - 1.0) < 0.05  # r1: 10 tokens left at 10/s (r0: 0.2 s + 50 at 10/s)
