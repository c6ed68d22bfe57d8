"""The models one router serves: per model its vocabulary, chat format and core (router/scheduler.py: its own
requests, workers, mirror and index, so a prefix is reused only within its model), and which are loaded.

A request names its model (`model`: a name or an alias); one that names none goes to the default model (else the
first), and so does, when a default is set, one naming a model the router does not know. With one model served that
model is the default, so any name is served as llama-server serves it (coding agents ask for a second model by another
name for background work).

Loading is the supervisor's (`on_load`, `on_unload`, set by router/supervisor.py); this module decides when:
- a request for a model with no worker, none starting, loads it (its requests wait for the workers' hello, for
  `LOAD_WAIT_S` at most); with `models_max` loaded already, or without room on one of its devices (`memory_mb`: the
  memory the loaded models' workers may take on each device, RAM for CPU workers, each GPU's for GPU workers), the
  least recently used model that is unpinned and idle (and, for room, on that device) is unloaded first; when none
  is idle the load waits for one to become so (each tick looks again), and after STARVE_S takes the least recently
  used unpinned one though it is busy (its worker drains: running jobs finish, waiting ones go back to the router's
  queue), so that steady traffic on one model does not starve another. A model's need on a device is what one of
  its workers takes (weights and KV: the operator's figure, else estimated, then what its workers said in their
  hello), times its workers there; one that alone needs more than a device has loads once nothing else is there;
- a model whose workers all failed to start is not loaded again for `RETRY_FAILED_S`: its requests get the reason;
- an unpinned model idle for its keep-alive is unloaded: the last request's `keep_alive_s`, or the model's own when
  that request gave none (Ollama's rule: a request's keep_alive is how long the model stays after it; `keep_alive: 0`
  in one request unloads the model after that request, not after every later one too).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from chat.request import ChatFormat
from common import logs
from common.vocab import Vocab
from protocol import FailedWorker, ModelStatus, StatusReply
from router import views
from router.prompt_tokens import PromptTokenizer
from router.requests import WorkerState, tenant
from router.scheduler import Scheduler

log = logs.get(__name__)

LOAD_WAIT_S = 120.0  # a model's workers must say hello this long after they are started
STARVE_S = 10.0  # a load waiting this long for room may unload a busy model (its running jobs finish first)
RETRY_FAILED_S = 60.0  # a model that failed to load is not started again before this


def model_name(vocab: Vocab) -> str:
    """A model's name when the operator gives none: its file's, without `.gguf` (what /v1/models lists)."""
    return Path(vocab.path).stem


@dataclass(frozen=True)
class ServedModel:
    """A model as the operator declared it (`kvroute serve --model NAME=PATH`, or a models file)."""

    name: str
    path: str
    aliases: tuple[str, ...] = ()
    pinned: bool = False  # never unloaded to make room or for idleness
    keep_alive_s: float = -1.0  # unloaded after this long without a request (-1: kept)
    load_at_start: bool = True  # False: started by its first request
    devices: tuple[str, ...] = ()  # where its workers run, one entry a worker ("cpu", "gpu0"...); () not known
    memory_mb: float = 0.0  # what one worker takes (weights and KV), estimated or the operator's; 0: not known
    weights_mb: float = 0.0  # of that, the weights (the file's size)
    memory_given: bool = False  # memory_mb is the operator's: what its workers say does not replace it
    mmproj: str | None = None  # its vision projector (the router's --mmproj for a single model)
    sampling: tuple[tuple[str, float | int], ...] = ()  # its sampling defaults, by `Sampling` field (router/sampling_defaults.py)
    generic_tools: bool | None = None  # tools in the generic JSON format for a template without tool syntax (None: the flag)


def from_flag(value: str, keep_alive_s: float = -1.0) -> ServedModel:
    """`--model [NAME=]PATH`: a PATH alone is named by its file once loaded (name "")."""
    name, sep, path = value.partition("=")
    if not sep:
        return ServedModel(name="", path=value, keep_alive_s=keep_alive_s)
    if not name or not path:
        raise ValueError(f"--model takes PATH or NAME=PATH, got {value!r}")
    return ServedModel(name=name, path=path, keep_alive_s=keep_alive_s)


class LoadState(Enum):
    LOADED = "loaded"
    LOADING = "loading"
    UNLOADED = "unloaded"
    FAILED = "failed"


@dataclass
class ModelCore:
    """One served model at run time."""

    spec: ServedModel
    vocab: Vocab
    chat: ChatFormat
    prompts: PromptTokenizer
    core: Scheduler
    last_used: float = field(default_factory=time.monotonic)
    keep_alive_s: float = -1.0  # the last request's keep_alive_s, the model's when it gave none
    loading_since: float | None = None  # a load was asked for and no worker is ready yet
    load_wanted: bool = False  # a request waits for a load that waits for room
    wanted_since: float = 0.0
    failed_at: float | None = None
    unloading: bool = False  # its workers were told to stop
    said_mb: float = 0.0  # what one worker took, by its hello (weights and KV), once one has said

    def __post_init__(self) -> None:
        self.keep_alive_s = self.spec.keep_alive_s

    @property
    def name(self) -> str:
        return self.spec.name

    def ready(self) -> bool:
        return any(w.state is WorkerState.READY for w in self.core.workers.values())

    def busy(self) -> bool:
        return bool(self.core.requests or self.core.embeds.running or self.core.embeds.waiting)

    def need_mb(self) -> float:
        """What one worker of it takes: the operator's figure, else what its workers said, else the estimate."""
        return self.spec.memory_mb if self.spec.memory_given else (self.said_mb or self.spec.memory_mb)

    def state(self) -> LoadState:
        if self.ready():
            return LoadState.LOADED
        if self.loading_since is not None:
            return LoadState.LOADING
        if self.failed_at is not None:
            return LoadState.FAILED
        return LoadState.UNLOADED if not self.core.workers else LoadState.LOADING


