"""An OpenAI-compatible HTTP server over :class:`kvtrim.serve.engine.Engine` (FastAPI + uvicorn).

Endpoints: ``GET /health``, ``GET /metrics`` (Prometheus), ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (both with ``stream: true`` as server-sent events ending in ``data: [DONE]``). The
engine decodes in its own thread; the handlers only submit (tokenization included) in worker threads, await
:meth:`RequestHandle.stream` and cancel, so the event loop never blocks. A client that disconnects before its
request finished has the request cancelled in the engine.

Requests pass, outermost first: the response counter (:mod:`.metrics`), the ``Host`` check, CORS (only with
``allowed_origins``), the ``Origin`` check, the API key and ``Content-Type`` check (:mod:`.security`) and the body
size limit (:mod:`.limits`); then the body's JSON depth, Unicode and fields are validated before anything is
tokenized. Shutdown (drain, then abort) is :mod:`.shutdown`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware

from ..errors import InvalidParameterError, KVTrimError
from .limits import BodyLimitMiddleware, ServerLimits, parse_json
from .metrics import Metrics, RequestCounterMiddleware
from .openai_schema import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    RequestError,
    Sampling,
    parse_chat,
    parse_completion,
)
from .security import AuthMiddleware, HostOriginMiddleware, SecurityConfig
from .shutdown import GracefulServer, ShutdownController
from .types import RequestHandle, SamplingParams, TokenEvent

if TYPE_CHECKING:
    from .engine import Engine

logger = logging.getLogger("uvicorn.error")
CHAT_DEFAULT_MAX_TOKENS = 512
DISCONNECT_POLL_S = 0.2
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# ---------------------------------------------------------------------------------------------------- helpers
def _sse(payload: Any) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


def _usage(handles: list[RequestHandle]) -> dict[str, int]:
    prompt = sum(h.prompt_tokens for h in handles)
    completion = sum(len(h.output.token_ids) for h in handles)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _engine_param(message: str) -> str | None:
    """Best guess at the parameter an engine rejection is about (its message names the limit)."""
    for name in ("max_tokens", "prompt", "temperature", "top_p", "seed", "stop"):
        if name in message:
            return name
    return None


def _failure(handles: list[RequestHandle], shutdown: ShutdownController) -> RequestError | None:
    for h in handles:
        if h.output.finish_reason == "error":
            return RequestError(f"generation failed: {h.output.error}", None, status=500, type="server_error")
    if shutdown.aborted and any(h.output.finish_reason == "cancelled" for h in handles):
        return _shutdown_error(shutdown)
    return None


def _shutdown_error(shutdown: ShutdownController) -> RequestError:
    if shutdown.aborted:
        message = "the server is shutting down: this request was aborted (--shutdown-timeout)"
    else:
        message = "the server is shutting down and accepts no new requests"
    return RequestError(message, status=503, type="server_error", code="server_shutdown")


def engine_stats(engine: Engine) -> Any:
    """The engine's :class:`EngineStats` snapshot (``stats`` as a property or a method)."""
    stats = engine.stats
    return stats() if callable(stats) else stats


async def _events(handles: list[RequestHandle]) -> AsyncIterator[tuple[int, TokenEvent]]:
    """Events of several requests, interleaved as they arrive, tagged with the request's index."""
    if len(handles) == 1:
        async for event in handles[0].stream():
            yield 0, event
        return
    queue: asyncio.Queue[tuple[int, TokenEvent]] = asyncio.Queue()

    async def pump(index: int, handle: RequestHandle) -> None:
        async for event in handle.stream():
            await queue.put((index, event))

    tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    try:
        for _ in range(len(handles)):
            while True:
                index, event = await queue.get()
                yield index, event
                if event.finished:
                    break
    finally:
        for task in tasks:
            task.cancel()


