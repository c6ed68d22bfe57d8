"""Deterministic, realistic English workloads, sized in model tokens.

Text comes from a fixed-seed sentence generator (real English words in sentence templates), so every run and
every system sees exactly the same prompts. Sizes are measured by tokenizing with the model's own vocabulary
(`common.vocab.Vocab`): "1,500 tokens" means 1,500 tokens of the served model, give or take one sentence.

A workload is a set of sessions run `concurrency` at a time. A session is an opening text and one message per
turn; turn k's prompt is the opening, then every earlier (message + completion), then message k. So a
multi-turn session resends its whole history, as an agent or a chat client does, and a prefix-aware server
only has to compute the new tail.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from common.config import opt

WORKLOADS = ("agent-long", "multi-agent", "many-agents", "throughput", "fanout", "long-session", "scale-out")


@dataclass(frozen=True)
class Sizes:
    """Every size and count of the workloads; each field is a flag of `python -m bench.run`."""

    seed: int = opt(1234, "seed of the text generator (same seed, same prompts)")
    turns: int = opt(30, "agent-long: turns of the one session")
    preamble_tokens: int = opt(1500, "agent-long and long-session: tokens of the system preamble")
    user_tokens: int = opt(50, "agent-long, long-session, multi-agent: tokens of each user message")
    max_tokens: int = opt(32, "max_tokens of each turn (agent-long, long-session, multi-agent, fanout)")
    long_turns: int = opt(300, "long-session: turns of the one session")
    sessions: int = opt(6, "multi-agent: concurrent sessions")
    many_sessions: int = opt(12, "many-agents: concurrent sessions (multi-agent's sessions and sizes otherwise)")
    session_turns: int = opt(8, "multi-agent: turns of each session")
    shared_tokens: int = opt(300, "multi-agent: tokens of the preamble every session shares")
    system_tokens: int = opt(800, "multi-agent: tokens of each session's own system prompt")
    requests: int = opt(16, "throughput: distinct prompts")
    concurrency: int = opt(8, "throughput: requests in flight at once")
    prompt_tokens: int = opt(200, "throughput: tokens of each prompt")
    throughput_max_tokens: int = opt(64, "throughput: max_tokens of each request")
    fanout_requests: int = opt(16, "fanout: requests about the one document")
    fanout_concurrency: int = opt(4, "fanout: requests in flight at once")
    document_tokens: int = opt(1000, "fanout: tokens of the shared document")
    question_tokens: int = opt(30, "fanout: tokens of each question")
    scale_sessions: int = opt(12, "scale-out: concurrent agent sessions")
    scale_turns: int = opt(8, "scale-out: turns of each session")
    scale_shared_tokens: int = opt(400, "scale-out: tokens of the system prompt every session shares")
    scale_user_tokens: int = opt(40, "scale-out: tokens of each user message")
    scale_max_tokens: int = opt(16, "scale-out: max_tokens of each turn")
    scale_workers: int = opt(2, "scale-out: kvroute workers (instead of --workers)")
    scale_slots: int = opt(2, "scale-out: slots per worker (instead of --slots)")
    scale_think_s: float = opt(0.5, "scale-out: before each turn a session pauses 0 to this many seconds (seeded): its tools")
    temperature: float = opt(
        0.0,
        "every request's temperature (0: greedy); above 0 with top_k 0, top_p 1, min_p 0 and a seed per request, "
        "the same for every system (llama-server's own defaults would cut the distribution)",
    )
    request_seeds: bool = opt(
        True,
        "with --temperature: a seed per request, the same on every system (--no-request-seeds: none, as most clients "
        "send; kvroute computes a seeded request's prompt alone, so that the seed repeats its tokens)",
    )


# Tiny sizes for checking the harness end to end in a minute or two (`--quick`).
QUICK = {
    "turns": 4,
    "preamble_tokens": 300,
    "user_tokens": 20,
    "max_tokens": 8,
    "long_turns": 12,
    "sessions": 3,
    "many_sessions": 5,
    "session_turns": 2,
    "shared_tokens": 60,
    "system_tokens": 120,
    "requests": 4,
    "concurrency": 2,
    "prompt_tokens": 60,
    "throughput_max_tokens": 16,
    "fanout_requests": 4,
    "fanout_concurrency": 2,
    "document_tokens": 200,
    "question_tokens": 15,
    "scale_sessions": 4,
    "scale_turns": 2,
    "scale_shared_tokens": 60,
    "scale_user_tokens": 15,
    "scale_max_tokens": 4,
}


@dataclass(frozen=True)
class Session:
    """One conversation: `opening`, then `messages[k]` at turn k, each answered with up to `max_tokens`."""

    name: str
    opening: str
    messages: tuple[str, ...]
    max_tokens: int
    think_s: tuple[float, ...] = ()  # pause before turn k (an agent running its tools); none when empty

    def prompt(self, turn: int, completions: Sequence[str]) -> str:
        """The prompt of `turn`: opening + every earlier (message + its completion) + this turn's message."""
        if len(completions) < turn:
            raise ValueError(f"turn {turn} needs the {turn} earlier completions, got {len(completions)}")
        parts = [self.opening]
        for k in range(turn):
            parts += [self.messages[k], completions[k]]
        parts.append(self.messages[turn])
        return "".join(parts)