class Models:
    """Every served model, found by name or alias; the load and unload decisions."""

    def __init__(self, cores: list[ModelCore], *, default: str | None, models_max: int = 0, memory_mb: float = 0) -> None:
        self.cores = cores
        self.models_max = models_max  # most models loaded at once (0: no bound)
        self.memory_mb = memory_mb  # what the loaded models' workers may take on each device (0: no bound)
        self.by_name: dict[str, ModelCore] = {}
        for m in cores:
            for name in (m.name, *m.spec.aliases):
                if name in self.by_name:
                    raise ValueError(f"model name {name!r} is given twice")
                self.by_name[name] = m
        if default is not None and default not in self.by_name:
            raise ValueError(f"--default-model {default!r} is not a served model ({', '.join(self.names())})")
        self.default = self.by_name[default] if default is not None else (cores[0] if len(cores) == 1 else None)
        self.on_load: Callable[[str], bool] | None = None  # start this model's workers (False: none to start)
        self.on_unload: Callable[[str], None] | None = None  # stop them
        self.by_worker: dict[str, ModelCore] = {}  # worker id -> its model (said hello, or expected)
        self.loads: dict[str, int] = {}  # by model, for /metrics
        self.unloads: dict[str, int] = {}

    def __iter__(self) -> Iterator[ModelCore]:
        return iter(self.cores)

    def dynamic(self) -> bool:
        """Whether any model is loaded or unloaded while serving (several models, a budget, keep-alives, on demand)."""
        return (
            len(self.cores) > 1
            or self.models_max > 0
            or self.memory_mb > 0
            or any(m.spec.keep_alive_s >= 0 or not m.spec.load_at_start for m in self)
        )

    def names(self) -> list[str]:
        return [m.name for m in self.cores]

    def find(self, name: str | None) -> ModelCore | None:
        """The model a request names; no name: the default, else the first; an unknown name: the default or None."""
        if not name:
            return self.default or self.cores[0]
        return self.by_name.get(name) or self.default

    def unknown(self, name: str) -> str:
        """The message for a name no model answers to."""
        served = ", ".join(f"{m.name!r}" + (f" (aliases {', '.join(m.spec.aliases)})" if m.spec.aliases else "") for m in self)
        return f"model {name!r} is not served here; served: {served}"

    def for_hello(self, name: str, fingerprint: str, weights: str) -> ModelCore:
        """The model a worker's hello is for: the one it names, else the first whose vocabulary (and weights, when
        both say) it has, else the default or first model (whose core refuses it, naming the mismatch)."""
        if name and name in self.by_name:
            return self.by_name[name]
        for m in self:
            if m.core.fingerprint == fingerprint and (not weights or not m.core.weights or m.core.weights == weights):
                return m
        return self.default or self.cores[0]

    # ---- use, loads and unloads --------------------------------------------------------------------------------

    def used(self, m: ModelCore, keep_alive_s: float | None) -> None:
        """A request for `m` arrived: it is the most recently used, and it is loaded if it is not."""
        m.last_used = time.monotonic()
        m.keep_alive_s = keep_alive_s if keep_alive_s is not None else m.spec.keep_alive_s
        if (not m.core.workers or m.unloading) and m.loading_since is None:
            self._load(m)

    def started(self, name: str) -> None:
        """The supervisor started this model's workers at start-up: it counts as loading."""
        m = self.by_name[name]
        m.loading_since = time.monotonic()
        m.core.table.starting(LOAD_WAIT_S)
        self.loads[m.name] = self.loads.get(m.name, 0) + 1

    def loaded(self) -> list[ModelCore]:
        return [m for m in self if m.core.workers or m.loading_since is not None]

    def _load(self, m: ModelCore) -> None:
        now = time.monotonic()
        if self.on_load is None:
            return  # workers join on their own (`kvroute worker`): nothing to start
        if m.failed_at is not None and now - m.failed_at < RETRY_FAILED_S:
            return  # its requests get the failure's reason (the core's none_can_come)
        if m.core.workers and m.unloading:
            self._wait(m)  # its stopping workers leave first (their exits would end the new ones' wait)
            return
        loaded = self.loaded()
        short = self.short(m, loaded)
        if short is not None:
            # room first: the least recently used idle model stops (its slots go to its disk tier), then this loads
            if not any(x.unloading for x in loaded):
                starved = m.load_wanted and time.monotonic() - m.wanted_since >= STARVE_S
                victim = self._least_recently_used(but=m, busy_too=starved, on=short or None)
                if victim is not None:
                    self.unload(victim, "room for " + m.name)
            self._wait(m)  # (each tick looks again; with every loaded model pinned or busy, until one is idle)
            return
        m.load_wanted = False
        if not self.on_load(m.name):
            return
        m.failed_at, m.loading_since = None, now
        m.core.table.starting(LOAD_WAIT_S)
        self.loads[m.name] = self.loads.get(m.name, 0) + 1
        log.info("model_loading", model=m.name, loaded=[x.name for x in self.loaded()])

    def short(self, m: ModelCore, loaded: list[ModelCore]) -> set[str] | None:
        """Why `m` cannot load beside `loaded` now: the devices without room for it (an empty set: `models_max` is
        reached), or None: it can. A device where nothing else is loaded always has room (`m` alone too big loads
        and llama.cpp says whether it fits)."""
        others = [x for x in loaded if x is not m]
        if self.models_max and len(others) >= self.models_max:
            return set()
        short = set()
        for device in set(m.spec.devices) if self.memory_mb else ():
            used = sum(x.spec.devices.count(device) * x.need_mb() for x in others)
            need = m.spec.devices.count(device) * m.need_mb()
            if used and used + need > self.memory_mb:
                short.add(device)
            elif not used and need > self.memory_mb:
                log.warning(
                    "model_over_memory_budget", model=m.name, device=device, need_mb=round(need), budget_mb=self.memory_mb
                )
        return short or None

    @staticmethod
    def _wait(m: ModelCore) -> None:
        """`m` loads when it can (the tick tries again); its requests wait LOAD_WAIT_S from the first try at most."""
        if not m.load_wanted:
            m.load_wanted, m.wanted_since = True, time.monotonic()
            m.core.table.starting(LOAD_WAIT_S)

    def _least_recently_used(self, but: ModelCore, busy_too: bool = False, on: set[str] | None = None) -> ModelCore | None:
        """The unpinned loaded model used longest ago, idle unless `busy_too`, with a worker on one of `on` (None: any)."""
        idle = [x for x in self.loaded() if x is not but and not x.spec.pinned and (busy_too or not x.busy())]
        idle = [x for x in idle if not x.unloading and (on is None or on & set(x.spec.devices))]
        return min(idle, key=lambda x: x.last_used) if idle else None

    def unload(self, m: ModelCore, why: str) -> None:
        if self.on_unload is None:
            return
        log.info("model_unloading", model=m.name, reason=why, idle_s=round(time.monotonic() - m.last_used, 1))
        m.loading_since, m.unloading = None, True
        self.unloads[m.name] = self.unloads.get(m.name, 0) + 1
        self.on_unload(m.name)

    def failed(self, m: ModelCore) -> None:
        """Every worker of `m` failed to start: no load again for RETRY_FAILED_S."""
        if m.core.none_can_come() is not None:
            m.failed_at, m.loading_since = time.monotonic(), None
            log.error("model_load_failed", model=m.name, reason=m.core.none_can_come())

    def tick(self, now: float) -> None:
        for m in self:
            if m.core.workers and m.spec.memory_mb:  # (what a worker said it took replaces the KV estimate)
                kv = max(w.hello.kv_bytes for w in m.core.workers.values())
                m.said_mb = m.spec.weights_mb + kv / 2**20 if kv else 0.0
            if m.loading_since is not None and m.ready():
                log.info("model_loaded", model=m.name, load_s=round(now - m.loading_since, 2))
                m.loading_since = None
            elif m.loading_since is not None and now - m.loading_since > LOAD_WAIT_S:
                m.loading_since = None  # its queued requests have had their no_workers error
            if m.unloading and not m.core.workers:
                m.unloading = False
            if m.load_wanted and not m.core.queue and now - m.wanted_since > LOAD_WAIT_S:
                m.load_wanted = False  # its requests gave up waiting
            if (m.load_wanted or m.core.queue) and not m.core.workers and m.loading_since is None:
                self._load(m)
            keep = m.keep_alive_s
            if m.ready() and not m.unloading and keep >= 0 and not m.spec.pinned and not m.busy() and now - m.last_used > keep:
                self.unload(m, f"idle for {now - m.last_used:.0f} s (keep-alive {keep:g} s)")


