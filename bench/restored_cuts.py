"""What llama-server reused by cutting a state restored from its `--cache-ram` where that state cannot be cut exactly.

A state saved with `llama_state_seq_get_data` keeps, of a sliding-window layer, only the positions its last one still
attends to (the last `n_swa`), even with `--swa-full`; with `--swa-full` llama-server treats the model as having no
window (tools/server: `n_swa = 0`) and cuts a restored state anywhere. A state of E tokens restored into a slot and
cut back to r < E - 1 tokens then computes the next tokens with window layers that lack positions they attend to:
the reuse is not exact (`python -m bench.swa_cut_probe` shows the logprobs move). kvroute cuts such a state only
where it kept a checkpoint (worker/checkpoints.py), so on a sliding-window model the prompt tokens the two compute
differ by this: `audit` reads llama-server's trace log (`--log-verbosity 4`: which cached state each slot restored)
and counts, per request, the tokens reused from below that exactness line. A lower bound: a slot cut exactly after
such a request still holds the positions it computed from holes, and those are not counted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TRACE_FLAGS = ("--log-verbosity", "4")  # llama-server logs the cache entries it weighs and the one it restores

_WINDOW = re.compile(r"print_info: n_swa\s+= (\d+)")
_PICKED = re.compile(r"id\s+(\d+) \| task -1 \| selected slot by")
_ENTRY = re.compile(r"- prompt with length\s+(\d+), lcp =\s+\d+, f_keep = ([\d.]+), f_sim = ([\d.]+)")
_RESTORED = re.compile(r"found better prompt with f_keep = ([\d.]+), f_sim = ([\d.]+)")
_TASK = re.compile(r"id\s+(\d+) \| task (\d+) \| processing task")
_COMPUTED = re.compile(r"task (\d+) \| prompt eval time =\s+[\d.]+ ms /\s+(\d+) tokens")
_GENERATED = re.compile(r"task (\d+) \|\s+eval time =\s+[\d.]+ ms /\s+(\d+) tokens")
_RELEASED = re.compile(r"task (\d+) \| stop processing: n_tokens = (\d+)")


@dataclass(frozen=True)
class Audit:
    window: int  # the model's sliding window (0: none, so every cut is exact)
    requests: int  # requests answered
    computed: int  # prompt tokens llama-server computed
    inexact: int  # prompt tokens it reused from below a restored state's exactness line
    inexact_requests: int


@dataclass
class _Task:
    slot: int
    line: int  # reuse below this many tokens is not exact (0: any is)
    computed: int = -1
    generated: int = -1
    n_tokens: int = -1  # what the slot held when the task ended: its prompt and all but its last generated token

    @property
    def reused(self) -> int:
        return self.n_tokens - self.generated + 1 - self.computed


def audit(log: str) -> Audit:
    """Count, in a llama-server log written with TRACE_FLAGS, the prompt tokens reused inexactly (module docstring)."""
    window = 0
    entries: list[tuple[int, str, str]] = []  # (tokens, f_keep, f_sim) of the cached states weighed for one slot
    picked: int | None = None
    restored: dict[int, int] = {}  # slot -> tokens of the state restored into it for its next task
    line: dict[int, int] = {}  # slot -> its exactness line (from the last state restored into it)
    tasks: dict[int, _Task] = {}
    for text in log.splitlines():
        if m := _WINDOW.search(text):
            window = int(m.group(1))
        elif m := _PICKED.search(text):
            picked, entries = int(m.group(1)), []
        elif m := _ENTRY.search(text):
            entries.append((int(m.group(1)), m.group(2), m.group(3)))
        elif m := _RESTORED.search(text):
            sizes = [n for n, keep, sim in entries if (keep, sim) == m.groups()]
            if sizes and picked is not None:
                restored[picked] = sizes[-1]
        elif m := _TASK.search(text):
            slot, task = int(m.group(1)), int(m.group(2))
            if slot in restored:  # a state of E tokens: exact down to E - 1, or anywhere when it held every position
                n = restored.pop(slot)
                line[slot] = n - 1 if window and n > window else 0
            tasks[task] = _Task(slot, line.get(slot, 0))
        elif m := _COMPUTED.search(text):
            if t := tasks.get(int(m.group(1))):
                t.computed = int(m.group(2))
        elif m := _GENERATED.search(text):
            if t := tasks.get(int(m.group(1))):
                t.generated = int(m.group(2))
        elif (m := _RELEASED.search(text)) and (t := tasks.get(int(m.group(1)))):
            t.n_tokens = int(m.group(2))
            if t.computed >= 0 and t.generated >= 0 and t.reused == 0:
                line.pop(t.slot, None)  # it computed its prompt from the start: no position of the old state is left
    done = [t for t in tasks.values() if min(t.computed, t.generated, t.n_tokens) >= 0]
    below = [t.reused for t in done if 0 < t.reused < t.line]
    return Audit(window, len(done), sum(t.computed for t in done), sum(below), len(below))
