"""A refusal: why a request or a job is not served, with the fields each API words its error from. One shape for
the router's admission (router/admission.py) and the worker's (worker/admission.py); it goes on the wire as the
client's `error` or the router's `job_error`, whose fields it carries (PROTOCOL.md)."""

from __future__ import annotations

from dataclasses import dataclass

from protocol.client_messages import Error
from protocol.common import Overflow
from protocol.worker_messages import JobError


@dataclass(frozen=True)
class Refusal:
    code: str  # an ErrorCode
    message: str
    param: str | None = None  # the request field to blame, when one is
    retry_after_ms: int | None = None  # with `queue_full`
    overflow: Overflow | None = None  # with `context_overflow`: the numbers
    error_id: str | None = None  # with `internal`: the id in the logs

    def error(self, request_id: str | None) -> Error:
        """The client's `error`."""
        return Error(
            id=request_id,
            code=self.code,
            message=self.message,
            param=self.param,
            retry_after_ms=self.retry_after_ms,
            overflow=self.overflow,
            error_id=self.error_id,
        )

    def job_error(self, job_id: str) -> JobError:
        """The worker's `job_error` (it names no field and asks for no retry: the router decides those)."""
        return JobError(id=job_id, code=self.code, message=self.message, overflow=self.overflow, error_id=self.error_id)
