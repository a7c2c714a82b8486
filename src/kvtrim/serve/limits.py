"""Request size limits of the HTTP server, enforced before any tokenization.

:class:`ServerLimits` holds the caps (body bytes, prompts per request, ``max_tokens``, prompt characters, JSON
nesting depth). :class:`BodyLimitMiddleware` enforces the body size *while reading* (``Content-Length`` first,
then the streamed chunks), so an oversized body is answered 413 without being buffered; :func:`parse_json`
bounds the nesting depth before ``json.loads`` and rejects lone UTF-16 surrogates, so neither a 100,000-deep
array nor ``"\\ud800"`` reaches the parser or the tokenizer.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..errors import InvalidParameterError
from .request_error import RequestError

BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


@dataclass(frozen=True)
class ServerLimits:
    """Caps on one request. The defaults protect a small machine (a few CPU cores, a 135M-parameter model).

    Attributes:
        max_request_bytes: request body size (HTTP 413 beyond it)
        max_prompts_per_request: prompts in one ``/v1/completions`` request
        max_tokens: largest ``max_tokens`` / ``max_completion_tokens`` a request may ask for
        max_prompt_chars: characters of one prompt (a completion prompt, or all chat contents together),
            checked before tokenizing
        max_json_depth: nesting depth of the JSON body
    """

    max_request_bytes: int = 1 << 20
    max_prompts_per_request: int = 16
    max_tokens: int = 4096
    max_prompt_chars: int = 100_000
    max_json_depth: int = 32

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "max_prompts_per_request", "max_tokens", "max_prompt_chars"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidParameterError(f"{name} must be an integer >= 1, got {value!r}")
        depth = self.max_json_depth
        if isinstance(depth, bool) or not isinstance(depth, int) or not 2 <= depth <= 500:
            raise InvalidParameterError(f"max_json_depth must be an integer in [2, 500], got {depth!r}")


# ------------------------------------------------------------------------------------------------ JSON bodies
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)  # a JSON string literal (unrolled: linear time)
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def json_depth(raw: bytes) -> int:
    """Deepest nesting of ``[``/``{`` in a JSON text, brackets inside strings ignored (C-speed scans only)."""
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKET)
    if not brackets:
        return 0
    codes = np.frombuffer(brackets, dtype=np.uint8)
    steps = np.where((codes == ord("[")) | (codes == ord("{")), 1, -1)
    return int(np.cumsum(steps).max())


def parse_json(raw: bytes, max_depth: int) -> Any:
    """The request body as JSON, or :class:`RequestError` (400) for invalid JSON, nesting deeper than
    ``max_depth`` and strings holding lone UTF-16 surrogates (``"\\ud800"``: not Unicode text)."""
    depth = json_depth(raw)
    if depth > max_depth:
        raise RequestError(
            f"the request body nests JSON {depth} levels deep; this server accepts at most {max_depth}",
            code="json_too_deep",
        )
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise RequestError(f"the request body is not valid JSON: {exc}"[:500]) from exc
    if _SURROGATE_ESCAPE.search(raw):  # only escapes can produce surrogates: invalid UTF-8 fails json.loads
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as exc:
            raise RequestError(
                "the request body contains a lone UTF-16 surrogate escape (\\ud800-\\udfff without its pair), "
                "which is not valid Unicode text",
                code="invalid_unicode",
            ) from exc
    return body


# ---------------------------------------------------------------------------------------------- body size
def too_large(limit: int, length: int | None = None) -> JSONResponse:
    size = f" of {length} bytes" if length is not None else ""
    body = RequestError(
        f"the request body{size} exceeds this server's limit of {limit} bytes (--max-request-bytes)",
        status=413,
        code="request_too_large",
    ).body()
    return JSONResponse(body, status_code=413, headers={"Connection": "close"})


class BodyLimitMiddleware:
    """Reads request bodies up to ``limit`` bytes and answers 413 beyond it, before the app sees any of it.

    A declared ``Content-Length`` over the limit is refused without reading; a body streamed without one (chunked)
    is refused as soon as the running total passes the limit. The buffered body is then replayed to the app, and
    later ``receive`` calls (disconnect detection) go to the server.
    """

    def __init__(self, app: ASGIApp, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in BODY_METHODS:
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared == -1:
            bad = RequestError("the Content-Length header is not a non-negative integer", code="bad_content_length")
            await JSONResponse(bad.body(), status_code=400, headers={"Connection": "close"})(scope, receive, send)
            return
        if declared is not None and declared > self.limit:
            await too_large(self.limit, declared)(scope, receive, send)
            return
        chunks: list[bytes] = []
        total = 0
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body: nothing to answer
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.limit:
                await too_large(self.limit)(scope, receive, send)
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def _content_length(scope: Scope) -> int | None:
    """The declared body length; None when absent, -1 when malformed."""
    for key, value in scope["headers"]:
        if key == b"content-length":
            return int(value) if value.isdigit() and len(value) < 19 else -1
    return None
