"""Images in a prompt's token ids, so that the router's mirror, its index, copies and the cache tiers treat them as
they treat text (issue 64).

An image the projector turns into n rows of embeddings takes n positions of the prompt. There the prompt holds n
negative ids made from the SHA-256 of the image file's bytes (as llama.cpp's mtmd names an image) and the row's index:
the same file at the same place is the same ids, so a turn that repeats a screenshot reuses its KV like any text, and
another image differs at its first row. No vocabulary id is negative, so an image's ids never equal text's. The first
row's id lies below START_BELOW and the others' above it: an image is computed whole, so a prefix never ends inside
one (`image_floor`).

The second row's id says how many positions the image advances (`n_pos`): its rows where positions are one per row,
fewer for a model placing rows with M-RoPE (Qwen-VL's: all of an image's rows share one temporal position, the next
text comes max(columns, rows) positions later; tools/mtmd/mtmd.cpp `mtmd_image_tokens_get_n_pos`). A prompt's ids
alone then say where each token's position is (`mrope_spans`), wherever they are kept or copied to.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

BITS = 30
MASK = (1 << BITS) - 1
START_BELOW = -(1 << BITS)  # an image's first row: [-2**31, -2**30 - 1]; its others: [-2**30, -1]


def digest(data: bytes) -> bytes:
    """An image's name: the SHA-256 of its file's bytes (what mtmd's bitmap helper names it)."""
    return hashlib.sha256(data).digest()


def image_tokens(name: bytes, n: int, n_pos: int | None = None) -> np.ndarray:
    """The ids an image named `name` takes in a prompt, one per row of its embeddings; it advances `n_pos` positions
    (default: one a row), written in the second row's id."""
    n_pos = n if n_pos is None else n_pos
    if not 0 < n_pos <= n or n_pos > MASK:
        raise ValueError(f"an image of {n} rows cannot advance {n_pos} positions")
    out = np.empty(n, dtype=np.int32)
    for i in range(n):
        h = int.from_bytes(hashlib.blake2b(name + i.to_bytes(4, "little"), digest_size=4).digest(), "little") & MASK
        out[i] = START_BELOW - 1 - h if i == 0 else -1 - h
    if n > 1:
        out[1] = -n_pos  # (in [-2**30, -1]: a row after the first)
    return out


def image_n_pos(tokens: Sequence[int] | np.ndarray, start: int, n: int) -> int:
    """The positions the image of `n` rows at `start` advances (`image_tokens`)."""
    return -int(tokens[start + 1]) if n > 1 else 1


def mrope_spans(tokens: Sequence[int] | np.ndarray) -> list[tuple[int, int, int]]:
    """(start, end, positions fewer than rows so far) of each image of a prompt, for a model placing rows with M-RoPE:
    the token at index i (not inside an image) is at position i minus the lag of the images ending at or before it."""
    if not len(tokens) or min(tokens) >= 0:
        return []
    spans, lag = [], 0
    for start, n in image_runs(tokens):
        lag += n - image_n_pos(tokens, start, n)
        spans.append((start, start + n, lag))
    return spans


def is_image(token: int) -> bool:
    return token < 0


def image_floor(tokens: Sequence[int] | np.ndarray, n: int) -> int:
    """The longest prefix of at most `n` tokens that does not end inside an image (its KV is computed whole)."""
    if n <= 0 or n >= len(tokens) or not START_BELOW <= tokens[n] < 0:  # (text, or an image's first row, follows)
        return n
    while n > 0 and not tokens[n] < START_BELOW:  # back to the image's first row
        n -= 1
    return n


def image_runs(tokens: Sequence[int] | np.ndarray) -> list[tuple[int, int]]:
    """(start, length) of each image in a prompt."""
    arr = np.asarray(tokens, dtype=np.int64)
    starts = np.flatnonzero(arr < START_BELOW).tolist()
    runs = []
    for s in starts:
        end = s + 1
        while end < len(arr) and START_BELOW <= arr[end] < 0:
            end += 1
        runs.append((s, end - s))
    return runs
