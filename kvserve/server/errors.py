"""The server's error: OpenAI's body, {"error": {"message", "type", "param", "code"}}, with a status."""

from __future__ import annotations

from typing import Optional

from fastapi.responses import JSONResponse


class APIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 kind: str = "invalid_request_error", code: Optional[str] = None,
                 headers: Optional[dict[str, str]] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.headers = headers


def error_response(e: APIError) -> JSONResponse:
    body = {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.code}}
    return JSONResponse(body, status_code=e.status, headers=e.headers)
