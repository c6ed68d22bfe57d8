"""Fingerprints read from a GGUF file's header. Its weights', so that a router refuses a worker whose model has the
router's vocabulary but other weights (another quantization, another fine-tune): its tokens would mean the same, its
KV would not, and replies would differ by worker. Its tokenizer's (`tokenizer_fingerprint`: every `tokenizer.ggml.*`
value as stored, what llama.cpp builds the vocabulary from), which common/vocab.py's fingerprint is made of.

It hashes the tensor table (every tensor's name, shape, type and offset: a quantization changes the types)
and the first bytes of every tensor's data (a fine-tune changes them), reading the header and one small
block per tensor, not the whole file: milliseconds for a 250 MB model, well under a second for a 70 GB one.
The `gguf` package (llama.cpp's own reader) would parse every metadata value into numpy arrays first, 11 s
for the default model's 262k-token vocabulary here, so the few header fields needed are read here.
"""

from __future__ import annotations

import hashlib
import mmap
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

SAMPLE_BYTES = 1024  # of each tensor's data
# GGUF metadata value types -> fixed size in bytes (8 = string, 9 = array: variable)
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
T = TypeVar("T")
_U64 = struct.Struct("<Q")
_TOKENIZER = b"tokenizer.ggml."


class GGUFError(ValueError):
    """The file is not a GGUF this reader understands; the message says where it stopped."""


def weights_fingerprint(path: str | Path) -> str:
    """Hex digest of the tensor table and a sample of every tensor's data. Raises GGUFError (OSError when the
    file cannot be read)."""

    def digest(m: mmap.mmap) -> str:
        table, starts = _Reader(m).tensors()
        h = hashlib.blake2b(table, digest_size=16)
        for start in starts:
            h.update(m[start : start + SAMPLE_BYTES])
        return h.hexdigest()

    return _mapped(path, digest)


def tokenizer_fingerprint(path: str | Path) -> str:
    """Hex digest of the file's `tokenizer.ggml.*` metadata (each key with its type and stored value, in key order):
    the token texts, types, scores, merges and special ids. Milliseconds, where reading each of 262k tokens through
    llama.cpp took 0.6 s. Raises GGUFError (OSError when the file cannot be read)."""

    def digest(m: mmap.mmap) -> str:
        h = hashlib.blake2b(digest_size=16)
        for key, kind, start, end in sorted(entry for entry in _Reader(m).metadata() if entry[0].startswith(_TOKENIZER)):
            h.update(struct.pack("<QIQ", len(key), kind, end - start) + key)
            h.update(m[start:end])
        return h.hexdigest()

    return _mapped(path, digest)


def tensor_data_starts(path: str | Path) -> list[int]:
    """Where each tensor's data starts in the file (the fault tests alter weights there)."""
    return _mapped(path, lambda m: _Reader(m).tensors()[1])


def _mapped(path: str | Path, read: Callable[[mmap.mmap], T]) -> T:
    """`read` over the file mapped read-only; a header cut short or malformed is a GGUFError naming the file."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        try:
            return read(m)
        except (struct.error, IndexError) as exc:
            raise GGUFError(f"{path}: malformed GGUF header ({exc})") from None


class _Reader:
    def __init__(self, m: mmap.mmap) -> None:
        self.m, self.pos, self.n_tensors = m, 0, 0

    def _take(self, fmt: str) -> int:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.m):
            raise GGUFError(f"the file ends inside its header (byte {self.pos})")
        (value,) = struct.unpack_from(fmt, self.m, self.pos)
        self.pos += size
        return int(value)

    def _string(self) -> bytes:
        n = self._take("<Q")
        if self.pos + n > len(self.m):
            raise GGUFError(f"a string of {n} bytes runs past the end of the file (byte {self.pos})")
        s = self.m[self.pos : self.pos + n]
        self.pos += n
        return s

    def _skip_value(self, kind: int) -> None:
        if kind == _STRING:
            n = self._take("<Q")  # (not `self.pos += self._take(...)`: that reads pos before _take moves it)
            self.pos += n
        elif kind == _ARRAY:
            inner, count = self._take("<I"), self._take("<Q")
            if inner in _SIZES:
                self.pos += _SIZES[inner] * count
            elif inner == _STRING:
                self._skip_strings(count)
            else:
                for _ in range(count):
                    self._skip_value(inner)
        elif kind in _SIZES:
            self.pos += _SIZES[kind]
        else:
            raise GGUFError(f"unknown metadata value type {kind} at byte {self.pos}")

    def _skip_strings(self, count: int) -> None:
        """Past `count` strings (a vocabulary's 262k tokens: one loop here, not a call per string)."""
        m, pos, end, length = self.m, self.pos, len(self.m), _U64.unpack_from
        for _ in range(count):
            if pos + 8 > end:
                raise GGUFError(f"the file ends inside a string array (byte {pos})")
            pos += 8 + length(m, pos)[0]
        if pos > end:
            raise GGUFError(f"a string array runs past the end of the file (byte {pos})")
        self.pos = pos

    def metadata(self) -> Iterator[tuple[bytes, int, int, int]]:
        """Each metadata entry as (key, value type, where its value starts, where it ends); then `pos` is at the
        tensor table and `n_tensors` says how many entries it has."""
        if self.m[:4] != b"GGUF":
            raise GGUFError("not a GGUF file (no GGUF magic)")
        self.pos = 4
        version = self._take("<I")
        if version not in (2, 3):
            raise GGUFError(f"GGUF version {version} is not supported (2 and 3 are)")
        self.n_tensors, n_kv = self._take("<Q"), self._take("<Q")
        for _ in range(n_kv):
            key, kind = self._string(), self._take("<I")
            start = self.pos
            self._skip_value(kind)
            yield key, kind, start, self.pos

    def tensors(self) -> tuple[bytes, list[int]]:
        """The tensor table (names, shapes, types, offsets) as bytes, and where each tensor's data starts."""
        alignment = 32
        for key, kind, start, _ in self.metadata():
            if key == b"general.alignment" and kind == 4:
                (alignment,) = struct.unpack_from("<I", self.m, start)
        table, offsets = bytearray(), []
        for _ in range(self.n_tensors):
            name, n_dims = self._string(), self._take("<I")
            dims = [self._take("<Q") for _ in range(n_dims)]
            kind, offset = self._take("<I"), self._take("<Q")
            table += name + struct.pack(f"<I{n_dims}QIQ", n_dims, *dims, kind, offset)
            offsets.append(offset)
        data = -(-self.pos // alignment) * alignment
        return bytes(table), [data + offset for offset in offsets]