@dataclass(frozen=True)
class Workload:
    """Sessions run `concurrency` at a time; each session's turns run one after the other. `workers` and `slots`,
    when set, are the kvroute layout the workload is about (scale-out), instead of the run's --workers/--slots."""

    name: str
    description: str
    sessions: tuple[Session, ...]
    concurrency: int
    workers: int = 0
    slots: int = 0
    temperature: float = 0.0  # (Sizes.temperature)
    request_seeds: bool = True  # (Sizes.request_seeds)
    # every reply runs to its max_tokens (`ignore_eos`, which llama-server and kvroute both honour): every system then
    # does the same work, whatever its random draws (sampled, one server's replies ended early by chance more often
    # than another's: 918 against 961 output tokens, 2026-11-26)
    full_length: bool = False

    @property
    def n_requests(self) -> int:
        return sum(len(s.messages) for s in self.sessions)


# --- the text generator -------------------------------------------------------------------------------------

# fmt: off
_WORDS: dict[str, tuple[str, ...]] = {
    "noun": (
        "report", "server", "customer", "budget", "schedule", "engineer", "library", "river", "garden", "teacher",
        "market", "process", "window", "question", "answer", "village", "contract", "machine", "document", "team",
        "history", "record", "station", "kitchen", "harbor", "letter", "meeting", "project", "mountain", "council",
        "student", "doctor", "bridge", "network", "invoice", "database", "request", "policy", "storm", "museum",
        "farmer", "journey", "factory", "signal", "forest", "language", "painting", "hospital", "account", "system",
    ),
    "adj": (
        "quiet", "careful", "broken", "quick", "ancient", "modern", "useful", "heavy", "bright", "narrow", "reliable",
        "strange", "gentle", "complex", "simple", "local", "public", "private", "early", "late", "patient",
        "detailed", "curious", "steady", "crowded", "empty", "familiar", "remote", "sudden", "honest",
    ),
    "verb_past": (
        "checked", "opened", "described", "repaired", "visited", "measured", "followed", "approved", "ignored",
        "moved", "painted", "replaced", "studied", "delivered", "explained", "closed", "organized", "tested",
        "reviewed", "collected", "protected", "finished", "built", "cleaned", "watched", "answered", "planned",
    ),
    "verb": (
        "check", "open", "describe", "repair", "visit", "measure", "follow", "approve", "move", "replace", "study",
        "deliver", "explain", "organize", "test", "review", "collect", "protect", "finish", "build", "plan",
        "compare", "summarize", "update", "list", "translate", "improve", "estimate",
    ),
    "adverb": (
        "slowly", "carefully", "quickly", "quietly", "finally", "usually", "rarely", "openly", "gladly", "gently",
        "clearly", "briefly", "twice", "again", "early", "later",
    ),
    "prep": (
        "near", "behind", "after", "before", "under", "beside", "across", "inside", "around", "without",
    ),
    "name": (
        "Alice", "Omar", "Mei", "Lucas", "Priya", "Jonas", "Sofia", "Kwame", "Elena", "Hiro", "Fatima", "Daniel",
        "Ingrid", "Mateo", "Amara", "Nikolai",
    ),
    "time": (
        "on Monday", "last week", "in the morning", "after lunch", "before the holiday", "every spring",
        "during the storm", "at midnight", "in early June", "yesterday", "this year", "at the end of the day",
    ),
    "number": (
        "two", "three", "four", "five", "six", "seven", "ten", "twelve", "twenty", "a hundred",
    ),
}
# fmt: on

