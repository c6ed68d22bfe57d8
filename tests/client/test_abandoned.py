"""kvroute/client.py: an embed or rerank whose caller gives up (its task cancelled: an HTTP client gone; or no reply
in `timeout_s`) sends the router a `cancel`, so that its inputs stop on the worker (issue 61: a 40-input embed went
on for minutes after its client had given up, and the next embed waited behind it). A stand-in router socket."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import zmq
import zmq.asyncio

from kvroute.client import AsyncClient
from protocol import Cancel, Embed, client_request_decoder

DECODER = client_request_decoder()


async def next_message(sock: zmq.asyncio.Socket) -> Any:
    frames = await asyncio.wait_for(sock.recv_multipart(), 5)
    return DECODER.decode(frames[-1])


@pytest.mark.parametrize("how", ["cancelled", "timed out"])
def test_an_abandoned_embed_is_cancelled_at_the_router(how: str) -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        router = ctx.socket(zmq.ROUTER)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        client = AsyncClient(f"tcp://127.0.0.1:{port}", timeout_s=0.5 if how == "timed out" else 30.0, context=ctx)
        try:
            task = asyncio.ensure_future(client.embed(Embed(id="e1", input=["hello"])))
            sent = await next_message(router)
            assert isinstance(sent, Embed) and sent.id == "e1"
            if how == "cancelled":
                task.cancel()
            with pytest.raises((asyncio.CancelledError, TimeoutError)):
                await task
            cancel = await next_message(router)
            assert isinstance(cancel, Cancel) and cancel.id == "e1", cancel
        finally:
            await client.close()
            router.close(0)
            ctx.term()

    asyncio.run(main())
