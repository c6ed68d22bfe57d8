"""The router's and its workers' figures in Prometheus' text format (served at /metrics by the HTTP front, which
asks the router for them over the protocol: `metrics`). Names follow Prometheus' conventions and, where there is
one, vLLM's metric of the same meaning with `kvroute_` for `vllm:` (`prefix_cache_queries`, `prefix_cache_hits`,
`requests_running`, `requests_waiting`, `time_to_first_token_seconds`, `request_queue_time_seconds`)."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from router.metrics import Histogram
from router.models import Models
from router.requests import ReqState, WorkerConn
from router.scheduler import Scheduler

# worker counter (protocol.EngineCounters) -> (metric, help); each a counter with a `worker` label
WORKER_COUNTERS = {
    "prefilled_tokens": ("kvroute_worker_prefill_tokens", "Prompt tokens computed"),
    "generated_tokens": ("kvroute_worker_decode_tokens", "Tokens generated"),
    "reused_tokens": ("kvroute_worker_reused_tokens", "Prompt tokens whose KV was reused"),
    "steps": ("kvroute_worker_steps", "Engine steps (one llama_decode each)"),
    "decode_s": ("kvroute_worker_decode_seconds", "Time spent in llama_decode"),
    "jobs_done": ("kvroute_worker_jobs_done", "Jobs that ended with a result"),
    "jobs_failed": ("kvroute_worker_jobs_failed", "Jobs that ended with an error"),
    "jobs_suspended": ("kvroute_worker_jobs_suspended", "Jobs that gave their slot to one of higher priority mid-output"),
    "invariant_violations": ("kvroute_worker_invariant_violations", "Slots whose KV disagreed with their tokens (a bug)"),
    "decode_errors": ("kvroute_worker_decode_errors", "llama_decode failures"),
    "host_saves": ("kvroute_worker_host_cache_saves", "Evicted slot contents kept in host RAM"),
    "copy_failures": ("kvroute_worker_copy_failures", "State copies llama.cpp refused"),
    "host_save_failures": ("kvroute_worker_host_save_failures", "Copies to host RAM that failed (nothing else did)"),
    "state_buffers_mapped": ("kvroute_worker_state_buffers_mapped", "Saved states and checkpoints copied into new memory"),
    "state_buffers_reused": (
        "kvroute_worker_state_buffers_reused",
        "Saved states and checkpoints copied into freed memory",
    ),
    "spec_proposed": ("kvroute_worker_spec_proposed", "Guessed tokens verified (--spec ngram)"),
    "spec_accepted": ("kvroute_worker_spec_accepted", "Guessed tokens the sampler took"),
    "spec_withheld": ("kvroute_worker_spec_withheld", "Guesses not computed: taken too rarely to pay in their batch"),
    "disk_restores": ("kvroute_worker_disk_restores", "Prefixes restored from the disk tier (--cache-dir)"),
    "disk_restore_failures": ("kvroute_worker_disk_restore_failures", "Disk-tier files that did not check out (served cold)"),
    "image_rows": ("kvroute_worker_image_rows", "Images' rows decoded into slots (--mmproj)"),
    "images_encoded": ("kvroute_worker_images_encoded", "Images the vision projector encoded (--mmproj)"),
    "image_encode_s": ("kvroute_worker_image_encode_seconds", "Time the vision projector took to encode them"),
    "paused_steps": ("kvroute_worker_paused_steps", "Jobs left out of a step for a job of higher priority (one per job a step)"),
}


def figure(w: WorkerConn, name: str) -> float:
    """One of a worker's engine counters (an EngineCounters field), 0 before its first heartbeat."""
    return float(getattr(w.counters, name)) if w.counters is not None else 0.0