_STATEMENTS = (
    "The {adj} {noun} {verb_past} the {noun} {prep} the {noun}.",
    "{name} {verb_past} the {adj} {noun} {time}.",
    "{time_cap}, the {noun} was {adverb} {verb_past} by {name}.",
    "Nobody expected the {noun} to be so {adj}, but {name} {verb_past} it {adverb}.",
    "There were {number} {adj} reasons why the {noun} {verb_past} the {noun}.",
    "After the {noun} {verb_past} the {noun}, {name} wrote a {adj} note about it.",
    "The {noun} {prep} the {adj} {noun} had been {verb_past} {number} times {time}.",
    "{name} and {name} {adverb} {verb_past} the {noun} {prep} the {adj} {noun}.",
    "It is {adj} to {verb} a {noun} when the {noun} is {adj}.",
    "Most people {prep} the {noun} never {verb} the {adj} {noun}.",
    "The {adj} {noun} is where the {noun} keeps its {adj} {noun}.",
    "Because the {noun} was {adj}, the {noun} {verb_past} {adverb}.",
    "In the {adj} {noun}, {number} {noun}s {verb_past} the {noun} {time}.",
    "{name} said that the {noun} should {verb} the {noun} {adverb}.",
)

_REQUESTS = (
    "Please {verb} the {adj} {noun} and {verb} the {noun} {prep} it.",
    "Can you {verb} what the {noun} {verb_past} {time}?",
    "Now {verb} the {noun} that {name} {verb_past}, and keep it {adj}.",
    "Why did the {adj} {noun} {verb} the {noun} {prep} the {noun}?",
    "Next, {verb} the {number} {adj} {noun}s {adverb}.",
    "What would {name} {verb} if the {noun} were {adj}?",
)


class TextGen:
    """Fixed-seed English text: the same seed gives the same sentences on every machine (random.Random with a
    string seed is stable across platforms and Python versions)."""

    def __init__(self, seed: str) -> None:
        self._rng = random.Random(seed)

    def _fill(self, template: str) -> str:
        rng = self._rng
        out = template
        while "{" in out:
            start = out.index("{")
            key = out[start + 1 : out.index("}", start)]
            if key == "time_cap":
                word = rng.choice(_WORDS["time"])
                word = word[0].upper() + word[1:]
            else:
                word = rng.choice(_WORDS[key])
            out = out[:start] + word + out[out.index("}", start) + 1 :]
        return out[0].upper() + out[1:]

    def statement(self) -> str:
        return self._fill(self._rng.choice(_STATEMENTS))

    def request(self) -> str:
        return self._fill(self._rng.choice(_REQUESTS))


def grow(head: str, target: int, sentence: Callable[[], str], tokenize: Callable[[str], list[int]]) -> str:
    """`head` plus sentences until it reaches `target` tokens; the last sentence is cut at a word so that the
    text overshoots by a token or two at most."""
    text = head
    while len(tokenize(text)) < target:
        text = f"{text} {sentence()}" if text else sentence()
    while " " in text:
        shorter = text.rsplit(" ", 1)[0].rstrip(",.?")
        if len(tokenize(shorter + ".")) < target:
            break
        text = shorter + "."
    return text


# --- the workloads -----------------------------------------------------------------------------------------


def _turn(text: str) -> str:
    return f"\n\nUser: {text}\nAssistant:"


