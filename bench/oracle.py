"""The offline oracle of the scale-out workload: the most prompt tokens any placement could have reused.

It sees the whole run at once: every request's prompt as token ids (`[BOS] + tokens of the prompt text`, what the
server counts as `usage.prompt_tokens`) and what a worker holds once the request is done, its *context*: the
prompt then the reply's tokens. Its budget is kvroute's: W workers of S slots, and each worker's host RAM
(`--host-cache-mb`, gigabytes by default), where evicted slot contents wait and from which a worker restores them.
On the scale-out sizes the host RAM of one worker holds every session's context several times over (Gemma 3 270M:
about 18 KB of KV per token, under 20 MB for an 830-token session), so memory never forces a recompute, and slots
only decide when a request runs, not what it can reuse. What is left is the placement across workers, which do not
share memory. The rule:

1. Each session lives on one worker: each turn reuses the longest prefix it shares with anything its worker
   computed before, which for turn k > 1 is the session's own previous context (all of it but where the reply's
   tokens and the re-tokenized next prompt disagree).
2. A session's first turn reuses the longest prefix it shares with another session's prompt computed earlier on
   the same worker: the shared system prompt, once that worker has computed it.
3. Every worker is used (one worker for everything is no scale-out): each of the W workers must compute the part
   every session shares once. Splitting the sessions between the workers where their prompts branch (right
   after what all of them share, D tokens) costs exactly D more per extra worker and no split costs less; so
   the oracle reuses (W - 1) x D fewer tokens than one worker with everything would. A system that left workers
   idle paid D fewer times: bench.run gives the oracle W = the workers the system ran jobs on (its /metrics), so
   that the oracle stays an upper bound of what the system could have reused with its own placement's spread.
4. A prompt never reuses all of its tokens: the worker computes the last one again for its logits (as kvroute's
   worker does on a full match).

So oracle reuse = sum over requests of min(len - 1, the longest prefix shared with any context computed before,
in turn order) - (W - 1) x D. Computed with a single worker, the sum does not depend on the order (each request
adds to the worker's prefix tree exactly its tokens that no earlier context shares), as long as a session's turns
keep their order; turn order does. The reply's tokens are the tokenizer's tokens of the reply's text, which is
what the worker holds when the model wrote the text the tokenizer's way (usually). The oracle stays an upper bound
where the worker holds less: a reply cut by max_tokens ends with a token that was sampled but never run through
the model, so a worker's next turn reuses one token less than the oracle's (at most one per turn). Requests that
failed are left out, as the measured reuse leaves them out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from common.slots import common_prefix

BOS = -1  # stands for the BOS token the server puts first: the same in every prompt


@dataclass(frozen=True)
class Request:
    """One request of the run: its session, turn, prompt tokens and what its worker held after it."""

    session: str
    turn: int
    prompt: tuple[int, ...]
    context: tuple[int, ...]  # prompt + the reply's tokens


@dataclass(frozen=True)
class Oracle:
    reused: int  # prompt tokens the oracle reuses, in all
    prompt: int  # prompt tokens, in all
    shared: int  # D: tokens every request's prompt starts with, computed once on each worker
    workers: int  # workers the oracle spreads the sessions over: min(W, sessions)
    per_request: dict[tuple[str, int], int]  # (session, turn) -> reused on one worker with everything

    @property
    def first_turns(self) -> int:
        """Reuse of the sessions' first turns (the shared prompt), with every worker paying for it once."""
        return sum(v for (_, t), v in self.per_request.items() if t == 0) - (self.workers - 1) * self.shared

    @property
    def later_turns(self) -> int:
        return sum(v for (_, t), v in self.per_request.items() if t > 0)


def oracle(requests: Sequence[Request], workers: int) -> Oracle:
    """The oracle's reuse over `requests` (any order; failed ones left out) on `workers` workers (rules above)."""
    ordered = sorted(requests, key=lambda r: (r.turn, r.session))
    held: list[tuple[int, ...]] = []
    per: dict[tuple[str, int], int] = {}
    for r in ordered:
        best = max((common_prefix(r.prompt, c) for c in held), default=0)
        per[(r.session, r.turn)] = max(0, min(len(r.prompt) - 1, best))
        held.append(r.context)
    sessions = {r.session for r in requests}
    w = max(1, min(workers, len(sessions)))
    prompts = [r.prompt for r in requests]
    shared = min((common_prefix(prompts[0], p) for p in prompts), default=0)  # what every prompt starts with
    total = sum(per.values()) - (w - 1) * shared
    return Oracle(max(0, total), sum(len(r.prompt) for r in requests), shared, w, per)
