"""Graceful shutdown of the HTTP server.

The first SIGTERM or SIGINT stops accepting connections and lets running requests finish for up to
``timeout`` seconds (the drain); what is still running then is aborted: streams end with an error event and
``data: [DONE]``, waiting requests get a 503. A second signal aborts at once. Either way the app's lifespan
then stops the engine, and the process exits with status 0 (uvicorn alone re-raises the signal: status 143).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Generator
from types import FrameType

import uvicorn

from ..errors import InvalidParameterError

logger = logging.getLogger("uvicorn.error")
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class ShutdownController:
    """Drain state shared by the signal handler and the app (all methods run on the event loop's thread)."""

    def __init__(self, timeout: float = 5.0):
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
            raise InvalidParameterError(f"shutdown timeout must be a number of seconds >= 0, got {timeout!r}")
        self.timeout = float(timeout)
        self.draining = False
        self.aborted = False
        self._on_abort: list[Callable[[], None]] = []
        self._timer: asyncio.TimerHandle | None = None

    def on_abort(self, callback: Callable[[], None]) -> None:
        """Register what aborting means (the app cancels its in-flight requests)."""
        self._on_abort.append(callback)

    def begin_drain(self) -> None:
        """Refuse new requests; abort the remaining ones after ``timeout`` seconds."""
        if self.draining:
            return
        self.draining = True
        logger.info("kvtrim: draining, running requests get %.3g s before they are aborted", self.timeout)
        self._timer = asyncio.get_running_loop().call_later(self.timeout, self.abort)

    def abort(self) -> None:
        """Abort every in-flight request now (idempotent)."""
        self.draining = True
        if self._timer is not None:
            self._timer.cancel()
        if self.aborted:
            return
        self.aborted = True
        for callback in self._on_abort:
            callback()


class GracefulServer(uvicorn.Server):
    """uvicorn's server with kvtrim's signal handling: drain, then abort; a second signal aborts at once; the
    signal is not re-raised after a clean stop, so the exit status is 0."""

    def __init__(self, config: uvicorn.Config, controller: ShutdownController):
        super().__init__(config)
        self.controller = controller
        self.signals_received = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler runs between two bytecodes of the loop's thread: hand the work to the loop.
        self.signals_received += 1
        self.should_exit = True
        if self._loop is None:
            return
        if self.signals_received == 1:
            self._loop.call_soon_threadsafe(self.controller.begin_drain)
        else:
            logger.info("kvtrim: second signal, aborting running requests now")
            self._loop.call_soon_threadsafe(self.controller.abort)
