"""How many prompt tokens an engine step computes (its prefill budget): `n_batch`, or, while other jobs generate, about
`target_s` of work at the prefill speed measured on recent steps, so that their next token waits for that, not for
a whole chunk. A chunk of 512 tokens deep in an agent's 12,000-token prompt took 3.5 s on 2 cores (its attention reads
the whole prompt so far): a stream beside it got a token every 3.5 s for a minute. llama-server's batch (2,048 tokens)
holds a stream longer still; vLLM and SGLang bound a step's tokens, not its time.

The speed is a moving average over steps that computed at least MIN_TOKENS prompt tokens (their decode rows
included: what the step cost), so it follows a prompt growing slower as it goes. Deterministic mode keeps its chunks
(their sizes are part of what it computes the same way every time).

The target (`--step-target-ms`, 1.5 s) is where pacing costs throughput no more than the noise: smaller steps are
more steps, each with its fixed costs. On 2 cores, 300 rows of the public trace (bench/trace_replay.py, one worker of 4
slots): 0.5 s took 3-9 % more wall time than no pacing, 1.5 s 1 % (bench/README.md)."""

from __future__ import annotations

MIN_TOKENS = 32  # fewest prompt tokens a paced step computes (below, a step's fixed costs dominate)
HURRY_S = 60.0  # a job of higher priority that ran this recently may come back (an agent between tool calls: the
# router keeps its slot --tool-wait-s, 60 s by default)
HURRY_TARGET_S = 0.25  # the prefill of lower-priority work a step then holds: what such a job waits for a step to end


class PrefillPace:
    def __init__(self, n_batch: int, target_s: float) -> None:
        self.n_batch, self.target_s = n_batch, target_s
        self.tokens_per_s = 0.0  # prompt tokens a second, measured (0: not yet)

    def budget(self, generating: bool, hurry: bool = False) -> int:
        """The step's prefill budget: `generating`, whether a job of the step is past its prompt (its next token waits
        for the step); `hurry`, whether a job of higher priority may come back at any step (`Urgency`)."""
        target = min(self.target_s, HURRY_TARGET_S) if hurry and self.target_s > 0 else self.target_s
        if not (generating or hurry) or target <= 0 or not self.tokens_per_s:
            return self.n_batch
        return max(min(MIN_TOKENS, self.n_batch), min(self.n_batch, int(self.tokens_per_s * target)))

    def measured(self, prompt_tokens: int, seconds: float) -> None:
        """A step computed `prompt_tokens` of prompts in `seconds`."""
        if prompt_tokens >= MIN_TOKENS and seconds > 0:
            rate = prompt_tokens / seconds
            self.tokens_per_s = rate if not self.tokens_per_s else 0.5 * self.tokens_per_s + 0.5 * rate


class Urgency:
    """When the priorities a worker served recently are above the ones it runs now (an interactive session paused on
    its tools, background work running meanwhile), a job of that priority may come back at any step and waits for the
    step in flight: those steps hold HURRY_TARGET_S of prompt work, not the pace's target. Measured on issue 65's agent
    traffic (2 cores, 3 slots): a returning parent turn waited 0.73 s for the others' step in flight before they were
    paused, of its 2.06 s."""

    def __init__(self) -> None:
        self.seen: dict[int, float] = {}  # priority -> when a step last ran a job of it

    def ran(self, top: int, now: float) -> None:
        """A step ran jobs whose highest priority is `top`."""
        self.seen[top] = now

    def hurry(self, top: int, now: float) -> bool:
        """Whether a job of a priority above `top` ran within HURRY_S."""
        return any(p > top and now - at < HURRY_S for p, at in self.seen.items())
