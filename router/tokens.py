"""Token ids as the router holds them (int32 numpy arrays) and as they cross the wire (little-endian int32 bytes,
protocol.pack_tokens' format): the one place the router converts between the two."""

from __future__ import annotations

import numpy as np

WIRE = np.dtype("<i4")


def tokens_from_wire(data: bytes) -> np.ndarray:
    """Wire bytes -> an int32 array of its own (a copy: the frame's buffer is not kept alive)."""
    return np.frombuffer(data, dtype=WIRE).astype(np.int32)


def tokens_to_wire(tokens: np.ndarray) -> bytes:
    return tokens.astype(WIRE).tobytes()


def tokens_to_list(data: bytes) -> list[int]:
    """Wire bytes -> token ids as Python ints (for text and JSON)."""
    return np.frombuffer(data, dtype=WIRE).tolist()
