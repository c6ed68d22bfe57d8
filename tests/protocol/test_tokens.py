"""protocol/tokens.py: one token codec for lists and int32 arrays, and one vocabulary check."""

from __future__ import annotations

import numpy as np
import pytest

from protocol import outside_vocab, pack_tokens, token_array, unpack_tokens, vocab_message


def test_router_tokens_and_protocol_tokens_are_one_format() -> None:
    ids = [0, 1, 2, 262_143, 2**31 - 1, 7]
    arr = token_array(pack_tokens(ids))
    assert arr.dtype == np.int32 and arr.tolist() == ids
    assert unpack_tokens(pack_tokens(np.array(ids, dtype=np.int64))) == ids
    assert unpack_tokens(pack_tokens(ids)) == ids
    assert token_array(pack_tokens(ids)).flags.writeable  # a copy of its own, not a view of the frame


@pytest.mark.parametrize("as_array", [False, True])
def test_the_first_id_outside_the_vocabulary_is_named(as_array: bool) -> None:
    def ids(xs: list[int]) -> object:
        return np.array(xs, dtype=np.int32) if as_array else xs

    assert outside_vocab(ids([]), 10) is None
    assert outside_vocab(ids([0, 9, 3]), 10) is None
    assert outside_vocab(ids([1, 10, -1]), 10) == 10
    assert outside_vocab(ids([1, -1, 10]), 10) == -1
    assert vocab_message(10, 10) == "token id 10 is outside the vocabulary (0..9)"
