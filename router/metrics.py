"""The router's counters and histograms, kept as plain Python objects in one place.

Owned by the router's event loop. `snapshot()` is what a /metrics endpoint or a test reads.
"""

from __future__ import annotations

import bisect
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any


class Histogram:
    """Bucketed counts plus the last `keep` raw values (for quantiles in tests and benchmarks)."""

    def __init__(self, buckets: tuple[float, ...], keep: int = 4096) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0
        self.recent: deque[float] = deque(maxlen=keep)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1
        self.recent.append(value)

    def quantile(self, q: float) -> float:
        if not self.recent:
            return 0.0
        values = sorted(self.recent)
        return values[min(len(values) - 1, int(q * len(values)))]

    def snapshot(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "sum": self.sum,
            "p50": self.quantile(0.5),
            "p99": self.quantile(0.99),
            "buckets": dict(zip([*map(str, self.buckets), "+Inf"], self.counts, strict=True)),
        }


MS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000)


@dataclass(frozen=True)
class RequestRecord:
    """One finished request: where it went, and predicted vs actual reuse."""

    id: str
    worker: str
    slot: int
    prompt_tokens: int
    predicted_reuse: int
    reused_tokens: int
    generated_tokens: int
    finish_reason: str
    ttft_ms: float
    queue_ms: float
    attempts: int
    restored_tokens: int = 0  # of reused_tokens: copied in by the worker from another slot or its host RAM


def mispredicted(predicted: int, reused: int, restored: int) -> bool:
    """The router predicts reuse from the chosen slot's own KV. The worker may do better by copying a longer
    prefix from another of its slots or its host RAM (it reports that as restored); it must never do worse."""
    return reused < predicted or (reused > predicted and not restored)


@dataclass
class Metrics:
    decisions: Counter[str] = field(default_factory=Counter)  # "affinity", "cold", "guarded", "wait"
    decision_ms: Histogram = field(default_factory=lambda: Histogram(MS_BUCKETS))
    queue_wait_ms: Histogram = field(default_factory=lambda: Histogram(MS_BUCKETS))
    ttft_ms: Histogram = field(default_factory=lambda: Histogram(MS_BUCKETS))
    requests: Counter[str] = field(default_factory=Counter)  # by outcome: finish reason or error code
    preparations: Counter[str] = field(default_factory=Counter)  # work queued for the preparing threads, by kind
    prepare_refused: Counter[str] = field(default_factory=Counter)  # by kind: no room, or waited past its deadline
    prepare_wait_ms: Histogram = field(default_factory=lambda: Histogram(MS_BUCKETS))
    prepare_waiting: int = 0  # pieces waiting for a preparing thread now
    prompt_tokens: int = 0
    generation_tokens: int = 0
    predicted_reuse_tokens: int = 0
    reused_tokens: int = 0
    restored_tokens: int = 0
    reuse_mispredictions: int = 0
    mirror_mismatches: int = 0
    dead_workers: int = 0
    restarts: int = 0
    redispatched: int = 0
    slot_conflicts: int = 0  # jobs a worker refused: another router's job held the slot (placed again)
    direct_jobs: int = 0  # jobs whose output went from the worker straight to the client (Submit.reply_to)
    bad_frames: int = 0
    unknown_messages: int = 0  # messages of a type the process decodes and has no handler for (a bug: each is logged)
    peers_cut: int = 0  # clients (or workers) that did not read their messages for too long
    queue_depth: int = 0
    # retention (router/mirror.py `Sessions`): "hit", "miss", "expired"
    retention: Counter[str] = field(default_factory=Counter)
    priorities: Counter[int] = field(default_factory=Counter)  # requests accepted, by Submit.priority
    # jobs of a lower priority asked back for a waiting one of higher priority ("asked"), and handed back ("handed")
    preemptions: Counter[str] = field(default_factory=Counter)
    state_copies: Counter[str] = field(default_factory=Counter)  # by outcome (router/state_copies.py)
    state_copy_bytes: int = 0
    worker_load: dict[str, dict[str, int]] = field(default_factory=dict)
    recent: deque[RequestRecord] = field(default_factory=lambda: deque(maxlen=4096))

    def finished(self, rec: RequestRecord, *, count_outcome: bool = True) -> None:
        """A job ended with a result; `count_outcome` False when its request was already answered (an error)."""
        self.recent.append(rec)
        if count_outcome:
            self.requests[rec.finish_reason] += 1
        self.prompt_tokens += rec.prompt_tokens
        self.generation_tokens += rec.generated_tokens
        self.predicted_reuse_tokens += rec.predicted_reuse
        self.reused_tokens += rec.reused_tokens
        self.restored_tokens += rec.restored_tokens
        self.ttft_ms.observe(rec.ttft_ms)
        if mispredicted(rec.predicted_reuse, rec.reused_tokens, rec.restored_tokens):
            self.reuse_mispredictions += 1

    def snapshot(self) -> dict[str, Any]:
        return {
            "decisions": dict(self.decisions),
            "decision_ms": self.decision_ms.snapshot(),
            "queue_wait_ms": self.queue_wait_ms.snapshot(),
            "ttft_ms": self.ttft_ms.snapshot(),
            "requests": dict(self.requests),
            "prompt_tokens": self.prompt_tokens,
            "predicted_reuse_tokens": self.predicted_reuse_tokens,
            "reused_tokens": self.reused_tokens,
            "restored_tokens": self.restored_tokens,
            "reuse_mispredictions": self.reuse_mispredictions,
            "mirror_mismatches": self.mirror_mismatches,
            "dead_workers": self.dead_workers,
            "restarts": self.restarts,
            "redispatched": self.redispatched,
            "slot_conflicts": self.slot_conflicts,
            "direct_jobs": self.direct_jobs,
            "bad_frames": self.bad_frames,
            "unknown_messages": self.unknown_messages,
            "queue_depth": self.queue_depth,
            "retention": dict(self.retention),
            "priorities": {str(k): v for k, v in self.priorities.items()},
            "preemptions": dict(self.preemptions),
            "state_copies": dict(self.state_copies),
            "state_copy_bytes": self.state_copy_bytes,
            "worker_load": {k: dict(v) for k, v in self.worker_load.items()},
        }