def _messages(gen: TextGen, n: int, tokens: int, tokenize: Callable[[str], list[int]]) -> tuple[str, ...]:
    """`n` user turns of about `tokens` tokens each, the User/Assistant framing included."""
    body = max(1, tokens - len(tokenize(_turn(""))))
    return tuple(_turn(grow(gen.request(), body, gen.statement, tokenize)) for _ in range(n))


def _agent_session(name: str, sizes: Sizes, turns: int, tokenize: Callable[[str], list[int]]) -> Session:
    gen = TextGen(f"{sizes.seed}:{name}")
    head = "You are a careful assistant that helps a small team with its daily work. Background notes follow."
    preamble = grow(head, sizes.preamble_tokens, gen.statement, tokenize)
    return Session(name, preamble, _messages(gen, turns, sizes.user_tokens, tokenize), sizes.max_tokens)


def agent_long(sizes: Sizes, tokenize: Callable[[str], list[int]]) -> Workload:
    session = _agent_session("agent-long", sizes, sizes.turns, tokenize)
    desc = (
        f"one session, {sizes.preamble_tokens}-token preamble, {sizes.turns} turns of {sizes.user_tokens}-token "
        f"messages, max_tokens {sizes.max_tokens}"
    )
    return Workload("agent-long", desc, (session,), 1)


def long_session(sizes: Sizes, tokenize: Callable[[str], list[int]]) -> Workload:
    session = _agent_session("long-session", sizes, sizes.long_turns, tokenize)
    desc = (
        f"agent-long with {sizes.long_turns} turns: {sizes.preamble_tokens}-token preamble, "
        f"{sizes.user_tokens}-token messages, max_tokens {sizes.max_tokens}"
    )
    return Workload("long-session", desc, (session,), 1)


def multi_agent(sizes: Sizes, tokenize: Callable[[str], list[int]], name: str = "multi-agent", n: int = 0) -> Workload:
    """`n` (default: --sessions) agents at once, each with its own system prompt after a shared preamble."""
    n = n or sizes.sessions
    gen = TextGen(f"{sizes.seed}:multi-agent:shared")
    shared = grow("Team handbook. Read it before answering.", sizes.shared_tokens, gen.statement, tokenize)
    sessions = []
    for i in range(n):
        own = TextGen(f"{sizes.seed}:multi-agent:{i}")
        system = grow(f"\n\nYou are agent {i + 1}. Your own notes follow.", sizes.system_tokens, own.statement, tokenize)
        messages = _messages(own, sizes.session_turns, sizes.user_tokens, tokenize)
        sessions.append(Session(f"agent-{i + 1}", shared + system, messages, sizes.max_tokens))
    desc = (
        f"{n} concurrent sessions, {sizes.shared_tokens}-token shared preamble + {sizes.system_tokens}-token "
        f"own system prompt, {sizes.session_turns} turns of {sizes.user_tokens}-token messages, max_tokens {sizes.max_tokens}"
    )
    return Workload(name, desc, tuple(sessions), n)


def many_agents(sizes: Sizes, tokenize: Callable[[str], list[int]]) -> Workload:
    """multi-agent with more agents (--many-sessions, 12): on 4 slots most of them wait for a slot at every turn."""
    return multi_agent(sizes, tokenize, "many-agents", sizes.many_sessions)


def throughput(sizes: Sizes, tokenize: Callable[[str], list[int]]) -> Workload:
    sessions = []
    for i in range(sizes.requests):
        gen = TextGen(f"{sizes.seed}:throughput:{i}")
        prompt = grow(f"Story {i + 1}.", sizes.prompt_tokens, gen.statement, tokenize)
        sessions.append(Session(f"prompt-{i + 1}", prompt, ("\n\nThe story continues:",), sizes.throughput_max_tokens))
    desc = (
        f"{sizes.requests} distinct {sizes.prompt_tokens}-token prompts, concurrency {sizes.concurrency}, "
        f"max_tokens {sizes.throughput_max_tokens}, every reply to its full length (ignore_eos)"
    )
    return Workload("throughput", desc, tuple(sessions), sizes.concurrency, full_length=True)


