"""What preparing one request may cost (issue 46): bounds checked before the work, in time linear in the request, and
a deadline checked while it is done.

- `nesting(value)`: how deep a JSON value nests, measured without recursion. A value nested deeper than MAX_NESTING
  (a schema, tool parameters, template variables, tool-call arguments) is refused before the recursive readers after
  it (schema tightening, llguidance, a template's `tojson`, msgpack) reach Python's recursion limit: that would be a
  500 for what is the request's problem.
- `Deadline`: how long a request's preparation may take. It is checked between stages (rendering, tokenizing, each
  grammar) and, through `running()`, inside a template's rendering at every attribute or item a template reads, so
  that a template looping over 100,000 messages stops at the deadline instead of holding a thread for minutes.
"""

from __future__ import annotations

import threading
import time
from typing import Any

MAX_NESTING = 64  # levels of JSON objects and arrays in one value (a tool's parameters seldom pass 10)
CHECK_EVERY = 256  # template reads between two looks at the clock


class DeadlinePassed(Exception):
    """The preparation ran past its deadline; `param` names the field whose work was under way."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def nesting(value: Any, limit: int = MAX_NESTING) -> int:
    """How many levels of dicts and lists `value` has (0 for a scalar), counting no further than `limit` + 1."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict):
            children: Any = v.values()
        elif isinstance(v, list | tuple):
            children = v
        else:
            continue
        depth += 1
        if depth > deepest:
            deepest = depth
            if deepest > limit:
                return deepest
        stack.extend((c, depth) for c in children if isinstance(c, dict | list | tuple))
    return deepest


class Deadline:
    """The time a request's preparation may take (`seconds`; None: no limit). `check(param)` raises DeadlinePassed
    once it is past; `running()` makes it the deadline a template's rendering on this thread checks."""

    _current = threading.local()

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self.at = None if seconds is None else time.monotonic() + seconds
        self.param: str | None = None  # the field whose work is under way (for the message)
        self._reads = 0

    def left(self) -> float:
        return float("inf") if self.at is None else self.at - time.monotonic()

    def check(self, param: str | None = None) -> None:
        if param is not None:
            self.param = param
        if self.at is not None and time.monotonic() > self.at:
            where = f" (while preparing `{self.param}`)" if self.param else ""
            raise DeadlinePassed(f"preparing this request took more than {self.seconds:g} s{where}", self.param)

    def running(self, param: str) -> _Running:
        """`with deadline.running("messages"): ...`: template reads on this thread check this deadline."""
        self.param = param
        return _Running(self)

    @classmethod
    def check_running(cls, param: str | None = None) -> None:
        """Check the deadline running on this thread, if any (for work below the one that set it)."""
        d: Deadline | None = getattr(cls._current, "deadline", None)
        if d is not None:
            d.check(param)

    @classmethod
    def read(cls) -> None:
        """A template read a value: every CHECK_EVERY reads, the running deadline (if any) is checked."""
        d: Deadline | None = getattr(cls._current, "deadline", None)
        if d is not None:
            d._reads += 1
            if d._reads % CHECK_EVERY == 0:
                d.check()


class _Running:
    def __init__(self, deadline: Deadline) -> None:
        self.deadline = deadline
        self.before: Deadline | None = None

    def __enter__(self) -> Deadline:
        self.before = getattr(Deadline._current, "deadline", None)
        Deadline._current.deadline = self.deadline
        return self.deadline

    def __exit__(self, *exc: object) -> None:
        Deadline._current.deadline = self.before
