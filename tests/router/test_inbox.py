"""The router reads its sockets without pyzmq's asyncio wrapper (common/inbox.py `Inbox`): a socket's descriptor is
edge-triggered and a send on the socket may take the edge, so a reader that did not look again after its sends would
sleep with messages waiting (the router once stalled so: every worker looked dead). Peers that send while the
router answers each message on the same socket must all be answered."""

from __future__ import annotations

import asyncio
import threading

import zmq
import zmq.asyncio

from common.inbox import Inbox

PEERS, EACH = 4, 500


def test_every_message_is_read_while_the_reader_answers_on_the_same_socket() -> None:
    async def main() -> int:
        ctx = zmq.asyncio.Context()
        router = ctx.socket(zmq.ROUTER)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        raw = zmq.Socket.shadow(router.underlying)
        answered = 0
        pending: list[list[bytes]] = []

        def on_frames(frames: list[bytes]) -> None:
            pending.append(frames)

        def flush() -> None:  # the answers go after the batch, as the router's flush sends them
            nonlocal answered
            while pending:
                identity, body = pending.pop(0)
                raw.send_multipart([identity, body], zmq.NOBLOCK)
                answered += 1
            inbox.rearm()

        inbox = Inbox(raw, on_frames, flush)
        got = [0] * PEERS

        def peer(i: int) -> None:  # a thread per peer: sends as fast as it can, then reads every answer
            sync = zmq.Context.instance().socket(zmq.DEALER)
            sync.connect(f"tcp://127.0.0.1:{port}")
            for n in range(EACH):
                sync.send(b"%d" % n)
                if n % 50 == 0 and sync.poll(0):
                    got[i] += 1
                    sync.recv()
            while got[i] < EACH and sync.poll(10_000):
                sync.recv()
                got[i] += 1
            sync.close(0)

        threads = [threading.Thread(target=peer, args=(i,)) for i in range(PEERS)]
        for t in threads:
            t.start()
        for _ in range(300):  # up to 30 s
            if sum(got) == PEERS * EACH:
                break
            await asyncio.sleep(0.1)
        for t in threads:
            await asyncio.to_thread(t.join, 15)
        inbox.close()
        router.close(0)
        ctx.term()
        return sum(got)

    assert asyncio.run(main()) == PEERS * EACH