def status(models: Models, rid: str | None, cache_salt: str | None) -> StatusReply:
    """Every model's workers and slots in one reply (a slot of another tenant than the asker's shows only whether it
    is busy), and where each model is loaded."""
    salt = tenant(cache_salt)
    workers, failed, queued = [], [], 0
    for m in models:
        c = m.core
        workers += views.worker_statuses(c.workers.values(), c.jobs, c.restarts, salt)
        failed += [FailedWorker(worker=w, reason=r) for w, r in sorted(c.failed.items())]
        queued += len(c.queue)
    main = models.default or models.cores[0]
    listing = [
        ModelStatus(
            name=m.name,
            aliases=list(m.spec.aliases),
            state=m.state().value,
            workers=sorted(m.core.workers),
            pinned=m.spec.pinned,
            keep_alive_s=m.keep_alive_s,
            reason=(m.core.none_can_come() or "") if m.failed_at is not None else "",
            memory_mb=round(m.need_mb(), 1),
            sampling=dict(m.core.sampling.values),
            sampling_from=dict(m.core.sampling.sources),
            sampling_not_applied=dict(m.core.sampling.not_applied),
            default_max_tokens=m.core.cfg.default_max_tokens,
            tool_format=m.chat.tool_format,
        )
        for m in models
    ]
    return StatusReply(
        id=rid, model=main.name, policy=main.core.cfg.policy, queued=queued, workers=workers, failed=failed, models=listing
    )
