"""Helpers for the worker tests: run a job on an engine and collect what it streamed."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from protocol import (
    CacheEntry,
    Constraint,
    Job,
    JobDelta,
    JobDone,
    JobError,
    JobImage,
    Message,
    Sampling,
    SlotUpdate,
    StateBlob,
    pack_tokens,
    token_hash,
    unpack_tokens,
)
from worker.engine import Engine

_ids = itertools.count()


def new_id(prefix: str = "t") -> str:
    return f"{prefix}-{next(_ids)}"


@dataclass
class Run:
    """What one job produced, with arrival times of its messages."""

    prompt: list[int]
    deltas: list[JobDelta] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    final: JobDone | JobError | None = None
    updates: list[SlotUpdate] = field(default_factory=list)  # the saved states its placing changed (worker/job_ends.py)

    def __call__(self, msg: Message) -> None:  # the job's sink (called on the compute thread)
        self.times.append(time.monotonic())
        if isinstance(msg, JobDelta):
            self.deltas.append(msg)
        elif isinstance(msg, SlotUpdate):
            assert self.final is None and msg.slot == -1, "a saved-state report after the job's end"
            self.updates.append(msg)
        else:
            assert self.final is None, "two final messages for one job"
            self.final = msg  # type: ignore[assignment]

    @property
    def cache_added(self) -> list[CacheEntry]:
        """The saved states the router was told of with this job: as it was placed, and at its end."""
        assert self.final is not None
        return [e for u in self.updates for e in u.cache_added] + self.final.cache_added

    @property
    def cache_dropped(self) -> list[int]:
        assert self.final is not None
        return [i for u in self.updates for i in u.cache_dropped] + self.final.cache_dropped

    @property
    def tokens(self) -> list[int]:
        assert isinstance(self.final, JobDone), self.final
        return unpack_tokens(self.final.tokens)

    @property
    def streamed_tokens(self) -> list[int]:
        return [t for d in self.deltas for t in unpack_tokens(d.tokens)]

    def wait(self, timeout: float = 120.0) -> JobDone | JobError:
        end = time.monotonic() + timeout
        while self.final is None:
            if time.monotonic() > end:
                raise TimeoutError("job did not finish")
            time.sleep(0.005)
        return self.final


def job(
    prompt: list[int],
    *,
    slot: int = -1,
    prefix_cache: bool = True,
    deadline_ms: int | None = None,
    constraint: Constraint | None = None,
    cache_salt: str = "",
    images: list[JobImage] | None = None,
    priority: int = 0,
    state: StateBlob | None = None,
    **sampling,
) -> Job:
    sampling.setdefault("temperature", 0.0)
    sampling.setdefault("max_tokens", 8)
    return Job(
        id=new_id(),
        slot=slot,
        tokens=pack_tokens(prompt),
        sampling=Sampling(**sampling),
        prefix_cache=prefix_cache,
        deadline_ms=deadline_ms,
        constraint=constraint,
        cache_salt=cache_salt,
        images=images or [],
        priority=priority,
        state=state,
    )


def start(engine: Engine, prompt: list[int], **kw) -> Run:
    run = Run(prompt)
    engine.submit(job(prompt, **kw), run)
    return run


def complete(engine: Engine, prompt: list[int], **kw) -> Run:
    run = start(engine, prompt, **kw)
    run.wait()
    return run


def prompt_of(engine: Engine, text: str, image: bytes) -> tuple[list[int], list[JobImage]]:
    """A rendered prompt with one image marker as the router lays it out with the engine's projector: its ids and
    the job's images."""
    tokens, images = engine.call(lambda e: e.projector.tokenize(text, True, [image])).result(30)
    return tokens.tolist(), [JobImage(start=i.start, n_tokens=i.n_tokens, data=i.data) for i in images]


def assert_slot_invariant(engine: Engine, run: Run) -> None:
    """The contract: the slot holds the first slot_tokens of prompt + generated, its hash matches, and the KV agrees."""
    done = run.final
    assert isinstance(done, JobDone), done
    held = (run.prompt + unpack_tokens(done.tokens))[: done.slot_tokens]
    assert done.slot_hash == token_hash(held)
    assert done.reused_tokens + done.prefilled_tokens == done.prompt_tokens == len(run.prompt)
    slot = done.slot
    kv = engine.call(lambda e: (list(e.table[slot].tokens), e.llama.seq_len(slot), e.table[slot].held_end())).result(30)
    if kv[0][: done.slot_tokens] == held and len(kv[0]) == done.slot_tokens:  # slot untouched since
        assert kv[1] == kv[2]  # (its tokens' count, but after an M-RoPE image: worker/slots.py `held_end`)
        if not engine.call(lambda e: e.table[slot].spans).result(30):
            assert kv[1] == done.slot_tokens


Decoded = list[list[tuple[int, int, bool]]]  # per llama_decode: (slot, position, logits?) of each row


@contextmanager
def decodes(engine: Engine) -> Iterator[Decoded]:
    """Every batch the engine decodes meanwhile."""
    seen: Decoded = []
    real: Callable[[], int] = engine.call(lambda e: e._decode).result(10)

    def record() -> int:
        b = engine.llama.batch
        seen.append([(b.seq[i][0], b.pos[i], bool(b.logits[i])) for i in range(b.n)])
        return real()

    engine.call(lambda e: setattr(e, "_decode", record)).result(10)
    try:
        yield seen
    finally:
        engine.call(lambda e: setattr(e, "_decode", real)).result(10)
