"""The client library under hostile input (issue item 2): a request it refuses before sending leaves nothing behind."""

from __future__ import annotations

import pytest

from bench.systems import free_port
from kvroute.client import AsyncClient, BadRequest, TooLarge
from protocol import Submit, pack_tokens


@pytest.mark.anyio
async def test_a_submit_refused_before_it_is_sent_leaves_no_record() -> None:
    """A submit was recorded (with its 9 MB of tokens, for the direct-reply path) before it was encoded; a refusal at
    encoding (over the frame cap: 413; a lone surrogate: a 500) left the record for good."""
    client = AsyncClient(f"tcp://127.0.0.1:{free_port()}", max_frame_bytes=1 << 20, reply_endpoint="auto")
    try:
        for sub, error in (
            (Submit(id="big", tokens=pack_tokens([1] * (1 << 19))), TooLarge),
            (Submit(id="surrogate", prompt="a\ud800b"), BadRequest),
        ):
            with pytest.raises(error) as raised:
                await anext(client.stream_submit(sub))
            assert raised.value.request_id == sub.id
            assert client._submits == {} and client._queues == {} and client._unanswered == {}
            assert client._direct is not None and client._direct.sent_at == {}
        assert "\\ud800" in str(raised.value) and "surrogate" in str(raised.value)
    finally:
        await client.close()
