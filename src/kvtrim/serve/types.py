"""The engine's request/response types, shared by :mod:`kvtrim.serve.engine` and the HTTP server.

A request is submitted with :class:`SamplingParams` and answered through a :class:`RequestHandle`, which
receives :class:`TokenEvent` objects from the engine thread and can be read synchronously (``result``,
``events``) or asynchronously (``stream``) by an asyncio server.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

from ..errors import InvalidParameterError

FINISH_REASONS = ("stop", "length", "cancelled", "error")


@dataclass(frozen=True)
class SamplingParams:
    """How to decode one request.

    Attributes:
        max_tokens: new tokens at most (> 0)
        temperature: 0 = greedy; otherwise softmax temperature (>= 0)
        top_p: nucleus sampling mass in (0, 1]
        stop: strings that end the request when the decoded text contains them (not included in the output)
        seed: per-request sampling seed (None: the engine's generator)
        ignore_eos: keep decoding past the end-of-sequence token (benchmarks use it for fixed output lengths)
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise InvalidParameterError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not self.temperature >= 0.0:
            raise InvalidParameterError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidParameterError(f"top_p must be in (0, 1], got {self.top_p!r}")
        object.__setattr__(self, "stop", tuple(self.stop))


@dataclass(frozen=True)
class TokenEvent:
    """One step of a request's output.

    ``token_id`` is None for a final event that carries no token (cancellation, error, stop-string cut).
    ``text`` is the newly decoded text (may be empty while a multi-byte character is incomplete).
    """

    request_id: str
    token_id: int | None
    text: str
    finished: bool = False
    finish_reason: str | None = None  # one of FINISH_REASONS when finished
    error: str | None = None


@dataclass
class RequestOutput:
    """A finished request."""

    request_id: str
    prompt_tokens: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    preemptions: int = 0
    compressions: int = 0


class RequestHandle:
    """The caller's end of a request: events arrive from the engine thread in order; the last is ``finished``."""

    def __init__(self, request_id: str, prompt_tokens: int):
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self._events: queue.Queue[TokenEvent] = queue.Queue()
        self._done = threading.Event()
        self.output = RequestOutput(request_id=request_id, prompt_tokens=prompt_tokens)

    # -- engine side
    def push(self, event: TokenEvent) -> None:
        """Record ``event`` (engine thread). Tokens and text accumulate into :attr:`output`."""
        if self._done.is_set():
            return
        if event.token_id is not None:
            self.output.token_ids.append(event.token_id)
        self.output.text += event.text
        if event.finished:
            self.output.finish_reason = event.finish_reason
            self.output.error = event.error
        self._events.put(event)
        if event.finished:
            self._done.set()

    # -- caller side
    @property
    def finished(self) -> bool:
        return self._done.is_set()

    def events(self, timeout: float | None = None) -> Iterator[TokenEvent]:
        """Blocking iterator over events until the final one (``queue.Empty`` after ``timeout`` s of silence)."""
        while True:
            event = self._events.get(timeout=timeout)
            yield event
            if event.finished:
                return

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Wait for the request to finish and return its output (``TimeoutError`` after ``timeout`` s)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
        return self.output

    async def stream(self, poll: float = 0.05) -> AsyncIterator[TokenEvent]:
        """Async iterator over events for asyncio servers (never blocks the event loop)."""
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                await asyncio.sleep(poll)
                continue
            yield event
            if event.finished:
                return
