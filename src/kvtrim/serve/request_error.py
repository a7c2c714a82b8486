"""The error an invalid HTTP request raises, shared by the request schema, the limits and the security checks."""

from __future__ import annotations


class RequestError(Exception):
    """An invalid request; rendered as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        code: str | None = None,
    ):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
