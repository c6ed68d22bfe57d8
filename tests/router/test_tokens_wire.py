"""router/tokens.py speaks the protocol's token format (pack_tokens / unpack_tokens) both ways."""

from __future__ import annotations

import numpy as np

from protocol import pack_tokens, unpack_tokens
from router.tokens import tokens_from_wire, tokens_to_list, tokens_to_wire


def test_router_tokens_and_protocol_tokens_are_one_format() -> None:
    ids = [0, 1, 2, 262_143, 2**31 - 1, 7]
    arr = tokens_from_wire(pack_tokens(ids))
    assert arr.dtype == np.int32 and arr.tolist() == ids
    assert unpack_tokens(tokens_to_wire(np.array(ids, dtype=np.int64))) == ids
    assert tokens_to_list(pack_tokens(ids)) == ids
    assert tokens_from_wire(pack_tokens(ids)).flags.writeable  # a copy of its own, not a view of the frame