class _Server:
    """Route implementations bound to one engine."""

    def __init__(
        self, engine: Engine, chat_default_max_tokens: int, limits: ServerLimits, shutdown: ShutdownController
    ):
        self.engine = engine
        self.chat_default_max_tokens = chat_default_max_tokens
        self.limits, self.shutdown = limits, shutdown
        self.inflight: set[RequestHandle] = set()  # handles not yet finished, for the shutdown's abort
        shutdown.on_abort(self.abort_all)
        self.model_name: str = getattr(engine, "model_name", None) or "kvtrim"
        config = getattr(getattr(engine, "model", None), "config", None)
        self.max_positions: int | None = getattr(config, "max_position_embeddings", None)
        self.vocab_size: int | None = getattr(config, "vocab_size", None)
        self.created = int(time.time())

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise RequestError(
                f"model {model!r} is not served here; this server serves {self.model_name!r}",
                "model",
                status=404,
                code="model_not_found",
            )

    # -- engine access: submit (it tokenizes) and cancel run in worker threads, never on the event loop
    async def submit(
        self,
        prompts: list,
        params: SamplingParams | Callable[[int], SamplingParams],
        base_id: str,
        prompt_param: str = "prompt",
    ) -> list[RequestHandle]:
        """Submit one request per prompt; an engine rejection cancels the ones already submitted (HTTP 400).
        ``params`` may be a function of the prompt's token count (chat defaults depend on it)."""
        if self.shutdown.draining:
            raise _shutdown_error(self.shutdown)
        handles: list[RequestHandle] = []
        try:
            for i, prompt in enumerate(prompts):
                rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
                handle = await run_in_threadpool(self._submit_one, prompt, params, rid)
                handles.append(handle)
                self.inflight.add(handle)
        except InvalidParameterError as exc:
            self.release(handles)
            param = _engine_param(str(exc))
            raise RequestError(str(exc), prompt_param if param == "prompt" else param) from exc
        except BaseException:  # e.g. the handler was cancelled (client gone) between two prompts
            self.release(handles)
            raise
        if self.shutdown.aborted:  # the abort ran while this request was being tokenized
            self.cancel(handles)
        return handles

    def _submit_one(self, prompt, params, rid: str) -> RequestHandle:
        """Worker thread: chat messages are rendered and tokenized here, text prompts inside ``Engine.submit``."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            prompt = self._chat_ids(prompt)
        if callable(params):
            params = params(len(prompt))
        return self.engine.submit(prompt, params, request_id=rid)

    def abort_all(self) -> None:
        """Shutdown: cancel every in-flight request; its stream ends with an error event (see _failure)."""
        for h in list(self.inflight):
            if not h.finished:
                self.engine.cancel(h.request_id)

    def release(self, handles: list[RequestHandle]) -> None:
        """Cancel ``handles`` and forget them (the request is over for the HTTP side)."""
        self.cancel(handles)
        self.inflight.difference_update(handles)

    def cancel(self, handles: list[RequestHandle]) -> None:
        """Cancel unfinished requests without blocking the caller (also safe inside a cancelled task)."""
        loop = asyncio.get_running_loop()
        for h in handles:
            if not h.finished:
                loop.run_in_executor(None, self.engine.cancel, h.request_id)

    async def watch(self, request: Request, handles: list[RequestHandle]) -> None:
        """Cancel ``handles`` when the client goes away before they finish."""
        while not all(h.finished for h in handles):
            if await request.is_disconnected():
                self.cancel(handles)
                return
            await asyncio.sleep(DISCONNECT_POLL_S)

    def streaming(self, request: Request, handles: list[RequestHandle], body: AsyncIterator[str]) -> StreamingResponse:
        async def guarded() -> AsyncIterator[str]:
            watcher = asyncio.create_task(self.watch(request, handles))
            try:
                async for chunk in body:
                    yield chunk
            finally:
                watcher.cancel()
                self.release(handles)

        return StreamingResponse(guarded(), media_type="text/event-stream", headers=SSE_HEADERS)

    async def wait(self, request: Request, handles: list[RequestHandle]) -> None:
        watcher = asyncio.create_task(self.watch(request, handles))
        try:
            for h in handles:
                async for _ in h.stream():
                    pass
        finally:
            watcher.cancel()
            self.release(handles)
        failure = _failure(handles, self.shutdown)
        if failure is not None:
            raise failure

    # -- /v1/completions
    async def completions(self, request: Request) -> Any:
        req = parse_completion(await self.json(request), self.vocab_size, self.limits)
        self.check_model(req.model)
        params = req.sampling.params(COMPLETION_DEFAULT_MAX_TOKENS)
        rid = f"cmpl-{uuid.uuid4().hex}"
        handles = await self.submit(req.prompts, params, rid)
        head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.model_name}
        if req.stream:
            return self.streaming(request, handles, self._completion_chunks(head, handles, req.include_usage))
        await self.wait(request, handles)
        choices = [
            {"index": i, "text": h.output.text, "logprobs": None, "finish_reason": h.output.finish_reason}
            for i, h in enumerate(handles)
        ]
        return {**head, "choices": choices, "usage": _usage(handles), "system_fingerprint": None}

    async def _completion_chunks(self, head: dict, handles: list[RequestHandle], include_usage: bool):
        extra = {"usage": None} if include_usage else {}
        async for index, event in _events(handles):
            if event.text or event.finished:
                reason = event.finish_reason if event.finished else None
                failure = _failure(handles, self.shutdown) if reason in ("error", "cancelled") else None
                if failure is not None:
                    yield _sse(failure.body())
                    yield _sse("[DONE]")
                    return
                choice = {"index": index, "text": event.text, "logprobs": None, "finish_reason": reason}
                yield _sse({**head, "choices": [choice], **extra})
        if include_usage:
            yield _sse({**head, "choices": [], "usage": _usage(handles)})
        yield _sse("[DONE]")

    # -- /v1/chat/completions
    def _chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The prompt token ids, rendered and tokenized by :meth:`Engine.encode` (the chat template, or a plain
        ``role: content`` transcript when the tokenizer has none) with this worker thread's own tokenizer copy:
        a fast tokenizer must not be used by several threads at once."""
        try:
            return self.engine.encode(messages)
        except InvalidParameterError:
            raise
        except Exception as exc:  # jinja errors (e.g. roles not alternating) are the caller's
            raise RequestError(f"messages could not be rendered with the chat template: {exc}", "messages") from exc

    def _chat_params(self, sampling: Sampling, prompt_tokens: int) -> SamplingParams:
        default = min(self.chat_default_max_tokens, self.limits.max_tokens)
        if self.max_positions is not None:
            default = max(1, min(default, self.max_positions - prompt_tokens))
        return sampling.params(default)

    async def chat(self, request: Request) -> Any:
        req = parse_chat(await self.json(request), self.limits)
        self.check_model(req.model)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        params = functools.partial(self._chat_params, req.sampling)
        handles = await self.submit([req.messages], params, rid, "messages")
        head = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": self.model_name}
        if req.stream:
            chunk_head = {**head, "object": "chat.completion.chunk"}
            return self.streaming(request, handles, self._chat_chunks(chunk_head, handles, req.include_usage))
        await self.wait(request, handles)
        out = handles[0].output
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": out.text},
            "logprobs": None,
            "finish_reason": out.finish_reason,
        }
        return {**head, "choices": [choice], "usage": _usage(handles), "system_fingerprint": None}

    async def _chat_chunks(self, head: dict, handles: list[RequestHandle], include_usage: bool):
        extra = {"usage": None} if include_usage else {}

        def chunk(delta: dict, reason: str | None = None) -> str:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            return _sse({**head, "choices": [choice], **extra})

        yield chunk({"role": "assistant", "content": ""})
        async for _, event in _events(handles):
            if event.text:
                yield chunk({"content": event.text})
            if event.finished:
                failure = _failure(handles, self.shutdown) if event.finish_reason in ("error", "cancelled") else None
                if failure is not None:
                    yield _sse(failure.body())
                    yield _sse("[DONE]")
                    return
                yield chunk({}, event.finish_reason)
        if include_usage:
            yield _sse({**head, "choices": [], "usage": _usage(handles)})
        yield _sse("[DONE]")

    # -- the rest
    def models(self) -> dict:
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "kvtrim"}
        return {"object": "list", "data": [card]}

    def health(self) -> JSONResponse:
        running = getattr(self.engine, "running", True)
        status = "engine not running" if not running else "shutting down" if self.shutdown.draining else "ok"
        out: dict[str, Any] = {"status": status, "model": self.model_name}
        stats = engine_stats(self.engine) if hasattr(self.engine, "stats") else None
        if dataclasses.is_dataclass(stats) and not isinstance(stats, type):
            out["stats"] = dataclasses.asdict(stats)
        return JSONResponse(out, status_code=200 if status == "ok" else 503)

    async def json(self, request: Request) -> Any:
        return parse_json(await request.body(), self.limits.max_json_depth)