def text(cores: Scheduler | Sequence[Scheduler], models: Models | None = None) -> str:
    """The exposition, made fresh from the cores' records (one per served model; their Metrics are the router's)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector([cores] if isinstance(cores, Scheduler) else list(cores), models))
    return generate_latest(registry).decode()


class _Collector:
    def __init__(self, cores: list[Scheduler], models: Models | None) -> None:
        self.cores, self.models = cores, models

    def collect(self) -> Iterator[Metric]:
        cores, m = self.cores, self.cores[0].metrics
        requests = [r for c in cores for r in c.requests.values()]
        yield _counter("kvroute_requests", "Requests ended, by outcome (finish reason or error code)", m.requests, "outcome")
        yield _gauge("kvroute_requests_running", "Requests (choices) running on a worker",
                     sum(r.state in (ReqState.RUNNING, ReqState.CANCELLING) for r in requests))  # fmt: skip
        waiting = sum(len(c.queue) for c in cores)
        yield _gauge("kvroute_requests_waiting", "Requests (choices) waiting in the router's queue", waiting)
        yield _counter("kvroute_prompt_tokens", "Prompt tokens of ended requests", m.prompt_tokens)
        yield _counter("kvroute_generation_tokens", "Tokens generated by ended requests", m.generation_tokens)
        yield _counter("kvroute_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", m.prompt_tokens)
        yield _counter(
            "kvroute_prefix_cache_hits", "Prompt tokens found in the prefix cache (reused, not computed)", m.reused_tokens
        )
        yield _counter("kvroute_reuse_predicted_tokens", "Prompt tokens the router predicted a worker would reuse",
                       m.predicted_reuse_tokens)  # fmt: skip
        yield _counter(
            "kvroute_reuse_mispredictions", "Jobs whose reuse differed from the router's prediction", m.reuse_mispredictions
        )
        yield _counter("kvroute_mirror_mismatches", "Slot reports that contradicted the router's mirror", m.mirror_mismatches)
        yield _counter("kvroute_router_decisions", "Routing decisions, by kind", m.decisions, "kind")
        yield _histogram("kvroute_router_decision_seconds", "Time to choose a slot", m.decision_ms)
        yield _histogram("kvroute_request_queue_time_seconds", "Time requests waited for a slot", m.queue_wait_ms)
        yield _histogram("kvroute_time_to_first_token_seconds", "Time from arrival to the first token", m.ttft_ms)
        yield _counter(
            "kvroute_request_redispatches", "Requests sent to a worker again (their worker died first)", m.redispatched
        )
        yield _counter(
            "kvroute_slot_conflicts", "Jobs a worker refused because another router's job held the slot", m.slot_conflicts
        )
        yield _counter(
            "kvroute_direct_jobs", "Jobs whose output went from the worker straight to the client (reply_to)", m.direct_jobs
        )
        now = time.monotonic()
        awaited = sum(s.awaited(now) is not None for c in cores for s in c.mirror.slots())
        yield _gauge("kvroute_awaited_slots", "Idle slots kept for a session's next turn after its tool calls", awaited)
        yield _counter(
            "kvroute_retention", "Awaited slots: their conversation came back to them (hit), lost them (miss), or came "
            "back after their time-to-live (expired)", m.retention, "outcome"
        )  # fmt: skip
        yield _counter("kvroute_requests_by_priority", "Requests accepted, by priority (1, 0, -1)", m.priorities, "priority")
        yield _counter(
            "kvroute_preemptions", "Jobs of a lower priority asked back for a waiting request of a higher priority "
            "(asked); handed back before their first token (handed), or suspended after it (suspended) and resumed "
            "(resumed)", m.preemptions, "outcome"
        )  # fmt: skip
        yield _counter(
            "kvroute_state_copies", "Jobs placed with a state copied from another worker: it came (copied), was gone "
            "(gone) or late (late), or the job's worker died meanwhile (dropped)", m.state_copies, "outcome"
        )  # fmt: skip
        yield _counter("kvroute_state_copy_bytes", "Bytes of the saved states copied between workers", m.state_copy_bytes)
        yield _counter("kvroute_worker_deaths", "Workers declared dead", m.dead_workers)
        yield _counter("kvroute_worker_restarts", "Local workers restarted by the supervisor", m.restarts)
        yield _counter("kvroute_preparations", "Work queued for the preparing threads, by kind", m.preparations, "kind")
        yield _counter(
            "kvroute_preparations_refused", "Work refused for want of a preparing thread, by kind", m.prepare_refused, "kind"
        )
        yield _gauge("kvroute_preparations_waiting", "Work waiting for a preparing thread", m.prepare_waiting)
        yield _histogram("kvroute_prepare_wait_seconds", "Time work waited for a preparing thread", m.prepare_wait_ms)
        yield _counter("kvroute_bad_frames", "Client frames that could not be decoded", m.bad_frames)
        yield _counter(
            "kvroute_unknown_messages", "Messages of a type with no handler (a bug: each is logged)", m.unknown_messages
        )
        yield _counter("kvroute_peers_cut", "Clients or workers cut for not reading their messages", m.peers_cut)
        if self.models is not None:
            yield from _per_model(self.models)
        workers = [w for c in cores for w in c.workers.values()]
        yield _per_worker("kvroute_worker_slots", "Slots of each worker", {w.id: len(w.slots) for w in workers}, gauge=True)
        yield _per_worker("kvroute_worker_busy_slots", "Slots running a job", {w.id: w.load.busy for w in workers}, gauge=True)
        restored = CounterMetricFamily(
            "kvroute_worker_restored_tokens", "Reused tokens copied in, by source", labels=["worker", "source"]
        )
        for w in workers:
            restored.add_metric([w.id, "slot"], figure(w, "restored_from_slots"))
            restored.add_metric([w.id, "host"], figure(w, "restored_from_host"))
        yield restored
        for key, (name, doc) in WORKER_COUNTERS.items():
            yield _per_worker(name, doc, {w.id: figure(w, key) for w in workers})
        yield _per_worker("kvroute_worker_host_cache_bytes", "Host RAM held by evicted slot contents",
                          {w.id: figure(w, "host_cache_bytes") for w in workers}, gauge=True)  # fmt: skip
        yield _per_worker("kvroute_worker_host_cache_entries", "Evicted slot contents kept in host RAM",
                          {w.id: figure(w, "host_cache_entries") for w in workers}, gauge=True)  # fmt: skip
        yield _per_worker("kvroute_worker_snapshot_bytes", "Host RAM held by the slots' context checkpoints",
                          {w.id: figure(w, "snapshot_bytes") for w in workers}, gauge=True)  # fmt: skip
        yield _per_worker("kvroute_worker_prefill_tokens_per_second", "Prompt tokens computed per second (last heartbeat)",
                          {w.id: w.rates.get("prefilled_tokens", 0.0) for w in workers}, gauge=True)  # fmt: skip
        yield _per_worker("kvroute_worker_decode_tokens_per_second", "Tokens generated per second (last heartbeat)",
                          {w.id: w.rates.get("generated_tokens", 0.0) for w in workers}, gauge=True)  # fmt: skip


def _per_model(models: Models) -> Iterator[Metric]:
    """Where each model is loaded, how often it was loaded and unloaded, and its requests' tools it was not shown."""
    state = GaugeMetricFamily("kvroute_model_loaded", "1 while a model has a ready worker, by model", labels=["model"])
    workers = GaugeMetricFamily("kvroute_model_workers", "Workers connected for each model", labels=["model"])
    loads = CounterMetricFamily("kvroute_model_loads", "Models started on demand (or at start), by model", labels=["model"])
    unloads = CounterMetricFamily("kvroute_model_unloads", "Models stopped (idle past keep-alive, or for room)", labels=["model"])
    memory = GaugeMetricFamily(
        "kvroute_model_worker_memory_mib", "What one worker of each model takes, as the memory budget counts it", labels=["model"]
    )
    unoffered = CounterMetricFamily(
        "kvroute_tools_not_offered",
        "Requests whose tools a model without tool-call syntax was not shown (a hint; --generic-tools shows them)",
        labels=["model"],
    )
    for mc in models:
        unoffered.add_metric([mc.name], mc.chat.tools_not_offered)
        state.add_metric([mc.name], 1.0 if mc.ready() else 0.0)
        workers.add_metric([mc.name], len(mc.core.workers))
        loads.add_metric([mc.name], models.loads.get(mc.name, 0))
        unloads.add_metric([mc.name], models.unloads.get(mc.name, 0))
        memory.add_metric([mc.name], mc.need_mb())
    yield from (state, workers, loads, unloads, memory, unoffered)


def _counter(name: str, doc: str, value: Any, label: str | None = None) -> Metric:
    if label is None:
        return CounterMetricFamily(name, doc, value=value)
    family = CounterMetricFamily(name, doc, labels=[label])
    for k, v in sorted(value.items()):
        family.add_metric([str(k)], v)
    return family


def _gauge(name: str, doc: str, value: float) -> Metric:
    return GaugeMetricFamily(name, doc, value=value)


def _per_worker(name: str, doc: str, values: dict[str, float], gauge: bool = False) -> Metric:
    family: Any = GaugeMetricFamily(name, doc, labels=["worker"]) if gauge else CounterMetricFamily(name, doc, labels=["worker"])
    for worker, v in sorted(values.items()):
        family.add_metric([worker], v)
    return family


def _histogram(name: str, doc: str, h: Histogram) -> Metric:
    """A histogram kept in milliseconds, as Prometheus wants it: seconds, cumulative buckets."""
    buckets, total = [], 0
    for bound, count in zip([*h.buckets, float("inf")], h.counts, strict=True):
        total += count
        buckets.append(("+Inf" if bound == float("inf") else repr(bound / 1000), total))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=h.sum / 1000)
