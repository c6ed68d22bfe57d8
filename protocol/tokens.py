"""Token ids on the wire: little-endian int32 bytes (PROTOCOL.md 2). The one codec every process uses, for lists of
ids (clients, the worker's messages) and for int32 arrays (the router's mirror, without a list between), and the one
check that ids lie in a model's vocabulary."""

from __future__ import annotations

import hashlib
import sys
from array import array
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

WIRE_DTYPE = "<i4"


def check_token_bytes(field: str, data: bytes | None, *, empty_ok: bool = True) -> None:
    """Raise ValueError unless `data` is packed int32 (length a multiple of 4; non-empty unless empty_ok)."""
    if data is None:
        return
    if len(data) % 4:
        raise ValueError(f"{field} must be little-endian int32 bytes: length {len(data)} is not a multiple of 4")
    if not data and not empty_ok:
        raise ValueError(f"{field} must hold at least one token")


def pack_tokens(tokens: Any) -> bytes:
    """Token ids (a list, an `array("i")` or an int array of numpy's) -> little-endian int32 bytes."""
    if hasattr(tokens, "astype"):
        return tokens.astype(WIRE_DTYPE).tobytes()
    packed = tokens if isinstance(tokens, array) and tokens.typecode == "i" else array("i", tokens)
    if sys.byteorder != "little":
        packed = array("i", packed)
        packed.byteswap()
    return packed.tobytes()


def unpack_tokens(data: bytes) -> list[int]:
    """Little-endian int32 bytes -> token ids. Raises ValueError on a length not divisible by 4."""
    if len(data) % 4:
        raise ValueError(f"token bytes length {len(data)} is not a multiple of 4")
    out = array("i")
    out.frombytes(data)
    if sys.byteorder != "little":
        out.byteswap()
    return out.tolist()


def token_array(data: bytes) -> np.ndarray:
    """Little-endian int32 bytes -> an int32 array of its own (a copy: the frame's buffer is not kept alive)."""
    import numpy as np

    return np.frombuffer(data, dtype=WIRE_DTYPE).astype(np.int32)


def token_hash(tokens: Any) -> str:
    """Hash that a worker reports for a slot's tokens: blake2b-64 of the packed tokens, hex. `tokens`: a list of
    ids, or an int32 array (numpy), hashed without a copy to a list."""
    return hashlib.blake2b(pack_tokens(tokens), digest_size=8).hexdigest()


def outside_vocab(tokens: Any, n_vocab: int) -> int | None:
    """The first id of `tokens` (ids, or an int array of numpy's) outside 0..n_vocab-1; None when all are in it."""
    if hasattr(tokens, "min"):
        if not len(tokens) or (tokens.min() >= 0 and tokens.max() < n_vocab):
            return None
        return int(tokens[(tokens < 0) | (tokens >= n_vocab)][0])
    return next((t for t in tokens if not 0 <= t < n_vocab), None)


def vocab_message(token: int, n_vocab: int) -> str:
    return f"token id {token} is outside the vocabulary (0..{n_vocab - 1})"
