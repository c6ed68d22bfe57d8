"""Python client for the kvroute ZMQ protocol, sync (`Client`) and asyncio (`AsyncClient`).

One DEALER socket carries many requests at once; replies are sorted by request id. Errors from the
router raise `KvrouteError` subclasses keyed by the stable error code. ZMQ reconnects the transport by
itself; a request whose replies stop for `timeout_s` raises `TimeoutError`, and the socket is then
re-created so that late replies from a restarted router cannot be mistaken for new ones.

One request's trouble stays its own: a message over `max_frame_bytes` raises `TooLarge` before it is sent (a
frame far over the router's cap would make it drop the connection, and with it every request on the socket);
an error the router could not tie to a request id goes to the one request waiting, or, with several waiting,
is logged and fails none of them; a request whose replies are not read (more than `max_buffered` waiting, the
asyncio client) is cancelled and ends with `TooSlow`, so that a stalled reader holds bounded memory.

    with Client("tcp://127.0.0.1:5555") as c:
        for delta in c.stream(prompt="The capital of France is", max_tokens=8):
            print(delta.text, end="")
"""

# The client is in modules by what changes together; every name is importable from here, as it always was.
from common.socket_security import secure_client_socket
from kvroute.async_client import MAX_BUFFERED, AsyncClient, reply_endpoint_of
from kvroute.errors import (
    BadRequest,
    ContextOverflow,
    DeadlineExceeded,
    KvrouteError,
    NoWorkers,
    QueueFull,
    TooLarge,
    TooSlow,
    Unauthorized,
    WorkerLost,
    error_from,
)
from kvroute.requests import DEFAULT_ENDPOINT, SUBMIT_FIELDS, build_submit, encode_checked
from kvroute.sync_client import Client, Stream
from protocol import Delta, Result, StatusReply

__all__ = [
    "DEFAULT_ENDPOINT",
    "MAX_BUFFERED",
    "SUBMIT_FIELDS",
    "AsyncClient",
    "BadRequest",
    "Client",
    "ContextOverflow",
    "DeadlineExceeded",
    "Delta",
    "KvrouteError",
    "NoWorkers",
    "QueueFull",
    "Result",
    "StatusReply",
    "Stream",
    "TooLarge",
    "TooSlow",
    "Unauthorized",
    "WorkerLost",
    "build_submit",
    "encode_checked",
    "error_from",
    "reply_endpoint_of",
    "secure_client_socket",
]
