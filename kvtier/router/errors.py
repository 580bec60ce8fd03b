"""The router's own error answers, in the OpenAI error shape engines and clients already parse:
``{"error": {"message", "type", "code"}}``. One table, one place."""

from __future__ import annotations

import json
from typing import Any

#: HTTP status -> the error's ``type``.
ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    502: "engine_error",
    503: "service_unavailable",
}


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "code": status}}


def sse_error(status: int, message: str) -> bytes:
    """An error as a server-sent event, for a stream that already began (vLLM streams its errors so)."""
    return b"data: " + json.dumps(error_body(status, message)).encode() + b"\n\n"
