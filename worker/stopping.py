"""Turns token pieces into streamable text: valid UTF-8 only, stop strings matched across token boundaries.

Text that could still become a stop string is held back until it cannot; a matched stop string and
everything after it are never emitted.
"""

from __future__ import annotations

import codecs


class TextStream:
    """Feed token bytes with `push`; get the text that is safe to emit now, and the stop string if one matched."""

    def __init__(self, stops: list[str] | tuple[str, ...] = ()) -> None:
        self.stops = tuple(s for s in stops if s)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")  # holds back partial sequences
        self._held = ""  # decoded text not yet emitted (a possible stop-string prefix)
        self.text: list[str] = []  # everything emitted so far
        self.stop: str | None = None

    def push(self, piece: bytes) -> str:
        """Add one token's bytes. Returns the text to emit (may be ""). After a stop match, `self.stop` is set."""
        new = self._utf8.decode(piece)
        if not self.stops:
            if new:
                self.text.append(new)
            return new
        pending = self._held + new
        hit, at = None, -1
        for s in self.stops:
            i = pending.find(s)
            if i >= 0 and (at < 0 or i < at):
                hit, at = s, i
        if hit is not None:
            self.stop = hit
            self._held = ""
            return self._emit(pending[:at])
        keep = self._partial_suffix(pending)
        self._held = pending[len(pending) - keep :] if keep else ""
        return self._emit(pending[: len(pending) - keep])

    def flush(self) -> str:
        """End of generation without a stop match: emit what was held back (incomplete UTF-8 becomes U+FFFD)."""
        if self.stop is not None:
            return ""
        out = self._held + self._utf8.decode(b"", final=True)
        self._held = ""
        return self._emit(out)

    def full_text(self) -> str:
        return "".join(self.text)

    def _emit(self, s: str) -> str:
        if s:
            self.text.append(s)
        return s

    def _partial_suffix(self, s: str) -> int:
        """Length of the longest suffix of `s` that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(s)), best, -1):
                if s.endswith(stop[:k]):
                    best = k
                    break
        return best
