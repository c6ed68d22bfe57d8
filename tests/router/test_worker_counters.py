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
