"""Grammar-constrained sampling with llguidance: one `Guide` per constrained job masks the logits of each row it
samples and follows the tokens chosen.

llguidance computes the set of allowed tokens in tens of microseconds (measured: 0.06 ms mean over Gemma's 262k
tokens, where llama.cpp's grammar sampler took 32 ms), so a constrained slot does not slow the others. A lazy
constraint (`triggers`) leaves the output free until a trigger appears in it; from there the text, trigger
included, must match the grammar.

Each distinct grammar is compiled once per worker (`CompiledGrammars`): as its first job arrives, on the I/O thread
(worker/engine.py `submit`), then cloned for each job; the compute thread only clones.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import llama_cpp
import numpy as np

from common import logs
from common.vocab import Vocab
from protocol import Constraint
from worker.guide_pieces import Stopped, guide_pieces

log = logs.get(__name__)

# llguidance is imported where it is used, after the worker has loaded its model: on an H200 (2026-11-28) every
# process that had loaded llguidance's native library before its first CUDA model load (a worker, worker_bench.py,
# the in-process tests) died in llama_model_load_from_file, while the same loads without it lived
# (bench/gpu/context_probe.py's import cases check that on the next GPU machine)

# compiled grammars a worker keeps: a compiled grammar takes about 60 bytes of memory a character of its text
# (measured: 11 MiB for 256 tools' 180k characters), so 2 Mi characters keep about 120 MiB at most
GRAMMARS_KEPT = 64
GRAMMARS_KEPT_CHARS = 2 * 2**20


class GuideError(ValueError):
    """A constraint that does not compile (the router checks first; a worker of another version might not)."""


class GuideTokenizer:
    """llguidance's view of the model's vocabulary, built once per worker on a thread (about 1.6 s for 262k tokens
    on 2 cores with the pieces cached, worker/guide_pieces.py; 1.1-1.3 s of it inside llguidance holding the GIL,
    which stalls every other thread of the process: the worker waits for it before it says hello, so that no request
    meets the stall).

    Only control tokens count as special: Gemma's user-defined tokens (`<b>`, `<table>`...) are ordinary text
    that a grammar may produce. Every end-of-generation token ends an accepted output."""

    def __init__(self, vocab: Vocab) -> None:
        self.vocab = vocab
        self._ready = threading.Event()
        self._closing = threading.Event()
        self._tok: Any = None
        self._error: BaseException | None = None
        self.grammars = CompiledGrammars(self.get)  # (compiled for this tokenizer: its text is the key)
        self._thread = threading.Thread(target=self._build, name="kvroute-guide-tokenizer", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop building and wait for the thread: call before the model (and its vocabulary) is freed."""
        self._closing.set()
        self._thread.join()

    def _build(self) -> None:
        try:
            v = self.vocab
            if not v.causal:  # an encoder generates nothing (the router refuses it): no grammar to guide
                raise GuideError("the model is an encoder: it generates no text")
            try:
                pieces = guide_pieces(v, self._closing)
            except Stopped as exc:
                raise GuideError(str(exc)) from None
            import llguidance

            fn = ctypes.cast(llama_cpp.llama_cpp._lib.llama_tokenize, ctypes.c_void_p).value
            self._tok = llguidance.LLTokenizer.from_llamacpp(  # type: ignore[attr-defined]
                tokens=pieces, vocab_ptr=v.pointer, tokenize_fptr=fn, eos_token=sorted(v.eog_tokens), slices=None
            )
        except GuideError as exc:
            self._error = exc
            log.info("guide_tokenizer_skipped", reason=str(exc))
        except BaseException as exc:  # reported to every constrained job rather than lost on this thread
            self._error = exc
            log.error("guide_tokenizer_failed", error=repr(exc))
        finally:
            self._ready.set()

    def wait(self, timeout_s: float) -> bool:
        """Whether the build has ended (built or failed) within `timeout_s`."""
        return self._ready.wait(timeout_s)

    def get(self) -> Any:
        self._ready.wait()
        if self._error is not None:
            raise GuideError(f"grammars are unavailable on this worker: {self._error!r}")
        return self._tok


