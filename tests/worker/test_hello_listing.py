"""A hello lists saved states with their tokens; a large disk tier must not make it a frame the router refuses (the
worker would repeat that hello forever). The most recently used states are listed within a byte budget."""

from __future__ import annotations

from types import SimpleNamespace

from protocol import MAX_FRAME_BYTES, CacheEntry, Hello, encode, pack_tokens, token_hash
from worker.saved_states import ENTRY_OVERHEAD_BYTES, HELLO_LISTING_BYTES, most_recent_within


def entry(name: str, n_tokens: int, last_used: int) -> SimpleNamespace:
    return SimpleNamespace(name=name, tokens=list(range(n_tokens)), last_used=last_used)


def test_host_ram_first_then_disk_each_most_recent_first_within_the_budget():
    host = [entry("h-old", 100, 1), entry("h-new", 100, 5)]
    disk = [entry("d-old", 100, 10), entry("d-mid", 100, 20), entry("d-new", 100, 30)]
    one = 4 * 100 + ENTRY_OVERHEAD_BYTES
    listed, left = most_recent_within(host, disk, 4 * one)  # type: ignore[arg-type]
    assert [x.name for x in listed] == ["h-new", "h-old", "d-new", "d-mid"] and left == 1
    listed, left = most_recent_within(host, disk, 10 * one)  # type: ignore[arg-type]
    assert len(listed) == 5 and left == 0
    assert most_recent_within([], [], 0) == ([], 0)


def test_a_listing_within_the_budget_makes_a_hello_the_router_takes():
    # 16 GB of disk tier at ~2.5 KB of state per token (q4_0 KV) is ~6.4M tokens: far over the frame cap, listed whole
    disk = [entry(f"d{i}", 2000, i) for i in range(3200)]
    listed, left = most_recent_within([], disk, HELLO_LISTING_BYTES)  # type: ignore[arg-type]
    assert left > 0 and listed[0].name == "d3199"
    cached = [
        CacheEntry(id=i, tier="disk", n_tokens=2000, hash=token_hash(x.tokens), nbytes=5_000_000, tokens=pack_tokens(x.tokens))
        for i, x in enumerate(listed)
    ]
    hello = Hello(worker_id="w0", incarnation=1, slots=4, ctx_per_slot=32768, model_fingerprint="f", device="cpu", cached=cached)
    assert len(encode(hello)) <= MAX_FRAME_BYTES
