"""The project's own errors. Each knows the HTTP status and OpenAI error code it
becomes at the proxy's edge; the CLI turns any of them into a one-line message."""

from __future__ import annotations


class OvernightError(Exception):
    status = 500
    type = "invalid_request_error"
    code = "overnight_error"

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None):
        super().__init__(message)
        if status is not None:
            self.status = status
        if code is not None:
            self.code = code
        if self.status >= 500:
            self.type = "upstream_error" if self.status in (502, 503, 504) else "server_error"

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "code": self.code}}


class ConfigError(OvernightError):
    status = 400
    code = "invalid_config"
