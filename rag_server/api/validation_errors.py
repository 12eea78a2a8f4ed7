"""FastAPI's 422 for invalid requests, rendered so that any input can be quoted back."""

from __future__ import annotations

import json

from fastapi import Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse


class AsciiJSONResponse(JSONResponse):
    def render(self, content) -> bytes:
        # ASCII escapes: a lone surrogate (valid JSON, "\\ud800") echoed back is not UTF-8.
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


async def validation_error(_request: Request, exc: RequestValidationError) -> Response:
    """The 422, which quotes the offending input (the default response raised a 500 on an
    unpaired surrogate in a question)."""
    return AsciiJSONResponse({"detail": jsonable_encoder(exc.errors())}, 422)