def _error(status: int, message: str, type_: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": type_, "param": param, "code": code}}, status_code=status
    )


# ---------------------------------------------------------------------------------------------------- the app
def create_app(
    engine: Engine,
    *,
    manage_engine: bool = True,
    chat_default_max_tokens: int = CHAT_DEFAULT_MAX_TOKENS,
    limits: ServerLimits | None = None,
    security: SecurityConfig | None = None,
    shutdown: ShutdownController | None = None,
) -> FastAPI:
    """The FastAPI app serving ``engine``.

    With ``manage_engine`` the app starts the engine's background thread on startup and stops it on shutdown.
    ``chat_default_max_tokens`` caps chat replies that give no ``max_tokens`` (also capped by the model's
    maximum positions and ``limits.max_tokens``); completions default to 16 tokens as in OpenAI's API.
    ``limits`` / ``security`` default to :class:`ServerLimits()` and :class:`SecurityConfig()` (loopback
    ``Host`` names only, no API key, CORS off); ``shutdown`` is the drain state a :class:`GracefulServer` drives.
    """
    limits = ServerLimits() if limits is None else limits
    security = SecurityConfig() if security is None else security
    shutdown = ShutdownController() if shutdown is None else shutdown
    server = _Server(engine, chat_default_max_tokens, limits, shutdown)
    metrics = Metrics(lambda: engine_stats(engine))

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        if manage_engine:
            engine.start()
        try:
            yield
        finally:
            shutdown.abort()  # uvicorn waited for the drain; whatever is left ends with an error event
            if manage_engine:
                await run_in_threadpool(engine.stop)
                logger.info("kvtrim: engine stopped")

    app = FastAPI(title="kvtrim", summary="OpenAI-compatible server over a compressed KV cache", lifespan=lifespan)
    app.state.server, app.state.metrics, app.state.shutdown = server, metrics, shutdown
    # add_middleware wraps: the last one added runs first
    app.add_middleware(BodyLimitMiddleware, limit=limits.max_request_bytes)
    app.add_middleware(AuthMiddleware, config=security)
    app.add_middleware(HostOriginMiddleware, config=security, check="origin")
    if security.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(security.allowed_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["authorization", "content-type"],
        )
    app.add_middleware(HostOriginMiddleware, config=security, check="host")
    app.add_middleware(RequestCounterMiddleware, metrics=metrics)

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail), "invalid_request_error")

    @app.exception_handler(Exception)
    async def _server_error(_: Request, exc: Exception) -> JSONResponse:
        return _error(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")

    routes: list[tuple[str, str, Callable]] = [
        ("GET", "/health", server.health),
        ("GET", "/metrics", metrics.response),
        ("GET", "/v1/models", server.models),
        ("POST", "/v1/completions", server.completions),
        ("POST", "/v1/chat/completions", server.chat),
    ]
    for method, path, endpoint in routes:
        app.add_api_route(path, endpoint, methods=[method], response_model=None)
    return app


def serve(
    engine: Engine,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    *,
    limits: ServerLimits | None = None,
    security: SecurityConfig | None = None,
    shutdown_timeout: float = 5.0,
) -> None:
    """Run the server with uvicorn until SIGTERM/SIGINT (starts and stops the engine; see :mod:`.shutdown`).
    ``security`` defaults to :meth:`SecurityConfig.for_bind` of ``host``. Returns after a clean stop."""
    import uvicorn

    security = SecurityConfig.for_bind(host) if security is None else security
    controller = ShutdownController(shutdown_timeout)
    app = create_app(engine, limits=limits, security=security, shutdown=controller)
    server = GracefulServer(uvicorn.Config(app, host=host, port=port, log_level=log_level), controller)
    server.run()
    if not server.started:
        raise KVTrimError(f"the server could not start on {host}:{port} (see the log above)")
