"""One message per moment instead of one per token: a client that asks for it (Submit.batch_deltas) gets the deltas
the router has for it at once in one `deltas` message, in order, and its other messages keep their place."""

from __future__ import annotations

from protocol import Delta, Deltas, Error, Heartbeat, pack_tokens
from router.scheduler import Out
from router.server import batched


def delta(rid: str, text: str) -> Delta:
    return Delta(id=rid, text=text, tokens=pack_tokens([1]))


def test_a_clients_deltas_of_one_moment_travel_as_one_message_in_order() -> None:
    gw, other = b"gateway", b"client"
    out = [
        Out(gw, delta("a", "1"), batch=True),
        Out(other, delta("x", "1")),  # a client that did not ask: alone, as before
        Out(gw, delta("b", "1"), batch=True),
        Out(gw, delta("a", "2"), batch=True),
    ]
    sent = batched(out)
    assert [o.to for o in sent] == [gw, other]
    assert isinstance(sent[0].msg, Deltas) and [(d.id, d.text) for d in sent[0].msg.items] == [("a", "1"), ("b", "1"), ("a", "2")]
    assert sent[1] is out[1]


def test_a_clients_other_message_keeps_its_place_between_its_deltas() -> None:
    gw = b"gateway"
    end = Out(gw, Error(id="a", code="internal", message="gone"))
    beat = Out(gw, Heartbeat(worker_id="w", incarnation=1, slots=[], queue=0), worker=True)  # a worker's: no effect
    sent = batched([Out(gw, delta("a", "1"), batch=True), beat, end, Out(gw, delta("b", "1"), batch=True)])
    assert [type(o.msg).__name__ for o in sent] == ["Delta", "Heartbeat", "Error", "Delta"]  # one alone stays a Delta
    assert sent[0].msg.id == "a" and sent[3].msg.id == "b"


def test_without_batching_clients_the_messages_are_untouched() -> None:
    out = [Out(b"c", delta("a", "1")), Out(b"c", delta("a", "2"))]
    assert batched(out) is out