def fanout(sizes: Sizes, tokenize: Callable[[str], list[int]]) -> Workload:
    gen = TextGen(f"{sizes.seed}:fanout:document")
    document = grow("Document.", sizes.document_tokens, gen.statement, tokenize)
    sessions = []
    for i in range(sizes.fanout_requests):
        q = TextGen(f"{sizes.seed}:fanout:{i}")
        question = grow(q.request(), sizes.question_tokens, q.statement, tokenize)
        sessions.append(Session(f"question-{i + 1}", document, (f"\n\nQuestion: {question}\nAnswer:",), sizes.max_tokens))
    desc = (
        f"{sizes.fanout_requests} requests sharing one {sizes.document_tokens}-token document, "
        f"{sizes.question_tokens}-token questions, concurrency {sizes.fanout_concurrency}, max_tokens {sizes.max_tokens}"
    )
    return Workload("fanout", desc, tuple(sessions), sizes.fanout_concurrency)


def scale_out(sizes: Sizes, tokenize: Callable[[str], list[int]]) -> Workload:
    """Many agents on several workers (issue 17): every session starts with the same system prompt, then each turn
    appends the reply and a new user message. Only routing decides how much of that a worker finds cached: a
    session's next turn must land where its history is, and a new session anywhere the shared prompt is."""
    gen = TextGen(f"{sizes.seed}:scale-out:shared")
    head = "You are one of a team of agents sharing this system prompt. Follow the team's notes below."
    shared = grow(head, sizes.scale_shared_tokens, gen.statement, tokenize)
    sessions = []
    for i in range(sizes.scale_sessions):
        own = TextGen(f"{sizes.seed}:scale-out:{i}")
        messages = _messages(own, sizes.scale_turns, sizes.scale_user_tokens, tokenize)
        # Seeded pauses: every system sees the same arrivals, and they do not come back in a fixed cycle (which
        # round-robin's rotation can line up with: 12 sessions, 2 workers)
        pauses = random.Random(f"{sizes.seed}:scale-out:{i}:think")
        think = tuple(round(pauses.uniform(0, sizes.scale_think_s), 3) for _ in messages)
        sessions.append(Session(f"agent-{i + 1}", shared, messages, sizes.scale_max_tokens, think))
    desc = (
        f"{sizes.scale_sessions} concurrent sessions on kvroute {sizes.scale_workers} workers x {sizes.scale_slots} "
        f"slots, {sizes.scale_shared_tokens}-token shared system prompt, {sizes.scale_turns} turns of "
        f"{sizes.scale_user_tokens}-token messages, max_tokens {sizes.scale_max_tokens}, "
        f"0-{sizes.scale_think_s:g} s pause before each turn"
    )
    n = sizes.scale_sessions
    return Workload("scale-out", desc, tuple(sessions), n, workers=sizes.scale_workers, slots=sizes.scale_slots)


BUILDERS: dict[str, Callable[[Sizes, Callable[[str], list[int]]], Workload]] = {
    "agent-long": agent_long,
    "multi-agent": multi_agent,
    "many-agents": many_agents,
    "throughput": throughput,
    "fanout": fanout,
    "long-session": long_session,
    "scale-out": scale_out,
}


def build(name: str, sizes: Sizes, tokenize: Callable[[str], list[int]]) -> Workload:
    """The workload called `name` (one of WORKLOADS); `tokenize` maps text to model tokens, without BOS."""
    if name not in BUILDERS:
        raise ValueError(f"unknown workload {name!r} (known: {', '.join(WORKLOADS)})")
    return replace(BUILDERS[name](sizes, tokenize), temperature=sizes.temperature, request_seeds=sizes.request_seeds)


def model_tokenizer(model_path: str) -> Callable[[str], list[int]]:
    """Text -> tokens of the model at `model_path`, without BOS (so pieces add up)."""
    from common.vocab import Vocab

    vocab = Vocab.load(model_path)
    return lambda text: vocab.tokenize(text, add_special=False, parse_special=False)
