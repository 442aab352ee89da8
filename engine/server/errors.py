"""OpenAI-style error answers: ``{"error": {"message", "type", "param", "code"}}`` for every
failure, whatever raised it (our checks, pydantic, an unknown route, a bug)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cachetier.engine.server.schemas import ErrorDetail, ErrorResponse
from cachetier.errors import RequestRefusedError
from cachetier.server.body_limit import BodyRefused

log = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"


class APIError(RequestRefusedError):
    """A request this server refuses; rendered as an OpenAI error body.

    Args:
        status: HTTP status.
        message: what is wrong and what to change.
        type: OpenAI's error type (``invalid_request_error``...).
        param: the request field at fault, if one is.
        code: OpenAI's machine-readable code (``model_not_found``...), if one applies.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = ErrorResponse(
            error=ErrorDetail(message=message, type=type, param=param, code=code)
        )


def error_response(exc: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    """The JSON answer of ``exc``."""
    return JSONResponse(exc.body.model_dump(), status_code=exc.status, headers=headers)


def body_refused_answer(refused: BodyRefused) -> JSONResponse:
    """The answer to a body ``BodyLimit`` refused (400, or 413 ``body_too_large``)."""
    code = "body_too_large" if refused.status_code == 413 else None
    return error_response(
        APIError(refused.status_code, refused.message, code=code), refused.headers
    )


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error of ``app`` with an OpenAI error body."""

    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return error_response(exc, headers)

    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        # OpenAI answers a body that does not fit the API with 400, not FastAPI's 422.
        errors = exc.errors()
        if any(err.get("type") == "json_invalid" for err in errors):
            return error_response(APIError(400, "the request body is not valid JSON"))
        problems, param = [], None
        for err in errors[:5]:
            where = [str(p) for p in err.get("loc", ()) if p != "body"]
            param = param or (where[0] if where else None)
            msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
            problems.append(f"{'.'.join(where) or 'body'}: {msg}")
        return error_response(APIError(400, "; ".join(problems), param=param))

    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(APIError(exc.status_code, str(exc.detail)), exc.headers)

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return error_response(APIError(500, "the server failed; see its log", type="server_error"))

    app.add_exception_handler(APIError, api_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, invalid)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, unexpected)