class CompiledGrammars:
    """Each distinct grammar compiled once for one tokenizer and kept, least recently used out first past `max_kept`
    grammars or `max_chars` characters of their text; each job advances a clone of it (`deep_copy`, microseconds,
    where a compile takes milliseconds to a second: 160 ms for 256 tools). A grammar that does not compile is kept as
    its error. The kept matchers have computed their first mask: the lexer states it built are cloned too.

    The first thread to ask for a grammar compiles it; another asking meanwhile waits for that compile. llguidance
    drops the GIL while it compiles, so a compile on the I/O thread does not stall the compute thread."""

    def __init__(self, tokenizer: Callable[[], Any], max_kept: int = GRAMMARS_KEPT, max_chars: int = GRAMMARS_KEPT_CHARS) -> None:
        self._tokenizer = tokenizer  # the LLTokenizer, asked for at the first compile (it may still be building)
        self.max_kept, self.max_chars = max_kept, max_chars
        self._kept: collections.OrderedDict[str, Future[Any]] = collections.OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()
        self.compiles = 0  # grammars compiled
        self.hits = 0  # jobs' grammars found compiled (`template`)
        self.compiled_on: collections.Counter[str] = collections.Counter()  # compiles by thread name

    def __len__(self) -> int:
        return len(self._kept)

    def compile_ahead(self, grammar: str) -> None:
        """Compile `grammar` now, on this thread, unless it is kept: a job with it arrived (worker/engine.py `submit`).
        A failure is left for the job's turn on the compute thread, which refuses it with the error."""
        with contextlib.suppress(Exception):  # (kept as its error, or met again and reported by the compute thread)
            self._result(self._entry(grammar, job=False))

    def template(self, grammar: str) -> Any:
        """The compiled matcher of `grammar`, shared by every job: clone it, never advance it. GuideError when the
        grammar does not compile."""
        return self._result(self._entry(grammar, job=True))

    def _entry(self, grammar: str, job: bool) -> Future[Any]:
        with self._lock:
            entry = self._kept.get(grammar)
            if entry is not None:
                self._kept.move_to_end(grammar)
                self.hits += job
                return entry
            entry = self._kept[grammar] = Future()
            self._chars += len(grammar)
            self._drop_oldest()
            self.compiles += 1
            self.compiled_on[threading.current_thread().name] += 1
        self._compile(grammar, entry)
        return entry

    def _result(self, entry: Future[Any]) -> Any:
        error = entry.exception()  # (waits for a compile under way on another thread)
        if isinstance(error, GuideError):
            raise GuideError(str(error))  # a new one: the kept one's traceback would grow at every raise
        return entry.result()

    def _compile(self, grammar: str, entry: Future[Any]) -> None:
        import llguidance

        t0 = time.perf_counter()
        try:
            matcher = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0)
            if matcher.is_error():
                raise GuideError(f"grammar does not compile: {matcher.get_error().strip()}")
            matcher.compute_bitmask()  # the first mask's lexer states, built once here rather than in every job
        except GuideError as exc:
            log.info("grammar_refused", chars=len(grammar), error=str(exc)[:200])
            entry.set_exception(exc)
            return
        except BaseException as exc:  # not kept: the next job tries again
            with self._lock:
                if self._kept.get(grammar) is entry:
                    del self._kept[grammar]
                    self._chars -= len(grammar)
            entry.set_exception(exc)
            return
        entry.set_result(matcher)
        ms = round((time.perf_counter() - t0) * 1000, 2)
        thread = threading.current_thread().name
        log.info("grammar_compiled", ms=ms, chars=len(grammar), thread=thread, compiles=self.compiles, hits=self.hits)

    def _drop_oldest(self) -> None:
        """Past either bound, the least recently used go (never the newest: its job is about to use it)."""
        while len(self._kept) > 1 and (len(self._kept) > self.max_kept or self._chars > self.max_chars):
            grammar, _ = self._kept.popitem(last=False)
            self._chars -= len(grammar)


class Guide:
    """One job's constraint. `mask(logits)` before sampling, `follow(token)` after; `done` once the grammar is
    complete and allows nothing more."""

    def __init__(self, constraint: Constraint, tokenizer: GuideTokenizer) -> None:
        self.constraint = constraint
        self.tokenizer = tokenizer
        self.vocab = tokenizer.vocab
        self._compiled = tokenizer.grammars.template(constraint.grammar)  # (GuideError when it does not compile)
        # a lazy constraint's clone is made when its trigger appears
        self.matcher: Any = None if constraint.triggers else self._compiled.deep_copy()
        self.failed = False  # a lazy constraint whose trigger text did not fit its grammar: the output stays free
        self.done = False
        self._text = bytearray()  # generated bytes, while waiting for a trigger
        self._bits: np.ndarray | None = None

    @property
    def active(self) -> bool:
        return self.matcher is not None and not self.done

    def mask(self, logits: np.ndarray) -> None:
        """Set the logits of tokens the grammar does not allow next to -inf (in place)."""
        if not self.active:
            return
        import llguidance.numpy as llnp

        if self._bits is None:
            self._bits = llnp.allocate_token_bitmask(1, self.vocab.n_vocab)
        llnp.fill_next_token_bitmask(self.matcher, self._bits)
        allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: logits.shape[0]]
        logits[allowed == 0] = -np.inf

    def follow(self, token: int) -> None:
        """The sampled token: the matcher moves on, or a lazy constraint looks for its trigger."""
        if self.done or self.failed:
            return
        if self.matcher is not None:
            if not self.matcher.consume_token(token):
                log.warning("guide_rejected_token", token=token, error=self.matcher.get_error()[:200])
                self.failed, self.matcher = True, None
            elif self.matcher.is_stopped():
                self.done = True
            return
        self._text += self.vocab.piece(token)
        self._look_for_trigger()

    def _look_for_trigger(self) -> None:
        c = self.constraint
        if c.at_start:
            text = self._text.decode("utf-8", "replace")
            head = text.lstrip()
            hit = next((t for t in c.triggers if head.startswith(t)), None)
            if hit is None:
                if head and not any(t.startswith(head) for t in c.triggers):
                    self.failed = True  # the reply did not open with a trigger: it stays free
                return
            self._engage(head)
            return
        # only the tail can hold a trigger that the last token completed
        window = max(len(t.encode()) for t in c.triggers) + 64
        start = max(0, len(self._text) - window)
        tail = self._text[start:].decode("utf-8", "replace")
        hits = [i for t in c.triggers if (i := tail.find(t)) >= 0]
        if hits:
            self._engage(tail[min(hits) :])

    def _engage(self, text: str) -> None:
        """A trigger appeared: from it on (`text`), the output must match the grammar."""
        self.matcher = self._compiled.deep_copy()
        replay = self.vocab.tokenize(text, add_special=False, parse_special=False)
        if not self.matcher.consume_tokens(replay):
            log.warning("guide_trigger_replay_refused", text=text[:80])
            self.failed, self.matcher = True, None
        elif self.matcher.is_stopped():
            self.done = True
