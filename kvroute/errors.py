"""The router's errors as exceptions, one class per stable protocol error code (`KvrouteError.code`), and the one
place a protocol `error` becomes one."""

from __future__ import annotations

from protocol import Error, ErrorCode, Overflow


class KvrouteError(Exception):
    """The router answered with an error. `code` is a protocol ErrorCode value."""

    code: str = ErrorCode.INTERNAL

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        error_id: str | None = None,
        request_id: str | None = None,
        retry_after_ms: int | None = None,
        param: str | None = None,
        overflow: Overflow | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code or self.code
        self.message = message
        self.error_id = error_id
        self.request_id = request_id
        self.retry_after_ms = retry_after_ms
        self.param = param
        self.overflow = overflow  # a context_overflow's numbers

    def __str__(self) -> str:
        tail = f" (error id {self.error_id})" if self.error_id else ""
        return f"{self.code}: {self.message}{tail}"


class BadRequest(KvrouteError):
    code = ErrorCode.BAD_REQUEST


class ContextOverflow(KvrouteError):
    code = ErrorCode.CONTEXT_OVERFLOW


class QueueFull(KvrouteError):
    code = ErrorCode.QUEUE_FULL


class NoWorkers(KvrouteError):
    code = ErrorCode.NO_WORKERS


class WorkerLost(KvrouteError):
    code = ErrorCode.WORKER_LOST


class DeadlineExceeded(KvrouteError):
    code = ErrorCode.DEADLINE_EXCEEDED


class Unauthorized(KvrouteError):
    code = ErrorCode.UNAUTHORIZED


class TooLarge(KvrouteError):
    code = ErrorCode.TOO_LARGE


class TooSlow(KvrouteError):
    code = ErrorCode.TOO_SLOW


_ERRORS: dict[str, type[KvrouteError]] = {
    cls.code: cls
    for cls in (BadRequest, ContextOverflow, QueueFull, NoWorkers, WorkerLost, DeadlineExceeded, Unauthorized, TooLarge, TooSlow)
}


def error_from(msg: Error) -> KvrouteError:
    cls = _ERRORS.get(msg.code, KvrouteError)
    return cls(
        msg.message,
        code=msg.code,
        error_id=msg.error_id,
        request_id=msg.id,
        retry_after_ms=msg.retry_after_ms,
        param=msg.param,
        overflow=msg.overflow,
    )
