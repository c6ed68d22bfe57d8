"""Every token's bytes as llguidance reads them (worker/guide.py), kept in the cache directory per vocabulary.

Asking llama.cpp for 262k tokens' pieces one ctypes call at a time takes 1.3 s on 2 cores, at every worker start
(and for every model a worker loads); read back from the file written the first time, 0.05 s. The file is named by
the vocabulary's fingerprint (its GGUF tokenizer metadata: common/vocab.py) and llama-cpp-python's version (which
renders the pieces), so another vocabulary or another llama.cpp never reads it. A file that is missing, short or
unreadable is computed again; one that cannot be written is not kept (logged), never fatal.

File: MAGIC, the token count (u32), each piece's length (u32 each), then the pieces one after another.
"""

from __future__ import annotations

import threading
from pathlib import Path

import llama_cpp
import numpy as np

from common import logs
from common.files import private_dir, write_private
from common.model import cache_dir
from common.vocab import Vocab

log = logs.get(__name__)

MAGIC = b"KVRPIECES1\n"
SPECIAL = b"\xff"  # llguidance's mark before a special token's bytes


class Stopped(Exception):
    """The worker stopped while the pieces were being read from llama.cpp."""


def pieces_file(vocab: Vocab) -> Path:
    return cache_dir() / "pieces" / f"{vocab.fingerprint}-{llama_cpp.__version__}.bin"


def guide_pieces(vocab: Vocab, stop: threading.Event) -> list[bytes]:
    """The pieces, from the cache when they are there, else from llama.cpp (then kept). Raises Stopped once `stop`
    is set while computing them."""
    path = pieces_file(vocab)
    pieces = read(path, vocab.n_vocab)
    if pieces is not None:
        return pieces
    pieces = compute(vocab, stop)
    try:
        private_dir(path.parent)
        write_private(path, encode(pieces))
    except OSError as exc:
        log.info("guide_pieces_not_kept", path=str(path), reason=str(exc))
    return pieces


def compute(vocab: Vocab, stop: threading.Event) -> list[bytes]:
    pieces, attrs = [], vocab.attrs
    for t in range(vocab.n_vocab):
        if stop.is_set():
            raise Stopped("the worker stopped")
        piece = vocab.piece(t)
        if attrs[t] & llama_cpp.LLAMA_TOKEN_ATTR_CONTROL:
            piece = SPECIAL + piece
        pieces.append(piece)
    return pieces


def encode(pieces: list[bytes]) -> bytes:
    lengths = np.fromiter((len(p) for p in pieces), dtype="<u4", count=len(pieces))
    return b"".join([MAGIC, np.uint32(len(pieces)).astype("<u4").tobytes(), lengths.tobytes(), *pieces])


def read(path: Path, n_vocab: int) -> list[bytes] | None:
    """The pieces kept at `path`, or None if it is missing or does not hold `n_vocab` whole pieces."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    head = len(MAGIC) + 4
    if not data.startswith(MAGIC) or len(data) < head or int.from_bytes(data[len(MAGIC) : head], "little") != n_vocab:
        return None
    lengths = np.frombuffer(data, dtype="<u4", count=n_vocab, offset=head) if len(data) >= head + 4 * n_vocab else None
    if lengths is None:
        return None
    start = head + 4 * n_vocab
    ends = start + np.cumsum(lengths, dtype=np.int64)
    if n_vocab and int(ends[-1]) != len(data):
        return None
    starts = [start, *ends[:-1].tolist()]
    return [data[a:b] for a, b in zip(starts, ends.tolist(), strict=True)]
